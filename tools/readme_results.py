"""Writes README.md's results block from the generated files of docs/results/, so README never holds a
figure that no command made:

    python tools/run_report.py RUN_DIR -o docs/results/main-job.md                   # a finished main job
    pytest benchmarks/ --benchmark-only --benchmark-json out.json
    python benchmarks/to_markdown.py out.json -o docs/results/cpu-benchmarks.md      # the kernels, the step
    pytest benchmarks/test_decoding.py --benchmark-only --benchmark-json dec.json
    python benchmarks/to_markdown.py dec.json -o docs/results/decoding.md            # beside CTranslate2
    python benchmarks/to_markdown.py hf.json -o docs/results/transformers.md         # transformers models
    python tools/translation_report.py RUN_DIR -o docs/results/translation.md        # BLEU and speed, int8
    python tools/readme_results.py                                                   # README's block

tools/make_results.py runs all of these, from a clean commit, as one command.

Each generated file opens with the line that names its machine, CPU kernel level, torch, commit, date and
command; tests/test_docs.py checks that the block is what this script makes from them.
"""
from __future__ import annotations

import argparse
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
# file, title, whether README shows the whole file (else its provenance line and a link)
SECTIONS = (("main-job.md", "The main job, `python -m fastformer.train`", True),
            ("translation.md", "The main job's model translating its test split, float32 and int8, beside CTranslate2 "
                               "(engines taking turns batch by batch in one run)", True),
            ("decoding.md", "Decoding beside CTranslate2 and a plain-PyTorch decoder, random models of the small and "
                            "base configs: float32 and int8, batch 1 and 32, beam 1 and 4, 1 and 2 threads, side by "
                            "side in one run; and decoding's thread scaling beside a large GEMM's", False),
            ("transformers.md", "A transformers Marian of opus-mt-de-en's shape: decoded by fastformer (converted) beside "
                                "transformers' generate and CTranslate2, float32 and int8, beam 4, batch 1 and 32; "
                                "its training step with attn_implementation='fastformer' beside 'sdpa' and 'eager'",
             True),
            ("cpu-benchmarks.md", "Every CPU kernel and the training step beside the PyTorch code they replace", False))


def block() -> str:
    lines = [BEGIN, "<!-- written by `python tools/readme_results.py` from docs/results/: do not edit by hand -->"]
    for name, title, whole in SECTIONS:
        path = RESULTS / name
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8").strip()
        lines += ["", f"**{title}** ([docs/results/{name}](docs/results/{name})):", ""]
        lines += [text] if whole else [text.splitlines()[0]]
    lines += ["", "GPU figures are not in this block: none was measured on the current code (docs/gpu.md).", END]
    return "\n".join(lines)


def replace_block(readme: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(readme):
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    return pattern.sub(lambda _: block(), readme, count=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tools/readme_results.py", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    readme = ROOT / "README.md"
    readme.write_text(replace_block(readme.read_text(encoding="utf-8")), encoding="utf-8")


if __name__ == "__main__":
    main()
