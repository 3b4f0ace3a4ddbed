"""The model's projections: ``Linear`` (an ``nn.Linear``) and ``linear(x, weight, bias)``, which at inference
on the CPU in float32 run fastformer's own GEMM on the weight packed once into column panels.

``fastformer._C.packed_linear`` (csrc/cpu/packed_linear.cpp, built per CPU level) streams W^T as
(ceil(out / P), in, P) panels, P = PACKED_LINEAR_PANEL, with ``at::vec`` fused multiply-adds (the decoding
benchmark, benchmarks/test_decoding.py, times the decoder built on it beside one on torch's GEMM; no
generated table times the two GEMMs alone). It is used where no gradient can be wanted: grad disabled (``torch.no_grad``,
``inference_mode``: translation, evaluation), not under autocast, not while ``torch.compile`` traces, x
float32 on the CPU. Everywhere else, training included, ``F.linear``.

The panels are one more copy of the weight, made at the first such call and kept (keyed on the weight
tensor, weakly) until the weight changes in place (its version counter moves: an optimizer step) or is
replaced; they are not part of the state dict.

A model quantized by ``fastformer.quantize(model, "int8")`` (fastformer/nn/quantize.py) gives each
projection an ``Int8Weight``: there the same rule picks ``fastformer._C.int8_linear`` (csrc/cpu/int8_linear.cpp:
int8 weights, activations quantized per row), and ``F.linear`` on the dequantized weight elsewhere.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from fastformer._ext import C

_PANELS = WeakIdKeyDictionary()  # weight -> (its (data_ptr, version, shape) when packed, panels)


class Int8Weight(NamedTuple):
    """A weight (out, in) quantized to int8 per output channel (fastformer/nn/quantize.py)."""
    panels: Tensor  # int8 (ceil(out / P), ceil(in / 4), P, 4): Wq in the kernel's layout (csrc/cpu/int8_linear.cpp)
    scale: Tensor   # float32 (out,): s_w, W ~ Wq s_w
    colsum: Tensor  # int32 (out,): sum_k Wq[n, k]
    weight: Tensor  # float32 (out, in): Wq s_w, the dequantized weight (for F.linear where the kernel does not apply)


def pack_panels(weight: Tensor) -> Tensor:
    """An (out, in) weight as the column panels of W^T that ``fastformer._C.packed_linear`` streams:
    (ceil(out / P), in, P) contiguous, P = PACKED_LINEAR_PANEL, zeros past ``out``."""
    P = C.PACKED_LINEAR_PANEL
    out, inp = weight.shape
    padded = weight.new_zeros((out + P - 1) // P * P, inp)
    padded[:out] = weight
    return padded.view(-1, P, inp).transpose(1, 2).contiguous()


def packed_panels(weight: Tensor) -> Optional[Tensor]:
    """``pack_panels(weight)``, cached until the weight changes; None unless it is a 2-D float32 CPU tensor."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    key = (weight.data_ptr(), weight._version, tuple(weight.shape))
    cached = _PANELS.get(weight)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        panels = pack_panels(weight.detach())
    _PANELS[weight] = (key, panels)
    return panels


def packed_applies(x: Tensor) -> bool:
    """Whether a projection of x may take the packed kernel: float32 on the CPU, grad disabled, no
    autocast, not traced by torch.compile."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling())


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, int8: Optional[Int8Weight] = None) -> Tensor:
    """x (..., in) W^T + b: ``F.linear``, or the packed kernel where ``packed_applies(x)``; with ``int8`` (a
    quantized model's projection), the int8 kernel where ``packed_applies(x)``, else ``F.linear`` on its
    dequantized weight."""
    if int8 is not None:
        if packed_applies(x):
            out = int8.scale.shape[0]
            y = C.int8_linear(x.reshape(-1, x.shape[-1]), int8.panels, int8.scale, int8.colsum,
                              None if bias is None else bias.detach(), out)
            return y.view(*x.shape[:-1], out)
        return F.linear(x, int8.weight, bias)
    if packed_applies(x):
        panels = packed_panels(weight)
        if panels is not None:
            out = weight.shape[0]
            y = C.packed_linear(x.reshape(-1, x.shape[-1]), panels, None if bias is None else bias.detach(), out)
            return y.view(*x.shape[:-1], out)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose inference runs ``linear`` above; ``int8`` is set
    in a quantized model (its weight then holds the dequantized values)."""

    int8: Optional[Int8Weight] = None

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.int8)
