"""Encoder and decoder stacks of the Transformer on fastformer's ops.

Each layer is a list of sublayers (self-attention, [cross-attention,] feed-forward), each with its
LayerNorm. The bias of a sublayer's last projection, residual dropout, residual connection and LayerNorm are
one fused op (its ``x_bias``; and under autocast it also writes the next sublayer's input in the autocast
dtype, ``compute_dtype``):

  post-norm (the paper, default):  x = LayerNorm(x + dropout(sublayer(x)))
      -> x = ops.layer_norm_residual(sublayer(x), x, norm, dropout_p)
  pre-norm (norm_first=True):      x = x + dropout(sublayer(LayerNorm(x))), final LayerNorm at the end
      -> the add and the *next* sublayer's LayerNorm are fused:
         h, x = ops.layer_norm_residual(sublayer(h), x, next_norm, dropout_p, prenorm=True)
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastformer import ops
from fastformer.data.batching import Sequences
from fastformer.nn.attention import MultiHeadAttention
from fastformer.nn.config import TransformerConfig
from fastformer.nn.linear import Linear, product


# ----------------------------------------------------------------------------------------------------
# The decoder layer, described once: its weights (DECODER_LAYER) and its computation (DECODER_SUBLAYERS,
# with ``run_sublayers`` for the norm placement and ``config.activation``). Every consumer is driven by
# this description and binds the weights by these names, checking their shapes: the model
# (DecoderLayer.sublayers), the Python decoder step and the C++ one (fastformer/nn/decoding.py sends the
# description and the named weights to csrc/inference/decoder.cpp), the CTranslate2 exporter
# (fastformer/export.py); the tests' plain-PyTorch reference and the benchmarks' plain decoder read the
# same state-dict names.


class LayerWeight(NamedTuple):
    name: str  # module path within the layer
    kind: str  # "linear": weight (out, in) and bias (out,); "norm": LayerNorm weight and bias (d,)
    shape: tuple[str, ...]  # linear (out, in), norm (d,), in units "d", "2d", "3d", "f"


# The weights by name (as under ``decoder.layers.<i>.`` in the state dict), kind and shape (d = d_model,
# f = d_ff), in the order the layer uses them.
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


class SublayerSpec(NamedTuple):
    """One sublayer of a layer: what it computes (``kind``), its LayerNorm and its weights by role."""
    kind: str  # "self_attention" (causal in the decoder), "cross_attention" or "feed_forward"
    norm: str  # the LayerNorm placed before (pre-norm) or after (post-norm) it
    weights: dict[str, str]  # role -> weight name: self_attention qkv, out; cross_attention q, kv, out;
    #                          feed_forward fc1, fc2 (config.activation between them)


# The sublayers in the order they run. The one place that order is written: training (DecoderLayer), the
# Python step and the C++ step (which receives this list and runs the kinds in its order) follow it.
DECODER_SUBLAYERS: tuple[SublayerSpec, ...] = (
    SublayerSpec("self_attention", "self_attn_norm", {"qkv": "self_attn.qkv_proj", "out": "self_attn.out_proj"}),
    SublayerSpec("cross_attention", "cross_attn_norm",
                 {"q": "cross_attn.q_proj", "kv": "cross_attn.kv_proj", "out": "cross_attn.out_proj"}),
    SublayerSpec("feed_forward", "ffn_norm", {"fc1": "ffn.fc1", "fc2": "ffn.fc2"}),
)
ENCODER_SUBLAYERS: tuple[SublayerSpec, ...] = (
    SublayerSpec("self_attention", "self_attn_norm", {"qkv": "self_attn.qkv_proj", "out": "self_attn.out_proj"}),
    SublayerSpec("feed_forward", "ffn_norm", {"fc1": "ffn.fc1", "fc2": "ffn.fc2"}),
)

# config.activation's functions (fastformer/nn/config.py ACTIVATIONS names them; the C++ step implements
# the same names): each takes x and whether it may overwrite x.
ACTIVATIONS: dict[str, Callable[[Tensor, bool], Tensor]] = {
    "relu": lambda x, inplace: F.relu(x, inplace=inplace),
    "gelu": lambda x, inplace: F.gelu(x),  # exact (erf)
    "silu": lambda x, inplace: F.silu(x, inplace=inplace),
}


def decoder_layer_weights(layer: nn.Module, config: TransformerConfig) -> dict[str, nn.Module]:
    """name -> the module of each weight of ``DECODER_LAYER``, looked up by name in ``layer``, each checked
    against its described shape: a renamed or reshaped weight fails here, not as wrong numbers. A projection
    module applies itself (``module(x)``, float or int8) and gives its weights to the C++ decoder
    (``module.bind(name)``); a norm is read by its ``weight`` and ``bias``."""
    units = {"d": config.d_model, "2d": 2 * config.d_model, "3d": 3 * config.d_model, "f": config.d_ff}
    out = {}
    for w in DECODER_LAYER:
        module = layer.get_submodule(w.name)
        shape = tuple(units[u] for u in w.shape)
        got = tuple(module.weight.shape) if w.kind == "norm" else (module.out_features, module.in_features)
        bias = module.bias
        if got != shape or bias is None or tuple(bias.shape) != shape[:1]:
            raise ValueError(f"decoder layer weight {w.name} ({w.kind}) must be {shape} with a bias of "
                             f"{shape[:1]}, got {got} and {None if bias is None else tuple(bias.shape)}")
        out[w.name] = module
    return out


class FeedForward(nn.Module):
    """Linear(d, d_ff) -> activation (config.activation) -> dropout -> Linear(d_ff, d).

    fc1's bias, the activation and its dropout are one op, ``ops.bias_activation``, on fc1's product without
    bias (where the packed or int8 kernels apply, inference on the CPU, their epilogue adds the bias instead);
    with ``defer_bias`` fc2's bias is handed back too, for the op that consumes the branch (``run_sublayers``)."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float = 0.0, activation: str = "relu",
                 backend: Optional[str] = None):
        super().__init__()
        self.fc1, self.fc2 = Linear(d_model, d_ff), Linear(d_ff, d_model)
        self.activation_dropout, self.activation, self.backend = activation_dropout, activation, backend
        for m in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, x: Tensor, defer_bias: bool = False):
        p = self.activation_dropout if self.training else 0.0
        h, bias = product(self.fc1, x)
        if bias is not None:
            h = ops.bias_activation(h, bias, activation=self.activation, dropout_p=p, backend=self.backend)
        else:
            h = ACTIVATIONS[self.activation](h, False)
            if p > 0:
                h = F.dropout(h, p, True)
        return product(self.fc2, h) if defer_bias else self.fc2(h)


# A sublayer: its LayerNorm and its function of the normalized input, which returns the branch, or (branch, the
# bias of its last projection, for ops.layer_norm_residual to add: None if added already).
Sublayer = tuple[nn.LayerNorm, Callable[[Tensor], object]]


def run_sublayers(x: Tensor, sublayers: list[Sublayer], final_norm: Optional[nn.LayerNorm], norm_first: bool,
                  dropout_p: float, backend: Optional[str]) -> Tensor:
    """Runs sublayers with fused residual + bias + dropout + LayerNorm (see the module docstring).

    Under autocast the residual stream and the LayerNorm parameters stay float32 while the branches come in the
    autocast dtype: the fused op takes the branch as it comes (its kernels upcast it as they read it and write
    its gradient in its dtype), adds the branch's bias, and writes beside the float32 stream the normalized
    output in the autocast dtype (``compute_dtype``), the next sublayer's input, so no cast runs around it."""
    device = x.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None

    def fused(out, residual, norm, prenorm, compute_dtype=compute):
        branch, bias = out if isinstance(out, tuple) else (out, None)
        return ops.layer_norm_residual(branch, residual, norm.weight, norm.bias, eps=norm.eps, dropout_p=dropout_p,
                                       prenorm=prenorm, x_bias=bias, compute_dtype=compute_dtype, backend=backend)

    if not norm_first:
        x_in = x  # the next sublayer's input: the stream, or its copy in the compute dtype
        for norm, fn in sublayers:
            out = fused(fn(x_in), x, norm, False)
            x, x_in = out if compute is not None else (out, out)
        return x
    first = sublayers[0][0]
    h = F.layer_norm(x, first.normalized_shape, first.weight, first.bias, first.eps)
    for index, (_, fn) in enumerate(sublayers):
        last = index + 1 == len(sublayers)
        # the stack's output (after the final norm) in the stream's dtype, as post-norm's
        h, x = fused(fn(h), x, final_norm if last else sublayers[index + 1][0], True, None if last else compute)
    return h


class EncoderLayer(nn.Module):
    def __init__(self, config: TransformerConfig, backend: Optional[str] = None):
        super().__init__()
        d = config.d_model
        self.self_attn = MultiHeadAttention(d, config.n_heads, attention_dropout=config.attention_dropout,
                                            backend=backend)
        self.ffn = FeedForward(d, config.d_ff, config.activation_dropout, config.activation, backend)
        self.self_attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.ffn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)

    def sublayers(self, key_padding_mask: Optional[Tensor], seqs: Optional[Sequences] = None) -> list[Sublayer]:
        run = {"self_attention": lambda h: self.self_attn(h, key_padding_mask=key_padding_mask, seqs=seqs,
                                                          defer_bias=True),
               "feed_forward": lambda h: self.ffn(h, defer_bias=True)}
        return [(self.get_submodule(s.norm), run[s.kind]) for s in ENCODER_SUBLAYERS]


class DecoderLayer(nn.Module):
    def __init__(self, config: TransformerConfig, backend: Optional[str] = None):
        super().__init__()
        d = config.d_model
        self.self_attn = MultiHeadAttention(d, config.n_heads, attention_dropout=config.attention_dropout,
                                            backend=backend)
        self.cross_attn = MultiHeadAttention(d, config.n_heads, cross=True,
                                             attention_dropout=config.attention_dropout, backend=backend)
        self.ffn = FeedForward(d, config.d_ff, config.activation_dropout, config.activation, backend)
        self.self_attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.cross_attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.ffn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)

    def sublayers(self, memory: Tensor, memory_padding_mask: Optional[Tensor], seqs: Optional[Sequences] = None,
                  memory_seqs: Optional[Sequences] = None) -> list[Sublayer]:
        run = {"self_attention": lambda h: self.self_attn(h, causal=True, seqs=seqs, defer_bias=True),
               "cross_attention": lambda h: self.cross_attn(h, memory, key_padding_mask=memory_padding_mask,
                                                            seqs=seqs, memory_seqs=memory_seqs, defer_bias=True),
               "feed_forward": lambda h: self.ffn(h, defer_bias=True)}
        return [(self.get_submodule(s.norm), run[s.kind]) for s in DECODER_SUBLAYERS]


class Encoder(nn.Module):
    """x (B, S, d) embedded source -> memory (B, S, d); packed (``seqs``): x (Ts, d) -> (Ts, d)."""

    def __init__(self, config: TransformerConfig, backend: Optional[str] = None):
        super().__init__()
        self.config, self.backend = config, backend
        self.layers = nn.ModuleList(EncoderLayer(config, backend) for _ in range(config.n_encoder_layers))
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_first else None

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor], seqs: Optional[Sequences] = None) -> Tensor:
        sublayers = [s for layer in self.layers for s in layer.sublayers(key_padding_mask, seqs)]
        return run_sublayers(x, sublayers, self.final_norm, self.config.norm_first,
                             self.config.dropout if self.training else 0.0, self.backend)


class Decoder(nn.Module):
    """x (B, T, d) embedded target prefix -> hidden states (B, T, d). Target padding must come last
    (right padding): the causal mask then keeps every real position away from it. Packed (``seqs``, the
    targets' Sequences, ``memory_seqs`` the sources'): x (Tt, d), memory (Ts, d) -> (Tt, d)."""

    def __init__(self, config: TransformerConfig, backend: Optional[str] = None):
        super().__init__()
        self.config, self.backend = config, backend
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.n_decoder_layers))
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_first else None

    def forward(self, x: Tensor, memory: Tensor, memory_padding_mask: Optional[Tensor],
                seqs: Optional[Sequences] = None, memory_seqs: Optional[Sequences] = None) -> Tensor:
        device = memory.device.type
        if torch.is_autocast_enabled(device) and memory.is_floating_point():
            # Cast once for every layer's kv projection (autocast would cast it in each), one cast back in backward.
            memory = memory.to(torch.get_autocast_dtype(device))
        sublayers = [s for layer in self.layers
                     for s in layer.sublayers(memory, memory_padding_mask, seqs, memory_seqs)]
        return run_sublayers(x, sublayers, self.final_norm, self.config.norm_first,
                             self.config.dropout if self.training else 0.0, self.backend)
