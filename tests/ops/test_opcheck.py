"""torch.library.opcheck on every fastformer op and backend.

opcheck runs the op's schema, fake (meta) kernel, autograd registration and AOT-dispatch checks: what
torch.compile and export rely on. Per backend the op is the C++ kernel op (cpu) or its ``_py`` twin
(helpers.kernel_op). The *_fwd ops are checked with inputs that require grad (exercising their C++
autograd), the *_bwd ops on the outputs of the matching *_fwd call.
"""
import math

import pytest
import torch

from helpers import ALL_BACKENDS, kernel_op, randn

F32 = torch.float32
B, H, LQ, LK, D = 2, 2, 5, 7, 16
ROWS, N = 6, 40


def seed(value=1234):
    return torch.tensor(value, dtype=torch.int64)


def leaf(t):
    return t.requires_grad_(True)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask_causal"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_attention_ops(backend, masked, dropout_p):
    q = randn(B, H, LQ, D, dtype=F32)
    k = randn(B, H, LK, D, dtype=F32)
    v = randn(B, H, LK, D, dtype=F32)
    mask = (torch.rand(B, LK) < 0.3) if masked else None
    scale = 1.0 / math.sqrt(D)
    fwd, tail = kernel_op("attention", "fwd", backend)
    bwd, _ = kernel_op("attention", "bwd", backend)
    fwd_args = (q, k, v, mask, masked, dropout_p, scale, seed()) + tail
    torch.library.opcheck(fwd, (leaf(q), leaf(k), leaf(v)) + fwd_args[3:])

    with torch.no_grad():
        out, lse = fwd(*fwd_args)
    dout = randn(B, H, LQ, D, dtype=F32)
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out, lse, mask, masked, dropout_p, scale, seed(), 0) + tail
    torch.library.opcheck(bwd, bwd_args)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("packed_grads", [3, 2])
def test_attention_bwd_packed_grads(backend, packed_grads):
    """The backward op's packed_grads (csrc/attention_grads.h): the gradients written as the parts of one packed
    tensor, the fake kernel's strides the real ones'."""
    qkv = randn(B, LQ, 3, H, D, dtype=F32)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    fwd, tail = kernel_op("attention", "fwd", backend)
    bwd, _ = kernel_op("attention", "bwd", backend)
    with torch.no_grad():
        out, lse = fwd(q, k, v, None, True, 0.25, None, seed(), *tail)
    bwd_args = (randn(B, H, LQ, D, dtype=F32), q, k, v, out, lse, None, True, 0.25, None, seed(), packed_grads) + tail
    grads = bwd(*bwd_args)
    # the packed gradient whole, in place of its parts' outputs, which are empty
    whole = grads[3 - packed_grads]
    assert whole.shape == (B, LQ, packed_grads, H, D) and whole.is_contiguous()
    assert [g.numel() for g in grads[4 - packed_grads:]] == [0] * (packed_grads - 1)
    torch.library.opcheck(bwd, bwd_args)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_attention_ops_grouped_query(backend):
    # k, v with fewer heads than q (4 query heads over 2 key/value heads): dk, dv keep k's heads.
    q = randn(B, 4, LQ, D, dtype=F32)
    k = randn(B, 2, LK, D, dtype=F32)
    v = randn(B, 2, LK, D, dtype=F32)
    mask = torch.rand(B, LK) < 0.3
    fwd, tail = kernel_op("attention", "fwd", backend)
    bwd, _ = kernel_op("attention", "bwd", backend)
    fwd_args = (q, k, v, mask, True, 0.25, None, seed()) + tail
    torch.library.opcheck(fwd, (leaf(q), leaf(k), leaf(v)) + fwd_args[3:])

    with torch.no_grad():
        out, lse = fwd(*fwd_args)
    bwd_args = (randn(B, 4, LQ, D, dtype=F32), q.detach(), k.detach(), v.detach(), out, lse, mask, True, 0.25, None,
                seed(), 0) + tail
    _, dk, dv = bwd(*bwd_args)
    assert dk.shape == k.shape and dv.shape == v.shape
    torch.library.opcheck(bwd, bwd_args)


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_softmax_ops(backend, masked):
    x = randn(B, H, LQ, N, dtype=F32)
    # The op takes the mask already expanded to x's shape (ops.softmax passes a broadcast view).
    mask = (torch.rand(B, 1, 1, N) < 0.3).expand(x.shape) if masked else None
    fwd, tail = kernel_op("softmax", "fwd", backend)
    bwd, _ = kernel_op("softmax", "bwd", backend)
    torch.library.opcheck(fwd, (leaf(x), mask, 0.5) + tail)

    with torch.no_grad():
        y = fwd(x, mask, 0.5, *tail)
    dy = randn(B, H, LQ, N, dtype=F32)
    torch.library.opcheck(bwd, (dy, y, 0.5) + tail)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "x_bias+bf16_out"])
@pytest.mark.parametrize("x_dtype", [F32, torch.bfloat16], ids=["f32", "bf16_branch"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("with_ds", [False, True], ids=["no_ds", "ds"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_layer_norm_residual_ops(backend, with_ds, dropout_p, x_dtype, fused):
    # fused: the branch's bias (float32, a master bias) and the bfloat16 copy of the output y_c, whose
    # gradient dy_c backward takes; without, y_c and dx_bias are empty (0,) tensors.
    x = randn(2, ROWS, N, dtype=x_dtype)  # a bfloat16 branch beside the float32 residual: autocast's case
    residual = randn(2, ROWS, N, dtype=F32)
    weight = randn(N, dtype=F32)
    bias = randn(N, dtype=F32)
    x_bias = randn(N, dtype=F32) if fused else None
    compute_dtype = torch.bfloat16 if fused else None
    fwd, tail = kernel_op("layer_norm_residual", "fwd", backend)
    bwd, _ = kernel_op("layer_norm_residual", "bwd", backend)
    fwd_args = (x, residual, weight, bias, 1e-5, dropout_p, seed(), x_bias, compute_dtype) + tail
    torch.library.opcheck(fwd, (leaf(x), leaf(residual), leaf(weight), leaf(bias)) + fwd_args[4:7] +
                          (None if x_bias is None else leaf(x_bias), compute_dtype) + tail)

    with torch.no_grad():
        y, s, mean, rstd, y_c = fwd(*fwd_args)
    assert y_c.shape == (s.shape if fused else (0,))
    dy = randn(2, ROWS, N, dtype=F32)
    ds = randn(2, ROWS, N, dtype=F32) if with_ds else None
    dy_c = randn(2, ROWS, N, dtype=torch.bfloat16) if fused else None
    bwd_args = (dy, ds, s, weight.detach(), mean, rstd, dropout_p, seed(), x_dtype, dy_c, x_bias) + tail
    torch.library.opcheck(bwd, bwd_args)


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("x_dtype", [F32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_bias_activation_ops(backend, x_dtype, dropout_p, activation):
    x = randn(2, ROWS, N, dtype=x_dtype)
    bias = randn(N, dtype=F32)  # the float32 master bias, beside a bfloat16 x too
    fwd, tail = kernel_op("bias_activation", "fwd", backend)
    bwd, _ = kernel_op("bias_activation", "bwd", backend)
    torch.library.opcheck(fwd, (leaf(x), leaf(bias), activation, dropout_p, seed()) + tail)

    with torch.no_grad():
        y = fwd(x, bias, activation, dropout_p, seed(), *tail)
    saved = y if activation == "relu" else x.detach()
    dy = randn(2, ROWS, N, dtype=x_dtype)
    torch.library.opcheck(bwd, (dy, saved, bias.detach(), activation, dropout_p, seed()) + tail)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_cross_entropy_ops(backend, dtype, label_smoothing):
    logits = randn(2, ROWS, N, dtype=dtype)
    target = torch.randint(0, N, (2, ROWS))
    target[0, 1] = target[1, 4] = 0  # ignore_index 0: a pad id
    fwd, tail = kernel_op("cross_entropy", "fwd", backend)
    bwd, _ = kernel_op("cross_entropy", "bwd", backend)
    torch.library.opcheck(fwd, (leaf(logits), target, label_smoothing, 0) + tail)

    with torch.no_grad():
        loss, nll, lse = fwd(logits, target, label_smoothing, 0, *tail)
    dloss, dnll = randn(2, ROWS, dtype=F32), randn(2, ROWS, dtype=F32)
    torch.library.opcheck(bwd, (dloss, dnll, logits.detach(), target, lse, label_smoothing, 0) + tail)


# attention_varlen: 3 packed sequences (one of them empty), query lengths 3, 0, 4 and key lengths 5, 2, 6.
VARLEN_LENS_Q, VARLEN_LENS_K = (3, 0, 4), (5, 2, 6)


def cu_seqlens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)], ids=["mha", "gqa"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_attention_varlen_ops(backend, heads, causal, dropout_p):
    H, H_kv = heads
    Tq, Tk = sum(VARLEN_LENS_Q), sum(VARLEN_LENS_K)
    q = randn(Tq, H, D, dtype=F32)
    k = randn(Tk, H_kv, D, dtype=F32)
    v = randn(Tk, H_kv, D, dtype=F32)
    cu_q, cu_k = cu_seqlens(VARLEN_LENS_Q), cu_seqlens(VARLEN_LENS_K)
    max_q, max_k = max(VARLEN_LENS_Q), max(VARLEN_LENS_K)
    scale = 1.0 / math.sqrt(D)
    fwd, tail = kernel_op("attention_varlen", "fwd", backend)
    bwd, _ = kernel_op("attention_varlen", "bwd", backend)
    fwd_args = (q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, scale, seed()) + tail
    torch.library.opcheck(fwd, (leaf(q), leaf(k), leaf(v)) + fwd_args[3:])

    with torch.no_grad():
        out, lse = fwd(*fwd_args)
    assert out.shape == (Tq, H, D) and lse.shape == (H, Tq) and lse.dtype == F32
    dout = randn(Tq, H, D, dtype=F32)
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k, max_q, max_k, causal, dropout_p,
                scale, seed()) + tail
    dq, dk, dv = bwd(*bwd_args)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    torch.library.opcheck(bwd, bwd_args)
