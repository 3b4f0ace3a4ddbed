"""Fused masked scaled dot-product attention in Triton, forward and backward (FlashAttention-2), for dense
batches (ops.attention) and packed sequences (ops.attention_varlen, fastformer/triton/attention_varlen.py):
one set of kernels, the packed case chosen by the constexpr VARLEN.

Shapes, dense: q (B, H, Lq, D), k and v (B, H_kv, Lk, D) with H a multiple of H_kv (grouped-query attention:
query head h reads key/value head h // (H / H_kv), in place, no repeated copies); key padding mask (B, Lk)
bool; out like q; lse (B, H, Lq) float32; dk, dv like k. Packed (VARLEN): q (Tq, H, D), k and v (Tk, H_kv, D),
int32 tables cu_seqlens_q, cu_seqlens_k (B + 1): sequence b is rows cu_q[b] .. cu_q[b + 1] of q and
cu_k[b] .. cu_k[b + 1] of k and v, each attended as a dense (1, H, Lq_b, D) problem; out like q, lse (H, Tq)
float32 (flash-attn's layout). D is padded to BLOCK_D (a power of two >= 16) with masked loads; D <= 128.
Layout (the rule of the CPU and CUDA kernels, csrc/ops.h attention_layout and attention_varlen_layout): q, k,
v, out and dout are read in place at their batch, head and row strides (kernel arguments; the last dim
contiguous), e.g. views (B, H, L, D) of (B, L, H, D) projections, or the heads of a packed (T, 3, H, D) one;
a packed tensor is one batch whose sequences start at row offsets (batch stride 0, the program's first row
from the table). Dense out, dq, dk, dv are written as (B, H, L, D) views of contiguous (B, L, H, D) tensors
(rows_like; a packed projection's parts get the parts of one packed gradient: grads_like, csrc/attention_grads.h),
packed ones contiguous (T, H, D), whatever the inputs' layout; lse and delta are contiguous.

Which rows a program works on: program column b H + h (the dK/dV kernel: b H_kv + kv head) is batch or
sequence b, query head h, kv head h // group. Packed: its rows come from the tables, each clamped into
[0, T] so that no table can make a program read or write outside the tensors; the grid covers
ceil(max_seqlen / BLOCK) tiles and a program past its sequence's end returns at once. Causal is
bottom-right per sequence: query i sees key j iff j <= i + (Lk_b - Lq_b). Row (b, h, i)'s entry of lse,
delta and the dropout rows is (b H + h) Lq + i dense, h Tq + cu_q[b] + i packed (csrc/cpu/attention.cpp
Seqs::lse_index).

Forward, grid (ceil(Lq / BLOCK_M), B H): a BLOCK_M tile of queries stays in registers while the program
walks key blocks up to the tile's causal limit (blocks above the diagonal are never visited):
  S = scale Q K^T (tl.dot), invisible keys -> -inf, online softmax m, l, acc = acc e^(m - m') + P r V
writes O = acc / l and lse = m + log l (-inf and O = 0 for a row with no visible key or only -inf scores;
NaN for a row with a NaN or +inf visible score; invisible keys are ignored whatever their scores).
Bytes moved: Q, O once; K, V once per query tile: (2 Lq + 2 Lk ceil(Lq / BLOCK_M)) D sizeof(T) per (b, h)
(packed: per sequence and head, Lq and Lk its lengths).
Backward: a preprocessing kernel forms delta = rowsum(dO O); one kernel per key block and kv head accumulates
dK, dV in registers over the group's query heads and the query tiles that can see the block; one kernel per
query tile accumulates dQ over its key blocks. No atomics (deterministic), no Lq x Lk matrix; probabilities
are recomputed from lse: P = e^(S - lse). Bytes moved per (b, kv head): the dK/dV kernel reads K, V once and
Q, dO of the group's heads once per key block, (2 Lk + 2 group Lq ceil(Lk / BLOCK_N)) D sizeof(T), and writes
dK, dV; per (b, h) the dQ kernel reads Q, dO once and K, V once per query tile, (2 Lq + 2 Lk
ceil(Lq / BLOCK_M)) D sizeof(T), and writes dQ; both also read lse and delta (4 bytes per row).
Dropout keeps element (b, h, i, j) of P when dropout_keep(seed, r Lk + j) is true, r the row's lse index
above and Lk the key count (packed: the total Tk), h the query head: the same Philox stream as every other
backend (_common.dropout_keep_rows: one Philox evaluation per 4 probabilities when Lk, or Tk, is a multiple
of 4). Each program reads the seed from the op's 0-dim int64 seed tensor (_common.load_seed: device memory,
never a launch argument, so a replayed CUDA graph draws a new mask).

Tiles: BLOCK_M, BLOCK_N, warps and pipeline stages are autotuned (fastformer/triton/_common.py lists the
candidates) once per (length bucket, head dim, mask, causal, dropout, varlen, dtype); packed calls bucket
by max(max_seqlen_q, max_seqlen_k). With a key padding mask, key tiles whose keys are all padding are
skipped (no loads, no dots): in the forward and the dQ kernel the tile is passed over, and a dK/dV program
whose key block is all padding only writes zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastformer._ext import C
from fastformer.ops.attention import grads_like, rows_like  # the kernels' output layout, one rule
from fastformer.triton._common import (
    MAX_HEAD_DIM,
    attention_autotune,
    attention_block_d,
    check,
    dropout_keep_rows,
    length_bucket,
    load_seed,
    seed_pointer,
    upcast_dot,
)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in float32; float32 inputs use exact IEEE products (not TF32) when IEEE."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _sequence(cu_q_ptr, cu_k_ptr, b, Lq, Lk, VARLEN: tl.constexpr):
    """(first query row, query rows, first key row, key rows) of batch or sequence b: packed,
    rows cu[b] .. cu[b + 1] of the tables, clamped into [0, Lq] and [0, Lk] (the totals Tq, Tk) so that a bad
    table cannot make a program leave the tensors; dense, the whole (b, h) slices (0, Lq, 0, Lk)."""
    if VARLEN:
        start_q = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b), 0), Lq)
        lq = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b + 1), start_q), Lq) - start_q
        start_k = tl.minimum(tl.maximum(tl.load(cu_k_ptr + b), 0), Lk)
        lk = tl.minimum(tl.maximum(tl.load(cu_k_ptr + b + 1), start_k), Lk) - start_k
        first_q, first_k = start_q.to(tl.int64), start_k.to(tl.int64)  # row offsets times strides: no overflow
    else:
        first_q, lq, first_k, lk = 0, Lq, 0, Lk
    return first_q, lq, first_k, lk


@triton.jit
def _stat_row(b, h, H, Lq, first_q, VARLEN: tl.constexpr):
    """Index of query row 0 of (b, h) in lse and delta, and its dropout row: (b H + h) Lq in a dense
    (B, H, Lq) table, h Tq + cu_q[b] in a packed (H, Tq) one (Lq = Tq)."""
    if VARLEN:
        return h * Lq + first_q
    return (b * H + h) * Lq


@triton.jit
def _head(ptr, b, h, first, stride_b, stride_h, stride_l):
    """Row ``first`` of head h of batch b (packed: stride_b 0, first the sequence's first row) of a tensor read
    at its batch, head and row strides."""
    return ptr + b * stride_b + h * stride_h + first * stride_l


@triton.jit
def _rows(ptr, stride_l, offs, offs_d):
    """Pointers to columns ``offs_d`` of rows ``offs`` of one (b, h) slice (row 0 at ptr, row stride stride_l)."""
    return ptr + offs[:, None].to(tl.int64) * stride_l + offs_d[None, :]


@triton.jit
def _load_tile(ptr, stride_l, L, offs, offs_d, D, UPCAST: tl.constexpr):
    """Rows ``offs`` of one (b, h) slice (row 0 at ptr) as a (rows, BLOCK_D) tile, zero-padded past row L."""
    tile = tl.load(_rows(ptr, stride_l, offs, offs_d), mask=(offs[:, None] < L) & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _scores(q, k, kpm_row, offs_m, offs_n, lq, lk, scale, HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr,
            IEEE: tl.constexpr):
    """S = scale q k^T for one (BLOCK_M x BLOCK_N) tile of a sequence of lq queries and lk keys, and which
    entries are visible."""
    s = _dot(q, tl.trans(k), IEEE) * scale
    visible = (offs_n[None, :] < lk) & (offs_m[:, None] < lq)
    if HAS_KPM:
        pad = tl.load(kpm_row + offs_n, mask=offs_n < lk, other=1).to(tl.int1)
        visible = visible & ~pad[None, :]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + (lk - lq))
    return s, visible


@triton.jit
def _any_key(kpm_row, offs_n, lk, HAS_KPM: tl.constexpr):
    """Whether keys ``offs_n`` hold one that is not padding (always, without a mask)."""
    if HAS_KPM:
        pad = tl.load(kpm_row + offs_n, mask=offs_n < lk, other=1).to(tl.int1)
        return tl.sum((~pad).to(tl.int32), 0) > 0
    return lk > 0  # every tile the loops visit holds keys


@triton.jit
def _causal_key_end(tile, lq, lk, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys past the diagonal of a query tile's last row are invisible to the whole tile."""
    if CAUSAL:
        return tl.minimum(lk, tl.maximum(0, (tile + 1) * BLOCK_M - 1 + lk - lq + 1))
    return lk


@attention_autotune("fwd")
@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, H, Lq, D), (B, H_kv, Lk, D), (B, H_kv, Lk, D); packed (Tq, H, D), (Tk, H_kv, D)
    kpm_ptr,  # (B, Lk) bool key padding mask (unused if not HAS_KPM)
    cu_q_ptr, cu_k_ptr,  # (B + 1) int32 sequence tables (unused if not VARLEN)
    o_ptr,  # like q, output
    lse_ptr,  # (B, H, Lq) or (H, Tq) float32 row logsumexp, output
    stride_qb, stride_qh, stride_ql,  # element strides (batch (packed: 0), head, row) of q; the last dim contiguous
    stride_kb, stride_kh, stride_kl,  # of k
    stride_vb, stride_vh, stride_vl,  # of v
    stride_ob, stride_oh, stride_ol,  # of o
    H, GROUP,  # query heads, query heads per kv head
    Lq, Lk, D,  # sizes: Lq, Lk every sequence's lengths (dense) or the totals Tq, Tk (VARLEN)
    scale,  # softmax scale
    p,  # dropout probability
    seed_ptr,  # () int64 dropout seed, read once per program (unused if not HAS_DROPOUT)
    L_BUCKET,  # autotuning key only: next power of two of the longest sequence
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, GROUPS_OF_4: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    first_q, lq, first_k, lk = _sequence(cu_q_ptr, cu_k_ptr, b, Lq, Lk, VARLEN)
    if tile * BLOCK_M >= lq:  # past its sequence's end (packed: the grid covers the longest)
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of the sequence
    offs_d = tl.arange(0, BLOCK_D)
    k_bh = _head(k_ptr, b, h // GROUP, first_k, stride_kb, stride_kh, stride_kl)  # key 0 of this sequence's kv head
    v_bh = _head(v_ptr, b, h // GROUP, first_k, stride_vb, stride_vh, stride_vl)
    q = _load_tile(_head(q_ptr, b, h, first_q, stride_qb, stride_qh, stride_ql), stride_ql, lq, offs_m, offs_d, D,
                   UPCAST)
    row0 = _stat_row(b, h, H, Lq, first_q, VARLEN)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bad = tl.zeros([BLOCK_M], tl.int32)  # per row: saw a NaN or +inf visible score
    kpm_row = kpm_ptr + b * Lk
    seed = load_seed(seed_ptr, HAS_DROPOUT)
    for start_n in range(0, _causal_key_end(tile, lq, lk, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if _any_key(kpm_row, offs_n, lk, HAS_KPM):  # an all-padding tile changes nothing: skipped
            k = _load_tile(k_bh, stride_kl, lk, offs_n, offs_d, D, UPCAST)
            s, visible = _scores(q, k, kpm_row, offs_m, offs_n, lq, lk, scale, HAS_KPM, CAUSAL, IEEE)
            s = tl.where(visible, s, float("-inf"))
            unbounded = (s != s) | (s == float("inf"))
            bad = bad | tl.max(unbounded.to(tl.int32), 1)
            s = tl.where(unbounded, float("-inf"), s)  # keeps m finite; the row is set to NaN at the end
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            prob = tl.exp(s - m_safe[:, None])  # 0 where invisible
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(prob, 1)
            m_i = m_new
            if HAS_DROPOUT:
                keep = dropout_keep_rows(seed, row0 + offs_m, start_n, Lk, p, BLOCK_M, BLOCK_N, GROUPS_OF_4)
                prob = tl.where(keep, prob / (1.0 - p), 0.0)
            v = _load_tile(v_bh, stride_vl, lk, offs_n, offs_d, D, UPCAST)
            acc = acc * alpha[:, None] + _dot(prob.to(v.dtype), v, IEEE)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    # A NaN or +inf visible score: the row's out and lse are NaN (as PyTorch's softmax gives).
    out = tl.where(bad[:, None] > 0, float("nan"), out)
    lse = tl.where(bad > 0, float("nan"), lse)
    tl.store(_rows(_head(o_ptr, b, h, first_q, stride_ob, stride_oh, stride_ol), stride_ol, offs_m, offs_d),
             out.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < lq) & (offs_d[None, :] < D))
    tl.store(lse_ptr + row0 + offs_m, lse, mask=offs_m < lq)


@triton.jit
def _attn_bwd_preprocess(
    o_ptr, do_ptr,  # (B, H, Lq, D) output and its gradient (packed: (Tq, H, D), one batch of Tq rows)
    delta_ptr,  # (B, H, Lq) (packed: (H, Tq)) float32 rowsum(dO O), output
    stride_ob, stride_oh, stride_ol,  # element strides (batch, head, row) of o; the last dim is contiguous
    stride_dob, stride_doh, stride_dol,  # of do
    H, Lq, D,  # sizes
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_m[:, None] < Lq) & (offs_d[None, :] < D)
    o = tl.load(_rows(_head(o_ptr, b, h, 0, stride_ob, stride_oh, stride_ol), stride_ol, offs_m, offs_d), mask=inside,
                other=0.0).to(tl.float32)
    do = tl.load(_rows(_head(do_ptr, b, h, 0, stride_dob, stride_doh, stride_dol), stride_dol, offs_m, offs_d),
                 mask=inside, other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh * Lq + offs_m, tl.sum(o * do, 1), mask=offs_m < Lq)


@triton.jit
def _backward_tile(q, do, k, v, kpm_row, lse, delta, offs_m, start_n, row0, lq, lk, Lk, scale, p, seed,
                   HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr,
                   GROUPS_OF_4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For one (query tile offs_m, key block start_n + [0, BLOCK_N)) of a sequence of lq queries and lk keys: P r
    (the dropped probabilities, for dV) and dS = P (dP r - delta) with dP = dO V^T, P = e^(S - lse) recomputed
    (0 where invisible or where the row saw nothing, lse = -inf); dropout rows row0 + offs_m of Lk columns."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    s, visible = _scores(q, k, kpm_row, offs_m, offs_n, lq, lk, scale, HAS_KPM, CAUSAL, IEEE)
    seen = lse != float("-inf")  # a NaN lse (a NaN or +inf score in the forward) gives NaN gradients
    prob = tl.where(visible & seen[:, None], tl.exp(s - tl.where(seen, lse, 0.0)[:, None]), 0.0)
    dp = _dot(do, tl.trans(v), IEEE)
    prob_dropped = prob
    if HAS_DROPOUT:
        keep = dropout_keep_rows(seed, row0 + offs_m, start_n, Lk, p, BLOCK_M, BLOCK_N, GROUPS_OF_4)
        prob_dropped = tl.where(keep, prob / (1.0 - p), 0.0)
        dp = tl.where(keep, dp / (1.0 - p), 0.0)
    return prob_dropped, prob * (dp - delta[:, None])


@attention_autotune("bwd")
@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, kpm_ptr, cu_q_ptr, cu_k_ptr,  # as in the forward
    do_ptr,  # like q, gradient of the output
    lse_ptr, delta_ptr,  # (B, H, Lq) or (H, Tq) float32
    dk_ptr, dv_ptr,  # like k, outputs
    stride_qb, stride_qh, stride_ql,  # element strides (batch (packed: 0), head, row) of q; the last dim contiguous
    stride_kb, stride_kh, stride_kl,  # of k
    stride_vb, stride_vh, stride_vl,  # of v
    stride_dob, stride_doh, stride_dol,  # of do
    stride_dkb, stride_dkh, stride_dkl,  # of dk
    stride_dvb, stride_dvh, stride_dvl,  # of dv
    H, GROUP, Lq, Lk, D, scale, p, seed_ptr, L_BUCKET,  # as in the forward
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, GROUPS_OF_4: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    block, bhk = tl.program_id(0), tl.program_id(1).to(tl.int64)
    H_kv = H // GROUP
    b, hk = bhk // H_kv, bhk % H_kv
    first_q, lq, first_k, lk = _sequence(cu_q_ptr, cu_k_ptr, b, Lq, Lk, VARLEN)
    if block * BLOCK_N >= lk:  # past its sequence's end (packed: the grid covers the longest)
        return
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(_head(k_ptr, b, hk, first_k, stride_kb, stride_kh, stride_kl), stride_kl, lk, offs_n, offs_d, D,
                   UPCAST)
    v = _load_tile(_head(v_ptr, b, hk, first_k, stride_vb, stride_vh, stride_vl), stride_vl, lk, offs_n, offs_d, D,
                   UPCAST)
    kpm_row = kpm_ptr + b * Lk
    seed = load_seed(seed_ptr, HAS_DROPOUT)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first_m = 0
    if CAUSAL:  # queries before this block's first key's diagonal see none of it
        first_m = tl.maximum(0, block * BLOCK_N - (lk - lq)) // BLOCK_M * BLOCK_M
    first_m = tl.where(_any_key(kpm_row, offs_n, lk, HAS_KPM), first_m, lq)  # all padding: dK = dV = 0
    for g in range(0, GROUP):  # the query heads that read this kv head: summed here, in registers
        h = hk * GROUP + g
        q_bh = _head(q_ptr, b, h, first_q, stride_qb, stride_qh, stride_ql)  # query 0 of this sequence and head
        do_bh = _head(do_ptr, b, h, first_q, stride_dob, stride_doh, stride_dol)
        row0 = _stat_row(b, h, H, Lq, first_q, VARLEN)
        for start_m in range(first_m, lq, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = _load_tile(q_bh, stride_ql, lq, offs_m, offs_d, D, UPCAST)
            do = _load_tile(do_bh, stride_dol, lq, offs_m, offs_d, D, UPCAST)
            lse = tl.load(lse_ptr + row0 + offs_m, mask=offs_m < lq, other=float("-inf"))
            delta = tl.load(delta_ptr + row0 + offs_m, mask=offs_m < lq, other=0.0)
            prob_dropped, ds = _backward_tile(q, do, k, v, kpm_row, lse, delta, offs_m, block * BLOCK_N, row0, lq,
                                              lk, Lk, scale, p, seed, HAS_KPM, CAUSAL, HAS_DROPOUT, IEEE, GROUPS_OF_4,
                                              BLOCK_M, BLOCK_N)
            dv += _dot(tl.trans(prob_dropped.to(do.dtype)), do, IEEE)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
    kv_mask = (offs_n[:, None] < lk) & (offs_d[None, :] < D)
    tl.store(_rows(_head(dk_ptr, b, hk, first_k, stride_dkb, stride_dkh, stride_dkl), stride_dkl, offs_n, offs_d),
             (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(_rows(_head(dv_ptr, b, hk, first_k, stride_dvb, stride_dvh, stride_dvl), stride_dvl, offs_n, offs_d),
             dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@attention_autotune("bwd")
@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, kpm_ptr, cu_q_ptr, cu_k_ptr, do_ptr, lse_ptr, delta_ptr,  # as in the dK/dV kernel
    dq_ptr,  # like q, output
    stride_qb, stride_qh, stride_ql,  # element strides (batch (packed: 0), head, row) of q; the last dim contiguous
    stride_kb, stride_kh, stride_kl,  # of k
    stride_vb, stride_vh, stride_vl,  # of v
    stride_dob, stride_doh, stride_dol,  # of do
    stride_dqb, stride_dqh, stride_dql,  # of dq
    H, GROUP, Lq, Lk, D, scale, p, seed_ptr, L_BUCKET,  # as in the forward
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, GROUPS_OF_4: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    first_q, lq, first_k, lk = _sequence(cu_q_ptr, cu_k_ptr, b, Lq, Lk, VARLEN)
    if tile * BLOCK_M >= lq:  # past its sequence's end (packed: the grid covers the longest)
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_bh = _head(k_ptr, b, h // GROUP, first_k, stride_kb, stride_kh, stride_kl)  # key 0 of this sequence's kv head
    v_bh = _head(v_ptr, b, h // GROUP, first_k, stride_vb, stride_vh, stride_vl)
    q = _load_tile(_head(q_ptr, b, h, first_q, stride_qb, stride_qh, stride_ql), stride_ql, lq, offs_m, offs_d, D,
                   UPCAST)
    do = _load_tile(_head(do_ptr, b, h, first_q, stride_dob, stride_doh, stride_dol), stride_dol, lq, offs_m, offs_d,
                    D, UPCAST)
    row0 = _stat_row(b, h, H, Lq, first_q, VARLEN)
    lse = tl.load(lse_ptr + row0 + offs_m, mask=offs_m < lq, other=float("-inf"))
    delta = tl.load(delta_ptr + row0 + offs_m, mask=offs_m < lq, other=0.0)
    kpm_row = kpm_ptr + b * Lk
    seed = load_seed(seed_ptr, HAS_DROPOUT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, _causal_key_end(tile, lq, lk, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if _any_key(kpm_row, offs_n, lk, HAS_KPM):  # an all-padding tile adds nothing: skipped
            k = _load_tile(k_bh, stride_kl, lk, offs_n, offs_d, D, UPCAST)
            v = _load_tile(v_bh, stride_vl, lk, offs_n, offs_d, D, UPCAST)
            _, ds = _backward_tile(q, do, k, v, kpm_row, lse, delta, offs_m, start_n, row0, lq, lk, Lk, scale, p, seed,
                                   HAS_KPM, CAUSAL, HAS_DROPOUT, IEEE, GROUPS_OF_4, BLOCK_M, BLOCK_N)
            dq += _dot(ds.to(k.dtype), k, IEEE)
    tl.store(_rows(_head(dq_ptr, b, h, first_q, stride_dqb, stride_dqh, stride_dql), stride_dql, offs_m, offs_d),
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=(offs_m[:, None] < lq) & (offs_d[None, :] < D))


def _flags(q, Lk, kpm, cu_q, causal, dropout_p):
    D = q.shape[-1]
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"fastformer attention (triton): head dim {D} is not supported; use 1 to {MAX_HEAD_DIM}")
    return dict(HAS_KPM=kpm is not None, CAUSAL=bool(causal), HAS_DROPOUT=dropout_p > 0, VARLEN=cu_q is not None,
                UPCAST=upcast_dot(q.dtype), IEEE=q.dtype == torch.float32, BLOCK_D=attention_block_d(D),
                GROUPS_OF_4=Lk % 4 == 0)  # dropout rows of Lk (packed: Tk) keys: one Philox evaluation per 4


def _strides(t):
    """The (batch, head, row) element strides the kernels take (last dim contiguous): of a dense (B, H, L, D)
    tensor, or of a packed (T, H, D) one, a single batch whose sequences start at row offsets (batch stride 0)."""
    if t.dim() == 3:
        return 0, t.stride(1), t.stride(0)
    return t.stride(0), t.stride(1), t.stride(2)


def forward(q, k, v, out, lse, kpm, cu_q, cu_k, B, Lq, Lk, max_q, bucket, causal, dropout_p, scale, seed):
    """Launches the forward kernel, writing out and lse: dense (cu_q None; q (B, H, Lq, D), k, v (B, H_kv, Lk, D))
    or packed (q (Tq, H, D), k, v (Tk, H_kv, D), B sequences, Lq = Tq, Lk = Tk, max_q the longest query
    sequence); kpm (B, Lk) bool or None; bucket the autotuning length bucket."""
    H, H_kv, D = q.shape[1], k.shape[1], q.shape[-1]
    flags = _flags(q, Lk, kpm, cu_q, causal, dropout_p)
    kpm, cu_q, cu_k = (t if t is not None else q for t in (kpm, cu_q, cu_k))  # unused pointers: any tensor
    grid = lambda meta: (triton.cdiv(max_q, meta["BLOCK_M"]), B * H)  # noqa: E731
    _attn_fwd_kernel[grid](q, k, v, kpm, cu_q, cu_k, out, lse, *_strides(q), *_strides(k), *_strides(v),
                           *_strides(out), H, H // H_kv, Lq, Lk, D, scale, dropout_p, seed_pointer(seed, lse), bucket,
                           **flags)


def backward(dout, q, k, v, out, lse, kpm, cu_q, cu_k, dq, dk, dv, B, Lq, Lk, max_q, max_k, bucket, causal,
             dropout_p, scale, seed):
    """Launches the backward kernels, writing dq, dk, dv (the arguments as in ``forward``; max_k the longest key
    sequence)."""
    H, H_kv, D = q.shape[1], k.shape[1], q.shape[-1]
    flags = _flags(q, Lk, kpm, cu_q, causal, dropout_p)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)  # like lse
    # delta needs no sequences: a packed tensor is one batch of Tq rows for it.
    rows_of = 1 if cu_q is not None else B
    _attn_bwd_preprocess[(triton.cdiv(Lq, 64), rows_of * H)](out, dout, delta, *_strides(out), *_strides(dout), H,
                                                             Lq, D, BLOCK_M=64, BLOCK_D=flags["BLOCK_D"])
    kpm, cu_q, cu_k = (t if t is not None else q for t in (kpm, cu_q, cu_k))  # unused pointers: any tensor
    seed = seed_pointer(seed, lse)
    _attn_bwd_dkdv_kernel[lambda meta: (triton.cdiv(max_k, meta["BLOCK_N"]), B * H_kv)](
        q, k, v, kpm, cu_q, cu_k, dout, lse, delta, dk, dv, *_strides(q), *_strides(k), *_strides(v),
        *_strides(dout), *_strides(dk), *_strides(dv), H, H // H_kv, Lq, Lk, D, scale, dropout_p, seed, bucket,
        **flags)
    _attn_bwd_dq_kernel[lambda meta: (triton.cdiv(max_q, meta["BLOCK_M"]), B * H)](
        q, k, v, kpm, cu_q, cu_k, dout, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
        *_strides(dq), H, H // H_kv, Lq, Lk, D, scale, dropout_p, seed, bucket, **flags)


def attention_fwd(q, k, v, key_padding_mask, causal: bool, dropout_p: float, scale: float, seed):
    check("attention", q, k, v)
    q, k, v = C.attention_layout(q), C.attention_layout(k), C.attention_layout(v)  # in place, unless D is strided
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    out = rows_like(q)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    if q.numel() == 0 or Lk == 0:  # nothing to compute (head dim 0 too): empty or zero rows, lse = -inf
        return out.zero_(), lse.fill_(float("-inf"))
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else None
    forward(q, k, v, out, lse, kpm, None, None, B, Lq, Lk, Lq, length_bucket(max(Lq, Lk)), causal, dropout_p, scale,
            seed)
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, key_padding_mask, causal: bool, dropout_p: float, scale: float, seed,
                  packed_grads: int):
    check("attention", dout, q, k, v, out)
    dout, q, k, v, out = (C.attention_layout(t) for t in (dout, q, k, v, out))
    lse = lse.contiguous()
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    (dq, dk, dv), outputs = grads_like(q, k, v, packed_grads)  # a packed projection's: one packed gradient
    if q.numel() == 0 or k.numel() == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return outputs
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else None
    backward(dout, q, k, v, out, lse, kpm, None, None, dq, dk, dv, B, Lq, Lk, Lq, Lk, length_bucket(max(Lq, Lk)),
             causal, dropout_p, scale, seed)
    return outputs
