"""ops.attention_varlen: attention over packed sequences of different lengths (flash-attn's varlen convention).

    q (Tq, H, D), k and v (Tk, H_kv, D): B sequences packed along the first dim, sequence b at rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and cu_seqlens_k[b] .. cu_seqlens_k[b + 1] of k and v;
    out[rows of b] = attention(q[rows of b], k[rows of b], v[rows of b]) per head, query head h reading
    key/value head h // (H / H_kv).

No padding is stored or computed: a batch of sentences of spread lengths costs the sum of their lengths
(squared), not B times the longest. Ops ``fastformer::attention_varlen_fwd`` (returns out and lse (H, Tq)) and
``attention_varlen_bwd``, the CPU kernels those of ops.attention (csrc/cpu/attention.cpp: one kernel for dense
and packed sequences), checks in C++ (csrc/ops.h check_attention_varlen), autograd in C++
(csrc/autograd/attention_varlen.cpp); the ``_py`` twins (torch, triton, cuda_sim) and the fake kernels here.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastformer import _dispatch
from fastformer.ops import _registry
from fastformer.ops._registry import C, dropout_seed, out_like


def _fake_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p, scale, seed):
    _registry.same_device("attention_varlen", "q", q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    C.check_seed(seed, dropout_p, q, "attention_varlen")
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype)


def _fake_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p,
              scale, seed):
    C.check_seed(seed, dropout_p, q, "attention_varlen")
    return out_like(q), out_like(k), out_like(v)


def _py_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p, scale, seed, backend):
    scale = C.check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale)
    C.check_seed(seed, dropout_p, q, "attention_varlen")
    impl = _dispatch.implementation("attention_varlen", "fwd", backend)
    rows = C.attention_varlen_layout
    return impl(rows(q), rows(k), rows(v), cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q,
                max_seqlen_k, causal, dropout_p, scale, seed)


def _py_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p, scale,
            seed, backend):
    C.check_attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 dropout_p)
    scale = C.check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale)
    C.check_seed(seed, dropout_p, q, "attention_varlen")
    impl = _dispatch.implementation("attention_varlen", "bwd", backend)
    rows = C.attention_varlen_layout
    return impl(rows(dout), rows(q), rows(k), rows(v), rows(out), lse.contiguous(), cu_seqlens_q.contiguous(),
                cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k, causal, dropout_p, scale, seed)


_registry.register("attention_varlen", fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, py_fwd=_py_fwd, py_bwd=_py_bwd)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False, dropout_p: float = 0.0, scale: Optional[float] = None,
                     backend: Optional[str] = None) -> Tensor:
    """Attention over packed sequences (flash-attn's ``flash_attn_varlen_func`` convention).

    q (Tq, H, D); k, v (Tk, H_kv, D) with H a multiple of H_kv (grouped-query attention, read in place);
    cu_seqlens_q, cu_seqlens_k int32 (B + 1) on q's device, 0 first, non-decreasing, the totals Tq and Tk last:
    sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k
    and v. max_seqlen_q, max_seqlen_k: at least the longest sequence's lengths (the GPU kernels size their grid
    by them). causal aligns bottom-right per sequence: query i of sequence b sees key j iff
    j <= i + (Lk_b - Lq_b). Empty sequences are allowed; a query with no visible key gives zeros. Returns
    (Tq, H, D). q, k, v may be strided views (the heads of a packed (T, 3, H, D) projection) with the last dim
    contiguous. Dropout: element (b, h, i, j) of the probabilities is element (h Tq + cu_seqlens_q[b] + i) Tk + j
    of the Philox stream every backend shares (docs/api.md). On a GPU the tables' values are checked on the
    host (a sync) except while a CUDA graph is being captured; the kernels never read outside the tensors.
    """
    try:
        fwd = _dispatch.forward("attention_varlen", backend, q)
        seed = dropout_seed(dropout_p, "attention_varlen", q)
        return fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal), dropout_p, scale,
                   seed)[0]
    except (TypeError, ValueError, RuntimeError):
        _registry.check_types("attention_varlen", locals())
        raise
