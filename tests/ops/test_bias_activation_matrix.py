"""ops.bias_activation over a test matrix (tests/matrix.py says how it is run and judged).

The op replaces the feed-forward's `fc1` bias, activation and dropout: its cases are the FFN widths of the
models fastformer trains and converts (d_ff 1024 of TransformerConfig.small, 2048 of base and opus-mt, 4096
of big) at a few token counts, PyTorch's OpInfo sample shapes of the unary elementwise ops (S = 5, M = 10),
and adversarial widths and magnitudes of our own. Judged against PyTorch eager in the same dtype:
act(x + bias.to(dtype)) with torch's relu, gelu (exact) and silu, the code the op replaces.
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

EAGER = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu}


@dataclass(frozen=True)
class Case:
    family: str
    shape: tuple
    activation: str
    magnitude: float = 1.0
    dtypes: tuple | None = None

    @property
    def work(self):
        return math.prod(self.shape)

    def __str__(self):
        s = f"{self.family}-" + "x".join(map(str, self.shape)) + f"-{self.activation}"
        return s + (f"-mag{self.magnitude}" if self.magnitude != 1.0 else "")


CASES = [
    # fastformer's FFNs: TransformerConfig.small (d_ff 1024), base and opus-mt (2048), big (4096); token counts
    # of a decoding step (1), a short batch (37) and a training batch's slice (256).
    *[Case("ffn", (tokens, d_ff), act) for d_ff in (1024, 2048, 4096) for tokens in (1, 37) for act in EAGER],
    *[Case("ffn", (2, 128, 1024), act) for act in EAGER],
    Case("ffn_small", (4, 64), "relu"),
    Case("ffn_small", (2, 3, 32), "gelu"),
    Case("ffn_small", (8, 16), "silu"),
    # PyTorch's sample_inputs_elementwise_unary shapes: (S,), (S, S), (S, M, S) with S = 5, M = 10.
    *[Case("opinfo", shape, act) for shape in ((5,), (5, 5), (5, 10, 5)) for act in EAGER],
    # Adversarial (ours): odd widths (no vector or Philox-group alignment), large and tiny magnitudes.
    *[Case("odd", (rows, n), act) for rows, n in ((3, 1), (7, 97), (5, 113), (13, 1031)) for act in EAGER],
    *[Case("magnitude", (4, 64), act, m) for act in EAGER for m in (1e-3, 30.0)],
]


@pytest.mark.parametrize("backend,dtype,case", matrix_params("bias_activation", CASES))
def test_bias_activation_matrix(backend, dtype, case):
    x = randn(*case.shape, dtype=dtype, scale=case.magnitude)
    bias = randn(case.shape[-1], dtype=torch.float32, scale=case.magnitude)  # the float32 master bias
    dy = randn(*case.shape, dtype=dtype)

    def run(b):
        return lambda x, bias: ops.bias_activation(x, bias, activation=case.activation, backend=b)

    (y,), (dx, _) = (on_cpu(t) for t in forward_backward(run(backend), on_device([x, bias]), on_device([dy])))
    (ref,), (ref_dx, _) = forward_backward(run("torch"), upcast([x, bias]), upcast([dy]))
    eager_fn = lambda x, bias: EAGER[case.activation](x + bias.to(x.dtype))  # noqa: E731
    (eager,), (eager_dx, _) = forward_backward(eager_fn, [x, bias], [dy])
    check("bias_activation", backend, dtype, "y", y, eager, ref)
    check("bias_activation", backend, dtype, "dx", dx, eager_dx, ref_dx)
