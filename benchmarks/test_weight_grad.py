"""A projection's gradients in bf16 training on the CPU: fastformer's ``weight_grad`` (csrc/gemm/weight_grad.cpp:
dW = dy^T x and db = dy's column sums, float32, on the bf16 micro-kernel) beside what it replaced, ATen's
bfloat16 product cast to the float32 parameter's dtype (and, for a projection with a bias, the float32 sum of dy,
which casts dy first: "bf16 mm+cast(+sum)").

dy (M, N), x (M, K) bfloat16, M the size profile's tokens per batch (4,096 by default), for the small config's
projections at d_model 256: the packed q, k, v (768 x 256, with a bias), fc1 (1024 x 256), fc2 (256 x 1024),
out_proj (256 x 256) and the output projection tied to the 8,000-token embedding (8000 x 256). CPU only, and
only where the CPU has bfloat16 dot products (the precision fastformer.train picks there); fastformer is timed in
alternation with the baseline (``turns_with``). Compute-bound: TFLOP/s of 2 M N K.
"""
import pytest
import torch

from fastformer.runtime import native_bf16_cpu

BASELINES = ("bf16 mm+cast",)
# (name, N, K, bias)
PROJECTIONS = [("qkv", 768, 256, True), ("fc1", 1024, 256, False), ("fc2", 256, 1024, False),
               ("out_proj", 256, 256, False), ("output", 8000, 256, False)]


def replaced(dy, x, bias):
    """What _ComputeLinear's backward ran before: the bf16 product, cast by autograd to the float32 parameter's
    dtype, and the bias's float32 sum."""
    dw = (dy.t() @ x).float()
    return (dw, dy.sum(0, dtype=torch.float32)) if bias else dw


@pytest.mark.parametrize("projection", PROJECTIONS, ids=[p[0] for p in PROJECTIONS])
def test_weight_grad(bench, ctx, projection):
    if ctx.cuda or not native_bf16_cpu():
        pytest.skip("a CPU benchmark of bf16 training: needs a CPU with bfloat16 dot products (on CUDA the weight "
                    "gradient is ATen's mm with out_dtype)")
    name, N, K, bias = projection
    M = ctx.sizes.tokens
    dy = torch.randn(M, N).to(torch.bfloat16)
    x = torch.randn(M, K).to(torch.bfloat16)
    bench(lambda: torch.ops.fastformer.weight_grad(dy, x), op="weight_grad", shape=f"{name} {M}x{N}x{K}",
          pass_="bwd", impl="fastformer", flops=2 * M * N * K,
          turns_with={BASELINES[0]: lambda: replaced(dy, x, bias)})
