"""MultiHeadAttention on ops.attention (the incremental decoder of fastformer/nn/decoding.py keeps its own
key/value caches)."""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from fastformer import ops
from fastformer.nn.linear import Linear


class MultiHeadAttention(nn.Module):
    """Multi-head attention: self-attention with one fused QKV projection (d -> 3d), or
    cross-attention with a query projection and one fused KV projection (d -> 2d) of the memory.

    Shapes: x (B, Lq, d); memory (B, Lk, d); key_padding_mask (B, Lk) bool, True = padding.
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
        reference backend copies on both sides)."""
        B, L, _ = x.shape
        parts = x.view(B, L, n, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return tuple(parts[i] for i in range(n))

    def forward(self, x: Tensor, memory: Optional[Tensor] = None, *, key_padding_mask: Optional[Tensor] = None,
                causal: bool = False) -> Tensor:
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

