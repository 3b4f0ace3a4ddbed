"""python -m fastformer.evaluate: BLEU and chrF (sacrebleu) of a checkpoint on its corpus' dev or test split."""
from __future__ import annotations

import argparse
import json

from fastformer import checkpoint as ckpt
from fastformer.cli import int_at_least
from fastformer.data import load_bible, load_text_files
from fastformer.translation import add_decoding_arguments, score, translate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastformer.evaluate",
                                description="Translate the dev or test split of the corpus a checkpoint was trained "
                                            "on and print sacrebleu BLEU (13a, detokenized), chrF and signatures.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="P", help="checkpoint file, or run folder (its latest)")
    p.add_argument("--split", choices=("dev", "test"), default="test", help="which split to score")
    p.add_argument("--limit", type=int_at_least(1), help="score only the first N sentences")
    p.add_argument("--output", metavar="F", help="also write the translations here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_decoding_arguments(p)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    model, tokenizer, state = ckpt.load_model_or_exit(args.checkpoint, backend=args.backend, device=args.device)
    data = state.get("data") or {}
    if data.get("kind") == "bible":
        corpus = load_bible(data["name"])
    elif data.get("kind") == "files":
        corpus = load_text_files(tuple(data["train"]), tuple(data["dev"]), tuple(data["test"]))
    else:
        raise SystemExit("error: the checkpoint does not say which corpus it was trained on")
    src, ref = corpus.src[args.split], corpus.tgt[args.split]
    if args.limit:
        src, ref = src[:args.limit], ref[:args.limit]
    hyps = translate(model, tokenizer, src, beam=args.beam, lenpen=args.lenpen, device=args.device, progress=True)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write("".join(h + "\n" for h in hyps))
    result = {"split": args.split, "sentences": len(hyps), **score(hyps, ref)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"BLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}  on {len(hyps)} {args.split} sentences "
              f"(beam {args.beam}, lenpen {args.lenpen})")
        print(result["bleu_detail"])
        print(f"BLEU signature: {result['bleu_signature']}")
        print(f"chrF signature: {result['chrf_signature']}")
    return result


if __name__ == "__main__":
    main()
