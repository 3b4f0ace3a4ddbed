"""Turns the JSON of fastformer's benchmarks (pytest-benchmark's --benchmark-json) into a markdown table.

    pytest benchmarks/ --benchmark-only --benchmark-json out.json
    python benchmarks/to_markdown.py out.json > table.md

One row per benchmark: op, shape, pass, backend (a fastformer backend or a PyTorch baseline), the
median time, the derived figure (TFLOP/s for attention; GB/s and the fraction of the copy bandwidth
measured in the same run for softmax, layer_norm_residual and cross_entropy; tokens/s for the training steps;
sentences/s for generate) and the speedup over each baseline of the same op, shape and pass (for
generate: over the same backend without the cache), measured in the same run. A line above the table
gives the machine and the settings of the run, and the optional packages whose comparisons the run left out.

The call-overhead benchmarks (test_overhead.py, op "overhead") get a table of their own below it: per
case, pass and device the median microseconds per call of fastformer's default backend and of the PyTorch
calls it replaces, timed in alternation in the same run, their ratio fastformer / PyTorch and its target.
"""
from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import pathlib
import sys

from fastformer.ops import OPS as KERNEL_OPS  # the op list of csrc/ops.h

OPS = KERNEL_OPS + ("training_step", "generate")  # the order of the table's rows
PASSES = ("no-grad fwd", "fwd", "bwd", "fwd+bwd", "fwd+bwd+adam", "cache", "no cache", "latency")




@functools.cache
def overhead_cases() -> tuple[str, ...]:
    """The call-overhead cases in the order of ``CASES`` in benchmarks/test_overhead.py, read from its source
    (this script renders JSON and does not import the benchmarks), so a case added there needs no edit here."""
    source = pathlib.Path(__file__).with_name("test_overhead.py")
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(getattr(t, "id", None) == "CASES" for t in targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError(f"{source} has no CASES = (...) of literal case names")
BACKENDS = ("cpu", "cuda", "triton", "torch")  # fastformer's, listed before the baselines


def _sig(value: float, digits: int = 3) -> str:
    """value with ``digits`` significant digits, never in exponent form."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def seconds(s: float) -> str:
    if s >= 1:
        return f"{_sig(s)} s"
    if s >= 1e-3:
        return f"{_sig(s * 1e3)} ms"
    return f"{_sig(s * 1e6)} µs"


def figure(info: dict) -> str:
    """The derived figure of a benchmark's extra_info."""
    if "tokens/s" in info and info.get("op") in ("training_step", "hf_marian_training_step", "hf_finetune_step"):
        return f"{info['tokens/s']:,.0f} tokens/s"
    if "sentences/s" in info:
        return f"{_sig(info['sentences/s'])} sentences/s"
    if "TFLOP/s" in info:  # GFLOP/s below 1 TFLOP/s (a CPU)
        tflops = info["TFLOP/s"]
        return f"{_sig(tflops)} TFLOP/s" if tflops >= 1 else f"{_sig(tflops * 1e3)} GFLOP/s"
    if "GB/s" in info:
        text = f"{_sig(info['GB/s'])} GB/s"
        if "fraction of copy" in info:
            text += f" ({info['fraction of copy']:.0%} of copy)"
        return text
    return ""


def speedup(info: dict) -> str:
    if info.get("baseline"):
        return "baseline"
    ratios = dict(info.get("speedup", {}))
    ratios.update({key[2:]: x for key, x in info.items() if key.startswith("x ")})  # test_decoding.py's "x plain"
    return ", ".join(f"{x:.2f}x {name}" for name, x in sorted(ratios.items()))


def _order(bench: dict) -> tuple:
    info = bench["extra_info"]
    op, impl = info.get("op", ""), info.get("impl", "")
    impl_rank = (BACKENDS.index(impl), "") if impl in BACKENDS else (len(BACKENDS), impl)
    return (OPS.index(op) if op in OPS else len(OPS), op, info.get("length", 0), info.get("shape", ""),
            impl_rank if op == "generate" else (), PASSES.index(info["pass"]) if info.get("pass") in PASSES else 0,
            impl_rank)


def header(session: dict, machine: dict | None = None, run: dict | None = None) -> str:
    """The run's provenance: machine, CPU kernel level, settings, then the commit, date and command that
    made it (pytest-benchmark's commit_info and datetime), so a table names where it came from."""
    parts = []
    if machine:
        parts.append(machine.get("cpu", {}).get("brand_raw") or machine.get("processor") or "")
    if session.get("gpu"):
        parts.append(session["gpu"])
    for key, label in (("device", "device"), ("cpu level", "CPU kernels"), ("dtype", "dtype"), ("sizes", "sizes"),
                       ("threads", "threads"), ("torch", "torch"), ("malloc", "malloc")):
        if key in session:
            parts.append(f"{label} {session[key]}")
    if "copy GB/s" in session:
        parts.append(f"copy bandwidth {_sig(session['copy GB/s'])} GB/s (read + write)")
    if session.get("not compared"):  # optional packages missing in the run (benchmarks/harness.py OPTIONAL)
        parts.append(f"not compared (not installed): {', '.join(session['not compared'])}")
    line = ", ".join(p for p in parts if p)
    commit = (run or {}).get("commit_info", {})
    if commit.get("id"):
        line += f"; commit {commit['id'][:7]}{' (with uncommitted changes)' if commit.get('dirty') else ''}"
    if (run or {}).get("datetime"):
        line += f", {run['datetime'][:10]}"
    if session.get("command"):
        line += f"; `{session['command']}`"
    return line


def _overhead_order(bench: dict) -> tuple:
    info = bench["extra_info"]
    case = info.get("case", "")
    cases = overhead_cases()
    return (info.get("device", ""), cases.index(case) if case in cases else len(cases),
            case, PASSES.index(info["pass"]) if info.get("pass") in PASSES else 0)


def overhead_table(benchmarks: list[dict]) -> list[str]:
    """The lines of the call-overhead table: one row per case, pass and device."""
    threads = sorted({str(b["extra_info"].get("threads", "?")) for b in benchmarks})
    lines = ["Call overhead on tiny tensors: median per call, fastformer's default backend and the PyTorch calls "
             f"it replaces, alternating in one run, {'/'.join(threads)} thread(s); ratio = fastformer / PyTorch.", "",
             "| case | inputs | pass | device | backend | fastformer | PyTorch | ratio | target |",
             "|---|---|---|---|---|---:|---:|---:|---|"]
    for bench in sorted(benchmarks, key=_overhead_order):
        info = bench["extra_info"]
        if "ratio" not in info:  # not timed (--benchmark-disable)
            continue
        verdict = "met" if info["ratio"] <= info["target"] else "missed"
        lines.append(f"| {info['case']} | {info['shape']} | {info['pass']} | {info['device']} | {info['impl']} | "
                     f"{_sig(info['fastformer us'])} µs | {_sig(info['pytorch us'])} µs ({info['pytorch']}) | "
                     f"{info['ratio']:.2f}x | <= {info['target']:g}x, {verdict} |")
    return lines


def threads_table(benchmarks: list[dict]) -> list[str]:
    """The lines of the thread-scaling table (benchmarks/test_decoding.py test_decoding_threads): one row
    per decoding setup, its median time at 1 and 2 threads beside the GEMM's of the same turns."""
    rows = [b for b in sorted(benchmarks, key=_order) if "decoding speed-up" in b["extra_info"]]
    if not rows:
        return []
    gemm = rows[0]["extra_info"]["gemm"]
    lines = [f"Thread scaling: decoding (beam 4) and a large GEMM ({gemm}), each at 1 and 2 threads, in "
             "alternating turns of one run (a timing: one untimed call, then calls of at least 0.15 s: steady "
             "state, both threads awake); speed-up = the median over turns of a turn's time at 1 thread / at 2 "
             "threads; share = decoding's speed-up / the GEMM's of the same turns (target: >= 90% at batch 32; "
             "batch 1 not slower at 2 threads).", "",
             "| decoding | 1 thread | 2 threads | speed-up | GEMM 1 / 2 threads | GEMM speed-up | share |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for bench in rows:
        info = bench["extra_info"]
        dec, mm, share = info["decoding ms"], info["gemm ms"], info["share of gemm's speed-up"]
        lines.append(f"| {info['shape']} | {_sig(dec['1'])} ms | {_sig(dec['2'])} ms | "
                     f"{info['decoding speed-up']:.2f}x | {_sig(mm['1'])} / {_sig(mm['2'])} ms | "
                     f"{info['gemm speed-up']:.2f}x | {share:.0%} |")
    return lines


def render(benchmarks: list[dict], session: dict | None = None, machine: dict | None = None,
           run: dict | None = None) -> str:
    """The markdown table of pytest-benchmark JSON entries (group, extra_info, stats.median), and below it
    the call-overhead table of the "overhead" entries."""
    overhead = [b for b in benchmarks if b["extra_info"].get("op") == "overhead"]
    threads = [b for b in benchmarks if b["extra_info"].get("op") == "threads"]
    others = [b for b in benchmarks if b["extra_info"].get("op") not in ("overhead", "threads")]
    lines = []
    if session or machine:
        lines += [header(session or {}, machine, run), ""]
    if others:
        lines += ["| op | shape | pass | backend | median | figure | speedup |", "|---|---|---|---|---:|---:|---|"]
    for bench in sorted(others, key=_order):
        info = bench["extra_info"]
        lines.append(f"| {info.get('op', bench['name'])} | {info.get('shape', '')} | {info.get('pass', '')} | "
                     f"{info.get('impl', '')} | {seconds(bench['stats']['median'])} | {figure(info)} | "
                     f"{speedup(info)} |")
    if overhead:
        lines += ([""] if others else []) + overhead_table(overhead)
    scaling = threads_table(threads)
    if scaling:
        lines += ([""] if others or overhead else []) + scaling
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/to_markdown.py",
        description="Render the JSON that `pytest benchmarks/ --benchmark-only --benchmark-json FILE` writes as a "
                    "markdown table: op x shape x pass x backend, median time, derived figure (TFLOP/s, GB/s and "
                    "fraction of the copy bandwidth, tokens/s, sentences/s) and speedup over the PyTorch "
                    "baselines of the same run.")
    parser.add_argument("json", help="the --benchmark-json file of a run of benchmarks/")
    parser.add_argument("-o", "--output", help="write the table to this file (default: standard output)")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    table = render(data["benchmarks"], data.get("fastformer", {}), data.get("machine_info"), data)
    if args.output:
        with open(args.output, "w") as f:
            f.write(table + "\n")
    else:
        sys.stdout.write(table + "\n")


if __name__ == "__main__":
    main()
