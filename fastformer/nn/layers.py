"""Encoder and decoder stacks of the Transformer on fastformer's ops.

Each layer is a list of sublayers (self-attention, [cross-attention,] feed-forward), each with its
LayerNorm. Residual connection, residual dropout and LayerNorm are one fused op:

  post-norm (the paper, default):  x = LayerNorm(x + dropout(sublayer(x)))
      -> x = ops.layer_norm_residual(sublayer(x), x, norm, dropout_p)
  pre-norm (norm_first=True):      x = x + dropout(sublayer(LayerNorm(x))), final LayerNorm at the end
      -> the add and the *next* sublayer's LayerNorm are fused:
         h, x = ops.layer_norm_residual(sublayer(h), x, next_norm, dropout_p, prenorm=True)
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch.nn.functional as F
from torch import Tensor, nn

from fastformer import ops
from fastformer.nn.attention import MultiHeadAttention
from fastformer.nn.config import TransformerConfig
from fastformer.nn.linear import Int8Weight, Linear


# ----------------------------------------------------------------------------------------------------
# The decoder layer, described once. Its weights by name (as under ``decoder.layers.<i>.`` in the state
# dict), kind and shape (d = d_model, f = d_ff), in the order the layer uses them; the sublayers run in
# the order self-attention, cross-attention, feed-forward, each with its LayerNorm placed by
# ``config.norm_first`` (run_sublayers below), the feed-forward's activation is ``ACTIVATION``. Every
# consumer binds the weights by these names and checks their shapes: the model (DecoderLayer), the Python
# decoder step and the C++ one (fastformer/nn/decoding.py, csrc/decoder.cpp), the CTranslate2 exporter
# (fastformer/export.py); the tests' plain-PyTorch reference and the benchmarks' plain decoder read the
# same state-dict names.


class LayerWeight(NamedTuple):
    name: str  # module path within the layer
    kind: str  # "linear": weight (out, in) and bias (out,); "norm": LayerNorm weight and bias (d,)
    shape: tuple[str, ...]  # linear (out, in), norm (d,), in units "d", "2d", "3d", "f"


DECODER_LAYER: tuple[LayerWeight, ...] = (
    LayerWeight("self_attn_norm", "norm", ("d",)),
    LayerWeight("self_attn.qkv_proj", "linear", ("3d", "d")),  # x -> q | k | v, each (H, Dh)
    LayerWeight("self_attn.out_proj", "linear", ("d", "d")),
    LayerWeight("cross_attn_norm", "norm", ("d",)),
    LayerWeight("cross_attn.q_proj", "linear", ("d", "d")),
    LayerWeight("cross_attn.kv_proj", "linear", ("2d", "d")),  # encoder memory -> k | v, once per sentence
    LayerWeight("cross_attn.out_proj", "linear", ("d", "d")),
    LayerWeight("ffn_norm", "norm", ("d",)),
    LayerWeight("ffn.fc1", "linear", ("f", "d")),
    LayerWeight("ffn.fc2", "linear", ("d", "f")),
)
ACTIVATION = "relu"  # of the feed-forward, between fc1 and fc2


def activation(x: Tensor, inplace: bool = False) -> Tensor:
    """The feed-forward's ``ACTIVATION`` (the C++ decoder step is told its name and refuses another)."""
    return F.relu(x, inplace=inplace)


class BoundWeight(NamedTuple):
    """One weight of ``DECODER_LAYER`` as bound: ``linear(x, *bound)`` applies a linear one."""
    weight: Tensor
    bias: Tensor
    int8: Optional[Int8Weight]  # a linear layer's int8 form in a quantized model, else None


def decoder_layer_weights(layer: nn.Module, config: TransformerConfig) -> dict[str, BoundWeight]:
    """name -> (weight, bias, int8) of ``DECODER_LAYER``, looked up by name in ``layer``, each checked against
    its described shape: a renamed or reshaped weight fails here, not as wrong numbers. The parameters
    themselves (not detached copies): the packed panels of fastformer/nn/linear.py are cached per parameter."""
    units = {"d": config.d_model, "2d": 2 * config.d_model, "3d": 3 * config.d_model, "f": config.d_ff}
    out = {}
    for w in DECODER_LAYER:
        module = layer.get_submodule(w.name)
        weight, bias = module.weight, module.bias
        shape = tuple(units[u] for u in w.shape)
        if tuple(weight.shape) != shape or bias is None or tuple(bias.shape) != shape[:1]:
            raise ValueError(f"decoder layer weight {w.name} ({w.kind}) must be {shape} with a bias of "
                             f"{shape[:1]}, got {tuple(weight.shape)} and "
                             f"{None if bias is None else tuple(bias.shape)}")
        out[w.name] = BoundWeight(weight, bias, getattr(module, "int8", None))
    return out


class FeedForward(nn.Module):
    """Linear(d, d_ff) -> activation (ReLU) -> dropout -> Linear(d_ff, d)."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float = 0.0):
        super().__init__()
        self.fc1, self.fc2 = Linear(d_model, d_ff), Linear(d_ff, d_model)
        self.activation_dropout = activation_dropout
        for m in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        h = activation(self.fc1(x))
        if self.activation_dropout > 0:
            h = F.dropout(h, self.activation_dropout, self.training)
        return self.fc2(h)


Sublayer = tuple[nn.LayerNorm, Callable[[Tensor], Tensor]]


def run_sublayers(x: Tensor, sublayers: list[Sublayer], final_norm: Optional[nn.LayerNorm], norm_first: bool,
                  dropout_p: float, backend: Optional[str]) -> Tensor:
    """Runs sublayers with fused residual + dropout + LayerNorm (see the module docstring)."""
    # Under autocast the sublayers return half-precision tensors while the residual stream and the
    # LayerNorm parameters stay in float32: the fused op runs in the residual stream's dtype.
    def fused(branch, residual, norm, prenorm):
        dtype, weight, bias = residual.dtype, norm.weight, norm.bias
        if branch.dtype != dtype or weight.dtype != dtype:  # autocast (a .to() call costs ~2 us even when a no-op)
            branch, weight, bias = branch.to(dtype), weight.to(dtype), bias.to(dtype)
        return ops.layer_norm_residual(branch, residual, weight, bias, eps=norm.eps, dropout_p=dropout_p,
                                       prenorm=prenorm, backend=backend)

    if not norm_first:
        for norm, fn in sublayers:
            x = fused(fn(x), x, norm, False)
        return x
    first = sublayers[0][0]
    h = F.layer_norm(x, first.normalized_shape, first.weight, first.bias, first.eps)
    for index, (_, fn) in enumerate(sublayers):
        norm = sublayers[index + 1][0] if index + 1 < len(sublayers) else final_norm
        h, x = fused(fn(h), x, norm, True)
    return h


class EncoderLayer(nn.Module):
    def __init__(self, config: TransformerConfig, backend: Optional[str] = None):
        super().__init__()
        d = config.d_model
        self.self_attn = MultiHeadAttention(d, config.n_heads, attention_dropout=config.attention_dropout,
                                            backend=backend)
        self.ffn = FeedForward(d, config.d_ff, config.activation_dropout)
        self.self_attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.ffn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)

    def sublayers(self, key_padding_mask: Optional[Tensor]) -> list[Sublayer]:
        return [(self.self_attn_norm, lambda h: self.self_attn(h, key_padding_mask=key_padding_mask)),
                (self.ffn_norm, self.ffn)]


class DecoderLayer(nn.Module):
    def __init__(self, config: TransformerConfig, backend: Optional[str] = None):
        super().__init__()
        d = config.d_model
        self.self_attn = MultiHeadAttention(d, config.n_heads, attention_dropout=config.attention_dropout,
                                            backend=backend)
        self.cross_attn = MultiHeadAttention(d, config.n_heads, cross=True,
                                             attention_dropout=config.attention_dropout, backend=backend)
        self.ffn = FeedForward(d, config.d_ff, config.activation_dropout)
        self.self_attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.cross_attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.ffn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)

    def sublayers(self, memory: Tensor, memory_padding_mask: Optional[Tensor]) -> list[Sublayer]:
        return [(self.self_attn_norm, lambda h: self.self_attn(h, causal=True)),
                (self.cross_attn_norm, lambda h: self.cross_attn(h, memory, key_padding_mask=memory_padding_mask)),
                (self.ffn_norm, self.ffn)]


class Encoder(nn.Module):
    """x (B, S, d) embedded source -> memory (B, S, d)."""

    def __init__(self, config: TransformerConfig, backend: Optional[str] = None):
        super().__init__()
        self.config, self.backend = config, backend
        self.layers = nn.ModuleList(EncoderLayer(config, backend) for _ in range(config.n_encoder_layers))
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_first else None

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        sublayers = [s for layer in self.layers for s in layer.sublayers(key_padding_mask)]
        return run_sublayers(x, sublayers, self.final_norm, self.config.norm_first,
                             self.config.dropout if self.training else 0.0, self.backend)


class Decoder(nn.Module):
    """x (B, T, d) embedded target prefix -> hidden states (B, T, d). Target padding must come last
    (right padding): the causal mask then keeps every real position away from it."""

    def __init__(self, config: TransformerConfig, backend: Optional[str] = None):
        super().__init__()
        self.config, self.backend = config, backend
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.n_decoder_layers))
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_first else None

    def forward(self, x: Tensor, memory: Tensor, memory_padding_mask: Optional[Tensor]) -> Tensor:
        sublayers = [s for layer in self.layers for s in layer.sublayers(memory, memory_padding_mask)]
        return run_sublayers(x, sublayers, self.final_norm, self.config.norm_first,
                             self.config.dropout if self.training else 0.0, self.backend)
