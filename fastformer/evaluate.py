"""python -m fastformer.evaluate: BLEU and chrF (sacrebleu) of a checkpoint on its corpus' dev or test split.

For a run trained on user files, the split's source and reference files are read line by line: a source
line that is not valid UTF-8, or empty, is reported on stderr with its number and translated as an empty
line (scored as such, and written as such with --output); a reference line of either kind is reported and
its pair left out of the score. Every other line is translated and scored; the exit status is then 1.
"""
from __future__ import annotations

import argparse
import json
import sys

from fastformer.cli import HelpFormatter, int_at_least
from fastformer.data import load_bible, read_sentence_file
from fastformer.translation import (add_decoding_arguments, add_quantize_argument, load_for_translation,
                                    report_line_problems, score, translate_lines)

PROG = "python -m fastformer.evaluate"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG,
                                description="Translate the dev or test split of the corpus a checkpoint was trained "
                                            "on and print sacrebleu BLEU (13a, detokenized), chrF and signatures.",
                                formatter_class=HelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="P", help="checkpoint file, or run folder (its latest)")
    p.add_argument("--split", choices=("dev", "test"), default="test", help="which split to score")
    p.add_argument("--limit", type=int_at_least(1), help="score only the first N sentences (default: all)")
    p.add_argument("--output", metavar="F", help="also write the translations here (default: not written)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_decoding_arguments(p)
    add_quantize_argument(p)
    return p


def split_lines(data: dict, split: str) -> tuple[list, list, list[tuple[str, dict[int, str], str]]]:
    """The split's source and reference lines (None where unreadable or empty), and for each file its
    label, its bad lines (number: why) and what becomes of them."""
    if data.get("kind") == "bible":
        corpus = load_bible(data["name"])
        return corpus.src[split], corpus.tgt[split], []
    if data.get("kind") != "files":
        raise SystemExit(f"{PROG}: error: the checkpoint does not say which corpus it was trained on")
    src_path, ref_path = data[split]
    try:
        (sources, src_bad), (refs, ref_bad) = read_sentence_file(src_path), read_sentence_file(ref_path)
    except OSError as exc:
        raise SystemExit(f"{PROG}: error: the {split} split of the checkpoint's corpus: {exc}") from exc
    if len(sources) != len(refs):
        raise SystemExit(f"{PROG}: error: {src_path} has {len(sources)} lines but {ref_path} has {len(refs)}")
    return sources, refs, [(f"{src_path}, line", src_bad, "translated as an empty line"),
                           (f"{ref_path}, line", ref_bad, "its pair is not scored")]


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    model, tokenizer, state = load_for_translation(PROG, args)
    sources, refs, problems = split_lines(state.get("data") or {}, args.split)
    if args.limit:
        sources, refs = sources[:args.limit], refs[:args.limit]
        problems = [(what, {n: why for n, why in bad.items() if n <= args.limit}, then) for what, bad, then in problems]
    hyps = translate_lines(model, tokenizer, sources, beam=args.beam, lenpen=args.lenpen, max_len_a=args.max_len_a,
                           max_len_b=args.max_len_b, device=args.device, progress=True)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write("".join(h + "\n" for h in hyps))
    scored = [i for i, ref in enumerate(refs) if ref is not None]
    scores = score([hyps[i] for i in scored], [refs[i] for i in scored])
    result = {"split": args.split, "sentences": len(scored), **scores}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"BLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}  on {len(scored)} {args.split} sentences "
              f"(beam {args.beam}, lenpen {args.lenpen})")
        print(result["bleu_detail"])
        print(f"BLEU signature: {result['bleu_signature']}")
        print(f"chrF signature: {result['chrf_signature']}")
    for what, bad, then in problems:
        report_line_problems(PROG, bad, what, then)
    if any(bad for _, bad, _ in problems):
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
