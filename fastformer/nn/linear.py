"""The model's projections: ``Linear`` (an ``nn.Linear``) and ``linear(x, weight, bias)``, which at inference
on the CPU in float32 run fastformer's own GEMM on the weight packed once into column panels.

``fastformer._C.packed_linear`` (csrc/gemm/packed_linear.cpp, built per CPU level) streams W^T as
(ceil(out / P), P / S, in, S) panels (P = PACKED_LINEAR_PANEL columns a panel, in strips of S =
PACKED_LINEAR_STRIP contiguous columns), with ``at::vec`` fused multiply-adds (the decoding benchmark,
benchmarks/test_decoding.py, times the decoder built on it beside one on torch's GEMM; no generated table
times the two GEMMs alone). It is used where no gradient can be wanted: grad disabled (``torch.no_grad``,
``inference_mode``: translation, evaluation), not under autocast, not while ``torch.compile`` traces, x
float32 on the CPU. Everywhere else, training included, ``F.linear``.

The panels are one more copy of the weight, made at the first such call and kept (keyed on the weight
tensor, weakly) until the weight changes in place (its version counter moves: an optimizer step) or is
replaced; they are not part of the state dict.

A model quantized by ``fastformer.quantize(model, "int8")`` (fastformer/nn/quantize.py) has ``Int8Linear``
projections in place of ``Linear``: the int8 weight (in the kernel's packed layout) and its scales are buffers
of the state dict, no float copy is kept; the same rule picks ``fastformer._C.int8_linear``
(csrc/gemm/int8_linear.cpp: int8 weights, activations quantized per row), and elsewhere ``F.linear`` on the
weight dequantized for that call. The packed layouts and the quantization rule are C++'s
(csrc/gemm/gemm.h): ``C.pack_linear``, ``C.quantize_int8``, ``C.dequantize_int8``.
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
    """A weight (out, in) quantized to int8 per output channel, as ``C.quantize_int8`` returns it (the views of an
    ``Int8Linear``'s buffers)."""
    panels: Tensor  # int8 (ceil(out / P), ceil(in / 4), P, 4): Wq in the kernel's layout (csrc/gemm/gemm.h)
    scale: Tensor   # float32 (out,): s_w, W ~ Wq s_w
    colsum: Tensor  # int32 (out,): sum_k Wq[n, k]


def pack_panels(weight: Tensor) -> Tensor:
    """An (out, in) float32 weight as the column panels of W^T that ``fastformer._C.packed_linear`` streams
    (``C.pack_linear``: the layout of csrc/gemm/gemm.h)."""
    return C.pack_linear(weight)


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


def linear(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor] = None,
           int8: Optional[Int8Weight] = None) -> Tensor:
    """x (..., in) W^T + b: ``F.linear``, or the packed kernel where ``packed_applies(x)``; with ``int8`` (a
    quantized model's projection; ``weight`` is then None), the int8 kernel where ``packed_applies(x)``, else
    ``F.linear`` on the weight dequantized for this call."""
    if int8 is not None:
        out = int8.scale.shape[0]
        if packed_applies(x):
            y = C.int8_linear(x.reshape(-1, x.shape[-1]), int8.panels, int8.scale, int8.colsum,
                              None if bias is None else bias.detach(), out)
            return y.view(*x.shape[:-1], out)
        dequantized = C.dequantize_int8(int8.panels, int8.scale, out, x.shape[-1])
        return F.linear(x, dequantized.to(x.dtype), None if bias is None else bias.to(x.dtype))
    if packed_applies(x):
        panels = packed_panels(weight)
        if panels is not None:
            out = weight.shape[0]
            y = C.packed_linear(x.reshape(-1, x.shape[-1]), panels, None if bias is None else bias.detach(), out)
            return y.view(*x.shape[:-1], out)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose inference runs ``linear`` above."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """A projection of a quantized model: y = x W^T + b with W (out, in) held as int8 per output channel.
    Its state dict: ``weight`` int8 in the kernel's packed layout (ceil(out / P), ceil(in / 4), P, 4),
    ``weight_scale`` float32 (out,), ``weight_colsum`` int32 (out,) and ``bias`` float32 (out,) or none; all
    buffers (nothing to train), about a quarter of the float32 bytes. ``Int8Linear(in, out, bias)`` makes an
    empty one for ``load_state_dict``; ``Int8Linear.quantize(weight, bias)`` quantizes a float32 weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # zeros in the layout C++ owns (csrc/gemm/gemm.h), not written again here
        panels, scale, colsum = C.quantize_int8(torch.zeros(out_features, in_features))
        self.register_buffer("weight", panels)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_colsum", colsum)
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def quantize(cls, weight: Tensor, bias: Optional[Tensor] = None) -> "Int8Linear":
        """The int8 form of a float32 (out, in) weight and its bias (``C.quantize_int8``: csrc/gemm/gemm.h)."""
        out, inp = weight.shape
        module = cls(inp, out, bias is not None)
        module.weight, module.weight_scale, module.weight_colsum = C.quantize_int8(weight.detach().float().cpu())
        if bias is not None:
            module.bias = bias.detach().float().cpu().clone()
        return module

    def int8(self) -> Int8Weight:
        return Int8Weight(self.weight, self.weight_scale, self.weight_colsum)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, None, self.bias, self.int8())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


class Int8Embedding(nn.Module):
    """A quantized model's source embedding (``Transformer.src_embed`` of a model with separate vocabularies):
    the (num, dim) table in int8, per row, by the projections' rule and in their packed layout (``C.quantize_int8``:
    csrc/gemm/gemm.h), as the target's rows are the int8 output projection's. A lookup dequantizes the rows
    it reads (``C.int8_embedding``). Its state dict: ``weight`` int8 (packed) and ``weight_scale`` float32
    (num,); no float copy. ``Int8Embedding(num, dim)`` makes an empty one for ``load_state_dict``;
    ``Int8Embedding.quantize(weight)`` quantizes a float32 table."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        panels, scale, _ = C.quantize_int8(torch.zeros(num_embeddings, embedding_dim))
        self.register_buffer("weight", panels)
        self.register_buffer("weight_scale", scale)

    @classmethod
    def quantize(cls, weight: Tensor) -> "Int8Embedding":
        num, dim = weight.shape
        module = cls(num, dim)
        module.weight, module.weight_scale, _ = C.quantize_int8(weight.detach().float().cpu())
        return module

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (any shape, int64 in [0, num)) -> (*tokens.shape, dim) float32."""
        return C.int8_embedding(tokens, self.weight, self.weight_scale, self.num_embeddings, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"
