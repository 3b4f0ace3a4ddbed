"""ops.attention against the float64 torch reference: every backend and dtype, masks, odd shapes.

Each test draws fresh random q, k, v and a random upstream gradient, runs forward and backward on the
backend under test in the tested dtype, and compares the output and dq, dk, dv with the torch backend run
in float64 on float64 copies of the same inputs (tests/tolerances.py). The torch backend itself is first
checked against a naive formula written here, so the reference is not trusted blindly.
"""
import math
import os
from dataclasses import dataclass

import pytest
import torch

from fastformer import _dispatch, ops
from fastformer._ext import C
from fastformer.ops import reference
from helpers import (
    ALL_BACKENDS,
    assert_layout_kept,
    BACKENDS,
    FLOAT64_BACKENDS,
    SLOW_LIMITS,
    backend_dtype_cases,
    dtype_name,
    forward_backward,
    kernel_op,
    padding_mask,
    projection_views,
    randn,
    same_memory,
    upcast,
    visible_keys,
)
from tolerances import assert_close


@dataclass(frozen=True)
class Case:
    B: int
    H: int
    Lq: int
    Lk: int
    D: int
    mask: str = "none"  # "none", "padding" (key padding mask), "causal" or "both"
    scale: float | None = None  # None: the default 1/sqrt(D)

    @property
    def padding(self):
        return self.mask in ("padding", "both")

    @property
    def causal(self):
        return self.mask in ("causal", "both")

    def __str__(self):
        scale = "" if self.scale is None else f"-scale{self.scale}"
        return f"B{self.B}H{self.H}q{self.Lq}k{self.Lk}d{self.D}-{self.mask}{scale}"


def small(case):
    """Whether the case fits the limits of the slow (simulated GPU) backends."""
    lim = SLOW_LIMITS
    return case.B <= lim["B"] and case.H <= lim["H"] and max(case.Lq, case.Lk) <= lim["L"] and case.D <= lim["D"]


CASES = [
    # Within the slow backends' limits.
    Case(1, 1, 1, 1, 16),
    Case(2, 2, 7, 7, 16),
    Case(2, 2, 7, 7, 40, "padding"),
    Case(2, 2, 33, 33, 64, "causal"),
    Case(2, 2, 33, 33, 40, "both", scale=0.3),
    Case(2, 1, 1, 33, 64, "causal"),  # one query against a cache of keys (decoding)
    Case(1, 2, 7, 33, 16, "both"),  # cross-attention, Lq < Lk
    Case(2, 2, 33, 7, 64, "both"),  # Lq > Lk with causal: the first 26 queries see no key
    Case(2, 2, 33, 17, 16, "padding"),  # cross-attention, Lq > Lk
    Case(1, 2, 17, 9, 128, "both"),  # the largest head dim, Lq > Lk
    Case(2, 1, 1, 33, 128, "causal"),
    # Bigger, odd shapes: head dims 40 and 128, lengths 97 and 113 (not multiples of any block size).
    Case(2, 3, 97, 97, 40, "padding"),
    Case(1, 2, 113, 113, 64, "causal"),
    Case(2, 2, 113, 97, 128, "both"),
    Case(2, 2, 1, 97, 128, "causal"),
    Case(2, 1, 7, 113, 40, "causal"),
    Case(1, 2, 97, 113, 16, "none", scale=0.5),
    Case(2, 2, 113, 7, 64, "causal"),
    Case(2, 2, 97, 113, 128, "both"),
]


def make_inputs(case, dtype):
    q = randn(case.B, case.H, case.Lq, case.D, dtype=dtype)
    k = randn(case.B, case.H, case.Lk, case.D, dtype=dtype)
    v = randn(case.B, case.H, case.Lk, case.D, dtype=dtype)
    mask = padding_mask(case.B, case.Lk) if case.padding else None
    dout = randn(case.B, case.H, case.Lq, case.D, dtype=dtype)
    return q, k, v, mask, dout


def attention_fn(backend, case, mask, **kwargs):
    return lambda q, k, v: ops.attention(
        q, k, v, key_padding_mask=mask, causal=case.causal, scale=case.scale, backend=backend, **kwargs
    )


def assert_masked_rows_and_keys_zero(case, mask, out, dq, dk, dv):
    """Rows with no visible key: output and dq exactly zero; keys no query sees: dk and dv exactly zero."""
    visible = visible_keys(case.B, case.Lq, case.Lk, mask, case.causal)  # (B, 1, Lq, Lk)
    empty_rows = (~visible.any(-1)).expand(case.B, case.H, case.Lq)  # (B, H, Lq)
    unseen_keys = (~visible.any(-2)).expand(case.B, case.H, case.Lk)  # (B, H, Lk)
    assert (out[empty_rows] == 0).all(), "a query with no visible key must return zeros"
    assert (dq[empty_rows] == 0).all(), "a query with no visible key must get a zero gradient"
    assert (dk[unseen_keys] == 0).all(), "a key no query attends to must get a zero gradient"
    assert (dv[unseen_keys] == 0).all(), "a value no query attends to must get a zero gradient"


def naive_attention(q, k, v, key_padding_mask, causal, scale):
    """softmax(scale q k^T, masked) v written out; rows with no visible key give zeros."""
    B, _, Lq, D = q.shape
    Lk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    visible = visible_keys(B, Lq, Lk, key_padding_mask, causal)
    empty = ~visible.any(-1, keepdim=True)
    scores = (q @ k.transpose(-1, -2)) * scale
    # Masked scores -> -inf; rows with nothing visible -> 0 so softmax stays finite, then zeroed by `visible`.
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(empty, 0.0)
    return (torch.softmax(scores, dim=-1) * visible) @ v


@pytest.mark.parametrize("case", CASES[:9] + [Case(2, 2, 113, 97, 40, "both", scale=0.7)], ids=str)
def test_torch_reference_matches_naive_formula(case):
    # The reference of every other test, checked against the formula in float64.
    q, k, v, mask, dout = make_inputs(case, torch.float64)
    (out,), grads = forward_backward(attention_fn("torch", case, mask), [q, k, v], [dout])
    (expected,), expected_grads = forward_backward(
        lambda q, k, v: naive_attention(q, k, v, mask, case.causal, case.scale), [q, k, v], [dout]
    )
    assert_close(out, expected, torch.float64, "out")
    for name, g, eg in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_close(g, eg, torch.float64, name)


@pytest.mark.parametrize("backend,dtype,case", backend_dtype_cases(ALL_BACKENDS, CASES, small))
def test_attention_matches_reference(backend, dtype, case):
    q, k, v, mask, dout = make_inputs(case, dtype)
    (out,), grads = forward_backward(attention_fn(backend, case, mask), [q, k, v], [dout])
    (ref,), ref_grads = forward_backward(attention_fn("torch", case, mask), upcast([q, k, v]), upcast([dout]))
    assert_close(out, ref, dtype, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, rg, dtype, name)
    assert_masked_rows_and_keys_zero(case, mask, out, *grads)


# Rows with no visible key, constructed on purpose: every key of batch element 0 padded, or causal with
# more queries than keys (query i < Lq - Lk sees nothing).
EMPTY_ROW_CASES = [Case(2, 2, 17, 33, 40, "padding"), Case(2, 2, 33, 9, 64, "causal"), Case(2, 2, 33, 9, 16, "both")]


@pytest.mark.parametrize("backend,dtype,case", backend_dtype_cases(ALL_BACKENDS, EMPTY_ROW_CASES, small))
def test_rows_without_visible_key_are_zero(backend, dtype, case):
    q, k, v, _, dout = make_inputs(case, dtype)
    mask = None
    if case.padding:
        mask = padding_mask(case.B, case.Lk)
        mask[0] = True  # batch element 0: nothing to attend to
    (out,), (dq, dk, dv) = forward_backward(attention_fn(backend, case, mask), [q, k, v], [dout])
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), f"{name} holds non-finite values"
    if case.padding:
        assert (out[0] == 0).all() and (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()
    if case.causal:
        first_seen = case.Lq - case.Lk  # query i sees key 0 from i = Lq - Lk on
        assert (out[:, :, :first_seen] == 0).all() and (dq[:, :, :first_seen] == 0).all()
        assert (out[:, :, first_seen:] != 0).any()
    assert_masked_rows_and_keys_zero(case, mask, out, dq, dk, dv)
    # The rows that do see keys still match the reference.
    (ref,), ref_grads = forward_backward(attention_fn("torch", case, mask), upcast([q, k, v]), upcast([dout]))
    assert_close(out, ref, dtype, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert_close(g, rg, dtype, name)


LSE_CASES = [Case(2, 2, 33, 17, 40, "both"), Case(2, 2, 7, 33, 64, "padding", scale=0.25)]


@pytest.mark.parametrize("backend,dtype,case", backend_dtype_cases(ALL_BACKENDS, LSE_CASES, small, [torch.float32]))
def test_attention_fwd_logsumexp(backend, dtype, case):
    # The forward op's second output is the log-sum-exp of each row's visible scaled scores, (B, H, Lq),
    # which the backward uses to rebuild the probabilities.
    q, k, v, _, _ = make_inputs(case, dtype)
    mask = padding_mask(case.B, case.Lk)
    scale = 1.0 / math.sqrt(case.D) if case.scale is None else case.scale
    seed = torch.tensor(0, dtype=torch.int64)
    fwd, tail = kernel_op("attention", "fwd", backend)
    out, lse = fwd(q, k, v, mask, case.causal, 0.0, scale, seed, *tail)
    visible = visible_keys(case.B, case.Lq, case.Lk, mask, case.causal)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    expected = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1)  # (B, H, Lq)
    assert lse.shape == (case.B, case.H, case.Lq)
    rows = visible.any(-1).expand(case.B, case.H, case.Lq)
    assert_close(lse[rows].float(), expected[rows], torch.float32, "lse")
    assert_close(out, attention_fn("torch", case, mask)(*upcast([q, k, v])), dtype, "out")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_explicit_default_scale(backend):
    # scale=None is 1/sqrt(D): passing that value explicitly gives the same result.
    case = Case(2, 2, 7, 9, 40, "causal")
    q, k, v, _, _ = make_inputs(case, torch.float32)
    default = ops.attention(q, k, v, causal=True, backend=backend)
    explicit = ops.attention(q, k, v, causal=True, scale=1.0 / math.sqrt(40), backend=backend)
    torch.testing.assert_close(default, explicit, atol=1e-6, rtol=1e-6)
    other = ops.attention(q, k, v, causal=True, scale=0.5, backend=backend)
    assert not torch.allclose(default, other, atol=1e-3)


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
def test_gradcheck_float64(backend):
    # Analytic gradients against finite differences, with both masks.
    case = Case(2, 1, 4, 5, 4, "both")
    q, k, v, _, _ = make_inputs(case, torch.float64)
    mask = padding_mask(case.B, case.Lk)
    fn = attention_fn(backend, case, mask)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("scale", [3.0, 1e4])
def test_backward_recomputes_the_forward_scores(backend, scale):
    # dV = P^T dO needs only P: when backward recomputes the scores in another rounding than the forward's
    # (the cuda dK/dV kernel once staged scale * K against the forward's scale * Q), e^(s - lse) carries
    # the difference, |s| ulp: 0.11 in dv at scale 1e4 (float32) against PyTorch eager's 6e-7. At 1e4
    # every row is one-hot, lse is its top score exactly, and only a score recomputed differently can err;
    # the bound is eager's own dv error (no allowance for |s|). (At scale 100 rows with near ties also
    # carry lse's own rounding, |lse| ulp, in every FlashAttention-style backward: not tested here.)
    case = Case(2, 2, 33, 33, 64, "both", scale=scale)
    q, k, v, _, dout = make_inputs(case, torch.float32)
    mask = padding_mask(case.B, case.Lk)
    _, (_, _, dv) = forward_backward(attention_fn(backend, case, mask), [q, k, v], [dout])
    _, (_, _, ref_dv) = forward_backward(attention_fn("torch", case, mask), upcast([q, k, v]), upcast([dout]))

    def eager(q, k, v):
        return naive_attention(q, k, v, mask, case.causal, scale)  # PyTorch eager in float32

    _, (_, _, eager_dv) = forward_backward(eager, [q, k, v], [dout])
    eager_error = (eager_dv.double() - ref_dv).abs().max().item()
    error = (dv.double() - ref_dv).abs().max().item()
    assert error <= 2 * eager_error + 8 * torch.finfo(torch.float32).eps * ref_dv.abs().max().item(), (
        f"dv error {error:.3g} against eager's {eager_error:.3g}")


def test_torch_reference_probabilities_at_large_logits():
    # The torch backend once formed P = e^(s - lse) with lse rounded to float32: at scale 100 its rows
    # summed to 1 within 2.6e-5 (|lse| ulp) and its out erred by 5.9e-5. P now comes from a max-subtracted
    # softmax: rows sum to 1 within a few ulps, and out is as close as PyTorch eager's.
    case = Case(2, 2, 33, 33, 64, "causal", scale=100.0)
    q, k, v, _, _ = make_inputs(case, torch.float32)
    p = reference.attention_probabilities(q, k, None, True, 100.0)
    assert (p.sum(-1) - 1).abs().max().item() <= 4 * torch.finfo(torch.float32).eps * 33
    out = ops.attention(q, k, v, causal=True, scale=100.0, backend="torch")
    ref = ops.attention(*upcast([q, k, v]), causal=True, scale=100.0, backend="torch")
    eager = naive_attention(q, k, v, None, True, 100.0)
    error, eager_error = ((t.double() - ref).abs().max().item() for t in (out, eager))
    bound = 2 * eager_error + 8 * torch.finfo(torch.float32).eps
    assert error <= bound, f"out error {error:.3g}, eager {eager_error:.3g}"


# The cuda launcher picks the tensor-core kernels (csrc/cuda/attention_mma.cuh) for 16-bit inputs on
# compute capability 8.0 and newer and the SIMT kernels (attention.cuh) below; cuda_sim plays 8.0 by
# default, so the suite above runs the tensor-core kernels for float16/bfloat16. Here both generations,
# the same inputs: each must match the reference, the two must not be the same computation (the choice
# really switched), and with dropout they must drop the same elements.
MMA_CASES = [Case(2, 2, 7, 33, 16, "both"), Case(1, 2, 97, 113, 40, "padding"), Case(2, 1, 70, 70, 128, "causal"),
             Case(1, 1, 33, 97, 64, "both", scale=0.3), Case(2, 2, 1, 33, 32, "causal")]


@pytest.mark.skipif("cuda_sim" not in ALL_BACKENDS, reason="cuda_sim is not among the tested backends (no C++ compiler, or FASTFORMER_TEST_BACKENDS)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", MMA_CASES, ids=str)
def test_cuda_sim_runs_the_simt_and_the_tensor_core_kernels(dtype, case):
    from fastformer import cuda_sim

    q, k, v, mask, dout = make_inputs(case, dtype)
    (ref,), ref_grads = forward_backward(attention_fn("torch", case, mask), upcast([q, k, v]), upcast([dout]))
    results = {}
    for capability in (60, 80):
        with cuda_sim.compute_capability(capability):
            (out,), grads = forward_backward(attention_fn("cuda_sim", case, mask), [q, k, v], [dout])
        assert_close(out, ref, dtype, f"out (sm_{capability})")
        for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert_close(g, rg, dtype, f"{name} (sm_{capability})")
        results[capability] = [out, *grads]
    assert any(not torch.equal(a, b) for a, b in zip(results[60], results[80])), "both runs took the same kernels"


@pytest.mark.skipif("cuda_sim" not in ALL_BACKENDS, reason="cuda_sim is not among the tested backends (no C++ compiler, or FASTFORMER_TEST_BACKENDS)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tensor_core_kernels_drop_what_the_simt_kernels_drop(dtype):
    """With dropout, both kernel generations match the float64 reference run with the same seed (the op
    draws its Philox seed from torch's generator): every backend drops the same elements."""
    from fastformer import cuda_sim

    case = Case(2, 2, 37, 75, 24, "both")
    q, k, v, mask, dout = make_inputs(case, dtype)
    torch.manual_seed(7)
    (ref,), ref_grads = forward_backward(attention_fn("torch", case, mask, dropout_p=0.3), upcast([q, k, v]),
                                         upcast([dout]))
    for capability in (60, 80):
        torch.manual_seed(7)
        with cuda_sim.compute_capability(capability):
            (out,), grads = forward_backward(attention_fn("cuda_sim", case, mask, dropout_p=0.3), [q, k, v], [dout])
        assert_close(out, ref, dtype, f"out (sm_{capability})")
        for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert_close(g, rg, dtype, f"{name} (sm_{capability})")


@pytest.mark.skipif("triton" not in ALL_BACKENDS, reason="triton is not among the tested backends (not installed, no "
                    "TRITON_INTERPRET=1 here, or FASTFORMER_TEST_BACKENDS)")
def test_triton_autotune_switch():
    # FASTFORMER_TRITON_AUTOTUNE=0 gives the GPU kernels one tile that every head dim fits (tests/gpu runs
    # so: autotuning would compile and time several kernels per new key); otherwise every candidate, and
    # the interpreter one small tile whatever the switch says.
    import subprocess
    import sys

    from fastformer.triton import _common
    for kind in ("fwd", "bwd"):
        assert _common.attention_shapes(kind, interpret=False, autotune=False) == [_common._UNTUNED]
        assert len(_common.attention_shapes(kind, interpret=False, autotune=True)) >= 4
        assert _common.attention_shapes(kind, interpret=True, autotune=True) == [(32, 32, 4, 1)]
    m, n, warps, stages = _common._UNTUNED
    assert m % 16 == 0 and n % 16 == 0 and warps in (4, 8) and stages >= 1  # tl.dot's tile rule
    read = "from fastformer.triton import _common; print(_common.AUTOTUNE)"
    for value, expected in (("0", "False"), ("1", "True")):
        env = dict(os.environ, FASTFORMER_TRITON_AUTOTUNE=value, TRITON_INTERPRET="1")
        out = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected


# (B, H, Lq, Lk, D, mask kind, pad): pad extra elements (NaN) after the H D (q) or 2 H D (k, v) of each token's
# row of the projection buffers, so the row stride is H D + pad: 1 breaks every vector alignment, 4 keeps
# element pairs aligned but not 16-byte chunks (float16). The cpu backend takes larger shapes and float64
# (no odd pad there: dgemm's float64 results depend on the rows' 16-byte alignment, so they are not
# bit-identical to contiguous copies'); cuda_sim (~200x slower) and the Triton interpreter small ones,
# cuda_sim also bfloat16 (the model plays compute capability 8.0: float16 and bfloat16 run the tensor-core
# kernels, float32 the SIMT ones).
LAYOUT_CASES = {
    "cpu": [(2, 3, 7, 9, 16, "padding", 0), (2, 3, 97, 97, 8, "both", 2), (1, 2, 1, 5, 4, "none", 0),
            (2, 4, 130, 140, 32, "causal", 4)],
    "slow": [(2, 3, 7, 9, 40, "padding", 0), (2, 2, 1, 33, 20, "causal", 1), (2, 2, 33, 17, 32, "both", 4)],
}
LAYOUT_DTYPES = {"cpu": (torch.float32, torch.float16, torch.float64),
                 "cuda_sim": (torch.float32, torch.float16, torch.bfloat16), "triton": (torch.float32, torch.float16)}


def layout_params():
    return [pytest.param(backend, dtype, case, id=f"{backend}-{dtype_name(dtype)}-" + "-".join(map(str, case)))
            for backend in BACKENDS for dtype in LAYOUT_DTYPES[backend]
            for case in LAYOUT_CASES["cpu" if backend == "cpu" else "slow"]]


@pytest.mark.parametrize("backend,dtype,case", layout_params())
def test_kernels_read_and_write_transformers_layout(backend, dtype, case, monkeypatch):
    """q, k, v as transformers and fastformer.nn hand them over (views (B, H, L, D) of (B, L, H, D) projections;
    k and v interleaved in one tensor; rows at a stride that breaks vector alignment): every kernel backend
    (cpu; the CUDA kernels through cuda_sim; the Triton kernels in the interpreter) reads them in place
    (csrc/ops.h attention_layout: no copy; the Python backends' functions receive the views themselves) and
    writes out, dq, dk, dv as views of (B, L, H, D) tensors, as torch's CPU sdpa does, whatever the inputs'
    layout (contiguous (B, H, L, D) ones too: transformers' key/value cache makes them), with results
    bit-identical to contiguous copies' on the same backend and within tolerance of the float64 reference
    (one row, L = 1, included: its row stride is never stepped)."""
    B, H, Lq, Lk, D, kind, pad = case
    causal, mask = kind in ("causal", "both"), padding_mask(B, Lk) if kind in ("padding", "both") else None
    _, (q, k, v) = projection_views(B, H, Lq, Lk, D, pad, dtype)
    for t in (q, k, v):
        assert same_memory(C.attention_layout(t), t)
    received = []  # the tensors that reach a Python backend's kernel function (csrc/cuda launcher, Triton host)
    if backend != "cpu":
        implementation = _dispatch.implementation

        def recording(op, phase, name):
            impl = implementation(op, phase, name)

            def run(*args):
                received.append((phase, args))
                return impl(*args)
            return run

        monkeypatch.setattr(_dispatch, "implementation", recording)
    out = ops.attention(q, k, v, key_padding_mask=mask, causal=causal, backend=backend)
    dout = randn(B, Lq, H, D, dtype=dtype).transpose(1, 2)  # the out projection's gradient, (B, L, H, D) memory
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if backend != "cpu":
        (fwd, fwd_args), (bwd, bwd_args) = received
        assert (fwd, bwd) == ("fwd", "bwd")
        assert all(same_memory(a, t) for a, t in zip(fwd_args[:3], (q, k, v)))
        assert all(same_memory(a, t) for a, t in zip(bwd_args[:5], (dout, q, k, v, out)))
        monkeypatch.undo()
    assert_layout_kept(lambda *qkv: ops.attention(*qkv, key_padding_mask=mask, causal=causal, backend=backend),
                       q, k, v, out, grads, dout)
    (expected,), expected_grads = forward_backward(
        lambda q, k, v: ops.attention(q, k, v, key_padding_mask=mask, causal=causal, backend="torch"),
        upcast([q, k, v]), upcast([dout]))
    assert_close(out, expected, dtype, "out")
    for name, g, eg in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_close(g, eg, dtype, name)


@pytest.mark.parametrize("backend,dtype,case", layout_params())
def test_a_packed_projections_parts_get_one_packed_gradient(backend, dtype, case):
    """q, k, v as fastformer.nn's self-attention hands them over, the three parts of one (B, L, 3, H, D)
    projection (SplitHeads), and k, v of cross-attention's (B, Lk, 2, H, D) one: every kernel backend writes
    their gradients as the parts of one packed gradient (csrc/attention_grads.h), which SplitHeads hands back to
    the projection as it is (no stack), bit-identical to the gradients of contiguous copies and within tolerance
    of the float64 reference."""
    from fastformer.nn.attention import SplitHeads

    B, H, Lq, _, D, kind, _ = case
    causal, mask = kind in ("causal", "both"), padding_mask(B, Lq) if kind in ("padding", "both") else None
    for n in (3, 2):
        x = randn(B, Lq, n * H * D, dtype=dtype).requires_grad_()
        parts = SplitHeads.apply(x, n, H)
        q, k, v = parts if n == 3 else (randn(B, H, Lq, D, dtype=dtype).requires_grad_(), *parts)
        out = ops.attention(q, k, v, key_padding_mask=mask, causal=causal, backend=backend)
        dout = randn(B, Lq, H, D, dtype=dtype).transpose(1, 2)
        *grads, dx = torch.autograd.grad(out, (q, k, v, x), dout)
        packed = grads[3 - n:]
        # the parts of one (B, L, n, H, D) block of memory, which is dx itself: no stack, no copy
        assert all(g.untyped_storage()._cdata == dx.untyped_storage()._cdata for g in packed)
        assert [g.data_ptr() - dx.data_ptr() for g in packed] == [i * H * D * dx.element_size() for i in range(n)]
        assert dx.is_contiguous() and dx.untyped_storage().nbytes() == dx.numel() * dx.element_size()
        assert_layout_kept(lambda *qkv: ops.attention(*qkv, key_padding_mask=mask, causal=causal, backend=backend),
                           q, k, v, out, grads, dout)


def test_packed_grads_must_fit_the_shapes():
    q, k = randn(2, 2, 5, 8, dtype=torch.float32), randn(2, 2, 7, 8, dtype=torch.float32)
    out, lse = torch.ops.fastformer.attention_fwd(q, k, k, None, False, 0.0, None, None)
    for packed, match in ((3, "3 \\(q, k and v of one shape\\)"), (5, "must be 0, 2")):
        with pytest.raises(ValueError, match=match):
            torch.ops.fastformer.attention_bwd(out, q, k, k, out, lse, None, False, 0.0, None, None, packed)
    assert C.attention_packed_kind(q, k, k) == 0  # k and v the same tensor: not two parts
