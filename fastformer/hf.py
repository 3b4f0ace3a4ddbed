"""fastformer's attention inside any transformers model: ``import fastformer.hf`` registers
``attn_implementation="fastformer"``.

    import fastformer.hf
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, attn_implementation="fastformer")   # or model.set_attn_implementation

Two registrations under the one name, as transformers' flash attention has them:

- ``AttentionMaskInterface``: ``fastformer_mask`` hands the attention the model's (B, Lk) padding mask
  (True = a real token), or None when nothing is padded, instead of a 4-D additive mask. Only the two plain
  patterns are accepted: causal and bidirectional. A sliding window, chunked attention, packed sequences or
  any other mask function the model combines in raises ValueError naming it.
- ``AttentionInterface``: ``fastformer_attention_forward`` calls ``fastformer.ops.attention`` (the usual
  dispatch: every backend, forward and backward) with the padding as ``key_padding_mask``, causality from
  the module (``is_causal``; bottom-right aligned, so a query against a longer cache of keys sees every key
  up to its own position), the module's scaling and, in training, its attention dropout (fastformer's Philox
  stream, not torch's). Grouped key/value heads are repeated to the query heads. It returns
  (B, Lq, H, D), as transformers' other attention functions do.

What the kernel cannot express raises ValueError naming what the model asked for, never a silent fallback:
a 4-D or block mask (custom masks), an additive position bias (T5's ``position_bias``), a sliding window,
logit soft-capping, attention sinks, ``output_attentions=True``, a paged cache.

transformers is an optional dependency (``pip install ".[hf]"``); ``import fastformer`` does not need it.
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("fastformer.hf needs transformers: pip install \"fastformer[hf]\" (or pip install "
                      "\"transformers>=5.23,<6\")") from exc

from fastformer.ops.attention import attention

NAME = "fastformer"

# The mask patterns the kernel expresses with key padding and a causal flag (transformers' own functions).
_PLAIN_MASKS = (masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function)


def _describe(mask_function) -> str:
    return getattr(mask_function, "__qualname__", None) or repr(mask_function)


def fastformer_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                    mask_function=masking_utils.causal_mask_function,
                    attention_mask: Optional[torch.Tensor] = None, **kwargs) -> Optional[torch.Tensor]:
    """The mask transformers builds for attn_implementation="fastformer": the (B, kv_length) bool padding mask
    (True = attend) or None when no key is padded. Causality is not in it: the attention takes it from the
    module. Refuses every mask pattern other than plain causal or bidirectional."""
    if mask_function not in _PLAIN_MASKS:
        raise ValueError(f"attn_implementation='fastformer' takes a key-padding mask with plain causal or "
                         f"bidirectional attention; this model asked for the mask function "
                         f"{_describe(mask_function)} (a sliding window, chunked attention, packed sequences or "
                         f"another pattern combined in), which fastformer's kernel cannot express")
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
    fastformer_mask ((B, Lk) bool, True = attend) or None -> ((B, Lq, H, D), None)."""
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation='fastformer': the model asked for {what}, which fastformer's "
                             f"attention kernel cannot express")
    if kwargs.get("output_attentions"):
        raise ValueError("attn_implementation='fastformer' does not return attention weights "
                         "(output_attentions=True): the fused kernel never forms them; use 'eager'")
    if kwargs.get("cache") is not None:
        raise ValueError("attn_implementation='fastformer' does not read a paged cache")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attn_implementation='fastformer' takes a (batch, keys) padding mask; the model passed "
                         f"{shape} (a custom 4-D or block mask), which fastformer's kernel cannot express")
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads:
        if heads % kv_heads:
            raise ValueError(f"attn_implementation='fastformer': {heads} query heads are not a multiple of "
                             f"{kv_heads} key/value heads")
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    padding = None if attention_mask is None else ~attention_mask.to(torch.bool)
    out = attention(query, key, value, key_padding_mask=padding, causal=bool(causal),
                    dropout_p=float(dropout), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers attn_implementation="fastformer" (done on import; calling it again changes nothing)."""
    AttentionInterface.register(NAME, fastformer_attention_forward)
    masking_utils.AttentionMaskInterface.register(NAME, fastformer_mask)


register()

__all__ = ["NAME", "fastformer_attention_forward", "fastformer_mask", "register"]
