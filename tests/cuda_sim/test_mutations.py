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
    (playing sm_80) runs for float16; the SIMT kernels of <op>.cuh run for float32. The kernels of <op>.cuh
    also serve the ops named <op>_... (attention's serve attention_varlen)."""
    if not fastformer.backends()["cuda_sim"]:
        return []
    from fastformer import cuda_sim

    sites = []
    for path in sorted((cuda_sim.SOURCE_ROOT / "cuda").glob("*.cuh")):
        stem, mma = (path.stem[:-len("_mma")], True) if path.stem.endswith("_mma") else (path.stem, False)
        users = [op for op in cuda_sim.OPS if op == stem or op.startswith(stem + "_")]
        users = users or list(cuda_sim.OPS)  # common.cuh: every op
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


def attention_varlen_case():
    # Packed sequences (an empty one among them) with grouped-query heads: the longest spans several walked
    # tiles of every kernel, and the dK/dV kernels walk them once per query head of the group.
    lens_q, lens_k, H, H_kv, D = (70, 0, 45), (150, 3, 90), 4, 2, 40
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
                  for lens in (lens_q, lens_k))
    q = randn(sum(lens_q), H, D, dtype=torch.float32)
    k, v = (randn(sum(lens_k), H_kv, D, dtype=torch.float32) for _ in range(2))

    def run(backend, dtype):
        out = []
        for causal in (False, True):
            out += _grads(lambda *t: ops.attention_varlen(*t, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                          backend=backend),
                          [q.to(dtype), k.to(dtype), v.to(dtype)])
        return out

    return run


def cross_entropy_case():
    # Rows of V = 97 (element by element, fewer logits than threads: some warps hold none), 2501 (element
    # by element, several per thread), 2500 and 1000 (16-byte packs of floats). The forward's per-warp
    # (max, sum) pairs and its sum of the logits cross warps only through block_sum's barriers (the kernel
    # file has none of its own): label smoothing 0.1 makes the loss read that sum, and ignored rows
    # (target -100) sit among the others.
    cases = []
    for rows, n in ((9, 97), (3, 2501), (5, 2500), (4, 1000)):
        x = randn(rows, n, dtype=torch.float32, scale=3.0)
        target = torch.randint(0, n, (rows,))
        target[1] = -100
        cases.append((x, target))

    def run(backend, dtype):
        out = []
        for x, target in cases:
            logits = x.to(dtype).clone().requires_grad_(True)
            loss, nll = ops.cross_entropy(logits, target, label_smoothing=0.1, return_nll=True, backend=backend)
            rows = loss.numel()
            upstream = [torch.linspace(-1, 1, rows, dtype=loss.dtype), torch.linspace(1, 0.5, rows, dtype=loss.dtype)]
            torch.autograd.backward([loss, nll], upstream)
            out += [loss.detach(), nll.detach(), logits.grad]
        return out

    return run


def bias_activation_case():
    # Rows of 97 (element by element) and 64 (pairs); gelu from the saved x, relu from the saved y; several
    # chunks of rows in the dbias reduction. csrc/cuda/bias_activation.cuh has no barrier: this case joins
    # those of common.cuh's.
    inputs = [(randn(40, n, dtype=torch.float32, scale=2.0), randn(n, dtype=torch.float32)) for n in (97, 64)]

    def run(backend, dtype):
        out = []
        for x, bias in inputs:
            for activation in ("gelu", "relu"):
                b = bias.double() if dtype == torch.float64 else bias  # the reference's gradients in float64
                out += _grads(lambda x, b: ops.bias_activation(x, b, activation=activation, backend=backend),
                              [x.to(dtype), b])
        return out

    return run


# One parity case per op of csrc/ops.h's list (tests/test_op_lists.py fails while an op has none).
CASES = {"softmax": softmax_case, "layer_norm_residual": layer_norm_residual_case, "attention": attention_case,
         "attention_varlen": attention_varlen_case, "cross_entropy": cross_entropy_case,
         "bias_activation": bias_activation_case}


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


def test_cross_entropy_needs_block_sums_last_barrier():
    """csrc/cuda/cross_entropy.cuh has no __syncthreads of its own, so no site above is its: its forward
    kernel's cross-warp values (the per-warp (max, sum) pairs it stages in shared memory, the sum of the
    logits in block_sum's scratch) are published by block_sum's barriers in common.cuh. Deleting block_sum's
    last barrier (between the staging writes and the reads) must break cross_entropy's own parity, not only
    another op's. (Its first barrier guards scratch's reuse by a second call: one call per block here.)"""
    from fastformer import cuda_sim

    lines = (cuda_sim.SOURCE_ROOT / "cuda" / "common.cuh").read_text().splitlines()
    start = next(i for i, text in enumerate(lines) if re.search(r"\bvoid block_sum\(", text))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("}"))
    barriers = [i + 1 for i in range(start, end) if re.search(r"\b__syncthreads\(\)", lines[i].split("//")[0])]
    assert len(barriers) == 2, f"block_sum should hold two barriers, found lines {barriers}"
    run = CASES["cross_entropy"]()
    reference = lambda: run("torch", torch.float64)  # noqa: E731
    before = cuda_sim.schedule_seed()
    caught = []
    try:
        cuda_sim.set_schedule_seed(SEEDS[0])
        assert _parity(lambda: run("cuda_sim", torch.float32), reference, torch.float32), "unmutated must pass first"
        with cuda_sim.barrier_deleted("cross_entropy", "cuda/common.cuh", barriers[-1]) as module:
            for seed in SEEDS:
                cuda_sim.set_schedule_seed(seed)
                caught.append(not _parity(lambda: run("cuda_sim", torch.float32), reference, torch.float32))
            hits = module.deleted_barrier_hits()
    finally:
        cuda_sim.set_schedule_seed(before)
    assert hits > 0, f"cross_entropy's kernels never reach common.cuh:{barriers[-1]}"
    assert any(caught), f"deleting common.cuh:{barriers[-1]} went unnoticed by cross_entropy under seeds {SEEDS}"
