"""The harness of the peer test matrices, tests/ops/test_<op>_matrix.py.

Each matrix module lists cases taken from the test files of the best-known fused-kernel projects (each
family cites its file) plus adversarial families, and checks every backend with FlashAttention's criterion
(tests/tolerances.py, MATRIX): the backend's error against a float64 reference is at most a small multiple
of PyTorch eager's own error in the same dtype on the same inputs, plus a floor of a few ulps. Upstream
gradients are drawn in the dtype, so every run sees the same rounded values.

Budget: the cpu and torch backends run every case; the slow backends (cuda_sim, the Triton interpreter)
run the cases whose work (``case.work``: multiply-adds of attention, elements of a row op) fits
SLOW_WORK, and every family keeps at least one case there (checked when the tests are collected), so a
family is shrunk, never dropped. Cases that a backend refuses by contract (``case.refused(backend)``:
head dims above 128 on cuda and triton, float64 outside torch and cpu) must raise the documented error.

Shards: FASTFORMER_MATRIX_SHARD="K/N" (1 <= K <= N) runs shard K of N. Every shard keeps the first case
of each (backend, dtype, family), so each shard still checks every family on every backend and dtype;
every other case falls in exactly one shard (a stable hash of its test id), so the N shards together are
the whole matrix. Unset or empty: every case. CI runs one shard, chosen by its commit (.ci/run), so
successive commits rotate through the matrix.

The largest error/bound ratio seen per (op, backend, dtype) is kept in RESULTS and printed at the end of
the run (tests/conftest.py), which is what the closing notes quote.
"""
from __future__ import annotations

import math
import os
import zlib
from collections import defaultdict

import pytest
import torch

import fastformer
from helpers import ALL_BACKENDS, SLOW_BACKENDS, dtype_name, dtypes_for
from tolerances import matrix_bound

# Where the backends under test run: "cpu" (CI: every backend on CPU tensors, cuda through cuda_sim and
# triton in its interpreter) or "cuda" (a GPU machine: the cuda and triton backends on CUDA tensors, every
# case, the references still computed on the CPU):
#     FASTFORMER_MATRIX_DEVICE=cuda python -m pytest tests/ops/test_attention_matrix.py ...
DEVICE = os.environ.get("FASTFORMER_MATRIX_DEVICE", "cpu")
if DEVICE == "cpu":
    BACKENDS = ALL_BACKENDS
else:
    BACKENDS = [b for b in ("cuda", "triton") if fastformer.backends().get(b)]
    if not torch.cuda.is_available() or not BACKENDS:
        raise RuntimeError(f"FASTFORMER_MATRIX_DEVICE={DEVICE}: needs a CUDA device and the cuda or triton backend")


def on_device(tensors):
    """The tensors on DEVICE (None stays None), keeping their strides where they are views."""
    return [None if t is None else t.to(DEVICE) for t in tensors]


def on_cpu(tensors):
    return [t.cpu() for t in tensors]

# The slow backends' work budget per case: attention B H Lq Lk D multiply-adds (B 2, H 2, 33 x 33 keys,
# D 64), attention_varlen the same over its sequences (H D sum of Lq_b Lk_b, or B H Lq Lk D for lengths
# drawn up to Lq, Lk), the row ops' elements. One per op of csrc/ops.h's list (tests/test_op_lists.py checks).
SLOW_WORK = {"attention": 2 * 2 * 33 * 33 * 64, "softmax": 16 * 4099, "layer_norm_residual": 16 * 4099,
             "cross_entropy": 16 * 4099, "attention_varlen": 2 * 2 * 33 * 33 * 64, "bias_activation": 16 * 128}

# (op, backend, dtype name) -> largest error / bound over the matrix.
RESULTS: dict[tuple[str, str, str], float] = defaultdict(float)


def parse_shard(value: str | None) -> tuple[int, int] | None:
    """FASTFORMER_MATRIX_SHARD's value "K/N" -> (K, N); None or "" -> None (every case)."""
    if not value:
        return None
    try:
        k, n = (int(part) for part in value.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise ValueError(f"FASTFORMER_MATRIX_SHARD={value!r}: expected K/N with 1 <= K <= N, e.g. 2/3")
    return k, n


SHARD = parse_shard(os.environ.get("FASTFORMER_MATRIX_SHARD"))


def in_shard(test_id: str, shard: tuple[int, int] | None) -> bool:
    """Whether a case that is not its family's first falls in ``shard`` (stable across runs and machines)."""
    return shard is None or zlib.crc32(test_id.encode()) % shard[1] == shard[0] - 1


def matrix_params(op: str, cases, shard: tuple[int, int] | None = SHARD):
    """pytest params (backend, dtype, case): every backend and dtype, every case on cpu/torch (and on a
    GPU), the cases within SLOW_WORK on the slow backends. A case's ``dtypes`` (None: all) restricts its
    dtypes; float64 runs only where the backend supports it. With a ``shard`` (K, N), the first case of each
    (backend, dtype, family) and the others that fall in shard K."""
    params = []
    for backend in BACKENDS:
        families = {case.family for case in cases}
        kept = set()
        for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            if dtype not in dtypes_for(backend):
                continue
            firsts = set()
            for case in cases:
                if case.dtypes is not None and dtype not in case.dtypes:
                    continue
                if DEVICE == "cpu" and backend in SLOW_BACKENDS and case.work > SLOW_WORK[op]:
                    continue
                kept.add(case.family)
                test_id = f"{backend}-{dtype_name(dtype)}-{case}"
                if case.family in firsts and not in_shard(test_id, shard):
                    continue
                firsts.add(case.family)
                params.append(pytest.param(backend, dtype, case, id=test_id))
        lost = families - kept
        assert not lost, f"{op} matrix: families {sorted(lost)} have no case within {backend}'s work budget"
    return params


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| (inf where either is non-finite and they differ; 0 for empty tensors)."""
    if actual.numel() == 0:
        return 0.0
    diff = (actual.double() - expected).abs()
    return float(torch.nan_to_num(diff, nan=math.inf).max())


def check(op, backend, dtype, name, actual, eager, expected, condition=1.0):
    """FlashAttention's criterion for one output: |actual - expected| <= factor |eager - expected| + floor
    (the floor grows with ``condition``, the largest |logit| of a softmax; tests/tolerances.py)."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == dtype, f"{name}: dtype {actual.dtype}, expected {dtype}"
    eager_error = max_error(eager, expected)
    assert math.isfinite(eager_error), f"{name}: PyTorch eager is not finite in {dtype}: the case misses its dtypes"
    error = max_error(actual, expected)
    bound = matrix_bound(eager_error, expected, dtype, condition)
    key = (op, backend, dtype_name(dtype))
    RESULTS[key] = max(RESULTS[key], error / bound)
    assert error <= bound, (f"{name} ({backend}, {dtype}): error {error:.3g} > bound {bound:.3g} "
                            f"(PyTorch eager's error {eager_error:.3g})")


def summary() -> list[str]:
    """Lines of the largest error/bound ratio per op, backend and dtype (<= 1 passes)."""
    lines = []
    for (op, backend, dtype), ratio in sorted(RESULTS.items()):
        lines.append(f"{op:20s} {backend:9s} {dtype:5s} largest error / bound = {ratio:.3f}")
    return lines
