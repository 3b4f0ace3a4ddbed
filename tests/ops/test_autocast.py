"""Under autocast an op computes what it computes on the same low-precision tensors without autocast, on
every backend, forward and backward. The model trains under ``torch.autocast("cpu", torch.bfloat16)``:
the ops then receive bfloat16 tensors, and the Python-written backends (torch, cuda_sim, triton) must not
let autocast recast their own float32 arithmetic (it did: the torch backend's attention returned a
bfloat16 logsumexp, which the backward's checks refuse).

Small odd shapes, masks and no dropout (a seed drawn under autocast is the same; kept out for clarity).
"""
import pytest
import torch

from fastformer import ops
from helpers import ALL_BACKENDS, randn

DTYPE = torch.bfloat16


def attention_call(backend):
    q = randn(2, 3, 7, 40, dtype=DTYPE).requires_grad_()
    k = randn(2, 3, 13, 40, dtype=DTYPE).requires_grad_()
    v = randn(2, 3, 13, 40, dtype=DTYPE).requires_grad_()
    mask = torch.rand(2, 13) < 0.3
    dout = randn(2, 3, 7, 40, dtype=DTYPE)

    def run():
        out = ops.attention(q, k, v, key_padding_mask=mask, causal=True, backend=backend)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    return run


def attention_varlen_call(backend):
    cu_q, cu_k = torch.tensor([0, 7, 7, 9], dtype=torch.int32), torch.tensor([0, 13, 15, 15], dtype=torch.int32)
    q = randn(9, 4, 40, dtype=DTYPE).requires_grad_()
    k = randn(15, 2, 40, dtype=DTYPE).requires_grad_()
    v = randn(15, 2, 40, dtype=DTYPE).requires_grad_()
    dout = randn(9, 4, 40, dtype=DTYPE)

    def run():
        out = ops.attention_varlen(q, k, v, cu_q, cu_k, 7, 13, causal=True, backend=backend)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    return run


def softmax_call(backend):
    x = randn(3, 5, 97, dtype=DTYPE).requires_grad_()
    mask = torch.rand(3, 1, 97) < 0.3
    dy = randn(3, 5, 97, dtype=DTYPE)

    def run():
        y = ops.softmax(x, mask=mask, scale=0.7, backend=backend)
        return (y, *torch.autograd.grad(y, (x,), dy))

    return run


def layer_norm_residual_call(backend):
    x, residual = randn(7, 97, dtype=DTYPE).requires_grad_(), randn(7, 97, dtype=DTYPE).requires_grad_()
    weight = randn(97, dtype=DTYPE, shift=1.0).requires_grad_()
    bias = randn(97, dtype=DTYPE).requires_grad_()
    dy, ds = randn(7, 97, dtype=DTYPE), randn(7, 97, dtype=DTYPE)

    def run():
        y, s = ops.layer_norm_residual(x, residual, weight, bias, prenorm=True, backend=backend)
        return (y, s, *torch.autograd.grad((y, s), (x, residual, weight, bias), (dy, ds)))

    return run


def layer_norm_residual_fused_call(backend):
    # The training case of the fused epilogue: a bfloat16 branch, float32 residual, parameters and x_bias, the
    # output also in bfloat16; nothing is cast under autocast (the op has no autocast kernel).
    f32 = torch.float32
    x, residual = randn(7, 97, dtype=DTYPE).requires_grad_(), randn(7, 97, dtype=f32).requires_grad_()
    weight, bias = randn(97, dtype=f32, shift=1.0).requires_grad_(), randn(97, dtype=f32).requires_grad_()
    x_bias = randn(97, dtype=f32).requires_grad_()
    dy, dy_c = randn(7, 97, dtype=f32), randn(7, 97, dtype=DTYPE)

    def run():
        y, y_c = ops.layer_norm_residual(x, residual, weight, bias, x_bias=x_bias, compute_dtype=DTYPE,
                                         backend=backend)
        return (y, y_c, *torch.autograd.grad((y, y_c), (x, residual, weight, bias, x_bias), (dy, dy_c)))

    return run


def cross_entropy_call(backend):
    logits = randn(7, 3, 113, dtype=DTYPE).requires_grad_()
    target = torch.randint(0, 113, (7, 3))
    target[::2, 1] = -100
    dloss, dnll = torch.rand(7, 3), torch.rand(7, 3)

    def run():
        loss, nll = ops.cross_entropy(logits, target, label_smoothing=0.1, return_nll=True, backend=backend)
        return (loss, nll, *torch.autograd.grad((loss, nll), (logits,), (dloss, dnll)))

    return run


def bias_activation_call(backend):
    x = randn(7, 97, dtype=DTYPE).requires_grad_()
    bias = randn(97, dtype=torch.float32).requires_grad_()  # the float32 master bias beside bfloat16 x
    dy = randn(7, 97, dtype=DTYPE)

    def run():
        y = ops.bias_activation(x, bias, activation="gelu", backend=backend)
        return (y, *torch.autograd.grad(y, (x, bias), dy))

    return run


# One call per op of csrc/ops.h's list (tests/test_op_lists.py fails while an op has none).
CALLS = {"attention": attention_call, "attention_varlen": attention_varlen_call, "softmax": softmax_call, "layer_norm_residual": layer_norm_residual_call,
         "layer_norm_residual+fused": layer_norm_residual_fused_call, "cross_entropy": cross_entropy_call,
         "bias_activation": bias_activation_call}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("op", list(CALLS))
def test_autocast_changes_nothing_inside_an_op(op, backend):
    run = CALLS[op](backend)
    plain = run()
    with torch.autocast("cpu", dtype=DTYPE):
        cast = run()
    for i, (a, b) in enumerate(zip(plain, cast)):
        assert a.dtype == b.dtype, f"{op} on {backend}: output {i} is {b.dtype} under autocast, {a.dtype} without"
        assert torch.equal(a, b), f"{op} on {backend}: output {i} differs under autocast"
