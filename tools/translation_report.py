"""BLEU and speed of a trained checkpoint on its test split, float32 and int8, fastformer beside CTranslate2
(when installed), as markdown:

    python tools/translation_report.py runs/small-bible-de-en -o docs/results/translation.md

The test sentences, sorted by length, go in batches of --batch (1 and 32 by default, one table each); for
each batch the engines take turns (fastformer float32, fastformer int8 = ``fastformer.quantize(model,
"int8")``, CTranslate2 float32 and int8 on the model ``fastformer.export`` writes), on --threads CPU
threads, beam 4 and the CLIs' length limits. Each engine's BLEU (sacrebleu, detokenized) is over the same
sentences; its time is the sum of its calls. The header names the machine, CPU kernel level, torch,
ctranslate2, commit, date and command.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tools/translation_report.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a trained checkpoint file or run folder")
    parser.add_argument("-o", "--output", help="write the markdown here (default: standard output)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="sentences per call")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of every engine")
    parser.add_argument("--limit", type=int, help="only the first N test sentences")
    args = parser.parse_args(argv)

    import fastformer
    from fastformer import checkpoint as ckpt
    from fastformer.data.batching import collate
    from fastformer.evaluate import split_lines
    from fastformer.export import ctranslate2_translate, vocabulary, write_ctranslate2
    from fastformer.nn import decoding
    from fastformer.runtime import provenance
    from fastformer.translation import score

    torch.set_num_threads(args.threads)
    model, tokenizer, state = ckpt.load_model(args.run_dir)
    sources, refs, _ = split_lines(state.get("data") or {}, "test")
    pairs = [(s, r) for s, r in zip(sources, refs) if s is not None and r is not None][: args.limit]
    ids = [s[: model.config.max_positions - 1] for s in tokenizer.encode([s for s, _ in pairs])]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    settings = dict(beam_size=decoding.BEAM_SIZE, length_penalty=decoding.LENGTH_PENALTY,
                    max_len_a=decoding.MAX_LEN_A, max_len_b=decoding.MAX_LEN_B)
    quantized = fastformer.quantize(model, "int8")
    engines = {"fastformer float32": lambda batch: model.generate(collate(batch), **settings),
               "fastformer int8": lambda batch: quantized.generate(collate(batch), **settings)}
    versions = ""
    try:
        import ctranslate2
    except ImportError:
        ctranslate2 = None
    tmp = tempfile.TemporaryDirectory()
    if ctranslate2 is not None:
        versions = f", ctranslate2 {ctranslate2.__version__}"
        pieces = vocabulary(tokenizer)
        folder = write_ctranslate2(model, pieces, tmp.name + "/ct2")
        for compute in ("float32", "int8"):
            translator = ctranslate2.Translator(folder, device="cpu", compute_type=compute, inter_threads=1,
                                                intra_threads=args.threads)
            engines[f"ctranslate2 {compute}"] = (
                lambda batch, t=translator: ctranslate2_translate(t, pieces, batch, **settings))

    p = provenance()
    lines = [f"Machine: {p['cpu']}, {p['cores']} cores, CPU kernels {p['cpu_level']}, torch {p['torch']}{versions}; "
             f"{args.threads} thread{'s' if args.threads > 1 else ''}; commit {p['commit']}, {p['date']}; "
             f"`{p['command']}`", "",
             f"Checkpoint: {args.run_dir} ({model.config.d_model}-dim, {model.config.n_encoder_layers}+"
             f"{model.config.n_decoder_layers} layers, vocabulary {model.config.vocab_size}); {len(pairs)} test "
             f"sentences; beam {settings['beam_size']}, length penalty {settings['length_penalty']}, at most "
             f"{settings['max_len_a']} n + {settings['max_len_b']} tokens; engines take turns batch by batch."]
    for size in args.batch:
        batches = [order[i:i + size] for i in range(0, len(order), size)]
        seconds = {name: 0.0 for name in engines}
        hyps = {name: [""] * len(pairs) for name in engines}
        for batch in batches:
            for name, run in engines.items():
                start = time.perf_counter()
                out = run([ids[i] for i in batch])
                seconds[name] += time.perf_counter() - start
                for i, text in zip(batch, tokenizer.decode(out)):
                    hyps[name][i] = text
        lines += ["", f"Batch {size}:", "", "| engine | BLEU | chrF | ms per sentence | fastformer int8 is x faster |",
                  "|---|---:|---:|---:|---:|"]
        for name in engines:
            s = score(hyps[name], [r for _, r in pairs])
            lines.append(f"| {name} | {s['bleu']:.2f} | {s['chrf']:.2f} | {1e3 * seconds[name] / len(pairs):.2f} | "
                         f"{seconds[name] / seconds['fastformer int8']:.2f}x |")
        print("\n".join(lines[-len(engines) - 4:]), file=sys.stderr)
    text = "\n".join(lines) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
