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
from helpers import ALL_BACKENDS, forward_backward, randn, upcast
from matrix import check, matrix_params


@dataclass(frozen=True)
class Case:
    family: str
    shape: tuple  # x and residual (..., N)
    eps: float = 1e-5
    prenorm: bool = False
    shift: float = 0.0  # added to the residual: a large common offset tests the variance's cancellation
    dtypes: tuple | None = None

    @property
    def work(self):
        return math.prod(self.shape)

    def __str__(self):
        s = f"{self.family}-" + "x".join(map(str, self.shape)) + f"-eps{self.eps}"
        return s + ("-prenorm" if self.prenorm else "") + (f"-shift{self.shift}" if self.shift else "")


CASES = [
    # apex, tests/L0/run_fused_layer_norm/test_fused_layer_norm.py: batch 16 and the normalized widths of
    # its cases (the op normalizes the last dim; apex's 2-D normalized shapes (32, 16) are taken as 512).
    *[Case("apex", (16, n)) for n in (32, 512, 1024, 65536 // 16)],
    Case("apex", (16, 512), prenorm=True),
    # Liger-Kernel, test/transformers/test_layer_norm.py: (batch, seq, hidden) cases.
    *[Case("liger", shape) for shape in ((2, 8, 64), (4, 16, 128), (1, 1, 1023), (3, 7, 256), (2, 2, 4096))],
    # Triton, python/tutorials/05-layer-norm.py: test_layer_norm(1151, 8192, float16), eps 1e-5.
    Case("triton_tutorial", (1151, 8192)),
    Case("triton_tutorial", (7, 8192)),
    # PyTorch, torch/testing/_internal/common_methods_invocations.py::sample_inputs_layer_norm: (S, S, S)
    # over (S,), 1-D (S,) and (1,), with eps 1e-5 and 0.1 (S = 5).
    Case("opinfo", (5, 5, 5)),
    Case("opinfo", (5,)),
    Case("opinfo", (1,), eps=0.1),
    Case("opinfo", (2, 2, 1)),
    # Adversarial (issue 18): 1-D inputs (the torch backend's backward once reduced every dim), rows of
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


@pytest.mark.parametrize("backend,dtype,case", matrix_params("layer_norm_residual", ALL_BACKENDS, CASES))
def test_layer_norm_residual_matrix(backend, dtype, case):
    N = case.shape[-1]
    inputs = [randn(*case.shape, dtype=dtype), randn(*case.shape, dtype=dtype, shift=case.shift),
              randn(N, dtype=dtype, shift=1.0), randn(N, dtype=dtype)]
    upstream = [randn(*case.shape, dtype=dtype) for _ in range(2 if case.prenorm else 1)]

    def run(b):
        return lambda x, r, w, bias: ops.layer_norm_residual(x, r, w, bias, eps=case.eps, prenorm=case.prenorm,
                                                             backend=b)

    outs, grads = forward_backward(run(backend), inputs, upstream)
    ref_outs, ref_grads = forward_backward(run("torch"), upcast(inputs), upcast(upstream))
    eager_outs, eager_grads = forward_backward(lambda *t: eager_lnr(*t, case), inputs, upstream)
    # The condition of (s - mean) / std at s: s is known to |s| ulp, the normalized value to |s| / std ulp
    # (a common offset 1000x the spread costs 1000 ulps whatever the order of the arithmetic).
    s = ref_outs[-1] if case.prenorm else inputs[0].double() + inputs[1].double()
    condition = float((s.abs().amax(-1) / s.std(-1, unbiased=False).clamp_min(1e-300)).max()) if N > 1 else 1.0
    for name, a, e, r in zip(("y", "s"), outs, eager_outs, ref_outs):
        check("layer_norm_residual", backend, dtype, name, a, e, r, condition)
    for name, a, e, r in zip(("dx", "dresidual", "dweight", "dbias"), grads, eager_grads, ref_grads):
        check("layer_norm_residual", backend, dtype, name, a, e, r, condition)
