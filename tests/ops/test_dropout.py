"""Dropout in attention and layer_norm_residual.

Contract (docs/api.md, and the op docs): with dropout_p > 0 each call draws its seed, a 0-dim int64 tensor,
from torch's generator of the inputs' device (the default CPU generator for CPU tensors), the same way on
every backend, and every backend generates the mask with the same counter-based generator (Philox4x32-10)
keyed by the seed's value. So after the same torch.manual_seed every backend drops the same elements: a
backend in any dtype must match the float64 torch reference within the normal tolerance, forward and
backward. Kept elements are scaled by 1/(1-p); attention drops normalized probabilities; backward reuses
the forward's mask. The registered ops take the seed tensor itself (csrc/ops.h check_seed): the same
value gives the same mask on every backend, and the GPU kernels (cuda_sim, Triton) read it from memory at
each call, as a replayed CUDA graph needs (tests/gpu/test_cuda_tensors.py captures one).
"""
import math

import pytest
import torch

from fastformer import ops
import test_attention as att  # the attention cases and their helpers
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


def run_lnr(backend, p):
    case = lnr.Case((5, 33), True)
    torch.manual_seed(1)
    (x, residual, weight, bias), _ = lnr.make_inputs(case, torch.float32)
    return lambda: ops.layer_norm_residual(x, residual, weight, bias, dropout_p=p, prenorm=True, backend=backend)[1]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("make", [run_attention, run_lnr], ids=["attention", "layer_norm_residual"])
def test_zero_dropout_is_deterministic_and_equal_to_no_dropout(backend, make):
    without = make(backend, 0.0)()
    torch.manual_seed(5)
    first = make(backend, 0.0)()
    torch.manual_seed(6)
    second = make(backend, 0.0)()
    assert torch.equal(first, second)
    assert torch.equal(first, without)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("make", [run_attention, run_lnr], ids=["attention", "layer_norm_residual"])
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


@pytest.mark.parametrize("make", [run_attention, run_lnr], ids=["attention", "layer_norm_residual"])
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


def lnr_op(backend, case, p, seed):
    fwd, tail = kernel_op("layer_norm_residual", "fwd", backend)

    def run(x, residual, weight, bias):
        y, s, _, _ = fwd(x, residual, weight, bias, case.eps, p, seed, *tail)
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
    rewritten = bwd(dout, q, k, v, out, lse, None, True, 0.5, None, seed, *tail)
    fresh = bwd(dout, q, k, v, out, lse, None, True, 0.5, None, seed_tensor(3), *tail)
    kept = bwd(dout, q, k, v, out, lse, None, True, 0.5, None, seed_tensor(2), *tail)
    for r, f, o in zip(rewritten, fresh, kept):
        assert torch.equal(r, f)
    assert not all(torch.equal(r, o) for r, o in zip(rewritten, kept))
