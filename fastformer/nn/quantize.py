"""``fastformer.quantize(model, "int8")``: a copy of a trained model whose projections run in int8 on the CPU,
the way CTranslate2's ``compute_type="int8"`` does.

- Weights, once, per output channel n: s_w[n] = max_k |W[n, k]| / 127 and Wq[n, k] = round(W[n, k] 127 /
  max_k |W[n, k]|) in [-127, 127] (a channel of zeros stays zeros). Every ``Linear`` of the encoder and the
  decoder, and the output projection (the shared embedding, transposed); the embedding lookup stays
  float32, as do the LayerNorms and the biases.
- Activations, per call and per row, in the kernel (csrc/cpu/int8_linear.cpp, which also states the
  arithmetic exactly); products in int32 with the CPU's dot-product instructions; attention, softmax, layer
  norm and the search in float32.
- Where the kernels apply (float32 on the CPU, grad disabled, no autocast: ``nn/linear.py``'s
  ``packed_applies``), a projection is ``fastformer._C.int8_linear`` and the decoder step runs its int8
  projections in C++; elsewhere it is ``F.linear`` on the dequantized weight Wq s_w (which the ``Linear``
  layers' ``weight`` holds, so the state dict is the dequantized model).

The copy is for inference: its parameters are frozen (requires_grad False); ``generate`` and
``beam_search`` take the same arguments as the float model's.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor

from fastformer._ext import C
from fastformer.nn.linear import Int8Weight, Linear

QUANTIZATIONS = ("int8",)


def quantize_weight(weight: Tensor) -> Int8Weight:
    """An (out, in) float32 weight as ``Int8Weight``: Wq per output channel, packed for the int8 kernel
    ((ceil(out / P), ceil(in / 4), P, 4), zeros past out and in), its scales and column sums, and the
    dequantized weight."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"quantize_weight: expected a 2-D float32 weight, got {weight.dtype} {tuple(weight.shape)}")
    w = weight.detach().cpu()
    out, inp = w.shape
    amax = w.abs().amax(dim=1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(w * inv[:, None]).clamp_(-127, 127)
    scale = amax / 127.0
    P = C.PACKED_LINEAR_PANEL
    padded = torch.zeros((out + P - 1) // P * P, (inp + 3) // 4 * 4, dtype=torch.int8)
    padded[:out, :inp] = q.to(torch.int8)
    panels = padded.view(-1, P, padded.shape[1] // 4, 4).transpose(1, 2).contiguous()
    return Int8Weight(panels, scale.contiguous(), q.sum(dim=1).to(torch.int32), q * scale[:, None])


def quantize(model, dtype: str = "int8"):
    """A quantized copy of ``model`` (a float32 ``fastformer.nn.Transformer`` on the CPU), in eval mode with
    frozen parameters; ``model`` is left as it is. ``dtype``: "int8" (the only one)."""
    from fastformer.nn.transformer import Transformer

    if dtype not in QUANTIZATIONS:
        raise ValueError(f"quantize: dtype must be one of {', '.join(QUANTIZATIONS)}, got {dtype!r}")
    if not isinstance(model, Transformer):
        raise ValueError(f"quantize: expected a fastformer.nn.Transformer, got {type(model).__name__}")
    if getattr(model, "quantization", None) is not None:
        raise ValueError(f"quantize: the model is already quantized ({model.quantization})")
    weight = model.embed.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise ValueError(f"quantize: int8 runs on the CPU in float32; the model is {weight.dtype} on "
                         f"{weight.device} (use model.float().cpu())")
    quantized = copy.deepcopy(model).eval()
    quantized.requires_grad_(False)
    with torch.no_grad():
        for module in quantized.modules():
            if isinstance(module, Linear):
                int8 = quantize_weight(module.weight)
                module.weight.copy_(int8.weight)
                module.int8 = int8._replace(weight=module.weight)
        quantized.output_int8 = quantize_weight(quantized.embed.weight)
    quantized.quantization = dtype
    return quantized
