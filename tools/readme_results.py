"""Writes README.md's results block from the generated files of docs/results/, so README never holds a
figure that no command made: for each file its title, a link to it, its provenance line and a headline table
(some of its rows and columns, as SECTIONS picks them; the full tables stay in the file). The files:

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
# One section a results file: its title and its headline, a function of the file's tables (the whole file is a
# link away). A table: (caption, header cells, rows of cells), caption the last text line above it.
Table = tuple[str, list[str], list[list[str]]]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(text: str) -> list[Table]:
    """The markdown tables of a results file, in order."""
    found, caption, lines, i = [], "", text.splitlines(), 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            caption = lines[i].strip() or caption
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j].startswith("|"):
            j += 1
        found.append((caption, _cells(lines[i]), [_cells(line) for line in lines[i + 2:j]]))  # less the |---| line
        i = j
    return found


def render(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def pick(table: Table, columns: tuple[str, ...], keep) -> list[str]:
    """The rows of ``table`` for which ``keep({column: cell})`` holds, in ``columns`` only."""
    _, header, rows = table
    picked = [[row[header.index(c)] for c in columns] for row in rows if keep(dict(zip(header, row)))]
    if not picked:
        raise SystemExit(f"no headline row in a table of columns {header}: tools/readme_results.py's rule is stale")
    return render(list(columns), picked)


def decoding_headline(found: list[Table]) -> list[str]:
    """Beam 4 on 1 thread: one row per model and compute type, a column per batch size (figure; speedup)."""
    _, header, rows = found[0]
    grouped: dict[str, dict[str, str]] = {}
    for row in rows:
        cell = dict(zip(header, row))
        batch = re.search(r"batch (\d+), ", cell["shape"])
        if batch and "beam 4" in cell["shape"] and cell["shape"].endswith("1 thread"):
            grouped.setdefault(cell["shape"].replace(batch.group(0), ""), {})[batch.group(1)] = \
                f"{cell['figure']}; {cell['speedup']}"
    if not grouped:
        raise SystemExit("no beam 4, 1 thread row in docs/results/decoding.md: tools/readme_results.py's rule is stale")
    batches = sorted({b for cells in grouped.values() for b in cells}, key=int)
    return render(["shape"] + [f"batch {b}: fastformer; its speedup" for b in batches],
                  [[shape] + [cells.get(b, "") for b in batches] for shape, cells in grouped.items()])


def translation_headline(found: list[Table]) -> list[str]:
    """One row per engine: BLEU (batch 1 / batch 32 where they differ) and ms per sentence at each batch size."""
    batches = [(re.match(r"Batch (\d+)", caption).group(1), header, rows) for caption, header, rows in found
               if re.match(r"Batch \d+", caption)]
    engines: dict[str, dict] = {}
    for batch, header, rows in batches:
        for row in rows:
            cell = dict(zip(header, row))
            engines.setdefault(cell["engine"], {}).setdefault("BLEU", []).append(cell["BLEU"])
            engines[cell["engine"]][batch] = cell["ms per sentence"]
    names = [batch for batch, _, _ in batches]
    rows = [[engine, " / ".join(dict.fromkeys(cells["BLEU"]))] + [cells.get(b, "") for b in names]
            for engine, cells in engines.items()]
    return render(["engine", "BLEU (" + " / ".join(f"batch {b}" for b in names) + " where they differ)"]
                  + [f"ms per sentence, batch {b}" for b in names], rows)


SECTIONS = (
    ("main-job.md", "The main job, `python -m fastformer.train`",
     lambda found: render(found[0][1], found[0][2])),
    ("translation.md", "Its model translating the test split, float32 and int8, beside CTranslate2, beam 4, 1 thread",
     translation_headline),
    ("decoding.md", "Decoding random small and base models beside CTranslate2 and a plain-PyTorch decoder (here beam "
                    "4, 1 thread; the file: beam 1 and 4, 1 and 2 threads, thread scaling)",
     decoding_headline),
    ("transformers.md", "A transformers Marian of opus-mt-de-en's shape: fastformer (converted) decoding it beside "
                        "transformers and CTranslate2, and its training step with attn_implementation='fastformer' "
                        "(here fastformer's rows; the file: every engine)",
     lambda found: pick(found[0], ("shape", "pass", "backend", "figure", "speedup"),
                        lambda r: r["backend"].startswith("fastformer"))),
    ("cpu-benchmarks.md", "The CPU kernels and the training step beside the PyTorch code they replace (here forward + "
                          "backward at L 128 and 1024; the file: every pass, length and backend, the call overhead)",
     lambda found: pick(found[0], ("op", "shape", "median", "figure", "speedup"),
                        lambda r: r["backend"] == "cpu" and r["pass"].startswith("fwd+bwd")
                        and not re.search(r"L=(?!128 |1024 )", r["shape"] + " "))),
)


def block() -> str:
    lines = [BEGIN, "<!-- written by `python tools/readme_results.py` from docs/results/: do not edit by hand -->"]
    for name, title, headline in SECTIONS:
        path = RESULTS / name
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8").strip()
        lines += ["", f"**{title}** ([docs/results/{name}](docs/results/{name})); {text.splitlines()[0]}", ""]
        lines += headline(tables(text))
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
