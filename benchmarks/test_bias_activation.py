"""ops.bias_activation beside add + relu + dropout, on the feed-forward's first projection.

x (M, N) = (tokens, 4 d_model): fc1's product without its bias (the model's d_ff = 4 d_model), in the
benchmark dtype (--bench-dtype: float32, or bfloat16 as autocast makes it); bias (N,) float32, the master
bias; relu, dropout 0 and 0.1. The baseline is the PyTorch code the op replaces: x + bias (the bias cast to
x's dtype, as autocast casts it), relu, dropout.

Bytes, e = the element size, the op's inputs read once and outputs written once: forward reads x and the
bias and writes y: 2 MN e + 4 N. Backward reads dy and y (relu's saved tensor; x for gelu and silu) and writes
dx and dbias: 3 MN e + 4 N. The dropout mask is regenerated, never stored. Memory-bound: each records its
fraction of the session's copy bandwidth.
"""
import pytest
import torch
import torch.nn.functional as F

from fastformer import ops

BASELINES = ("add+relu+dropout",)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["p0", "p0.1"])
def test_bias_activation(bench, ctx, impl, pass_, dropout_p):
    M, N = ctx.sizes.tokens, 4 * ctx.sizes.d_model
    x = ctx.randn(M, N, grad=True)
    bias = torch.randn(N, device=ctx.device, requires_grad=True)  # the float32 master bias
    if impl in BASELINES:
        forward = lambda: F.dropout(F.relu(x + bias.to(x.dtype)), dropout_p)  # noqa: E731
    else:
        forward = lambda: ops.bias_activation(x, bias, activation="relu", dropout_p=dropout_p,  # noqa: E731
                                              backend=impl)
    e = x.element_size()
    bench.op(forward, [x, bias], ctx.randn(M, N), pass_=pass_, op="bias_activation", shape=f"{M}x{N} p={dropout_p:g}",
             impl=impl, bytes_moved=(2 * M * N * e + 4 * N, 3 * M * N * e + 4 * N), memory_bound=True)
