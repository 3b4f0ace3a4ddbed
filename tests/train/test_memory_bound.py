"""The trainer's memory stays bounded: resident memory must not keep growing as a run goes on.

The default main job must stay within 4 GiB for the whole run. What grew before (to 4.25 GiB on an Intel
Xeon with AMX) were the caches behind torch's bfloat16 matmuls on the CPU: every new batch shape made a new
oneDNN primitive and ideep computation, each holding buffers sized by its shapes, and 1,024 of each were
kept (fastformer/runtime.py bound_onednn_cache). Both tests run in a fresh process, so that resident memory
is the trainer's alone:

- the mechanism, at the small config's shapes: the trainer's process settings, then bfloat16 linears
  forward and backward over 80 token counts, each new; resident memory after the first 20 and at the end,
  each measured after handing the heap's free pages back (malloc_trim, as --max-rss-gib does), so that
  what it sees is live memory, not the fragmentation of a heap that keeps freed memory. On the
  AVX512_BF16 EPYC it grew 0.37 GiB with both caches at 1,024, 0.17-0.21 GiB with only one bounded, and
  0.001 GiB with the trainer's bounds.
- a short training run of the small config whose resident memory (the train records' rss_gib) in its
  second half stays within a margin of its first half's.
"""
import json
import os
import subprocess
import sys

import pytest

from fastformer.runtime import native_bf16_cpu
from train_helpers import tiny_run_args

CACHE_GROWTH_GIB = 0.05  # live memory allowed to grow over 60 new shapes (caught: 0.17 to 0.37 GiB)
RUN_GROWTH_GIB = 0.3  # resident memory allowed to grow from a short run's first half to its second

MECHANISM = r"""
import argparse, json, torch, torch.nn.functional as F
from fastformer.runtime import resident_bytes, trim_freed_memory
from fastformer.training.setup import configure_process
configure_process(argparse.Namespace(threads=0, malloc="keep"))
torch.manual_seed(0)
# the small config's projections: feed-forward in and out, the output projection, the fused q/k/v
weights = [torch.randn(n, k, requires_grad=True) for n, k in ((1024, 256), (256, 1024), (8000, 256), (768, 256))]
rss = []
for tokens in range(1000, 1800, 10):  # 80 batch shapes, each new
    x = torch.randn(tokens, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = F.linear(F.linear(x, weights[0]), weights[1])
        loss = F.linear(h, weights[2]).float().sum() + F.linear(h, weights[3]).float().sum()
    loss.backward()
    trim_freed_memory(1)  # free heap pages back (the trainer's --max-rss-gib, at its lowest): what stays is live
    rss.append(resident_bytes() / 2**30)
print(json.dumps(rss))
"""


def trainer_env():
    env = dict(os.environ)
    for variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        env.pop(variable, None)  # the trainer's own bounds, not a caller's
    return env


@pytest.mark.skipif(not native_bf16_cpu(), reason="the trainer takes float32 on a CPU without bfloat16 "
                    "instructions (AVX512_BF16 or AMX): its matmuls make no oneDNN primitives")
def test_bfloat16_matmuls_over_new_shapes_do_not_grow_memory():
    done = subprocess.run([sys.executable, "-c", MECHANISM], env=trainer_env(), capture_output=True, text=True,
                          check=True)
    rss = json.loads(done.stdout)
    growth = max(rss[20:]) - rss[19]
    assert growth < CACHE_GROWTH_GIB, (f"live memory grew by {growth:.3f} GiB over 60 new batch shapes "
                                 f"({rss[19]:.2f} -> {max(rss[20:]):.2f} GiB)")


def test_a_training_run_does_not_keep_growing(tmp_path):
    args = tiny_run_args(tmp_path, "--max-steps", "40")
    args[args.index("tiny")] = "small"
    args[args.index("--max-tokens") + 1] = "2000"  # batches of many shapes, up to 2,000 tokens
    args[args.index("--update-tokens") + 1] = "1000"
    subprocess.run([sys.executable, "-m", "fastformer.train", *args], env=trainer_env(), capture_output=True,
                   check=True)
    records = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    rss = [r["rss_gib"] for r in records if r["kind"] == "train"]
    assert len(rss) == 40
    first, second = max(rss[:20]), max(rss[20:])
    assert second - first < RUN_GROWTH_GIB, (f"resident memory grew from {first:.2f} GiB (updates 1-20) to "
                                         f"{second:.2f} GiB (updates 21-40)")
