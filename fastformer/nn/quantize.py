"""``fastformer.quantize(model, "int8")``: a copy of a trained model whose projections run in int8 on the CPU,
the way CTranslate2's ``compute_type="int8"`` does.

- Weights, once, per output channel: every ``Linear`` of the encoder and the decoder becomes an
  ``Int8Linear`` (fastformer/nn/linear.py), and the output projection (the shared embedding, transposed)
  becomes ``model.output_projection``, an ``Int8Linear`` (its bias: the output bias, if the config has one). Its rows are the embedding too: the
  lookup reads them dequantized (``C.int8_embedding``, in C++ the decoder step's ``int8_row``), and the
  float embedding is gone (``model.embed`` is None), as CTranslate2's int8 quantizes its embeddings. A model
  with separate vocabularies quantizes its source's table (``model.src_embed``) the same way, into an
  ``Int8Embedding`` whose lookup dequantizes the rows it reads. The LayerNorms and the biases stay float32.
  The rule (scale = max |W[n, :]| / 127, round half to even, clamp to [-127, 127]) and the packed layout
  are C++'s, in one place: csrc/gemm/gemm.h, ``C.quantize_int8``.
- Activations, per call and per row, in the kernel (csrc/gemm/int8_linear.cpp, which states the arithmetic
  exactly); products in int32 with the CPU's dot-product instructions; attention, softmax, layer norm and
  the search in float32.
- Where the kernels apply (float32 on the CPU, grad disabled, no autocast: ``nn/linear.py``'s
  ``packed_applies``), a projection is ``fastformer._C.int8_linear`` and the decoder step runs its int8
  projections in C++; elsewhere it is ``F.linear`` on the weight dequantized for the call.

The int8 weights are buffers of the state dict: a quantized model saves as int8 (about a quarter of the
float32 bytes: 25% for an opus-mt-sized model) and loads with ``prepare(Transformer(config), "int8").load_state_dict(state)``. The copy is
for inference: its parameters are frozen (requires_grad False); ``generate`` and ``beam_search`` take the same
arguments as the float model's.
"""
from __future__ import annotations

import copy

import torch

from fastformer.nn.linear import Int8Embedding, Int8Linear, Linear

QUANTIZATIONS = ("int8",)


def _check(model, dtype: str) -> None:
    from fastformer.nn.transformer import Transformer

    if dtype not in QUANTIZATIONS:
        raise ValueError(f"quantize: dtype must be one of {', '.join(QUANTIZATIONS)}, got {dtype!r}")
    if not isinstance(model, Transformer):
        raise ValueError(f"quantize: expected a fastformer.nn.Transformer, got {type(model).__name__}")
    if model.quantization is not None:
        raise ValueError(f"quantize: the model is already quantized ({model.quantization})")


def _replace_linears(model, make) -> None:
    """Every ``Linear`` of ``model`` replaced by ``make(linear)``, in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Linear):
                setattr(module, child_name, make(child))


def prepare(model, dtype: str = "int8"):
    """``model`` (a ``fastformer.nn.Transformer``) with empty int8 projections in place, ready for the
    ``load_state_dict`` of a quantized model's state; returned in eval mode with frozen parameters."""
    _check(model, dtype)
    _replace_linears(model, lambda m: Int8Linear(m.in_features, m.out_features, m.bias is not None))
    model.output_projection = Int8Linear(model.config.d_model, model.config.vocab_size, bias=model.config.output_bias)
    model.embed = model.output_bias = None  # the lookup reads the output projection's int8 rows
    if model.src_embed is not None:
        model.src_embed = Int8Embedding(model.config.src_vocab_size, model.config.d_model)
    model.requires_grad_(False)
    return model.eval()


def quantize(model, dtype: str = "int8"):
    """A quantized copy of ``model`` (a float32 ``fastformer.nn.Transformer`` on the CPU), in eval mode with
    frozen parameters; ``model`` is left as it is. ``dtype``: "int8" (the only one)."""
    _check(model, dtype)
    weight = model.embed.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise ValueError(f"quantize: int8 runs on the CPU in float32; the model is {weight.dtype} on "
                         f"{weight.device} (use model.float().cpu())")
    quantized = copy.deepcopy(model)
    with torch.no_grad():
        _replace_linears(quantized, lambda m: Int8Linear.quantize(m.weight, m.bias))
        quantized.output_projection = Int8Linear.quantize(quantized.embed.weight, quantized.output_bias)
        if quantized.src_embed is not None:
            quantized.src_embed = Int8Embedding.quantize(quantized.src_embed.weight)
    quantized.embed = quantized.output_bias = None  # the lookup reads the output projection's int8 rows
    quantized.requires_grad_(False)
    return quantized.eval()
