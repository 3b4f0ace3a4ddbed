"""Attention over packed sequences in Triton (ops.attention_varlen): the kernels of fastformer/triton/attention.py
with VARLEN, whose docstring gives the algorithm, the indexing and the bytes moved.

q (Tq, H, D), k and v (Tk, H_kv, D) read in place at their row and head strides (e.g. the heads of a packed
(T, 3, H, D) projection); int32 cu_seqlens_q, cu_seqlens_k (B + 1) read by the kernels from device memory
(never on the host: a call records into a launch plan and replays in a CUDA graph); their values are checked
before the call (csrc/ops.h), on the device and reported later in the deferred mode (csrc/value_checks.h), and
the kernels clamp every sequence into the tensors (attention.py _sequence). Sequence b is rows
cu_q[b] .. cu_q[b + 1] of q and cu_k[b] .. cu_k[b + 1] of k and v; query head h reads kv head h // (H / H_kv);
causal bottom-right per sequence. Outputs: out (Tq, H, D) and lse (H, Tq) float32; backward dq (Tq, H, D),
dk and dv (Tk, H_kv, D), all contiguous. Grids: ceil(max_seqlen / BLOCK) tiles x B H programs (dK/dV:
B H_kv), so max_seqlen_q and max_seqlen_k size the launches and the autotuning length bucket; a program past
its sequence's end returns at once. Bytes moved: those of attention summed over the sequences, no padding.
Dropout element (b, h, i, j) is Philox element (h Tq + cu_q[b] + i) Tk + j (csrc/cpu/attention.cpp).
"""
from __future__ import annotations

import torch

from fastformer._ext import C
from fastformer.triton._common import check, length_bucket
from fastformer.triton.attention import backward, forward


def _packed(*tensors):
    """The packed tensors as the kernels take them (csrc/ops.h attention_varlen_layout: in place, unless the
    rows overlap or D is strided)."""
    return (C.attention_varlen_layout(t) for t in tensors)


def attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                         dropout_p: float, scale: float, seed):
    check("attention_varlen", q, k, v)
    q, k, v = _packed(q, k, v)
    Tq, H, D = q.shape
    Tk = k.shape[0]
    out = q.new_empty(Tq, H, D)
    lse = torch.empty(H, Tq, dtype=torch.float32, device=q.device)
    if q.numel() == 0 or k.numel() == 0:  # no query, or no key at all: zero rows, lse = -inf
        return out.zero_(), lse.fill_(float("-inf"))
    forward(q, k, v, out, lse, None, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), cu_seqlens_q.shape[0] - 1,
            Tq, Tk, max_seqlen_q, length_bucket(max(max_seqlen_q, max_seqlen_k)), causal, dropout_p, scale, seed)
    return out, lse


def attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                         causal: bool, dropout_p: float, scale: float, seed):
    check("attention_varlen", dout, q, k, v, out)
    dout, q, k, v, out = _packed(dout, q, k, v, out)
    lse = lse.contiguous()
    Tq, Tk = q.shape[0], k.shape[0]
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    backward(dout, q, k, v, out, lse, None, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), dq, dk, dv,
             cu_seqlens_q.shape[0] - 1, Tq, Tk, max_seqlen_q, max_seqlen_k,
             length_bucket(max(max_seqlen_q, max_seqlen_k)), causal, dropout_p, scale, seed)
    return dq, dk, dv
