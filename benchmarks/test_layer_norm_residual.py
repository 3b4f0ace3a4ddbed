"""ops.layer_norm_residual beside add + dropout + layer_norm, on the model's residual stream.

x, residual (M, N) = (tokens, 512), weight and bias (N,), dropout 0 and 0.1.

Bytes, e = the element size, the op's inputs read once and outputs written once: forward reads x,
residual, weight, bias and writes y, s = residual + dropout(x) (kept for backward) and the float32 row
mean and rstd: 4 MN e + 2 N e + 8 M. Backward reads dy, s, weight, mean, rstd and writes dx, dresidual,
dweight, dbias: 4 MN e + 3 N e + 8 M. The dropout mask is regenerated, never stored. Memory-bound: each
records its fraction of the session's copy bandwidth.

The fused epilogue of a bf16 training step (issue 52): a bfloat16 branch x from a projection run without
its bias, the float32 residual stream, parameters and branch bias; the op adds the bias, drops out, adds,
normalizes and writes y (float32) and y_c = y in bfloat16 for the next GEMM, beside the PyTorch code it
replaces: x + bias, dropout, add, layer_norm, .to(bfloat16). Bytes: forward reads x (2 MN), residual
(4 MN) and writes y, s (4 MN each), y_c (2 MN): 16 MN + 16 N + 8 M; backward reads dy (4 MN), dy_c (2 MN),
s (4 MN) and writes dx (2 MN), dresidual (4 MN): 16 MN + 20 N + 8 M.
"""
import pytest
import torch
import torch.nn.functional as F

from fastformer import ops

BASELINES = ("add+dropout+layer_norm", "bias+dropout+add+layer_norm+cast")


@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["p0", "p0.1"])
def test_layer_norm_residual(bench, ctx, impl, pass_, dropout_p):
    M, N = ctx.sizes.tokens, ctx.sizes.d_model
    x, residual = ctx.randn(M, N, grad=True), ctx.randn(M, N, grad=True)
    weight, bias = ctx.randn(N, grad=True), ctx.randn(N, grad=True)
    if impl == "bias+dropout+add+layer_norm+cast":
        pytest.skip("the fused epilogue's baseline (test_fused_epilogue)")
    if impl in BASELINES:
        forward = lambda: F.layer_norm(residual + F.dropout(x, dropout_p), (N,), weight, bias)  # noqa: E731
    else:
        forward = lambda: ops.layer_norm_residual(x, residual, weight, bias, dropout_p=dropout_p,  # noqa: E731
                                                  backend=impl)
    e = x.element_size()
    bench.op(forward, [x, residual, weight, bias], ctx.randn(M, N), pass_=pass_, op="layer_norm_residual",
             shape=f"{M}x{N} p={dropout_p:g}", impl=impl,
             bytes_moved=(4 * M * N * e + 2 * N * e + 8 * M, 4 * M * N * e + 3 * N * e + 8 * M), memory_bound=True)


def test_fused_epilogue(bench, ctx, impl, pass_):
    if impl == "add+dropout+layer_norm":
        pytest.skip("the plain op's baseline (test_layer_norm_residual)")
    M, N, p = ctx.sizes.tokens, ctx.sizes.d_model, 0.1
    bf16, f32 = torch.bfloat16, torch.float32
    x = torch.randn(M, N, device=ctx.device, dtype=bf16, requires_grad=True)
    residual = torch.randn(M, N, device=ctx.device, dtype=f32, requires_grad=True)
    weight, bias, x_bias = (torch.randn(N, device=ctx.device, dtype=f32, requires_grad=True) for _ in range(3))
    if impl in BASELINES:
        def forward():
            y = F.layer_norm(residual + F.dropout(x + x_bias, p), (N,), weight, bias)
            return y, y.to(bf16)
    else:
        def forward():
            return ops.layer_norm_residual(x, residual, weight, bias, dropout_p=p, x_bias=x_bias,
                                           compute_dtype=bf16, backend=impl)
    grads = (torch.randn(M, N, device=ctx.device, dtype=f32), torch.randn(M, N, device=ctx.device, dtype=bf16))
    bench.op(forward, [x, residual, weight, bias, x_bias], grads, pass_=pass_, op="layer_norm_residual+bias+bf16",
             shape=f"{M}x{N} p={p:g}", impl=impl,
             bytes_moved=(16 * M * N + 16 * N + 8 * M, 16 * M * N + 20 * N + 8 * M), memory_bound=True)
