"""The result of a training run as markdown, from the run folder's log.jsonl (its "summary" record, which
fastformer.training writes at the end with the machine, CPU kernel level, torch, commit, date and command):

    python -m fastformer.train                                   # the main job: runs/small-bible-de-en
    python tools/run_report.py runs/small-bible-de-en -o docs/results/main-job.md

The table is what README's results block quotes; it is written from the run, never by hand.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def summary(run_dir: str) -> dict:
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path} does not exist: give the folder of a training run")
    with open(path) as f:
        found = [r for r in map(json.loads, f) if r.get("kind") == "summary"]
    if not found:
        raise SystemExit(f"{path} has no summary record: the run did not finish (or predates summaries)")
    return found[-1]


def render(s: dict) -> str:
    rows = [("updates", f"{s['steps']:,} in {s['train_minutes']} training minutes"),
            ("target tokens/s (whole updates: forward, backward, optimizer)", f"{s['tokens_per_s']:,.0f}"),
            ("precision", s["precision"]),
            ("peak resident memory", f"{s['peak_rss_gib']} GiB ({s.get('malloc_trims', 0)} updates handed freed "
                                     f"memory back)")]
    if "test_bleu" in s:
        rows.append(("test BLEU (beam search, sacrebleu on detokenized text)",
                     f"{s['test_bleu']:.2f} (chrF {s['test_chrf']:.2f}); {s['bleu_signature'].replace('|', ' ')}"))
    lines = [f"Machine: {s['cpu']}, {s['cores']} cores, {s['threads']} threads, CPU kernels {s['cpu_level']}, "
             f"torch {s['torch']}; commit {s['commit']}, {s['date']}; `{s['command']}`", "",
             "| what | result |", "|---|---|"]
    lines += [f"| {what} | {result} |" for what, result in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tools/run_report.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the folder of a finished training run (holding log.jsonl)")
    parser.add_argument("-o", "--output", help="write the markdown here (default: standard output)")
    args = parser.parse_args(argv)
    text = render(summary(args.run_dir)) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
