"""The automatic GPU backend of each op, from measurements: writes fastformer/ops/gpu_table.py.

Reads the JSON of the op benchmarks run on a GPU (``tools/gpu_check.sh`` makes it: ``pytest
benchmarks/test_<op>.py --bench-sizes paper -k fwdbwd --benchmark-json BENCH``), and for each op and dtype
of that run compares the GPU backends (cuda, triton) on the shapes both ran, forward+backward: the one with
the smaller geometric mean of median times goes first. The table is keyed by the GPU's compute capability
(one run, one capability); rows measured earlier on other capabilities are kept. The dispatcher
(fastformer/_dispatch.py) follows the table where it has the device's capability, op and dtype, and the
rule of thumb (triton first on 8.0 and newer, cuda first before) elsewhere.

    python tools/gpu_choice.py BENCH.json                 # print the rows this run gives
    python tools/gpu_choice.py BENCH.json --write         # and merge them into fastformer/ops/gpu_table.py
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pprint
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "fastformer", "ops", "gpu_table.py")
GPU_BACKENDS = ("cuda", "triton")

HEADER = '''"""The measured choice of GPU backend per op (fastformer/_dispatch.py reads it): written by tools/gpu_choice.py
from the op benchmarks of a GPU run (tools/gpu_check.sh); edit by running the tool, not by hand.

TABLE[compute capability][op][dtype] = (backends, fastest first), {"gpu": ..., "command": ...,
"speedup": geometric mean of the slower one's time over the faster one's, forward+backward}.
"""

'''


def choices(bench: dict) -> dict:
    """{capability: {op: {dtype: (order, provenance)}}} of one benchmark JSON."""
    info = bench.get("fastformer", {})
    capability, dtype = info.get("compute capability"), info.get("dtype")
    if info.get("device") != "cuda" or not capability or not dtype:
        raise SystemExit("the benchmark JSON is not of a CUDA run with its compute capability and dtype "
                         "(benchmarks/conftest.py records them; run tools/gpu_check.sh on a GPU machine)")
    times = defaultdict(dict)  # (op, shape) -> {impl: median seconds}
    for b in bench["benchmarks"]:
        extra = b["extra_info"]
        if extra.get("pass") == "fwd+bwd" and extra.get("impl") in GPU_BACKENDS:
            times[(extra["op"], extra["shape"])][extra["impl"]] = b["stats"]["median"]
    logs = defaultdict(list)  # op -> log(cuda time / triton time) per shape both ran
    for (op, _), by_impl in times.items():
        if all(name in by_impl for name in GPU_BACKENDS):
            logs[op].append(math.log(by_impl["cuda"] / by_impl["triton"]))
    table = {}
    for op, values in sorted(logs.items()):
        ratio = math.exp(sum(values) / len(values))  # cuda time / triton time
        order = ("triton", "cuda") if ratio > 1 else ("cuda", "triton")
        table[op] = {dtype: (order, {"gpu": info.get("gpu", "?"), "command": info.get("command", "?"),
                                     "shapes": len(values), "speedup": round(max(ratio, 1 / ratio), 3)})}
    return {capability: table}


def merge(old: dict, new: dict) -> dict:
    out = {cap: {op: dict(rows) for op, rows in ops.items()} for cap, ops in old.items()}
    for cap, ops in new.items():
        for op, rows in ops.items():
            out.setdefault(cap, {}).setdefault(op, {}).update(rows)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", help="a --benchmark-json of the op benchmarks run on a GPU")
    parser.add_argument("--write", action="store_true", help=f"merge the rows into {os.path.relpath(TABLE, ROOT)}")
    args = parser.parse_args(argv)
    with open(args.bench) as f:
        rows = choices(json.load(f))
    if not any(rows.values()):
        print("no op ran on both cuda and triton forward+backward: nothing to choose", file=sys.stderr)
        return 1
    for cap, ops in rows.items():
        for op, by_dtype in ops.items():
            for dtype, (order, prov) in by_dtype.items():
                print(f"compute capability {cap}, {op}, {dtype}: {order[0]} first ({prov['speedup']}x over "
                      f"{order[1]}, {prov['shapes']} shapes)")
    if args.write:
        namespace: dict = {}
        with open(TABLE) as f:
            exec(compile(f.read(), TABLE, "exec"), namespace)
        table = merge(namespace["TABLE"], rows)
        with open(TABLE, "w") as f:
            f.write(HEADER + "TABLE = " + pprint.pformat(table, width=110, sort_dicts=True) + "\n")
        print(f"wrote {os.path.relpath(TABLE, ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
