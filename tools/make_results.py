"""Re-make every file of docs/results/ and README's results block with one command, from a clean commit.

    python tools/make_results.py                                  # all five: about 95 minutes on a 2-core CPU
    python tools/make_results.py --only decoding,cpu-benchmarks   # some of them
    python tools/make_results.py --dry-run                        # check the tree, print the commands

Each measurement names the commit it ran on in the first line of its file, so the tree must be clean: the
script refuses to start when a tracked file has uncommitted changes. The files are first written to a
staging folder (--stage, ignored by git) and copied into docs/results/ only after every chosen measurement
has finished, so that no measurement runs on a tree that the previous one has changed; then
tools/readme_results.py rewrites README's results block. Review the diff and commit it.

translation measures the checkpoint in the main job's run folder (--run-dir). main-job refuses to start
when that folder holds an earlier run (move it away): `python -m fastformer.train` would refuse too, only
later.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
MAIN_RUN = "runs/small-bible-de-en"  # where `python -m fastformer.train` (small config, bible-de-en) writes


class Result(NamedTuple):
    name: str      # the --only name, and the file docs/results/<name>.md
    minutes: int   # about how long it runs on a 2-core CPU
    what: str

    def commands(self, stage: str, run_dir: str) -> list[list[str]]:
        """The commands that measure this result and write <stage>/<name>.md (paths relative to ROOT)."""
        out = f"{stage}/{self.name}.md"
        if self.name == "main-job":
            train = ["python", "-m", "fastformer.train"] + ([] if run_dir == MAIN_RUN else ["--out", run_dir])
            return [train, ["python", "tools/run_report.py", run_dir, "-o", out]]
        if self.name == "translation":
            return [["python", "tools/translation_report.py", run_dir, "-o", out]]
        json_file = f"{stage}/{self.name}.json"
        selection = BENCHMARK_SELECTIONS[self.name]
        return [["pytest", *selection, "--benchmark-only", "--benchmark-json", json_file, "-q",
                 "-p", "no:cacheprovider"],
                ["python", "benchmarks/to_markdown.py", json_file, "-o", out]]


# The benchmark files of each benchmark result; cpu-benchmarks is every other file of benchmarks/.
_OWN_FILES = {"decoding": ["benchmarks/test_decoding.py"],
              "transformers": ["benchmarks/test_hf_decoding.py", "benchmarks/test_hf_training_step.py"]}
BENCHMARK_SELECTIONS = {**_OWN_FILES, "cpu-benchmarks": ["benchmarks/"] + [
    arg for files in _OWN_FILES.values() for f in files for arg in ("--ignore", f)]}

# In the order they run (translation measures the checkpoint that main-job trains). The minutes are for the
# 2-core AMD EPYC VM the current files come from.
ALL = (Result("main-job", 35,
              "docs/results/main-job.md: `python -m fastformer.train` (30 training minutes, then the test split "
              "translated with beam 4), then tools/run_report.py on its run folder"),
       Result("translation", 3,
              "docs/results/translation.md: tools/translation_report.py on the main job's checkpoint: fastformer "
              "float32 and int8 beside CTranslate2, batch 1 and 32"),
       Result("decoding", 20,
              "docs/results/decoding.md: benchmarks/test_decoding.py (decoding beside CTranslate2 and a plain "
              "PyTorch decoder, and its thread scaling), then benchmarks/to_markdown.py; its time is an "
              "estimate, not timed"),
       Result("transformers", 25,
              "docs/results/transformers.md: benchmarks/test_hf_decoding.py (an opus-mt-shaped Marian decoded "
              "by fastformer beside transformers' generate and CTranslate2) and test_hf_training_step.py "
              "(a transformers Marian training step with attn_implementation='fastformer' beside 'sdpa' and "
              "'eager'), then benchmarks/to_markdown.py"),
       Result("cpu-benchmarks", 10,
              "docs/results/cpu-benchmarks.md: benchmarks/ without the files of decoding and transformers "
              "(every CPU kernel and the training step beside the PyTorch code they replace), then "
              "benchmarks/to_markdown.py"))
NAMES = tuple(r.name for r in ALL)
README_COMMAND = ["python", "tools/readme_results.py"]


def dirty_files(root: pathlib.Path = ROOT) -> list[str]:
    """Tracked files with uncommitted changes (staged or not); untracked files do not count, as for the
    commit that the measurements record (fastformer/runtime.py, pytest-benchmark's `git describe --dirty`)."""
    done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                          text=True, check=True)
    return [line[3:] for line in done.stdout.splitlines() if line.strip()]


def head_commit(root: pathlib.Path = ROOT) -> str:
    return subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def only_names(text: str) -> list[str]:
    """argparse type of --only: a comma-separated subset of NAMES, returned in run order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown result {', '.join(unknown) or repr(text)}; choose from "
                                         f"{', '.join(NAMES)}")
    return [n for n in NAMES if n in names]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/make_results.py", description=__doc__,
                                epilog="results, in run order, with their run time on a 2-core CPU:\n" + "\n".join(
                                    textwrap.fill(f"{r.name} (about {r.minutes} min): {r.what}", width=100,
                                                  initial_indent="  ", subsequent_indent="    ") for r in ALL),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", type=only_names, default=list(NAMES), metavar="NAME[,NAME...]",
                   help=f"re-make only these results, comma-separated, from: {', '.join(NAMES)} (default: all)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the tree and print the commands that would run, in order; run nothing")
    p.add_argument("--stage", default="runs/results", metavar="DIR",
                   help="folder (relative to the repository root, ignored by git) where the files are written "
                        "before they are copied into docs/results/ (default: runs/results)")
    p.add_argument("--run-dir", default=MAIN_RUN, metavar="DIR",
                   help=f"the main job's run folder: main-job trains into it, translation measures its checkpoint "
                        f"(default: {MAIN_RUN})")
    return p


def refusal(args, dirty: list[str]) -> str | None:
    """Why the chosen measurements cannot start, or None."""
    if dirty:
        return ("the tree has uncommitted changes to tracked files, so no commit would describe the results: "
                f"{', '.join(dirty)}. Commit or stash them, then run this again")
    run_dir = ROOT / args.run_dir
    if "main-job" in args.only and any(run_dir.glob("checkpoint_*.pt")):
        return (f"{args.run_dir} holds the checkpoints of an earlier run, and `python -m fastformer.train` "
                f"would refuse to start: move it away (e.g. mv {args.run_dir} {args.run_dir}.old)")
    if "translation" in args.only and "main-job" not in args.only and not (run_dir / "log.jsonl").exists():
        return f"translation measures the main job's checkpoint, and {args.run_dir} holds no run: add main-job"
    return None


def run_commit(run_dir: pathlib.Path) -> str | None:
    """The commit a finished training run recorded in its summary (None when there is none)."""
    try:
        with open(run_dir / "log.jsonl") as f:
            summaries = [r for r in map(json.loads, f) if r.get("kind") == "summary"]
    except OSError:
        return None
    return summaries[-1].get("commit") if summaries else None


def execute(command: list[str]) -> None:
    """Runs a command in the repository root with this interpreter (``python``, ``pytest``); stops on failure.
    The checkout comes first on PYTHONPATH, so that every command (tools/*.py too, whose own folder is first on
    their path) measures the checkout whose commit the results name, not a copy installed in site-packages."""
    argv = ([sys.executable, *command[1:]] if command[0] == "python"
            else [sys.executable, "-m", "pytest", *command[1:]] if command[0] == "pytest" else command)
    print(f"$ {shlex.join(command)}", flush=True)
    start = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(argv, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"make_results: `{shlex.join(command)}` failed (exit status {done.returncode}); "
                         "docs/results/ is unchanged")
    print(f"  ({(time.monotonic() - start) / 60:.1f} min)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    chosen = [r for r in ALL if r.name in args.only]
    why = refusal(args, dirty_files())
    if why:
        print(f"make_results: refused: {why}", file=sys.stderr)
        return 2
    plan = [(r, r.commands(args.stage, args.run_dir)) for r in chosen]
    print(f"make_results at commit {head_commit()}: {', '.join(r.name for r in chosen)} "
          f"(about {sum(r.minutes for r in chosen)} min)")
    if "translation" in args.only and "main-job" not in args.only:
        trained = run_commit(ROOT / args.run_dir)
        print(f"note: translation measures the checkpoint of {args.run_dir}, trained at commit {trained or 'unknown'}")
    if args.dry_run:
        for result, commands in plan:
            print(f"# {result.name} -> docs/results/{result.name}.md (about {result.minutes} min)")
            for command in commands:
                print(shlex.join(command))
        print(f"# then copy {args.stage}/<name>.md into docs/results/, and README's block:")
        print(shlex.join(README_COMMAND))
        return 0
    stage = ROOT / args.stage
    stage.mkdir(parents=True, exist_ok=True)
    for result, commands in plan:
        print(f"== {result.name} (about {result.minutes} min)", flush=True)
        for command in commands:
            execute(command)
    for result in chosen:  # only now: every measurement above ran on the clean tree
        shutil.copyfile(stage / f"{result.name}.md", RESULTS / f"{result.name}.md")
        print(f"wrote docs/results/{result.name}.md")
    execute(README_COMMAND)
    print("done: review `git diff`, then commit docs/results/ and README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
