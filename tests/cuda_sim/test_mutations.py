"""Mutation tests of the CUDA kernels on the CPU SIMT model: every ``__syncthreads()`` in csrc/cuda/*.cuh
is deleted in turn (the model treats that one call site as a no-op, exactly as if the line were removed),
and the op's parity check against the float64 reference must then fail under some shuffled schedule.
A barrier whose deletion goes unnoticed is either unneeded or untested; both are defects. The test also
checks that the parity case really passes the deleted barrier, so it cannot pass vacuously.
"""
import re

import pytest
import torch

import fastformer
from fastformer import ops

from helpers import padding_mask, randn
from tolerances import assert_close

pytestmark = pytest.mark.skipif(not fastformer.backends()["cuda_sim"], reason="cuda_sim needs a C++ compiler")

SEEDS = (1, 2, 3)


def barrier_sites():
    """(kernel file, line, the ops whose kernels include it, the dtype that runs them) for every
    __syncthreads() in csrc/cuda/*.cuh. <op>_mma.cuh holds <op>'s tensor-core kernels, which the model
    (playing sm_80) runs for float16; the SIMT kernels of <op>.cuh run for float32."""
    if not fastformer.backends()["cuda_sim"]:
        return []
    from fastformer import cuda_sim

    sites = []
    for path in sorted((cuda_sim.SOURCE_ROOT / "cuda").glob("*.cuh")):
        stem, mma = (path.stem[:-len("_mma")], True) if path.stem.endswith("_mma") else (path.stem, False)
        users = [stem] if stem in cuda_sim.OPS else list(cuda_sim.OPS)  # common.cuh: every op
        dtype = torch.float16 if mma else torch.float32
        for number, text in enumerate(path.read_text().splitlines(), start=1):
            if re.search(r"\b__syncthreads\(\)", text.split("//")[0]):
                sites.append(pytest.param(f"cuda/{path.name}", number, users, dtype, id=f"{path.name}:{number}"))
    return sites


def _parity(run, reference, dtype):
    """True iff the cuda_sim outputs and gradients match the float64 reference."""
    try:
        for got, want in zip(run(), reference()):
            assert_close(got, want, dtype)
    except AssertionError:
        return False
    return True


def _grads(fn, inputs):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    return [out.detach()] + [leaf.grad for leaf in leaves]


def softmax_case():
    """Rows short enough for a warp per row and long enough for a block per row."""
    cases = []
    for rows, n in ((5, 97), (3, 2500)):
        x = randn(rows, n, dtype=torch.float32, scale=3.0)
        mask = torch.rand(rows, n) < 0.2
        cases.append((x, mask))

    def run(backend, dtype):
        out = []
        for x, mask in cases:
            out += _grads(lambda t: ops.softmax(t, mask=mask, scale=0.7, backend=backend), [x.to(dtype)])
        return out

    return run


def layer_norm_residual_case():
    # Short rows (a warp per row) and long ones (a block per row), enough of them that the backward's
    # blocks each reduce several rows in turn (reusing their shared scratch).
    cases = [[randn(*shape, dtype=torch.float32) for shape in ((rows, n), (rows, n), (n,), (n,))]
             for rows, n in ((9, 97), (300, 1100))]

    def run(backend, dtype):
        out = []
        for x, res, w, b in cases:
            out += _grads(lambda *t: ops.layer_norm_residual(*t, backend=backend),
                          [x.to(dtype), res.to(dtype), w.to(dtype), b.to(dtype)])
        return out

    return run


def attention_case():
    # Lk and Lq span several walked tiles of every kernel (the SIMT ones walk 32 rows; the tensor-core
    # ones 32 or 64, double-buffered), so a barrier guarding a buffer's refill is crossed.
    B, H, Lq, Lk, D = 2, 2, 70, 150, 40
    q, k, v = (randn(B, H, L, D, dtype=torch.float32) for L in (Lq, Lk, Lk))
    kpm = padding_mask(B, Lk)

    def run(backend, dtype):
        out = []
        for causal in (False, True):
            out += _grads(lambda *t: ops.attention(*t, key_padding_mask=kpm, causal=causal, backend=backend),
                          [q.to(dtype), k.to(dtype), v.to(dtype)])
        return out

    return run


CASES = {"softmax": softmax_case, "layer_norm_residual": layer_norm_residual_case, "attention": attention_case}


@pytest.mark.parametrize("file, line, users, dtype", barrier_sites())
def test_deleting_any_barrier_breaks_parity(file, line, users, dtype):
    from fastformer import cuda_sim

    before = cuda_sim.schedule_seed()
    hits, caught = 0, []
    try:
        for op in users:
            run = CASES[op]()
            reference = lambda: run("torch", torch.float64)  # noqa: E731
            cuda_sim.set_schedule_seed(SEEDS[0])
            assert _parity(lambda: run("cuda_sim", dtype), reference, dtype), f"unmutated {op} must pass first"
            with cuda_sim.barrier_deleted(op, file, line) as module:
                for seed in SEEDS:
                    cuda_sim.set_schedule_seed(seed)
                    caught.append(not _parity(lambda: run("cuda_sim", dtype), reference, dtype))
                hits += module.deleted_barrier_hits()
    finally:
        cuda_sim.set_schedule_seed(before)
    assert hits > 0, f"no parity case of {users} reaches the barrier at {file}:{line}"
    assert any(caught), f"deleting the __syncthreads at {file}:{line} went unnoticed under seeds {SEEDS}"
