"""ops.layer_norm_residual over the peers' test matrices (tests/matrix.py says how they are run and judged).

PyTorch eager is F.layer_norm(residual + x) in the dtype (residual + x rounded to the dtype, as the fused
op's returned pre-norm sum is). Row counts are cut so the matrix fits a 2-core CI run; widths, leading
shapes, eps and dtypes are the peers' own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from fastformer import ops
from helpers import forward_backward, randn, upcast
from matrix import check, matrix_params, on_cpu, on_device


@dataclass(frozen=True)
class Case:
    family: str
    shape: tuple  # x and residual (..., N)
    eps: float = 1e-5
    prenorm: bool = False
    shift: float = 0.0  # added to the residual: a large common offset tests the variance's cancellation
    layout: str = "contiguous"  # "strided": x and residual are every third/fifth/third element of a bigger tensor
    dtypes: tuple | None = None

    @property
    def work(self):
        return math.prod(self.shape)

    def __str__(self):
        s = f"{self.family}-" + "x".join(map(str, self.shape)) + f"-eps{self.eps}"
        s += ("-prenorm" if self.prenorm else "") + (f"-shift{self.shift}" if self.shift else "")
        return s + ("-strided" if self.layout == "strided" else "")


CASES = [
    # NVIDIA/apex tests/L0/run_fused_layer_norm/test_fused_layer_norm.py (at 6424da3b): normalized_shape
    # (32, 16) (the op normalizes the last dim: taken as 512) at batch 16, contiguous or not (its
    # non-contiguous input is randn(3B, 32 * 5, 16 * 3)[::3, ::5, ::3]).
    Case("apex", (16, 512)),
    Case("apex", (16, 32, 16)),
    Case("apex", (16, 32, 16), layout="strided"),
    Case("apex", (16, 512), prenorm=True),
    # Dao-AILab/flash-attention tests/ops/test_dropout_layer_norm.py: hidden [192, 256, 384, 768, 1024, 1280,
    # 1536, 1600, 2048, 2560, 3000, 3072, 4096, 5120, 6144] with a residual, prenorm too (8 x 512 rows there).
    *[Case("flash_dropout_layer_norm", (8, n), prenorm=n % 3 == 0)
      for n in (192, 256, 384, 768, 1024, 1280, 1536, 1600, 2048, 2560, 3000, 3072, 4096, 5120, 6144)],
    Case("flash_dropout_layer_norm", (4, 192), prenorm=True),
    # linkedin/Liger-Kernel test/transformers/test_layer_norm.py: (B, T, H) in [(2, 8, 64), (4, 16, 128),
    # (1, 1, 1023), (3, 7, 256), (1, 1, 1500)], eps 1e-6.
    *[Case("liger", shape, eps=1e-6) for shape in ((2, 8, 64), (4, 16, 128), (1, 1, 1023), (3, 7, 256), (1, 1, 1500))],
    # Triton python/tutorials/05-layer-norm.py (at 54569929): test_layer_norm(1151, 8192, float16), eps 1e-5.
    Case("triton_tutorial", (1151, 8192)),
    Case("triton_tutorial", (7, 8192)),
    # PyTorch common_methods_invocations.py::sample_inputs_layer_norm: (1,) over (1,), (1, 2) over (2,), a
    # zero batch (0, 1), eps 0.5 (its (1, 2, 3) case; its eps -0.5 is refused here: eps must be >= 0).
    Case("opinfo", (1,)),
    Case("opinfo", (1, 2)),
    Case("opinfo", (2, 2, 3), eps=0.5),
    Case("opinfo", (0, 1)),
    # Adversarial (ours, not a peer's): 1-D inputs (the torch backend's backward once reduced every dim), rows of
    # length 1 (variance 0), large eps, a common offset 1000x the spread.
    *[Case("one_dim", (n,), prenorm=p) for n in (6, 97, 1000) for p in (False, True)],
    *[Case("length_one", shape) for shape in ((1, 1), (7, 1), (3, 2, 1))],
    Case("eps", (16, 97), eps=0.5),
    Case("offset", (16, 1000), shift=1000.0, dtypes=(torch.float64, torch.float32)),
    Case("offset", (4, 97), shift=30.0),
]


def eager_lnr(x, residual, weight, bias, case):
    s = residual + x
    y = F.layer_norm(s, (case.shape[-1],), weight, bias, case.eps)
    return (y, s) if case.prenorm else y


@pytest.mark.parametrize("backend,dtype,case", matrix_params("layer_norm_residual", CASES))
def test_layer_norm_residual_matrix(backend, dtype, case):
    N = case.shape[-1]
    x, residual = randn(*case.shape, dtype=dtype), randn(*case.shape, dtype=dtype, shift=case.shift)
    if case.layout == "strided":  # apex's views: randn(3 B, 5 T, 3 N)[::3, ::5, ::3]
        B, T, _ = case.shape
        x, residual = (randn(3 * B, 5 * T, 3 * N, dtype=dtype, shift=sh)[::3, ::5, ::3] for sh in (0.0, case.shift))
    inputs = [x, residual, randn(N, dtype=dtype, shift=1.0), randn(N, dtype=dtype)]
    upstream = [randn(*case.shape, dtype=dtype) for _ in range(2 if case.prenorm else 1)]

    def run(b):
        return lambda x, r, w, bias: ops.layer_norm_residual(x, r, w, bias, eps=case.eps, prenorm=case.prenorm,
                                                             backend=b)

    outs, grads = (on_cpu(t) for t in forward_backward(run(backend), on_device(inputs), on_device(upstream)))
    ref_outs, ref_grads = forward_backward(run("torch"), upcast(inputs), upcast(upstream))
    eager_outs, eager_grads = forward_backward(lambda *t: eager_lnr(*t, case), inputs, upstream)
    # The condition of (s - mean) rstd at s, rstd = 1 / sqrt(var + eps): s is known to |s| ulp, the
    # normalized value to |s| rstd ulp (a common offset 1000x the spread costs 1000 ulps whatever the order
    # of the arithmetic; a row of one element, var 0, costs 1 / sqrt(eps)).
    s = ref_outs[-1] if case.prenorm else inputs[0].double() + inputs[1].double()
    rstd = torch.rsqrt(s.var(-1, unbiased=False) + case.eps) if s.numel() else s.new_zeros(())
    condition = float((s.abs().amax(-1) * rstd).max()) if s.numel() else 1.0
    for name, a, e, r in zip(("y", "s"), outs, eager_outs, ref_outs):
        check("layer_norm_residual", backend, dtype, name, a, e, r, condition)
    for name, a, e, r in zip(("dx", "dresidual", "dweight", "dbias"), grads, eager_grads, ref_grads):
        check("layer_norm_residual", backend, dtype, name, a, e, r, condition)
