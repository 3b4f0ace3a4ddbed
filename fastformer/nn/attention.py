"""MultiHeadAttention on ops.attention, or on ops.attention_varlen for packed (padding-free) sequences (the
incremental decoder of fastformer/nn/decoding.py keeps its own key/value caches)."""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from fastformer import ops
from fastformer.data.batching import Sequences
from fastformer.nn.linear import Linear


class MultiHeadAttention(nn.Module):
    """Multi-head attention: self-attention with one fused QKV projection (d -> 3d), or
    cross-attention with a query projection and one fused KV projection (d -> 2d) of the memory.

    Shapes: x (B, Lq, d); memory (B, Lk, d); key_padding_mask (B, Lk) bool, True = padding. Packed
    (``seqs``, the queries' Sequences, and for cross-attention ``memory_seqs``, the memory's): x (Tq, d),
    memory (Tk, d), sequence b of the queries attending to sequence b of the keys, no padding anywhere.
    """

    def __init__(self, d_model: int, n_heads: int, *, cross: bool = False, attention_dropout: float = 0.0,
                 backend: Optional[str] = None):
        super().__init__()
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.cross, self.attention_dropout, self.backend = cross, attention_dropout, backend
        # When set (by fastformer.visualize), forward also stores the attention probabilities
        # (B, H, Lq, Lk), recomputed by the plain PyTorch reference: the fused op never forms them.
        self.record_attention = False
        self.last_attention: Optional[Tensor] = None
        if cross:
            self.q_proj = Linear(d_model, d_model)
            self.kv_proj = Linear(d_model, 2 * d_model)
        else:
            self.qkv_proj = Linear(d_model, 3 * d_model)
        self.out_proj = Linear(d_model, d_model)
        self.reset_parameters()

    def reset_parameters(self):
        for m in (self.out_proj, *((self.q_proj, self.kv_proj) if self.cross else (self.qkv_proj,))):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)

    def _heads(self, x: Tensor, n: int) -> tuple[Tensor, ...]:
        """(B, L, n * d) -> n tensors (B, H, L, Dh): views, which the kernels (cpu, cuda, triton) read in place;
        their output comes back in (B, L, H, Dh) memory, so the reshape in forward copies nothing (the torch
        reference backend copies on both sides). Split by ``unbind``, whose backward stacks the n gradients
        into one (B, L, n, H, Dh) tensor (one write); indexing would give each part a zero-filled gradient of
        the whole projection, add them and copy the sum back into its layout."""
        B, L, _ = x.shape
        if n == 1:
            return (x.view(B, L, self.n_heads, self.head_dim).transpose(1, 2),)
        parts = x.view(B, L, n, self.n_heads, self.head_dim)
        return tuple(p.transpose(1, 2) for p in parts.unbind(2))

    def _packed_heads(self, x: Tensor, n: int) -> tuple[Tensor, ...]:
        """(T, n * d) -> n tensors (T, H, Dh): views (the heads of a packed projection), read in place; split as
        ``_heads`` splits."""
        if n == 1:
            return (x.view(x.shape[0], self.n_heads, self.head_dim),)
        return x.view(x.shape[0], n, self.n_heads, self.head_dim).unbind(1)

    def forward(self, x: Tensor, memory: Optional[Tensor] = None, *, key_padding_mask: Optional[Tensor] = None,
                causal: bool = False, seqs: Optional[Sequences] = None,
                memory_seqs: Optional[Sequences] = None) -> Tensor:
        if seqs is not None:
            return self._forward_packed(x, memory, seqs, memory_seqs, causal)
        if self.cross:
            if memory is None:
                raise ValueError("cross-attention needs memory")
            (q,) = self._heads(self.q_proj(x), 1)
            k, v = self._heads(self.kv_proj(memory), 2)
        else:
            q, k, v = self._heads(self.qkv_proj(x), 3)
        if self.record_attention:
            from fastformer.ops.reference import attention_probabilities

            self.last_attention = attention_probabilities(q.detach(), k.detach(), key_padding_mask, causal,
                                                          self.head_dim ** -0.5)
        out = ops.attention(q, k, v, key_padding_mask=key_padding_mask, causal=causal,
                            dropout_p=self.attention_dropout if self.training else 0.0, backend=self.backend)
        B, _, Lq, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, Lq, self.d_model))


    def _forward_packed(self, x: Tensor, memory: Optional[Tensor], seqs: Sequences, memory_seqs: Optional[Sequences],
                        causal: bool) -> Tensor:
        """x (Tq, d) of packed sequences -> (Tq, d): ops.attention_varlen, each sequence on its own."""
        if self.cross:
            if memory is None or memory_seqs is None:
                raise ValueError("packed cross-attention needs memory and memory_seqs")
            (q,) = self._packed_heads(self.q_proj(x), 1)
            k, v = self._packed_heads(self.kv_proj(memory), 2)
            keys = memory_seqs
        else:
            q, k, v = self._packed_heads(self.qkv_proj(x), 3)
            keys = seqs
        out = ops.attention_varlen(q, k, v, seqs.cu_seqlens, keys.cu_seqlens, seqs.max_len, keys.max_len,
                                   causal=causal, dropout_p=self.attention_dropout if self.training else 0.0,
                                   backend=self.backend)
        return self.out_proj(out.reshape(x.shape[0], self.d_model))
