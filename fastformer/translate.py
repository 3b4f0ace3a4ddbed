"""python -m fastformer.translate: translate text with a trained checkpoint (stdin to stdout by default).

One output line per input line. A line that is not valid UTF-8, or is empty, is reported on stderr with its
number and gives an empty output line; every other line is translated, and the exit status is then 1.
"""
from __future__ import annotations

import argparse
import sys

from fastformer.cli import HelpFormatter
from fastformer.data import read_sentences
from fastformer.translation import (add_decoding_arguments, add_quantize_argument, load_for_translation,
                                    report_line_problems, translate_lines)


PROG = "python -m fastformer.translate"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG,
                                description="Translate one sentence per line with a fastformer checkpoint.",
                                formatter_class=HelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="P", help="checkpoint file, or run folder (its latest)")
    p.add_argument("--input", metavar="F", help="source text file (default: standard input)")
    p.add_argument("--output", metavar="F", help="where translations go (default: standard output)")
    add_decoding_arguments(p)
    add_quantize_argument(p)
    p.add_argument("--source-lang", metavar="CODE",
                   help="a converted NLLB or M2M-100 model's source language (NLLB: deu_Latn; M2M-100: de): its "
                        "token goes before every sentence (default: the tokenizer's src_lang, if it had one)")
    p.add_argument("--target-lang", metavar="CODE",
                   help="a converted NLLB or M2M-100 model's target language: its token is forced first, as "
                        "transformers' forced_bos_token_id (needed by those models; default: the language a model "
                        "was fine-tuned into with train --init)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    model, tokenizer, _ = load_for_translation(PROG, args)
    if args.input:
        with open(args.input, "rb") as f:
            raw = f.read()
    else:
        raw = sys.stdin.buffer.read()
    sentences, problems = read_sentences(raw)
    stats: dict = {}
    try:
        out = translate_lines(model, tokenizer, sentences, beam=args.beam, lenpen=args.lenpen,
                              max_len_a=args.max_len_a, max_len_b=args.max_len_b, device=args.device,
                              progress=args.output is not None, stats=stats, source_lang=args.source_lang,
                              target_lang=args.target_lang)
    except ValueError as exc:
        raise SystemExit(f"{PROG}: error: {exc}") from exc
    text = "".join(h + "\n" for h in out)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    seconds = max(stats["seconds"], 1e-9)
    print(f"translated {stats['sentences']} sentences ({stats['tokens']} target tokens) in {seconds:.2f} s: "
          f"{stats['sentences'] / seconds:.1f} sentences/s, {stats['tokens'] / seconds:.0f} tokens/s "
          f"(beam {args.beam}, {args.device})", file=sys.stderr)
    report_line_problems(PROG, problems, "line", "its output line is left empty")
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
