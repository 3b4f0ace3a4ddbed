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
  (B, Lq, H, D), as transformers' other attention functions do. The boundaries cost one host read per
  forward (a copy of the ids or tables, by the mask function or the first layer; the other layers find the
  result again), and their table reaches the device checked (``_on_device``), so that attention_varlen reads
  it in no layer, forward or backward.

What the kernel cannot express raises ValueError naming what the model asked for, never a silent fallback:
a 4-D or block mask (custom masks), an additive position bias (T5's ``position_bias``), a sliding window,
logit soft-capping, attention sinks, ``output_attentions=True``, a paged cache.

transformers is an optional dependency (``pip install ".[hf]"``); ``import fastformer`` does not need it.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

try:
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("fastformer.hf needs transformers: pip install \"fastformer[hf]\" (or pip install "
                      "\"transformers>=5.23,<6\")") from exc

from fastformer._ext import C
from fastformer.ops.attention import attention
from fastformer.ops.attention_varlen import attention_varlen

NAME = "fastformer"

# The mask patterns the kernel expresses with key padding and a causal flag (transformers' own functions).
_PLAIN_MASKS = (masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function)


def _describe(mask_function) -> str:
    return getattr(mask_function, "__qualname__", None) or repr(mask_function)


class PackedSequences:
    """Sequences packed along the rows of a (B, L) batch, as the attention sees them flattened to B L tokens:
    sequence s is tokens cu_seqlens[s] .. cu_seqlens[s + 1] (int32, on the model's device, checked on the host:
    _on_device); max_seqlen the longest. The mask function's come from the (B, L) sequence ids and are found on
    first use: one host read per forward, shared by every layer, and none when the layers take transformers'
    flash-attention keyword arguments instead (which transformers passes besides the mask)."""

    def __init__(self, cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: int = 0, *,
                 sequence_ids: Optional[torch.Tensor] = None):
        self._table = None if sequence_ids is not None else (cu_seqlens, max_seqlen)
        self._sequence_ids = sequence_ids

    def _found(self) -> tuple:
        if self._table is None:
            packed = _cu_seqlens(self._sequence_ids, self._sequence_ids.device)
            self._table = (packed.cu_seqlens, packed.max_seqlen)
        return self._table

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self._found()[0]

    @property
    def max_seqlen(self) -> int:
        return self._found()[1]


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


def _on_device(cu: torch.Tensor, device: torch.device, total: int, max_seqlen: Optional[int] = None) -> PackedSequences:
    """PackedSequences of a table on the host (int32 (B + 1) on the CPU) for ``total`` packed rows: its rules
    checked there and the table copied to ``device`` without waiting (fastformer._C.checked_cu_seqlens), so that
    no layer's attention_varlen reads it again (csrc/value_checks.h)."""
    if max_seqlen is None:
        max_seqlen = int(cu.diff().max()) if cu.numel() > 1 else 0
    return PackedSequences(C.checked_cu_seqlens(cu, device, total, max_seqlen), max_seqlen)


def _cu_seqlens(sequence_ids: torch.Tensor, device: torch.device) -> PackedSequences:
    """PackedSequences on ``device`` of (B, L) sequence ids (a new sequence wherever the id changes or a row
    starts), found on the host from one copy of the ids (a no-op on the CPU): the forward's one host read."""
    ids = sequence_ids.cpu().reshape(-1)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    starts[:: sequence_ids.shape[1]] = True
    first = starts.nonzero().view(-1)
    return _on_device(torch.cat([first, first.new_tensor([ids.numel()])]).to(torch.int32), device, ids.numel())


class _ForwardMemo:
    """The PackedSequences that a forward's first layer derived from tensors that transformers hands every layer
    unchanged (the flash-attention keyword arguments, position_ids), found again by the other layers: the
    forward reads the host once, not once per layer. Keyed by the tensors themselves (alive, the same objects,
    at the same versions) and the call's other inputs."""

    def __init__(self):
        self.entry = None  # (weak references to the tensors, their versions, other inputs, PackedSequences or None)

    def get(self, tensors: tuple, other: tuple, build: Callable[[], Optional[PackedSequences]]):
        if any(t.is_inference() for t in tensors):  # no version counter: nothing to tell a change by
            return build()
        versions = tuple(t._version for t in tensors)
        entry = self.entry
        if entry is not None and entry[1:3] == (versions, other) and len(entry[0]) == len(tensors) and \
                all(ref() is t for ref, t in zip(entry[0], tensors)):
            return entry[3]
        packed = build()
        self.entry = (tuple(weakref.ref(t) for t in tensors), versions, other, packed)  # one assignment: atomic
        return packed


_memo = _ForwardMemo()


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
            return PackedSequences(sequence_ids=sequence_ids)  # found on first use
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
    (the model built no packed mask when it holds a cache: a Llama in train mode with use_cache on).
    One host read per forward (the table's or the ids' copy, by the first layer; _ForwardMemo for the others,
    fastformer_mask once per forward), and the table on the device is checked already (_on_device)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        if isinstance(attention_mask, PackedSequences):
            return attention_mask
        positions = kwargs.get("position_ids")
        B, _, L, _ = query.shape
        if attention_mask is not None or not isinstance(positions, torch.Tensor) or B != 1 or L < 2 or \
                key.shape[2] != L or positions.shape[-1] != L:
            return None
        return _memo.get((positions,), (L, query.device), lambda: _restarts(positions.reshape(1, L), query.device))
    tables = tuple(t for t in (cu_q, cu_k) if t is not None)
    if cu_k is cu_q:
        tables = tables[:1]
    max_len = kwargs.get("max_length_q", kwargs.get("max_length_k"))
    if isinstance(max_len, torch.Tensor):  # as transformers' helpers make it: the longest sequence, which the
        max_len = None                     # host copy of the table gives without a second read of the device
    rows = query.shape[0] * query.shape[2]
    return _memo.get(tables, (max_len, rows, query.device), lambda: _given_tables(tables, max_len, rows, query.device))


def _restarts(positions: torch.Tensor, device: torch.device) -> Optional[PackedSequences]:
    """PackedSequences on ``device`` of a (1, L) row of positions that restart (None if they never do), from one
    host copy of the positions."""
    positions = positions.cpu()
    starts = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1
    return _cu_seqlens(starts.cumsum(-1), device) if bool(starts[:, 1:].any()) else None


def _given_tables(tables: tuple, max_len: Optional[int], rows: int, device: torch.device) -> PackedSequences:
    """PackedSequences on ``device`` of the flash-attention keyword arguments (cu_seq_lens_q and/or cu_seq_lens_k:
    one table, or two that must be equal) over ``rows`` flattened tokens, from one host copy of the tables."""
    differ = ValueError("attn_implementation='fastformer' takes packed self-attention (cu_seq_lens_q equal to "
                        "cu_seq_lens_k); these differ")
    if any(t.shape != tables[0].shape for t in tables):
        raise differ
    same_device = all(t.device == tables[0].device for t in tables)
    on_host = (torch.stack(tables).cpu() if same_device else torch.stack([t.cpu() for t in tables])).to(torch.int32)
    if not bool((on_host == on_host[0]).all()):
        raise differ
    return _on_device(on_host[0], device, rows, max_len)


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
