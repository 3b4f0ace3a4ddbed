"""Throughput of Transformer.generate with and without the key/value cache, side by side.

    python benchmarks/generate_speed.py --checkpoint runs/small-bible-de-en

Translates the first --sentences test sentences of the checkpoint's Bible corpus in batches of 16,
beams 1 and 4, after one warm-up batch; prints target tokens/s and sentences/s.
"""
import argparse
import time

from fastformer import checkpoint as ckpt
from fastformer.data import collate, load_bible


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint file or run folder")
    parser.add_argument("--sentences", type=int, default=64, help="test sentences to translate")
    args = parser.parse_args()
    model, tokenizer, state = ckpt.load_model(args.checkpoint)
    ids = tokenizer.encode(load_bible(state["data"]["name"]).src["test"][: args.sentences])
    model.generate(collate(ids[:16]), beam_size=4)  # warm-up
    for beam in (1, 4):
        for use_cache in (True, False):
            tokens = sentences = 0
            start = time.perf_counter()
            for i in range(0, len(ids), 16):
                out = model.generate(collate(ids[i:i + 16]), beam_size=beam, max_len_a=1.2, max_len_b=10,
                                     use_cache=use_cache)
                tokens += sum(len(o) + 1 for o in out)
                sentences += len(out)
            seconds = time.perf_counter() - start
            print(f"beam {beam}, cache {'on ' if use_cache else 'off'}: {tokens / seconds:7.0f} target tokens/s, "
                  f"{sentences / seconds:5.1f} sentences/s")


if __name__ == "__main__":
    main()
