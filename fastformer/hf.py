"""fastformer's attention inside any transformers model: ``import fastformer.hf`` registers
``attn_implementation="fastformer"``.

    import fastformer.hf
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, attn_implementation="fastformer")   # or model.set_attn_implementation

Two registrations under the one name, as transformers' flash attention has them:

- ``AttentionMaskInterface``: ``fastformer_mask`` hands the attention the model's (B, Lk) padding mask
  (True = a real token), or None when nothing is padded, instead of a 4-D additive mask; for packed
  sequences (padding-free training: several sequences in one row, told apart by ``position_ids`` that restart,
  as ``DataCollatorWithFlattening`` makes them) a ``PackedSequences`` (their int32 ``cu_seqlens`` over the
  flattened rows). Only the plain patterns are accepted: causal and bidirectional, each alone or on packed
  sequences. A sliding window, chunked attention or any other mask function the model combines in raises
  ValueError naming it.
- ``AttentionInterface``: ``fastformer_attention_forward`` calls ``fastformer.ops.attention`` (the usual
  dispatch: every backend, forward and backward) with the padding as ``key_padding_mask``, causality from
  the module (``is_causal``; bottom-right aligned, so a query against a longer cache of keys sees every key
  up to its own position), the module's scaling and, in training, its attention dropout (fastformer's Philox
  stream, not torch's). Grouped key/value heads (GQA, MQA) are read in place, not repeated. Packed sequences
  go to ``fastformer.ops.attention_varlen`` on the flattened (B L, H, D) rows, no mask formed and no score
  across sequences computed: from the ``PackedSequences`` of the mask, or from the flash-attention keyword
  arguments ``cu_seq_lens_q``/``cu_seq_lens_k``/``max_length_q``/``max_length_k`` where the collator passes them
  (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), on every backend and device. It returns
  (B, Lq, H, D), as transformers' other attention functions do.

What the kernel cannot express raises ValueError naming what the model asked for, never a silent fallback:
a 4-D or block mask (custom masks), an additive position bias (T5's ``position_bias``), a sliding window,
logit soft-capping, attention sinks, ``output_attentions=True``, a paged cache.

transformers is an optional dependency (``pip install ".[hf]"``); ``import fastformer`` does not need it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

try:
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("fastformer.hf needs transformers: pip install \"fastformer[hf]\" (or pip install "
                      "\"transformers>=5.23,<6\")") from exc

from fastformer.ops.attention import attention
from fastformer.ops.attention_varlen import attention_varlen

NAME = "fastformer"

# The mask patterns the kernel expresses with key padding and a causal flag (transformers' own functions).
_PLAIN_MASKS = (masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function)


def _describe(mask_function) -> str:
    return getattr(mask_function, "__qualname__", None) or repr(mask_function)


@dataclass(frozen=True)
class PackedSequences:
    """Sequences packed along the rows of a (B, L) batch, as the attention sees them flattened to B L tokens:
    sequence s is tokens cu_seqlens[s] .. cu_seqlens[s + 1] (int32, on the model's device); max_seqlen the
    longest."""
    cu_seqlens: torch.Tensor
    max_seqlen: int


def _closure(fn) -> dict:
    """The free variables of a function made by a transformers mask factory (its closure), by name."""
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells)))


def _packed_sequence_ids(mask_function) -> Optional[torch.Tensor]:
    """The (B, L) sequence ids of transformers' packed-sequence mask (masking_utils: ``and_masks`` of the plain
    pattern remapped to per-sequence positions and ``packed_sequence_mask_function``), or None when
    ``mask_function`` is not that pattern."""
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    ids, plain = None, 0
    for part in _closure(mask_function).get("mask_functions", ()):
        name = getattr(part, "__qualname__", "")
        inner = _closure(part)
        if name == "packed_sequence_mask_function.<locals>.inner_mask":
            ids = inner.get("packed_sequence_mask")
        elif name == "remap_positions_for_packed_sequence.<locals>.inner_mask" and \
                inner.get("mask_function") in _PLAIN_MASKS:
            plain += 1
        else:
            return None
    return ids if plain == 1 and isinstance(ids, torch.Tensor) else None


def _cu_seqlens(sequence_ids: torch.Tensor) -> PackedSequences:
    """PackedSequences of (B, L) sequence ids (a new sequence wherever the id changes or a row starts)."""
    ids = sequence_ids.reshape(-1)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    starts[:: sequence_ids.shape[1]] = True
    first = starts.nonzero().view(-1)
    cu = torch.cat([first, first.new_tensor([ids.numel()])]).to(torch.int32)
    return PackedSequences(cu, int(cu.diff().max()) if cu.numel() > 1 else 0)


def fastformer_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                    mask_function=masking_utils.causal_mask_function,
                    attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """The mask transformers builds for attn_implementation="fastformer": the (B, kv_length) bool padding mask
    (True = attend), None when no key is padded, or PackedSequences for packed rows. Causality is not in it:
    the attention takes it from the module. Refuses every mask pattern other than plain causal or bidirectional,
    alone or on packed sequences."""
    if mask_function not in _PLAIN_MASKS:
        sequence_ids = _packed_sequence_ids(mask_function) if attention_mask is None else None
        if sequence_ids is not None and q_length == kv_length == sequence_ids.shape[1]:
            return _cu_seqlens(sequence_ids)
        raise ValueError(f"attn_implementation='fastformer' takes a key-padding mask or packed sequences with plain "
                         f"causal or bidirectional attention; this model asked for the mask function "
                         f"{_describe(mask_function)} (a sliding window, chunked attention or another pattern "
                         f"combined in), which fastformer's kernel cannot express")
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation='fastformer': expected a (batch, keys) padding mask, got shape "
                         f"{tuple(attention_mask.shape)}")
    attention_mask = attention_mask[:, -kv_length:].to(torch.bool)
    if attention_mask.shape[1] != kv_length:
        raise ValueError(f"attn_implementation='fastformer': the padding mask covers {attention_mask.shape[1]} "
                         f"keys but the attention has {kv_length} (a static cache longer than the mask?)")
    return None if bool(attention_mask.all()) else attention_mask


# Keyword arguments of transformers' attention calls that ask for what the kernel has not.
_REFUSED = {"position_bias": "an additive position bias (position_bias, as T5's)",
            "sliding_window": "a sliding window (sliding_window)",
            "softcap": "logit soft-capping (softcap)",
            "s_aux": "attention sinks (s_aux)",
            "sinks": "attention sinks (sinks)"}


def fastformer_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                 dropout: float = 0.0, scaling: Optional[float] = None,
                                 is_causal: Optional[bool] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (B, H, Lq, D), key and value (B, Hkv, Lk, D) with H a multiple of Hkv, attention_mask from
    fastformer_mask ((B, Lk) bool, True = attend; PackedSequences; or None) -> ((B, Lq, H, D), None)."""
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation='fastformer': the model asked for {what}, which fastformer's "
                             f"attention kernel cannot express")
    if kwargs.get("output_attentions"):
        raise ValueError("attn_implementation='fastformer' does not return attention weights "
                         "(output_attentions=True): the fused kernel never forms them; use 'eager'")
    if kwargs.get("cache") is not None:
        raise ValueError("attn_implementation='fastformer' does not read a paged cache")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    packed = _packed_sequences(query, key, attention_mask, kwargs)
    if packed is not None:
        return _varlen_forward(query, key, value, packed, causal, dropout, scaling), None
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attn_implementation='fastformer' takes a (batch, keys) padding mask; the model passed "
                         f"{shape} (a custom 4-D or block mask), which fastformer's kernel cannot express")
    padding = None if attention_mask is None else ~attention_mask.to(torch.bool)
    out = attention(query, key, value, key_padding_mask=padding, causal=causal, dropout_p=float(dropout),
                    scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _packed_sequences(query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs: dict) -> Optional[PackedSequences]:
    """The packed sequences of a padding-free call, None for any other. As transformers' flash attention finds
    them: the flash-attention keyword arguments (cu_seq_lens_q/k over the flattened rows, max_length_q/k) if the
    model got them; else the mask's PackedSequences; else, with no mask, position_ids of one row that restart
    (the model built no packed mask when it holds a cache: a Llama in train mode with use_cache on)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        if isinstance(attention_mask, PackedSequences):
            return attention_mask
        positions = kwargs.get("position_ids")
        B, _, L, _ = query.shape
        if attention_mask is not None or not isinstance(positions, torch.Tensor) or B != 1 or L < 2 or \
                key.shape[2] != L or positions.shape[-1] != L:
            return None
        positions = positions.reshape(1, L)
        starts = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1
        return _cu_seqlens(starts.cumsum(-1)) if bool(starts[:, 1:].any()) else None
    if cu_k is not None and cu_q is not None and cu_k is not cu_q and not torch.equal(cu_q, cu_k):
        raise ValueError("attn_implementation='fastformer' takes packed self-attention (cu_seq_lens_q equal to "
                         "cu_seq_lens_k); these differ")
    cu = (cu_q if cu_q is not None else cu_k).to(device=query.device, dtype=torch.int32)
    max_len = kwargs.get("max_length_q", kwargs.get("max_length_k"))
    return PackedSequences(cu, int(max_len) if max_len is not None else int(cu.diff().max()))


def _varlen_forward(query, key, value, packed: PackedSequences, causal: bool, dropout: float, scaling):
    """query (B, H, L, D), key and value (B, H_kv, L, D) whose B L tokens hold the packed sequences ->
    (B, L, H, D) through ops.attention_varlen on the (B L, H, D) rows (views of the projections where their
    layout allows)."""
    B, H, L, D = query.shape
    if key.shape[2] != L:
        raise ValueError(f"attn_implementation='fastformer': packed sequences need as many keys as queries; got "
                         f"{L} queries and {key.shape[2]} keys (a cache?)")
    flat = lambda t: t.transpose(1, 2).reshape(B * L, t.shape[1], D)  # noqa: E731  (B, L, heads, D) rows
    out = attention_varlen(flat(query), flat(key), flat(value), packed.cu_seqlens, packed.cu_seqlens,
                           packed.max_seqlen, packed.max_seqlen, causal=causal, dropout_p=float(dropout),
                           scale=scaling)
    return out.view(B, L, H, D)


def register() -> None:
    """Registers attn_implementation="fastformer" (done on import; calling it again changes nothing)."""
    AttentionInterface.register(NAME, fastformer_attention_forward)
    masking_utils.AttentionMaskInterface.register(NAME, fastformer_mask)


register()

__all__ = ["NAME", "PackedSequences", "fastformer_attention_forward", "fastformer_mask", "register"]
