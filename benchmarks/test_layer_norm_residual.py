"""ops.layer_norm_residual beside add + dropout + layer_norm, on the model's residual stream.

x, residual (M, N) = (tokens, 512), weight and bias (N,), dropout 0 and 0.1.

Bytes, e = the element size, the op's inputs read once and outputs written once: forward reads x,
residual, weight, bias and writes y, s = residual + dropout(x) (kept for backward) and the float32 row
mean and rstd: 4 MN e + 2 N e + 8 M. Backward reads dy, s, weight, mean, rstd and writes dx, dresidual,
dweight, dbias: 4 MN e + 3 N e + 8 M. The dropout mask is regenerated, never stored. Memory-bound: each
records its fraction of the session's copy bandwidth.
"""
import pytest
import torch.nn.functional as F

from fastformer import ops

BASELINES = ("add+dropout+layer_norm",)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["p0", "p0.1"])
def test_layer_norm_residual(bench, ctx, impl, pass_, dropout_p):
    M, N = ctx.sizes.tokens, ctx.sizes.d_model
    x, residual = ctx.randn(M, N, grad=True), ctx.randn(M, N, grad=True)
    weight, bias = ctx.randn(N, grad=True), ctx.randn(N, grad=True)
    if impl in BASELINES:
        forward = lambda: F.layer_norm(residual + F.dropout(x, dropout_p), (N,), weight, bias)  # noqa: E731
    else:
        forward = lambda: ops.layer_norm_residual(x, residual, weight, bias, dropout_p=dropout_p,  # noqa: E731
                                                  backend=impl)
    e = x.element_size()
    bench.op(forward, [x, residual, weight, bias], ctx.randn(M, N), pass_=pass_, op="layer_norm_residual",
             shape=f"{M}x{N} p={dropout_p:g}", impl=impl,
             bytes_moved=(4 * M * N * e + 2 * N * e + 8 * M, 4 * M * N * e + 3 * N * e + 8 * M), memory_bound=True)
