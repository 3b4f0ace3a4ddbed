"""``fastformer.quantize(model, "int8")``: a copy of a trained model whose projections run in int8 on the CPU,
the way CTranslate2's ``compute_type="int8"`` does.

- Weights, once, per output channel: the quantized model is the same ``Transformer`` with int8 modules in
  place of the float ones, module by module (``to_int8``, the one swap that ``quantize``, ``prepare`` and
  checkpoint loading share): every ``Linear`` becomes an ``Int8Linear`` and every ``Embedding`` an
  ``Int8Embedding`` (fastformer/nn/linear.py). The target's table is also the output projection
  (``Transformer.project``: ``embed.project(h, output_bias)``), so its int8 form serves both: the lookup
  dequantizes the rows it reads (``C.int8_embedding``, in C++ the decoder step's ``int8_row``), the projection
  runs the int8 kernel; no float copy is kept, as CTranslate2's int8 quantizes its embeddings. A model with
  separate vocabularies quantizes its source's table (``model.src_embed``) the same way. The LayerNorms, the
  biases and the output bias stay float32. The rule (scale = max |W[n, :]| / 127, round half to even, clamp
  to [-127, 127]; a channel with a NaN or an infinity: zeros and a NaN scale) and the packed layout are C++'s,
  in one place: csrc/gemm/gemm.h, ``C.quantize_int8``.
- Activations, per call and per row, in the kernel, by the same rule (csrc/gemm/int8_linear.cpp, which states
  the arithmetic exactly); products in int32 with the CPU's dot-product instructions; attention, softmax,
  layer norm and the search in float32.
- The int8 products are fastformer's own kernels, or oneDNN's (through torch) on a CPU with AMX for products
  of at least 32 rows and 2^22 multiply-adds: the same int32 sums either way, so the same outputs
  (csrc/gemm/int8_onednn.h; ``fastformer.int8_providers()`` says which runs here, ``FASTFORMER_INT8_PROVIDER``
  forces one). Where oneDNN's may run, each int8 module packs its weight for it at quantization and at
  ``load_state_dict`` and holds the packing (``C.int8_prepare``: a second copy of the int8 weights, freed with
  the module; fastformer/nn/linear.py ``Int8Module``); ``pack_for_providers`` packs a whole model again.
- Where the kernels apply (float32 on the CPU, grad disabled, no autocast: ``nn/linear.py``'s
  ``packed_applies``), a projection is ``fastformer._C.int8_linear`` and the decoder step runs its int8
  projections in C++; elsewhere it is ``F.linear`` on the weight dequantized for the call.

The int8 weights are buffers of the state dict, under the float model's names plus ``weight_scale`` and
``weight_colsum``: a quantized model saves as int8 (about a quarter of the float32 bytes: 25% for an
opus-mt-sized model) and loads with ``prepare(Transformer(config), "int8").load_state_dict(state)`` (the int8
checkpoints of 9aea6a7's code too: ``Transformer`` renames their ``output_projection.*`` on load). The copy
is for inference: its parameters are frozen (requires_grad False); ``generate`` and ``beam_search`` take the
same arguments as the float model's.
"""
from __future__ import annotations

import copy

import torch

from fastformer.nn.linear import Int8Module

QUANTIZATIONS = ("int8",)


def _check(model, dtype: str) -> None:
    from fastformer.nn.transformer import Transformer

    if dtype not in QUANTIZATIONS:
        raise ValueError(f"quantize: dtype must be one of {', '.join(QUANTIZATIONS)}, got {dtype!r}")
    if not isinstance(model, Transformer):
        raise ValueError(f"quantize: expected a fastformer.nn.Transformer, got {type(model).__name__}")
    if model.quantization is not None:
        raise ValueError(f"quantize: the model is already quantized ({model.quantization})")


def to_int8(model, quantize_weights: bool):
    """``model`` with every projection module that has an int8 form (``to_int8``: ``Linear`` -> ``Int8Linear``,
    ``Embedding`` -> ``Int8Embedding``) replaced by it, in place: each holding its float module's weight quantized
    (``quantize_weights``), or empty, for the ``load_state_dict`` of a quantized model's state; returned in eval
    mode with frozen parameters."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            convert = getattr(child, "to_int8", None)
            if convert is not None:
                setattr(module, name, convert(quantize_weights))
    model.requires_grad_(False)
    return model.eval()


def prepare(model, dtype: str = "int8"):
    """``model`` (a ``fastformer.nn.Transformer``) with empty int8 modules in place (``to_int8``), ready for
    the ``load_state_dict`` of a quantized model's state; returned in eval mode with frozen parameters."""
    _check(model, dtype)
    return to_int8(model, quantize_weights=False)


def quantize(model, dtype: str = "int8"):
    """A quantized copy of ``model`` (a float32 ``fastformer.nn.Transformer`` on the CPU), in eval mode with
    frozen parameters; ``model`` is left as it is. ``dtype``: "int8" (the only one)."""
    _check(model, dtype)
    weight = model.embed.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise ValueError(f"quantize: int8 runs on the CPU in float32; the model is {weight.dtype} on "
                         f"{weight.device} (use model.float().cpu())")
    with torch.no_grad():
        return to_int8(copy.deepcopy(model), quantize_weights=True)  # each int8 module packed as it is made


def pack_for_providers(model):
    """``model``, each int8 module's weight packed for oneDNN's products again (``Int8Module.pack``): where this
    CPU's rule can choose them (AMX) or ``FASTFORMER_INT8_PROVIDER`` forces them now, else its packing dropped.
    Quantization and ``load_state_dict`` pack already; this is for weights changed in place some other way, or a
    provider forced after them (without it, a projection that runs oneDNN's products unpacked packs per call)."""
    for module in model.modules():
        if isinstance(module, Int8Module):
            module.pack()
    return model
