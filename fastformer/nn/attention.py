"""MultiHeadAttention on ops.attention, or on ops.attention_varlen for packed (padding-free) sequences (the
incremental decoder of fastformer/nn/decoding.py keeps its own key/value caches)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from fastformer import ops
from fastformer.data.batching import Sequences
from fastformer.nn.linear import Linear, product


class SplitHeads(torch.autograd.Function):
    """x (B, L, n H Dh), a packed projection -> its n parts (B, H, L, Dh), views. Backward: the parts' gradients as
    one (B, L, n H Dh) gradient: where they are the parts of one packed tensor (the kernel backends write them
    so: csrc/attention_grads.h), that tensor itself; else stacked (one copy). Indexing the parts instead would
    give each a zero-filled gradient of the whole projection, then add them and copy the sum into its layout."""

    @staticmethod
    def forward(ctx, x: Tensor, n: int, heads: int):
        B, L, width = x.shape
        ctx.packed_shape = (B, L, n, heads, width // (n * heads))
        parts = x.view(ctx.packed_shape)
        return tuple(parts.select(2, i).transpose(1, 2) for i in range(n))

    @staticmethod
    def backward(ctx, *grads):
        B, L, n, H, D = ctx.packed_shape
        first, strides = grads[0], (L * n * H * D, D, n * H * D, 1)  # (grads are materialized: unused parts zeros)
        if all(g.untyped_storage()._cdata == first.untyped_storage()._cdata
               and g.storage_offset() == first.storage_offset() + i * H * D
               and all(size == 1 or stride == want for size, stride, want in zip(g.shape, g.stride(), strides))
               for i, g in enumerate(grads)):
            # the n parts tile one (B, L, n, H, D) block of their memory: that block is the gradient
            return first.as_strided((B, L, n * H * D), (L * n * H * D, n * H * D, 1)), None, None
        return torch.stack([g.transpose(1, 2) for g in grads], dim=2).view(B, L, n * H * D), None, None


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
        reference backend copies on both sides). Split by ``SplitHeads``, whose backward hands the n gradients
        back as one (B, L, n * d) tensor: the kernels' own packed gradient, without a copy (they write the
        gradients of a packed projection's parts as the parts of one tensor: csrc/attention_grads.h)."""
        B, L, _ = x.shape
        if n == 1:
            return (x.view(B, L, self.n_heads, self.head_dim).transpose(1, 2),)
        return SplitHeads.apply(x, n, self.n_heads)

    def _packed_heads(self, x: Tensor, n: int) -> tuple[Tensor, ...]:
        """(T, n * d) -> n tensors (T, H, Dh): views (the heads of a packed projection), read in place; split as
        ``_heads`` splits."""
        if n == 1:
            return (x.view(x.shape[0], self.n_heads, self.head_dim),)
        return x.view(x.shape[0], n, self.n_heads, self.head_dim).unbind(1)

    def forward(self, x: Tensor, memory: Optional[Tensor] = None, *, key_padding_mask: Optional[Tensor] = None,
                causal: bool = False, seqs: Optional[Sequences] = None, memory_seqs: Optional[Sequences] = None,
                defer_bias: bool = False):
        """The attention's output; with ``defer_bias``, (output without out_proj's bias, that bias or None) for
        the op that consumes it (``run_sublayers``: ops.layer_norm_residual's branch bias)."""
        if seqs is not None:
            return self._out(self._forward_packed(x, memory, seqs, memory_seqs, causal), defer_bias)
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
        return self._out(out.transpose(1, 2).reshape(B, Lq, self.d_model), defer_bias)

    def _out(self, a: Tensor, defer_bias: bool):
        """out_proj of the heads' outputs a (..., d): the projection, or (product, bias) (``defer_bias``)."""
        return product(self.out_proj, a) if defer_bias else self.out_proj(a)


    def _forward_packed(self, x: Tensor, memory: Optional[Tensor], seqs: Sequences, memory_seqs: Optional[Sequences],
                        causal: bool) -> Tensor:
        """x (Tq, d) of packed sequences -> the heads' outputs (Tq, d) (before out_proj): ops.attention_varlen,
        each sequence on its own."""
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
        return out.reshape(x.shape[0], self.d_model)
