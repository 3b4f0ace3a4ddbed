"""Dropout in attention, attention_varlen, layer_norm_residual and bias_activation.

Contract (docs/api.md, and the op docs): with dropout_p > 0 each call draws its seed, a 0-dim int64 tensor,
from torch's generator of the inputs' device (the default CPU generator for CPU tensors), the same way on
every backend, and every backend generates the mask with the same counter-based generator (Philox4x32-10)
keyed by the seed's value. So after the same torch.manual_seed every backend drops the same elements: a
backend in any dtype must match the float64 torch reference within the normal tolerance, forward and
backward. Kept elements are scaled by 1/(1-p); attention drops normalized probabilities; backward reuses
the forward's mask. attention_varlen drops element (b, h, i, j) of the probabilities by element
(h Tq + cu_seqlens_q[b] + i) Tk + j of the same stream (reference.dropout_keep_at). The registered ops take the seed tensor itself (csrc/ops.h check_seed): the same
value gives the same mask on every backend, and the GPU kernels (cuda_sim, Triton) read it from memory at
each call, as a replayed CUDA graph needs (tests/gpu/test_cuda_tensors.py captures one).
"""
import math

import pytest
import torch

from fastformer import ops
import test_attention as att  # the attention cases and their helpers
import test_attention_varlen as varlen
import test_layer_norm_residual as lnr
from helpers import (ALL_BACKENDS, FLOAT64_BACKENDS, backend_dtype_cases, forward_backward, kernel_op, padding_mask,
                     randn, upcast)
from tolerances import assert_close

SEED = 20240611


def seeded(fn, seed=SEED):
    """fn with torch.manual_seed(seed) before every call, so every call draws the same dropout seed."""

    def call(*args):
        torch.manual_seed(seed)
        return fn(*args)

    return call


def attention_dropout_fn(backend, case, mask, p):
    return seeded(att.attention_fn(backend, case, mask, dropout_p=p))


def lnr_dropout_fn(backend, case, p):
    return seeded(
        lambda x, residual, weight, bias: ops.layer_norm_residual(
            x, residual, weight, bias, eps=case.eps, dropout_p=p, prenorm=case.prenorm, backend=backend
        )
    )


ATTENTION_CASES = [
    att.Case(2, 2, 33, 33, 64, "both"),
    att.Case(2, 2, 7, 33, 40, "causal"),
    att.Case(1, 2, 33, 17, 16, "padding", scale=0.5),
    att.Case(1, 2, 113, 97, 128, "both"),
    att.Case(2, 3, 97, 97, 16, "none"),
]


# Lk a multiple of 4 (the Triton kernels then draw one Philox evaluation per 4 probabilities): one key
# tile, and 68 keys over three tiles of 32 in the interpreter, so tiles start past column 0. Small enough
# for every backend, though past the slow backends' usual L.
KEY_TILE_CASES = [
    att.Case(2, 1, 33, 32, 16, "causal"),
    att.Case(1, 2, 9, 68, 16, "both"),
]


@pytest.mark.parametrize("p", [0.2, 0.5])
@pytest.mark.parametrize("backend,dtype,case",
                         backend_dtype_cases(ALL_BACKENDS, ATTENTION_CASES, att.small)
                         + backend_dtype_cases(ALL_BACKENDS, KEY_TILE_CASES, lambda case: True))
def test_attention_dropout_matches_reference(backend, dtype, case, p):
    # Same seed -> same mask on every backend: parity with the float64 reference despite dropout.
    q, k, v, mask, dout = att.make_inputs(case, dtype)
    (out,), grads = forward_backward(attention_dropout_fn(backend, case, mask, p), [q, k, v], [dout])
    (ref,), ref_grads = forward_backward(
        attention_dropout_fn("torch", case, mask, p), upcast([q, k, v]), upcast([dout])
    )
    assert_close(out, ref, dtype, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, rg, dtype, name)
    att.assert_masked_rows_and_keys_zero(case, mask, out, *grads)


LNR_CASES = [
    lnr.Case((7, 97), True),
    lnr.Case((16, 1000), False),
    lnr.Case((2, 5, 113), True, 1e-6),
    lnr.Case((113, 512), True),
]


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("backend,dtype,case", backend_dtype_cases(ALL_BACKENDS, LNR_CASES, lnr.small))
def test_layer_norm_residual_dropout_matches_reference(backend, dtype, case, p):
    inputs, upstream = lnr.make_inputs(case, dtype)
    outs, grads = forward_backward(lnr_dropout_fn(backend, case, p), inputs, upstream)
    refs, ref_grads = forward_backward(lnr_dropout_fn("torch", case, p), upcast(inputs), upcast(upstream))
    for name, o, r in zip(("y", "s"), outs, refs):
        assert_close(o, r, dtype, name)
    for name, g, r in zip(("dx", "dresidual", "dweight", "dbias"), grads, ref_grads):
        assert_close(g, r, dtype, name)


VARLEN_CASES = [
    varlen.Case((5, 0, 1, 7), None, 2, 2, 16, causal=True),  # an empty and a one-token sequence
    varlen.Case((7, 3), (2, 9), 2, 1, 40),  # cross-attention, multi-query
    varlen.Case((3, 17, 0, 1), (5, 9, 4, 0), 4, 2, 64, causal=True),  # a key-less query sequence
    varlen.Case((97, 1, 60), (97, 5, 68), 2, 1, 40, causal=True),  # several key tiles per sequence
]


def attention_varlen_dropout_fn(backend, case, p):
    return seeded(varlen.varlen_fn(backend, case, dropout_p=p))


@pytest.mark.parametrize("p", [0.17, 0.5])
@pytest.mark.parametrize("backend,dtype,case", backend_dtype_cases(ALL_BACKENDS, VARLEN_CASES, varlen.small))
def test_attention_varlen_dropout_matches_reference(backend, dtype, case, p):
    # Same seed -> same mask on every backend: parity with the float64 reference despite dropout.
    q, k, v, dout = varlen.make_inputs(case, dtype)
    (out,), grads = forward_backward(attention_varlen_dropout_fn(backend, case, p), [q, k, v], [dout])
    (ref,), ref_grads = forward_backward(attention_varlen_dropout_fn("torch", case, p), upcast([q, k, v]),
                                         upcast([dout]))
    assert_close(out, ref, dtype, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, rg, dtype, name)
    # and something was dropped
    (plain,), _ = forward_backward(varlen.varlen_fn("torch", case), upcast([q, k, v]), upcast([dout]))
    assert (plain - ref).abs().max() > 1e-3


def assert_kept_fraction(kept, p):
    """The kept fraction is 1 - p within 5 standard deviations of a Bernoulli mean."""
    n = kept.numel()
    fraction = kept.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(fraction - (1 - p)) < 5 * sigma, f"kept {fraction:.4f} of {n}, expected {1 - p} +- {5 * sigma:.4f}"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_attention_dropout_statistics(backend, p):
    # q = 0 makes every score 0, so each probability is exactly 1/Lk; v = identity (D = Lk) makes the
    # output the dropped probability matrix itself: every entry is 0 or 1/(Lk (1-p)).
    B, H, Lq, Lk = 2, 2, 33, 32
    q = torch.zeros(B, H, Lq, Lk)
    k = torch.randn(B, H, Lk, Lk)
    v = torch.eye(Lk).expand(B, H, Lk, Lk).contiguous()
    out = ops.attention(q, k, v, dropout_p=p, backend=backend)  # (B, H, Lq, Lk)
    kept = out != 0
    expected = torch.where(kept, 1.0 / (Lk * (1 - p)), 0.0)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    assert_kept_fraction(kept, p)
    # Each (batch, head) has its own mask (the generator's counter covers all of B and H).
    planes = kept.reshape(B * H, Lq * Lk)
    for a in range(B * H):
        for b in range(a + 1, B * H):
            assert not torch.equal(planes[a], planes[b]), f"planes {a} and {b} drew the same mask"


# Packed sequences for the varlen mask tests: query lengths, key lengths (sequence 2 has queries, no keys).
DROP_LENS_Q, DROP_LENS_K = (33, 0, 7, 4), (32, 5, 0, 20)


def attention_varlen_dropped(backend, seed, dtype, p, H=2, H_kv=1):
    """(out, dv, dout, visible) of attention_varlen over DROP_LENS on ``backend`` with the seed tensor ``seed``
    through the registered forward op: q = 0 makes each probability 1/Lk of its sequence, and v one-hot on the
    key's index within its sequence (D = the longest key sequence) makes out[rows of b, h, :Lk_b] the dropped
    probabilities P r of sequence b themselves. visible (Tq, 1, D): the columns that are keys of the row's
    sequence."""
    cu_q, cu_k = varlen.pack(DROP_LENS_Q), varlen.pack(DROP_LENS_K)
    Tq, Tk, D = sum(DROP_LENS_Q), sum(DROP_LENS_K), max(DROP_LENS_K)
    q = torch.zeros(Tq, H, D, dtype=dtype)
    k = randn(Tk, H_kv, D, dtype=dtype)
    v = torch.zeros(Tk, H_kv, D, dtype=dtype)
    visible = torch.zeros(Tq, 1, D, dtype=torch.bool)
    for b, (lq, lk) in enumerate(zip(DROP_LENS_Q, DROP_LENS_K)):
        v[cu_k[b]: cu_k[b + 1], :, :lk] = torch.eye(lk, dtype=dtype)[:, None, :]
        visible[cu_q[b]: cu_q[b + 1], :, :lk] = True
    dout = randn(Tq, H, D, dtype=dtype)
    fwd, tail = kernel_op("attention_varlen", "fwd", backend)
    run = lambda q, k, v: fwd(q, k, v, cu_q, cu_k, max(DROP_LENS_Q), D, False, p, None, seed, *tail)[0]  # noqa: E731
    (out,), (_, _, dv) = forward_backward(run, [q, k, v], [dout])
    return out, dv, dout, visible


def varlen_rule_mask(seed, p, H=2):
    """The keep-mask (Tq, H, D) that the shared rule gives DROP_LENS: element (b, h, i, j) kept iff Philox
    element (h Tq + cu_q[b] + i) Tk + j is (reference.dropout_keep_at); False outside a sequence's keys."""
    from fastformer.ops import reference

    cu_q = varlen.pack(DROP_LENS_Q).tolist()
    Tq, Tk, D = sum(DROP_LENS_Q), sum(DROP_LENS_K), max(DROP_LENS_K)
    mask = torch.zeros(Tq, H, D, dtype=torch.bool)
    for b, (lq, lk) in enumerate(zip(DROP_LENS_Q, DROP_LENS_K)):
        h = torch.arange(H)[None, :, None]
        i = torch.arange(lq)[:, None, None]
        j = torch.arange(lk)[None, None, :]
        mask[cu_q[b]: cu_q[b] + lq, :, :lk] = reference.dropout_keep_at(seed, (h * Tq + cu_q[b] + i) * Tk + j, p)
    return mask


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("p", [0.17, 0.5, 0.8])
def test_attention_varlen_dropout_statistics_and_rule(backend, p):
    # Every kept probability is 1/(Lk_b (1-p)), every dropped one 0; about 1 - p of them are kept; the mask
    # is the shared rule's, element by element (sequence offsets included); backward uses that mask.
    seed = 987654321 + int(100 * p)
    out, dv, dout, visible = attention_varlen_dropped(backend, seed_tensor(seed), F32, p)
    cu_q, cu_k = varlen.pack(DROP_LENS_Q).tolist(), varlen.pack(DROP_LENS_K).tolist()
    lk = torch.tensor(DROP_LENS_K, dtype=torch.float32).repeat_interleave(torch.tensor(DROP_LENS_Q))[:, None, None]
    kept = out != 0
    assert not (kept & ~visible).any(), "only keys of the row's own sequence may carry probability"
    expected = torch.where(kept, 1.0 / (lk.clamp(min=1) * (1 - p)), 0.0)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    assert_kept_fraction(kept[visible.expand_as(kept)], p)
    assert torch.equal(kept, varlen_rule_mask(seed, p)), "the mask is not the shared rule's"
    # dv[key] = sum over the query heads of its group and the rows of its sequence of (P r)[i, j] dout[i]
    expected_dv = torch.zeros_like(dv, dtype=torch.float64)
    for b, n in enumerate(DROP_LENS_K):
        rows = slice(cu_q[b], cu_q[b + 1])
        pr = out[rows, :, :n].double()  # (Lq, H, Lk)
        expected_dv[cu_k[b]: cu_k[b + 1], 0] = torch.einsum("ihj,ihd->jd", pr, dout[rows].double())
    assert_close(dv, expected_dv, F32, "dv: backward's mask")


def test_attention_varlen_one_seed_one_mask_on_every_backend():
    # One seed value: the same mask on every backend (float16 too); another value: another mask.
    for dtype in (F32, F16):
        masks = {b: attention_varlen_dropped(b, seed_tensor(2**40 + 7), dtype, 0.4)[0] != 0 for b in ALL_BACKENDS}
        for backend in ALL_BACKENDS:
            assert torch.equal(masks[backend], masks["torch"]), f"{backend} ({dtype}): attention_varlen mask differs"
    other = attention_varlen_dropped("torch", seed_tensor(3), F32, 0.4)[0] != 0
    assert not torch.equal(other, masks["torch"])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_layer_norm_residual_dropout_statistics(backend, p):
    # residual = 0 makes s = dropout(x): every entry is 0 (dropped) or x / (1 - p) (kept).
    x = torch.rand(16, 512) + 0.5  # bounded away from 0, so a kept entry is never 0
    residual = torch.zeros_like(x)
    weight, bias = torch.randn(512), torch.randn(512)
    _, s = ops.layer_norm_residual(x, residual, weight, bias, dropout_p=p, prenorm=True, backend=backend)
    kept = s != 0
    torch.testing.assert_close(s, torch.where(kept, x / (1 - p), 0.0), atol=1e-6, rtol=1e-5)
    assert_kept_fraction(kept, p)
    assert not torch.equal(kept[0], kept[1]), "rows 0 and 1 drew the same mask"


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
def test_attention_dropout_gradcheck(backend):
    # gradcheck's finite differences re-run the forward many times, each with the same seed (same mask);
    # the analytic gradient passes only if backward regenerates exactly the forward's mask.
    case = att.Case(2, 1, 4, 5, 4, "both")
    q, k, v, _, _ = att.make_inputs(case, torch.float64)
    mask = padding_mask(case.B, case.Lk)
    fn = attention_dropout_fn(backend, case, mask, 0.2)
    assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in (q, k, v)])


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
def test_attention_varlen_dropout_gradcheck(backend):
    # Backward must regenerate exactly the forward's mask, for every sequence at its offset.
    case = varlen.Case((3, 0, 4), (2, 3, 5), 2, 1, 4, causal=True)
    q, k, v, _ = varlen.make_inputs(case, torch.float64)
    fn = attention_varlen_dropout_fn(backend, case, 0.3)
    assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in (q, k, v)])


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
@pytest.mark.parametrize("prenorm", [False, True])
def test_layer_norm_residual_dropout_gradcheck(backend, prenorm):
    case = lnr.Case((3, 7), prenorm)
    inputs, _ = lnr.make_inputs(case, torch.float64)
    fn = lnr_dropout_fn(backend, case, 0.3)
    assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in inputs])


def run_attention(backend, p):
    case = att.Case(2, 2, 9, 11, 16, "both")
    torch.manual_seed(1)
    q, k, v, mask, _ = att.make_inputs(case, torch.float32)
    return lambda: ops.attention(q, k, v, key_padding_mask=mask, causal=True, dropout_p=p, backend=backend)


def run_attention_varlen(backend, p):
    case = varlen.Case((5, 0, 8), (7, 3, 9), 4, 2, 16, causal=True)
    torch.manual_seed(1)
    q, k, v, _ = varlen.make_inputs(case, torch.float32)
    return lambda: varlen.varlen_fn(backend, case, dropout_p=p)(q, k, v)


def run_lnr(backend, p):
    case = lnr.Case((5, 33), True)
    torch.manual_seed(1)
    (x, residual, weight, bias), _ = lnr.make_inputs(case, torch.float32)
    return lambda: ops.layer_norm_residual(x, residual, weight, bias, dropout_p=p, prenorm=True, backend=backend)[1]


def run_bias_activation(backend, p):
    torch.manual_seed(1)
    x, bias = randn(5, 33, dtype=torch.float32), randn(33, dtype=torch.float32)
    return lambda: ops.bias_activation(x, bias, activation="silu", dropout_p=p, backend=backend)


MAKERS = [run_attention, run_attention_varlen, run_lnr, run_bias_activation]
MAKER_IDS = ["attention", "attention_varlen", "layer_norm_residual", "bias_activation"]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_bias_activation_dropout_statistics_and_rule(backend, p, activation):
    # x + bias > 0 everywhere: every element is 0 (dropped) or act(x + b) / (1 - p) (kept); about 1 - p are
    # kept; the mask is the shared rule's at the element's flat row-major index (reference.dropout_keep), rows
    # of 97 starting anywhere in a Philox group of 4; backward's mask is the forward's.
    from fastformer.ops import reference

    x = (torch.rand(24, 97) + 0.5).requires_grad_()
    bias = torch.full((97,), 0.25, requires_grad=True)
    seed = seed_tensor(2**33 + 5)
    fwd, tail = kernel_op("bias_activation", "fwd", backend)
    y = fwd(x, bias, activation, p, seed, *tail)
    kept = y != 0
    plain = ops.bias_activation(x.detach(), bias.detach(), activation=activation, backend="torch")
    torch.testing.assert_close(y.detach(), torch.where(kept, plain / (1 - p), 0.0), atol=1e-6, rtol=1e-5)
    assert_kept_fraction(kept, p)
    assert torch.equal(kept, reference.dropout_keep(seed, x.numel(), p).view(24, 97)), "not the shared rule's mask"
    (dx,) = torch.autograd.grad(y, (x,), torch.ones_like(y))
    assert torch.equal(dx != 0, kept), "backward's mask is not the forward's"


def test_bias_activation_one_seed_one_mask_on_every_backend():
    # The op name as test_op_lists.py looks for it: "bias_activation".
    x, bias = torch.rand(9, 68) + 0.5, torch.zeros(68)
    for dtype in (F32, F16):
        masks = {}
        for backend in ALL_BACKENDS:
            fwd, tail = kernel_op("bias_activation", "fwd", backend)
            masks[backend] = fwd(x.to(dtype), bias, "gelu", 0.4, seed_tensor(2**40 + 7), *tail) != 0
        for backend in ALL_BACKENDS:
            assert torch.equal(masks[backend], masks["torch"]), f"{backend} ({dtype}): bias_activation mask differs"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_zero_dropout_is_deterministic_and_equal_to_no_dropout(backend, make):
    without = make(backend, 0.0)()
    torch.manual_seed(5)
    first = make(backend, 0.0)()
    torch.manual_seed(6)
    second = make(backend, 0.0)()
    assert torch.equal(first, second)
    assert torch.equal(first, without)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_dropout_mask_follows_torch_seed(backend, make):
    call = make(backend, 0.5)
    torch.manual_seed(7)
    a = call()
    torch.manual_seed(7)
    b = call()
    c = call()  # no reseed: a new seed is drawn, so a new mask
    torch.manual_seed(8)
    d = call()
    assert torch.equal(a, b), "the same torch seed must give the same dropout mask"
    assert not torch.equal(b, c), "consecutive calls must draw different masks"
    assert not torch.equal(a, d), "a different torch seed must give a different mask"


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_backends_draw_the_seed_the_same_way(make):
    # Every backend consumes torch's default generator identically, so the random stream after a call
    # (and so every later mask in a model) does not depend on the backend.
    after = {}
    for backend in ALL_BACKENDS:
        call = make(backend, 0.3)
        torch.manual_seed(11)
        call()
        after[backend] = torch.randint(0, 2**62, (4,))
    for backend in ALL_BACKENDS:
        assert torch.equal(after[backend], after["torch"]), f"{backend} draws from the generator differently"
    torch.manual_seed(11)
    untouched = torch.randint(0, 2**62, (4,))
    assert not torch.equal(after["torch"], untouched), "a dropout call must draw from torch's generator"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("N", [97, 98, 264], ids=["elements", "pairs", "packs"])
def test_layer_norm_residual_x_bias_keeps_the_mask(backend, N):
    # x_bias is added before dropout and changes no mask: with residual = 0 and x + x_bias > 0, s is zero
    # exactly where the call without x_bias (same seed) drops, the element index rule unchanged, and kept
    # values are (x + x_bias) / (1 - p), as the torch reference draws them. The compute-dtype output on top.
    x = (torch.rand(70, N) + 0.5).to(torch.bfloat16)
    x_bias = torch.rand(N) + 0.5
    residual, weight, bias = torch.zeros(70, N), torch.randn(N), torch.randn(N)
    runs = {}
    for name, b, kwargs in (("plain", backend, {}), ("fused", backend, dict(x_bias=x_bias, compute_dtype=torch.float16)),
                            ("reference", "torch", dict(x_bias=x_bias))):
        torch.manual_seed(SEED)
        _, runs[name] = ops.layer_norm_residual(x, residual, weight, bias, dropout_p=0.3, prenorm=True,
                                                backend=b, **kwargs)
    assert torch.equal(runs["fused"] != 0, runs["plain"] != 0)
    assert torch.equal(runs["fused"] != 0, runs["reference"] != 0)
    kept = runs["plain"] != 0
    torch.testing.assert_close(runs["fused"][kept], ((x.float() + x_bias) / 0.7)[kept])
    assert_kept_fraction(kept, 0.3)


def test_reference_mask_over_several_slices_matches_the_cpu_kernel():
    """The torch reference computes its Philox mask in slices of reference._KEEP_SLICE counters on the CPU:
    over 2.3 slices (odd row length, a partial last slice) its mask is the cpu kernel's (csrc/philox.h)."""
    from fastformer.ops import reference
    n = int(2.3 * 4 * reference._KEEP_SLICE)
    x = torch.rand(n // 97, 97) + 0.5
    residual, weight, bias = torch.zeros_like(x), torch.randn(97), torch.randn(97)
    masks = []
    for backend in ("torch", "cpu"):
        torch.manual_seed(SEED)
        _, s = ops.layer_norm_residual(x, residual, weight, bias, dropout_p=0.3, prenorm=True, backend=backend)
        masks.append(s != 0)
    assert torch.equal(masks[0], masks[1])
    assert_kept_fraction(masks[0], 0.3)


# ---- The seed as the registered ops take it: a 0-dim int64 tensor on the inputs' device.

F32, F16 = torch.float32, torch.float16


def seed_tensor(value):
    return torch.tensor(value, dtype=torch.int64)


def attention_op(backend, case, mask, p, seed):
    """attention through the registered forward op (its C++ autograd on top) with an explicit seed tensor."""
    fwd, tail = kernel_op("attention", "fwd", backend)
    return lambda q, k, v: fwd(q, k, v, mask, case.causal, p, case.scale, seed, *tail)[0]


def attention_varlen_op(backend, case, p, seed):
    """attention_varlen through the registered forward op with an explicit seed tensor."""
    fwd, tail = kernel_op("attention_varlen", "fwd", backend)
    cu_q, cu_k = varlen.pack(case.lens_q), varlen.pack(case.keys)
    return lambda q, k, v: fwd(q, k, v, cu_q, cu_k, max(case.lens_q), max(case.keys), case.causal, p, case.scale,
                               seed, *tail)[0]


def lnr_op(backend, case, p, seed):
    fwd, tail = kernel_op("layer_norm_residual", "fwd", backend)

    def run(x, residual, weight, bias):
        y, s, _, _, _ = fwd(x, residual, weight, bias, case.eps, p, seed, None, None, *tail)
        return (y, s) if case.prenorm else y

    return run


# Seeds beyond the draws' [0, 2^62): any int64 keys the stream (the high word and a negative value too).
SEEDS = [12345678901234, -5]
SEED_ATTENTION_CASES = [att.Case(2, 2, 7, 33, 40, "both"), att.Case(1, 2, 33, 17, 16, "padding", scale=0.5),
                        att.Case(2, 1, 1, 32, 16, "causal")]
SEED_LNR_CASES = [lnr.Case((7, 97), True), lnr.Case((2, 3, 113), False), lnr.Case((16, 64), True)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend,dtype,case",
                         backend_dtype_cases(ALL_BACKENDS, SEED_ATTENTION_CASES, att.small, dtypes=[F32, F16]))
def test_attention_explicit_seed_matches_reference(backend, dtype, case, seed):
    # One seed tensor, one mask: every backend matches the float64 reference given the same seed value,
    # forward and backward (the autograd node saves the tensor; backward regenerates the mask from it).
    q, k, v, mask, dout = att.make_inputs(case, dtype)
    (out,), grads = forward_backward(attention_op(backend, case, mask, 0.3, seed_tensor(seed)), [q, k, v], [dout])
    (ref,), ref_grads = forward_backward(attention_op("torch", case, mask, 0.3, seed_tensor(seed)), upcast([q, k, v]),
                                         upcast([dout]))
    assert_close(out, ref, dtype, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, rg, dtype, name)
    att.assert_masked_rows_and_keys_zero(case, mask, out, *grads)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend,dtype,case",
                         backend_dtype_cases(ALL_BACKENDS, VARLEN_CASES[:3], varlen.small, dtypes=[F32, F16]))
def test_attention_varlen_explicit_seed_matches_reference(backend, dtype, case, seed):
    q, k, v, dout = varlen.make_inputs(case, dtype)
    (out,), grads = forward_backward(attention_varlen_op(backend, case, 0.3, seed_tensor(seed)), [q, k, v], [dout])
    (ref,), ref_grads = forward_backward(attention_varlen_op("torch", case, 0.3, seed_tensor(seed)),
                                         upcast([q, k, v]), upcast([dout]))
    assert_close(out, ref, dtype, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, rg, dtype, name)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend,dtype,case",
                         backend_dtype_cases(ALL_BACKENDS, SEED_LNR_CASES, lnr.small, dtypes=[F32, F16]))
def test_layer_norm_residual_explicit_seed_matches_reference(backend, dtype, case, seed):
    inputs, upstream = lnr.make_inputs(case, dtype)
    outs, grads = forward_backward(lnr_op(backend, case, 0.3, seed_tensor(seed)), inputs, upstream)
    refs, ref_grads = forward_backward(lnr_op("torch", case, 0.3, seed_tensor(seed)), upcast(inputs),
                                       upcast(upstream))
    for name, o, r in zip(("y", "s"), outs, refs):
        assert_close(o, r, dtype, name)
    for name, g, r in zip(("dx", "dresidual", "dweight", "dbias"), grads, ref_grads):
        assert_close(g, r, dtype, name)


def attention_dropped(backend, seed, dtype, Lq=9, Lk=32, p=0.4):
    """(out, dv, dout) of attention on ``backend`` with ``seed``: q = 0 and v = identity make the output the
    dropped probabilities P r themselves (test_attention_dropout_statistics), so out != 0 is the forward's
    keep-mask, and dv = (P r)^T dout = out^T dout when backward regenerates that mask."""
    B, H = 2, 2
    q = torch.zeros(B, H, Lq, Lk, dtype=dtype)
    k = randn(B, H, Lk, Lk, dtype=dtype)
    v = torch.eye(Lk, dtype=dtype).expand(B, H, Lk, Lk).contiguous()
    dout = randn(B, H, Lq, Lk, dtype=dtype)
    case = att.Case(B, H, Lq, Lk, Lk, "none")
    (out,), (_, _, dv) = forward_backward(attention_op(backend, case, None, p, seed), [q, k, v], [dout])
    return out, dv, dout


def attention_mask_of(backend, seed, dtype):
    """attention's keep-mask on ``backend`` with ``seed``, after checking that its backward used it too."""
    out, dv, dout = attention_dropped(backend, seed, dtype)
    assert_close(dv, out.double().transpose(-1, -2) @ dout.double(), dtype, "dv: backward's mask")
    return out != 0


def lnr_masks_of(backend, seed, dtype, shape=(7, 97), p=0.4):
    """The keep-masks layer_norm_residual draws on ``backend`` with ``seed``: forward (residual = 0 makes
    s = dropout(x)) and backward (upstream dy = 0, ds = 1 make dx = r, the keep-factors themselves)."""
    x = (torch.rand(shape, dtype=torch.float64) + 0.5).to(dtype)  # bounded away from 0: kept is never 0
    weight, bias = torch.ones(shape[-1], dtype=dtype), torch.zeros(shape[-1], dtype=dtype)
    (_, s), (dx, *_) = forward_backward(lnr_op(backend, lnr.Case(shape, True), p, seed),
                                        [x, torch.zeros_like(x), weight, bias],
                                        [torch.zeros_like(x), torch.ones_like(x)])
    return s != 0, dx != 0


@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
def test_one_seed_value_one_mask_on_every_backend(dtype):
    # The masks themselves, exactly: identical on every backend for one seed value, different for another.
    for seed in (3, 2**40 + 7):
        attention = {b: attention_mask_of(b, seed_tensor(seed), dtype) for b in ALL_BACKENDS}
        norm = {b: lnr_masks_of(b, seed_tensor(seed), dtype) for b in ALL_BACKENDS}
        for backend in ALL_BACKENDS:
            assert torch.equal(attention[backend], attention["torch"]), f"{backend}: attention mask differs"
            for phase, m, r in zip(("forward", "backward"), norm[backend], norm["torch"]):
                assert torch.equal(m, r), f"{backend}: layer_norm_residual {phase} mask differs"
        assert torch.equal(norm["torch"][0], norm["torch"][1]), "backward must regenerate the forward's mask"
    assert not torch.equal(attention_mask_of("torch", seed_tensor(3), dtype), attention["torch"])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_seed_is_read_at_each_call(backend):
    # What a replayed CUDA graph does: the same seed tensor, rewritten in place between calls. Every call
    # (forward and backward, both ops) reads the tensor's current value: the mask follows it and equals a
    # call with a fresh tensor of that value.
    seed = seed_tensor(1)
    first = attention_mask_of(backend, seed, F32), lnr_masks_of(backend, seed, F32)
    seed.fill_(2)
    again = attention_mask_of(backend, seed, F32), lnr_masks_of(backend, seed, F32)
    fresh = attention_mask_of(backend, seed_tensor(2), F32), lnr_masks_of(backend, seed_tensor(2), F32)
    assert not torch.equal(first[0], again[0]) and not torch.equal(first[1][0], again[1][0])
    assert torch.equal(again[0], fresh[0])
    for a, f in zip(again[1], fresh[1]):
        assert torch.equal(a, f)
    # attention's backward reads the tensor too: dq, dk, dv of a call follow the value it holds then.
    case = att.Case(1, 2, 7, 12, 16, "causal")
    q, k, v, _, dout = att.make_inputs(case, F32)
    fwd, tail = kernel_op("attention", "fwd", backend)
    bwd, _ = kernel_op("attention", "bwd", backend)
    out, lse = fwd(q, k, v, None, True, 0.5, None, seed, *tail)
    seed.fill_(3)
    rewritten = bwd(dout, q, k, v, out, lse, None, True, 0.5, None, seed, 0, *tail)
    fresh = bwd(dout, q, k, v, out, lse, None, True, 0.5, None, seed_tensor(3), 0, *tail)
    kept = bwd(dout, q, k, v, out, lse, None, True, 0.5, None, seed_tensor(2), 0, *tail)
    for r, f, o in zip(rewritten, fresh, kept):
        assert torch.equal(r, f)
    assert not all(torch.equal(r, o) for r, o in zip(rewritten, kept))
