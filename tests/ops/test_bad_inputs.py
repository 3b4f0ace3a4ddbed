"""Bad input raises a Python exception on every backend (never a crash), and odd strides just work.

The contract (docs/correctness.md, "Bad input"): wrong rank, mismatched shapes, devices or dtypes, a mask of the wrong shape or dtype, dropout_p
outside [0, 1), non-finite eps, a target that is not int64 or holds a class outside [0, V) (other than
ignore_index), label_smoothing outside [0, 1] and unknown backend names raise ValueError; a named backend
that cannot run the inputs raises ValueError or RuntimeError naming the backend, with no silent fallback.
Device mismatches use a "meta" tensor for one argument. Non-contiguous inputs give the same result as
contiguous ones.
"""
import re

import pytest
import torch

import fastformer
from fastformer import ops
from helpers import ALL_BACKENDS, BACKENDS, backend_dtypes, dtypes_for, forward_backward, kernel_op, randn, upcast
from tolerances import assert_close

B, H, LQ, LK, D = 2, 2, 5, 7, 16
ROWS, N = 5, 24
F32 = torch.float32


def with_changes(valid_args, op, changes):
    """A call of ``op`` on valid arguments with ``changes`` applied (value, or function of the arguments)."""

    def call(backend):
        args = valid_args()
        args["backend"] = backend
        for key, change in changes.items():
            args[key] = change(args) if callable(change) else change
        return op(**args)

    return call


def attention_args():
    return dict(
        q=randn(B, H, LQ, D, dtype=F32),
        k=randn(B, H, LK, D, dtype=F32),
        v=randn(B, H, LK, D, dtype=F32),
        key_padding_mask=torch.rand(B, LK) < 0.3,
        causal=True,
    )


def softmax_args():
    return dict(x=randn(B, H, LQ, N, dtype=F32), mask=torch.rand(B, 1, 1, N) < 0.3, scale=0.5)


def lnr_args():
    return dict(
        x=randn(ROWS, N, dtype=F32),
        residual=randn(ROWS, N, dtype=F32),
        weight=randn(N, dtype=F32),
        bias=randn(N, dtype=F32),
        prenorm=True,
    )


def ce_args():
    target = torch.randint(0, N, (ROWS, 3))
    target[0, 1] = -100
    return dict(logits=randn(ROWS, 3, N, dtype=F32), target=target, label_smoothing=0.1, return_nll=True)


# Per op of csrc/ops.h's list: valid keyword arguments of its public function (the calls below change
# one of them); tests/test_op_lists.py fails while an op has none.
def varlen_args():
    # 3 sequences (5, 0, 2 queries; 4, 3, 0 keys), 4 query heads over 2 key/value heads
    return dict(
        q=randn(7, 4, D, dtype=F32),
        k=randn(7, 2, D, dtype=F32),
        v=randn(7, 2, D, dtype=F32),
        cu_seqlens_q=torch.tensor([0, 5, 5, 7], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 4, 7, 7], dtype=torch.int32),
        max_seqlen_q=5,
        max_seqlen_k=4,
        causal=True,
    )


def ba_args():
    return dict(x=randn(ROWS, 3, N, dtype=F32), bias=randn(N, dtype=F32), activation="gelu", dropout_p=0.1)


VALID_ARGS = {"attention": attention_args, "attention_varlen": varlen_args, "softmax": softmax_args,
              "layer_norm_residual": lnr_args, "cross_entropy": ce_args, "bias_activation": ba_args}


def attention(**changes):
    return with_changes(attention_args, ops.attention, changes)


def varlen(**changes):
    return with_changes(varlen_args, ops.attention_varlen, changes)


def softmax(**changes):
    return with_changes(softmax_args, ops.softmax, changes)


def lnr(**changes):
    return with_changes(lnr_args, ops.layer_norm_residual, changes)


def ce(**changes):
    return with_changes(ce_args, ops.cross_entropy, changes)


def ba(**changes):
    return with_changes(ba_args, ops.bias_activation, changes)


VALUE = (ValueError,)
# Integer tensors: any clear Python exception (a type error is as good as a value error here).
ANY = (ValueError, TypeError, RuntimeError)
meta = lambda name: lambda a: a[name].to("meta")  # noqa: E731

BAD = {
    # attention: (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D), mask (B, Lk)
    "attention-q_rank3": (attention(q=lambda a: a["q"][0]), VALUE),
    "attention-k_rank5": (attention(k=lambda a: a["k"][None]), VALUE),
    "attention-kv_batch": (attention(k=lambda a: a["k"][:1], v=lambda a: a["v"][:1]), VALUE),
    # 3 query heads over 2 key/value heads: not a grouped-query layout
    "attention-kv_heads": (attention(q=lambda a: torch.cat([a["q"], a["q"][:, :1]], 1)), VALUE),
    "attention-k_head_dim": (attention(k=lambda a: a["k"][..., :8]), VALUE),
    "attention-q_head_dim": (attention(q=lambda a: a["q"][..., :8]), VALUE),
    "attention-v_head_dim": (attention(v=lambda a: a["v"][..., :8]), VALUE),
    "attention-v_length": (attention(v=lambda a: a["v"][:, :, :-1]), VALUE),
    "attention-k_float16": (attention(k=lambda a: a["k"].half()), VALUE),
    "attention-v_bfloat16": (attention(v=lambda a: a["v"].bfloat16()), VALUE),
    "attention-q_float64": (attention(q=lambda a: a["q"].double()), VALUE),
    "attention-int": (attention(**{n: (lambda a, n=n: a[n].long()) for n in "qkv"}), ANY),
    "attention-k_meta": (attention(k=meta("k")), VALUE),
    "attention-v_meta": (attention(v=meta("v")), VALUE),
    "attention-mask_meta": (attention(key_padding_mask=meta("key_padding_mask")), VALUE),
    "attention-mask_length": (attention(key_padding_mask=torch.zeros(B, LK + 1, dtype=torch.bool)), VALUE),
    "attention-mask_batch": (attention(key_padding_mask=torch.zeros(B + 1, LK, dtype=torch.bool)), VALUE),
    "attention-mask_rank1": (attention(key_padding_mask=torch.zeros(LK, dtype=torch.bool)), VALUE),
    "attention-mask_float": (attention(key_padding_mask=lambda a: a["key_padding_mask"].float()), VALUE),
    "attention-dropout_negative": (attention(dropout_p=-0.1), VALUE),
    "attention-dropout_one": (attention(dropout_p=1.0), VALUE),
    "attention-dropout_above_one": (attention(dropout_p=1.5), VALUE),
    "attention-dropout_nan": (attention(dropout_p=float("nan")), VALUE),
    "attention-dropout_str": (attention(dropout_p="0.1"), VALUE),
    "attention-dropout_bool": (attention(dropout_p=True), VALUE),
    # softmax: x (..., N), mask broadcastable to x
    "softmax-x_rank0": (softmax(x=torch.tensor(1.0), mask=None), VALUE),
    "softmax-mask_last_dim": (softmax(mask=torch.zeros(N + 1, dtype=torch.bool)), VALUE),
    "softmax-mask_rows": (softmax(mask=torch.zeros(B, H, LQ + 1, N, dtype=torch.bool)), VALUE),
    "softmax-mask_bigger_than_x": (softmax(mask=torch.zeros(3, B, H, LQ, N, dtype=torch.bool)), VALUE),
    "softmax-mask_float": (softmax(mask=lambda a: a["mask"].float()), VALUE),
    "softmax-mask_meta": (softmax(mask=meta("mask")), VALUE),
    "softmax-int": (softmax(x=lambda a: a["x"].long()), ANY),
    # layer_norm_residual: x, residual (..., N); weight, bias (N,)
    "lnr-residual_width": (lnr(residual=randn(ROWS, N + 1, dtype=F32)), VALUE),
    "lnr-residual_rows": (lnr(residual=randn(ROWS - 1, N, dtype=F32)), VALUE),
    "lnr-weight_width": (lnr(weight=randn(N + 1, dtype=F32)), VALUE),
    "lnr-weight_rank2": (lnr(weight=randn(1, N, dtype=F32)), VALUE),
    "lnr-bias_width": (lnr(bias=randn(N - 1, dtype=F32)), VALUE),
    "lnr-residual_float16": (lnr(residual=lambda a: a["residual"].half()), VALUE),
    # dtypes: x has residual's dtype, or is float16/bfloat16 beside a float32 residual (a bfloat16 x beside
    # float32 is valid: autocast's branch); weight and bias have residual's dtype.
    "lnr-x_float64": (lnr(x=lambda a: a["x"].double()), VALUE),
    "lnr-residual_bfloat16": (lnr(residual=lambda a: a["residual"].bfloat16()), VALUE),
    "lnr-x_bfloat16_residual_float16": (lnr(x=lambda a: a["x"].bfloat16(), residual=lambda a: a["residual"].half(),
                                            weight=lambda a: a["weight"].half(), bias=lambda a: a["bias"].half()),
                                        VALUE),
    "lnr-x_float16_residual_float64": (lnr(residual=lambda a: a["residual"].double(),
                                           weight=lambda a: a["weight"].double(), bias=lambda a: a["bias"].double(),
                                           x=lambda a: a["x"].half()), VALUE),
    "lnr-weight_bfloat16_like_x": (lnr(x=lambda a: a["x"].bfloat16(), weight=lambda a: a["weight"].bfloat16()),
                                   VALUE),
    "lnr-bias_float16": (lnr(x=lambda a: a["x"].half(), bias=lambda a: a["bias"].half()), VALUE),
    "lnr-residual_meta": (lnr(residual=meta("residual")), VALUE),
    "lnr-weight_meta": (lnr(weight=meta("weight")), VALUE),
    "lnr-bias_meta": (lnr(bias=meta("bias")), VALUE),
    "lnr-eps_nan": (lnr(eps=float("nan")), VALUE),
    "lnr-eps_inf": (lnr(eps=float("inf")), VALUE),
    "lnr-eps_minus_inf": (lnr(eps=float("-inf")), VALUE),
    "lnr-eps_negative": (lnr(eps=-0.5), VALUE),  # PyTorch's OpInfo sample_inputs_layer_norm passes -0.5
    "lnr-dropout_negative": (lnr(dropout_p=-0.1), VALUE),
    "lnr-dropout_one": (lnr(dropout_p=1.0), VALUE),
    "lnr-dropout_above_one": (lnr(dropout_p=1.5), VALUE),
    "lnr-dropout_nan": (lnr(dropout_p=float("nan")), VALUE),
    "lnr-dropout_str": (lnr(dropout_p="0.1"), VALUE),
    "lnr-dropout_tensor": (lnr(dropout_p=torch.tensor(0.1)), VALUE),
    "lnr-int": (lnr(**{n: (lambda a, n=n: a[n].long()) for n in ("x", "residual", "weight", "bias")}), ANY),
    # x_bias (N,) floating on x's device; compute_dtype float16, bfloat16 or residual's dtype.
    "lnr-x_bias_width": (lnr(x_bias=randn(N + 1, dtype=F32)), VALUE),
    "lnr-x_bias_rank2": (lnr(x_bias=randn(1, N, dtype=F32)), VALUE),
    "lnr-x_bias_int": (lnr(x_bias=torch.ones(N, dtype=torch.int32)), VALUE),
    "lnr-x_bias_meta": (lnr(x_bias=torch.ones(N, device="meta")), VALUE),
    "lnr-compute_float64": (lnr(compute_dtype=torch.float64), VALUE),
    "lnr-compute_int8": (lnr(compute_dtype=torch.int8), VALUE),
    # cross_entropy: logits (..., V), target (...) int64 in [0, V) or ignore_index
    "ce-target_int32": (ce(target=lambda a: a["target"].int()), VALUE),
    "ce-target_float": (ce(target=lambda a: a["target"].float()), VALUE),
    "ce-target_bool": (ce(target=lambda a: a["target"] > 0), VALUE),
    "ce-target_shape": (ce(target=lambda a: a["target"][:, :2]), VALUE),
    "ce-target_rank": (ce(target=lambda a: a["target"][..., None]), VALUE),
    "ce-target_flat": (ce(target=lambda a: a["target"].reshape(-1)), VALUE),  # same rows, not logits' shape
    "ce-target_meta": (ce(target=meta("target")), VALUE),
    "ce-logits_meta": (ce(logits=meta("logits")), VALUE),
    "ce-int": (ce(logits=lambda a: a["logits"].long()), ANY),
    "ce-no_classes": (ce(logits=torch.empty(ROWS, 3, 0)), VALUE),
    "ce-logits_rank0": (ce(logits=torch.tensor(1.0), target=torch.tensor(0)), VALUE),
    "ce-target_V": (ce(target=lambda a: a["target"].index_fill(0, torch.tensor([2]), N)), VALUE),
    "ce-target_minus_one": (ce(target=lambda a: a["target"].index_fill(0, torch.tensor([3]), -1)), VALUE),
    "ce-target_ignore_default": (ce(ignore_index=0, target=lambda a: a["target"].clamp(min=0).index_fill(
        0, torch.tensor([1]), -100)), VALUE),  # -100 is out of range once ignore_index is 0
    "ce-smoothing_negative": (ce(label_smoothing=-0.1), VALUE),
    "ce-smoothing_above_one": (ce(label_smoothing=1.5), VALUE),
    "ce-smoothing_nan": (ce(label_smoothing=float("nan")), VALUE),
    "ce-smoothing_inf": (ce(label_smoothing=float("inf")), VALUE),
    # bias_activation: x (..., N); bias (N,) of any floating dtype; activation relu, gelu or silu
    "ba-x_rank0": (ba(x=torch.tensor(1.0), bias=randn(1, dtype=F32)), VALUE),
    "ba-bias_width": (ba(bias=randn(N + 1, dtype=F32)), VALUE),
    "ba-bias_rank2": (ba(bias=randn(1, N, dtype=F32)), VALUE),
    "ba-bias_rank0": (ba(bias=torch.tensor(1.0)), VALUE),
    "ba-bias_meta": (ba(bias=meta("bias")), VALUE),
    "ba-bias_int": (ba(bias=lambda a: a["bias"].long()), VALUE),
    "ba-activation_unknown": (ba(activation="tanh"), VALUE),
    "ba-activation_case": (ba(activation="ReLU"), VALUE),
    "ba-activation_empty": (ba(activation=""), VALUE),
    "ba-dropout_negative": (ba(dropout_p=-0.1), VALUE),
    "ba-dropout_one": (ba(dropout_p=1.0), VALUE),
    "ba-dropout_nan": (ba(dropout_p=float("nan")), VALUE),
    "ba-dropout_str": (ba(dropout_p="0.1"), VALUE),
    "ba-int": (ba(x=lambda a: a["x"].long(), bias=lambda a: a["bias"].long()), ANY),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("name,value", [("activation", "tanh"), ("activation", "ReLU"), ("dropout_p", 1.0),
                                        ("bias", randn(N + 1, dtype=F32))], ids=["tanh", "ReLU", "p1", "bias"])
def test_bias_activation_errors_name_the_argument(backend, name, value):
    with pytest.raises(ValueError, match=rf"fastformer bias_activation: {name} must "):
        ba(**{name: value})(backend)


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
def test_bias_activation_noncontiguous(backend, dtype):
    x = randn(N, ROWS, dtype=dtype).t()  # (rows, N), last dim strided
    bias = randn(N, 3, dtype=F32)[:, 1]  # stride 3
    dy = randn(ROWS, 2 * N, dtype=dtype)[:, N:]

    def fn(backend):
        return lambda x, b: ops.bias_activation(x, b, activation="silu", backend=backend)

    x = x.detach()
    outs, grads = forward_backward(fn(backend), [x, bias], [dy])
    c_outs, c_grads = forward_backward(fn(backend), [x.contiguous(), bias.contiguous()], [dy.contiguous()])
    refs, ref_grads = forward_backward(fn("torch"), upcast([x, bias]), upcast([dy]))
    for o, c, r, d in zip(outs + grads, c_outs + c_grads, refs + ref_grads, (dtype, dtype, F32)):
        assert_close(o, r, d, "non-contiguous vs reference")
        torch.testing.assert_close(o, c, msg=lambda m: f"non-contiguous vs contiguous: {m}")


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_bad_input_raises(backend, name):
    call, errors = BAD[name]
    with pytest.raises(errors):
        call(backend)


# layer_norm_residual's dtype mixes that it does not take name both dtypes (as c10 writes them).
C10_NAMES = {F32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16"}
LNR_DTYPE_MIXES = {  # x, residual, weight and bias, (the argument named, its dtype), (the one it must match, its dtype)
    "x_f32-residual_bf16": (F32, torch.bfloat16, torch.bfloat16, ("x", F32), ("residual", torch.bfloat16)),
    "x_f64-residual_f32": (torch.float64, F32, F32, ("x", torch.float64), ("residual", F32)),
    "x_f16-residual_f64": (torch.float16, torch.float64, torch.float64, ("x", torch.float16),
                           ("residual", torch.float64)),
    "weight_bf16": (torch.bfloat16, F32, torch.bfloat16, ("weight", torch.bfloat16), ("residual", F32)),
}
# The backend is chosen by x's dtype: a backend without float64 refuses a float64 x by its own message.
LNR_DTYPE_MIX_CASES = [pytest.param(b, *mix, id=f"{b}-{name}") for b in ALL_BACKENDS
                       for name, mix in LNR_DTYPE_MIXES.items() if mix[0] in dtypes_for(b)]


@pytest.mark.parametrize("backend,x_dtype,residual_dtype,param_dtype,named,reference", LNR_DTYPE_MIX_CASES)
def test_layer_norm_residual_dtype_mix_names_both_dtypes(backend, x_dtype, residual_dtype, param_dtype, named,
                                                        reference):
    args = lnr_args()
    x = args.pop("x").to(x_dtype)
    residual = args.pop("residual").to(residual_dtype)
    weight, bias = args.pop("weight").to(param_dtype), args.pop("bias").to(param_dtype)
    with pytest.raises(ValueError, match=rf"fastformer layer_norm_residual: {named[0]} has dtype "
                                         rf"{C10_NAMES[named[1]]} but {reference[0]} has {C10_NAMES[reference[1]]}"):
        ops.layer_norm_residual(x, residual, weight, bias, **args, backend=backend)


@pytest.mark.parametrize("op", ops.OPS)
def test_unknown_backend_name_raises(op):
    with pytest.raises(ValueError, match="nope"):
        with_changes(VALID_ARGS[op], getattr(ops, op), {})("nope")


# Named backends that cannot run CPU inputs of some dtype: "cuda" never runs CPU tensors; backends not
# built here cannot run anything; simulated GPU backends have no float64. No silent fallback allowed.
CANNOT_RUN = [("cuda", F32)]
CANNOT_RUN += [(b, F32) for b in ("cuda_sim", "triton") if not fastformer.backends().get(b)]
CANNOT_RUN += [(b, torch.float64) for b in BACKENDS if torch.float64 not in dtypes_for(b)]


def cast_floats(args, dtype):
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in args.items()}


@pytest.mark.parametrize("backend,dtype", CANNOT_RUN, ids=[f"{b}-{d}" for b, d in CANNOT_RUN])
@pytest.mark.parametrize("op", ops.OPS)
def test_backend_that_cannot_run_the_inputs_raises(op, backend, dtype):
    args = cast_floats(VALID_ARGS[op](), dtype)
    with pytest.raises((ValueError, RuntimeError), match=f"(?i){re.escape(backend)}"):
        getattr(ops, op)(**args, backend=backend)


# Non-contiguous inputs: transposed views, slices with a row stride, a stride-0 broadcast, and
# non-contiguous masks and upstream gradients. The result must match the reference, and the same
# backend's result on contiguous copies.


def assert_same_as_contiguous(fn, inputs, upstream, backend, dtype):
    assert not all(t.is_contiguous() for t in inputs), "the test should pass non-contiguous inputs"
    outs, grads = forward_backward(fn(backend), inputs, upstream)
    contiguous = [t.contiguous() for t in inputs]
    c_outs, c_grads = forward_backward(fn(backend), contiguous, [g.contiguous() for g in upstream])
    refs, ref_grads = forward_backward(fn("torch"), upcast(contiguous), upcast(upstream))
    for o, c, r in zip(outs + grads, c_outs + c_grads, refs + ref_grads):
        assert_close(o, r, dtype, "non-contiguous vs reference")
        torch.testing.assert_close(o, c, msg=lambda m: f"non-contiguous vs contiguous: {m}")


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
def test_attention_noncontiguous(backend, dtype):
    q = randn(B, LQ, H, D, dtype=dtype).transpose(1, 2)  # (B, H, Lq, D) view of (B, Lq, H, D)
    k = randn(B, LK, H, D, dtype=dtype).transpose(1, 2)
    v = randn(B, H, LK, 2 * D, dtype=dtype)[..., :D]  # rows strided by 2D
    mask = (torch.rand(B, 2 * LK) < 0.3)[:, ::2]  # (B, Lk) with stride 2
    dout = randn(B, LQ, H, D, dtype=dtype).transpose(1, 2)

    def fn(backend):
        return lambda q, k, v: ops.attention(q, k, v, key_padding_mask=mask, causal=True, backend=backend)

    assert_same_as_contiguous(fn, [q, k, v], [dout], backend, dtype)


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
def test_softmax_noncontiguous(backend, dtype):
    x = randn(B, H, N, LQ, dtype=dtype).transpose(-1, -2)  # last dim strided
    mask = (torch.rand(B, 1, N, LQ) < 0.3).transpose(-1, -2)
    dy = randn(B, H, N, LQ, dtype=dtype).transpose(-1, -2)

    def fn(backend):
        return lambda x: ops.softmax(x, mask=mask, scale=0.5, backend=backend)

    assert_same_as_contiguous(fn, [x], [dy], backend, dtype)


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
def test_softmax_stride0_input(backend, dtype):
    x = randn(1, LQ, N, dtype=dtype).expand(3, LQ, N)  # stride 0 over the first dim
    dy = randn(3, LQ, N, dtype=dtype)

    def fn(backend):
        return lambda x: ops.softmax(x, backend=backend)

    assert_same_as_contiguous(fn, [x], [dy], backend, dtype)


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
def test_layer_norm_residual_noncontiguous(backend, dtype):
    x = randn(N, ROWS, dtype=dtype).t()  # (rows, N), last dim strided
    residual = randn(ROWS, 2 * N, dtype=dtype)[:, ::2]
    weight = randn(2 * N, dtype=dtype, shift=1.0)[::2]
    bias = randn(N, 3, dtype=dtype)[:, 1]
    dy = randn(N, ROWS, dtype=dtype).t()
    ds = randn(ROWS, 2 * N, dtype=dtype)[:, N:]

    def fn(backend):
        return lambda x, r, w, b: ops.layer_norm_residual(x, r, w, b, prenorm=True, backend=backend)

    assert_same_as_contiguous(fn, [x, residual, weight, bias], [dy, ds], backend, dtype)


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
def test_cross_entropy_noncontiguous(backend, dtype):
    logits = randn(N, ROWS, dtype=dtype).t()  # (rows, V), last dim strided
    sliced = randn(ROWS, 3, 2 * N, dtype=dtype)[..., 1::2]  # (rows, 3, V), stride 2 and an odd offset
    target = torch.randint(0, N, (2 * ROWS,))[::2]
    target[2] = -100
    target3 = torch.randint(0, N, (3, ROWS)).t()
    dloss, dnll = randn(2 * ROWS, dtype=F32)[1::2], randn(ROWS, dtype=F32)
    dloss3, dnll3 = randn(3, ROWS, dtype=F32).t(), randn(ROWS, 3, dtype=F32)
    if dtype == torch.float64:
        dloss, dnll, dloss3, dnll3 = upcast([dloss, dnll, dloss3, dnll3])

    def fn(target):
        return lambda backend: lambda x: ops.cross_entropy(x, target, label_smoothing=0.1, return_nll=True,
                                                           backend=backend)

    # assert_same_as_contiguous compares the losses at the logits' dtype: they are float32 (float64).
    for x, t, up in ((logits, target, [dloss, dnll]), (sliced, target3, [dloss3, dnll3])):
        outs, grads = forward_backward(fn(t)(backend), [x], up)
        c_outs, c_grads = forward_backward(fn(t.contiguous())(backend), [x.contiguous()], [u.contiguous() for u in up])
        refs, ref_grads = forward_backward(fn(t)("torch"), upcast([x]), upcast(up))
        acc = torch.float64 if dtype == torch.float64 else F32
        for o, c, r, d in zip(outs + grads, c_outs + c_grads, refs + ref_grads, (acc, acc, dtype)):
            assert_close(o, r, d, "non-contiguous vs reference")
            torch.testing.assert_close(o, c, msg=lambda m: f"non-contiguous vs contiguous: {m}")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_double_backward_raises(backend):
    # The backward kernels are not differentiable: create_graph=True must raise, not return zero
    # second-order gradients.
    q, k, v = (randn(1, 2, 5, 8, dtype=F32).requires_grad_() for _ in range(3))
    x = randn(3, 8, dtype=F32).requires_grad_()
    weight, bias = randn(8, dtype=F32), randn(8, dtype=F32)
    outputs = {
        "attention": ops.attention(q, k, v, causal=True, backend=backend),
        "attention_varlen": ops.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                                 torch.tensor([0, 2, 5], dtype=torch.int32),
                                                 torch.tensor([0, 3, 5], dtype=torch.int32), 3, 3, causal=True,
                                                 backend=backend),
        "softmax": ops.softmax(x, backend=backend),
        "layer_norm_residual": ops.layer_norm_residual(x, x, weight, bias, backend=backend),
        "cross_entropy": ops.cross_entropy(x, torch.tensor([0, 7, 3]), label_smoothing=0.1, backend=backend),
        "bias_activation": ops.bias_activation(x, bias, activation="gelu", backend=backend),
    }
    assert set(outputs) == set(ops.OPS), "every op of csrc/ops.h's list needs its call here"
    for op, out in outputs.items():
        with pytest.raises(RuntimeError, match=f"fastformer {op}: double backward"):
            torch.autograd.grad(out.sum(), [q] if op.startswith("attention") else [x], create_graph=True)


# Wrong Python types: None for every tensor argument of every op, and other types an argument does not
# take. Every backend raises a ValueError that names the argument (the dispatcher's own TypeError or
# RuntimeError names the registered op's schema instead, and None for a tensor failed deeper down).
WRONG_TYPES = {
    "attention": (attention, [("q", None), ("k", None), ("v", None), ("q", [[1.0]]), ("v", 3.0),
                              ("key_padding_mask", [[True]]), ("scale", "0.5"), ("dropout_p", None)]),
    "attention_varlen": (varlen, [("q", None), ("k", [[1.0]]), ("cu_seqlens_q", None), ("cu_seqlens_k", [0, 7]),
                                  ("max_seqlen_q", None), ("max_seqlen_k", 4.0), ("scale", "0.5"),
                                  ("dropout_p", None)]),
    "softmax": (softmax, [("x", None), ("x", [1.0, 2.0]), ("mask", [[True]]), ("mask", 1), ("scale", "0.5"),
                          ("scale", None)]),
    "layer_norm_residual": (lnr, [("x", None), ("residual", None), ("weight", None), ("bias", None),
                                  ("weight", [1.0] * N), ("bias", 0.0), ("eps", "1e-5"), ("eps", None),
                                  ("dropout_p", None), ("x_bias", [0.0] * N), ("compute_dtype", "bfloat16")]),
    "cross_entropy": (ce, [("logits", None), ("target", None), ("target", [0, 1]), ("logits", 1.0),
                           ("label_smoothing", None), ("ignore_index", 1.5), ("ignore_index", None)]),
    "bias_activation": (ba, [("x", None), ("bias", None), ("x", [[1.0]]), ("bias", 0.5), ("activation", None),
                             ("activation", 1), ("dropout_p", None)]),
}
WRONG_TYPE_CASES = [(op, name, value) for op, (_, cases) in WRONG_TYPES.items() for name, value in cases]


@pytest.mark.parametrize("op,name,value", WRONG_TYPE_CASES,
                         ids=[f"{op}-{name}-{type(value).__name__}" for op, name, value in WRONG_TYPE_CASES])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_wrong_python_type_names_the_argument(backend, op, name, value):
    call = WRONG_TYPES[op][0](**{name: value})
    with pytest.raises(ValueError, match=rf"fastformer {op}: {name} must be "):
        call(backend)


# The registered backward ops check their arguments too (csrc/ops.h check_<op>_bwd): autograd always
# passes what the forward made, but a direct caller may not, and no kernel may then read out of bounds.
def backward_calls():
    from fastformer import _dispatch

    q, k, v = randn(B, H, LQ, D, dtype=F32), randn(B, H, LK, D, dtype=F32), randn(B, H, LK, D, dtype=F32)
    x, w, b = randn(ROWS, N, dtype=F32), randn(N, dtype=F32), randn(N, dtype=F32)
    logits, target = randn(ROWS, N, dtype=F32), torch.randint(0, N, (ROWS,))
    short = lambda t: t[..., :-1]  # noqa: E731  one element too few along the last dim

    def calls(backend):
        fwd = lambda op: _dispatch.kernel(op, "fwd", backend)  # noqa: E731
        bwd = lambda op: _dispatch.kernel(op, "bwd", backend)  # noqa: E731
        out, lse = fwd("attention")(q, k, v, None, False, 0.0, None, None)
        va = varlen_args()
        packed = (va["q"], va["k"], va["v"])
        tables = (va["cu_seqlens_q"], va["cu_seqlens_k"], 5, 4, True, 0.0, None, None)
        v_out, v_lse = fwd("attention_varlen")(*packed, *tables)
        y = fwd("softmax")(x, None, 1.0)
        _, s, mean, rstd, _ = fwd("layer_norm_residual")(x, x, w, b, 1e-5, 0.0, None, None, None)
        loss, nll, ce_lse = fwd("cross_entropy")(logits, target, 0.0, -100)
        ba_y = fwd("bias_activation")(x, b, "gelu", 0.0, None)
        return {
            "attention-dout": lambda: bwd("attention")(short(out), q, k, v, out, lse, None, False, 0.0, None, None, 0),
            "attention-lse": lambda: bwd("attention")(out, q, k, v, out, short(lse), None, False, 0.0, None, None, 0),
            "attention_varlen-dout": lambda: bwd("attention_varlen")(short(v_out), *packed, v_out, v_lse, *tables),
            "attention_varlen-lse": lambda: bwd("attention_varlen")(v_out, *packed, v_out, v_lse[:, :-1], *tables),
            "softmax-dy": lambda: bwd("softmax")(short(y), y, 1.0),
            "layer_norm_residual-ds": lambda: bwd("layer_norm_residual")(s, short(s), s, w, mean, rstd, 0.0, None,
                                                                         None, None, None),
            "layer_norm_residual-rstd": lambda: bwd("layer_norm_residual")(s, None, s, w, mean, short(rstd), 0.0, None,
                                                                           None, None, None),
            "layer_norm_residual-dx_dtype": lambda: bwd("layer_norm_residual")(s, None, s, w, mean, rstd, 0.0, None,
                                                                               torch.float64, None, None),
            "layer_norm_residual-weight": lambda: bwd("layer_norm_residual")(s, None, s, w.bfloat16(), mean, rstd, 0.0,
                                                                             None, torch.bfloat16, None, None),
            "layer_norm_residual-dy_c": lambda: bwd("layer_norm_residual")(s, None, s, w, mean, rstd, 0.0, None, None,
                                                                           short(s).bfloat16(), None),
            "layer_norm_residual-dy_c-dtype": lambda: bwd("layer_norm_residual")(s, None, s, w, mean, rstd, 0.0, None,
                                                                                 None, s.double(), None),
            "layer_norm_residual-x_bias": lambda: bwd("layer_norm_residual")(s, None, s, w, mean, rstd, 0.0, None,
                                                                             None, None, short(w)),
            "cross_entropy-lse": lambda: bwd("cross_entropy")(loss, nll, logits, target, short(ce_lse), 0.0, -100),
            "cross_entropy-dloss": lambda: bwd("cross_entropy")(loss.double(), nll, logits, target, ce_lse, 0.0, -100),
            "bias_activation-dy": lambda: bwd("bias_activation")(short(ba_y), x, b, "gelu", 0.0, None),
            "bias_activation-bias": lambda: bwd("bias_activation")(ba_y, x, short(b), "gelu", 0.0, None),
            "bias_activation-activation": lambda: bwd("bias_activation")(ba_y, x, b, "tanh", 0.0, None),
        }

    return calls


BACKWARD_CASES = ["attention-dout", "attention-lse", "attention_varlen-dout", "attention_varlen-lse", "softmax-dy", "layer_norm_residual-ds", "layer_norm_residual-rstd",
                  "layer_norm_residual-dx_dtype", "layer_norm_residual-weight", "layer_norm_residual-dy_c",
                  "layer_norm_residual-dy_c-dtype", "layer_norm_residual-x_bias", "cross_entropy-lse",
                  "cross_entropy-dloss", "bias_activation-dy", "bias_activation-bias", "bias_activation-activation"]


@pytest.mark.parametrize("case", BACKWARD_CASES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_backward_op_checks_its_arguments(backend, case):
    call = backward_calls()(backend)[case]
    name = case.split("-")[1]
    with pytest.raises(ValueError, match=rf"fastformer {case.split('-')[0]}: {name} "):
        call()


# The dropout seed of the registered ops (csrc/ops.h check_seed): a 0-dim int64 tensor on the inputs' device,
# given when dropout_p > 0. Anything else raises a ValueError naming the op and what the seed is; a seed on
# another device is refused, not moved (docs/correctness.md).
BAD_SEEDS = {
    "int32": (torch.tensor(7, dtype=torch.int32), r"seed must be a 0-dim int64 tensor on cpu .*got dtype Int"),
    "float": (torch.tensor(7.0), r"seed must be a 0-dim int64 tensor on cpu .*got dtype Float"),
    "shape1": (torch.tensor([7]), r"seed must be a 0-dim int64 tensor on cpu .*shape \[1\]"),
    "meta": (torch.tensor(7, device="meta"), r"seed must be a 0-dim int64 tensor on cpu .* on meta"),
    "none": (None, r"dropout_p = 0.25 needs a seed, a 0-dim int64 tensor on cpu"),
}


def registered(op, phase, backend, **arguments):
    """Calls the registered op running ``op``'s ``phase`` on ``backend`` with its arguments by name (None for
    an optional one not given)."""
    overload, tail = kernel_op(op, phase, backend)
    names = [a.name for a in overload._schema.arguments][:len(overload._schema.arguments) - len(tail)]
    return overload(*(arguments.get(n) for n in names), *tail)


def seed_calls(backend, seed):
    q, k, v = randn(B, H, LQ, D, dtype=F32), randn(B, H, LK, D, dtype=F32), randn(B, H, LK, D, dtype=F32)
    x, w, b = randn(ROWS, N, dtype=F32), randn(N, dtype=F32), randn(N, dtype=F32)
    good = torch.tensor(7)
    attn = dict(q=q, k=k, v=v, causal=True, dropout_p=0.25, packed_grads=0)
    out, lse = registered("attention", "fwd", backend, **attn, seed=good)
    packed = dict(varlen_args(), dropout_p=0.25)
    v_out, v_lse = registered("attention_varlen", "fwd", backend, **packed, seed=good)
    norm = dict(x=x, residual=x, weight=w, bias=b, eps=1e-5, dropout_p=0.25)
    _, s, mean, rstd, _ = registered("layer_norm_residual", "fwd", backend, **norm, seed=good)
    act = dict(bias=b, activation="silu", dropout_p=0.25)
    return {
        "attention-fwd": lambda: registered("attention", "fwd", backend, **attn, seed=seed),
        "attention-bwd": lambda: registered("attention", "bwd", backend, **attn, dout=out, out=out, lse=lse, seed=seed),
        "attention_varlen-fwd": lambda: registered("attention_varlen", "fwd", backend, **packed, seed=seed),
        "attention_varlen-bwd": lambda: registered("attention_varlen", "bwd", backend, **packed, dout=v_out, out=v_out,
                                                   lse=v_lse, seed=seed),
        "layer_norm_residual-fwd": lambda: registered("layer_norm_residual", "fwd", backend, **norm, seed=seed),
        "layer_norm_residual-bwd": lambda: registered("layer_norm_residual", "bwd", backend, dy=s, s=s, weight=w,
                                                      mean=mean, rstd=rstd, dropout_p=0.25, seed=seed),
        "bias_activation-fwd": lambda: registered("bias_activation", "fwd", backend, x=x, **act, seed=seed),
        "bias_activation-bwd": lambda: registered("bias_activation", "bwd", backend, dy=x, saved=x, **act, seed=seed),
    }


@pytest.mark.parametrize("call", ["attention-fwd", "attention-bwd", "attention_varlen-fwd", "attention_varlen-bwd",
                                  "layer_norm_residual-fwd", "layer_norm_residual-bwd", "bias_activation-fwd",
                                  "bias_activation-bwd"])
@pytest.mark.parametrize("seed", list(BAD_SEEDS))
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_bad_seed_raises(backend, seed, call):
    value, message = BAD_SEEDS[seed]
    with pytest.raises(ValueError, match=rf"fastformer {call.split('-')[0]}: {message}"):
        seed_calls(backend, value)[call]()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_seed_without_dropout_is_unused(backend):
    # dropout_p = 0: no seed needed, and a given one is only checked, never read.
    q = randn(B, H, LQ, D, dtype=F32)
    without = registered("attention", "fwd", backend, q=q, k=q, v=q, dropout_p=0.0)[0]
    with_seed = registered("attention", "fwd", backend, q=q, k=q, v=q, dropout_p=0.0, seed=torch.tensor(3))[0]
    assert torch.equal(without, with_seed)
