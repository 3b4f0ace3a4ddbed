"""Fused masked scaled dot-product attention in Triton, forward and backward (FlashAttention-2).

Shapes: q (B, H, Lq, D), k and v (B, H, Lk, D); key padding mask (B, Lk) bool; out like q; lse (B, H, Lq)
float32. D is padded to BLOCK_D (a power of two >= 16) with masked loads; D <= 128.
Layout (the rule of the CPU and CUDA kernels, csrc/ops.h attention_layout): q, k, v, out and dout are read
in place at their batch, head and row strides (kernel arguments; the last dim contiguous), e.g. views
(B, H, L, D) of (B, L, H, D) projections; out, dq, dk, dv are written as (B, H, L, D) views of contiguous
(B, L, H, D) tensors (rows_like), whatever the inputs' layout; lse and delta are contiguous (B, H, Lq).

Forward, grid (ceil(Lq / BLOCK_M), B H): a BLOCK_M tile of queries stays in registers while the program
walks key blocks up to the tile's causal limit (blocks above the diagonal are never visited):
  S = scale Q K^T (tl.dot), invisible keys -> -inf, online softmax m, l, acc = acc e^(m - m') + P r V
writes O = acc / l and lse = m + log l (-inf and O = 0 for a row with no visible key or only -inf scores;
NaN for a row with a NaN or +inf visible score; invisible keys are ignored whatever their scores).
Bytes moved: Q, O once; K, V once per query tile: (2 Lq + 2 Lk ceil(Lq / BLOCK_M)) D sizeof(T) per (b, h).
Backward: a preprocessing kernel forms delta = rowsum(dO O); one kernel per key block accumulates dK, dV
over the query tiles that can see it; one kernel per query tile accumulates dQ over its key blocks. No
atomics, no Lq x Lk matrix; probabilities are recomputed from lse: P = e^(S - lse). Bytes moved per (b, h):
the dK/dV kernel reads K, V once and Q, dO once per key block, (2 Lk + 2 Lq ceil(Lk / BLOCK_N)) D sizeof(T),
and writes dK, dV; the dQ kernel reads Q, dO once and K, V once per query tile, (2 Lq + 2 Lk
ceil(Lq / BLOCK_M)) D sizeof(T), and writes dQ; both also read lse and delta (4 bytes per row).
Dropout keeps element (b, h, i, j) of P when dropout_keep(seed, ((b H + h) Lq + i) Lk + j) is true,
the same Philox stream as every other backend (_common.dropout_keep_rows: one Philox evaluation per 4
probabilities when Lk is a multiple of 4). Each program reads the seed from the op's 0-dim int64 seed
tensor (_common.load_seed: device memory, never a launch argument, so a replayed CUDA graph draws a new
mask).

Tiles: BLOCK_M, BLOCK_N, warps and pipeline stages are autotuned (fastformer/triton/_common.py lists the
candidates) once per (length bucket, head dim, mask, causal, dropout, dtype). With a key padding mask,
key tiles whose keys are all padding are skipped (no loads, no dots): in the forward and the dQ kernel
the tile is passed over, and a dK/dV program whose key block is all padding only writes zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastformer._ext import C
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
def _slice(ptr, bh, H, stride_b, stride_h):
    """Row 0 of the (b, h) = divmod(bh, H) slice of a (B, H, L, D) tensor at batch and head strides (int64 bh)."""
    return ptr + (bh // H) * stride_b + (bh % H) * stride_h


@triton.jit
def _rows(ptr, stride_l, offs, offs_d):
    """Pointers to columns ``offs_d`` of rows ``offs`` of one (b, h) slice (row 0 at ptr, row stride stride_l)."""
    return ptr + offs[:, None].to(tl.int64) * stride_l + offs_d[None, :]


@triton.jit
def _load_tile(ptr, stride_l, L, offs, offs_d, D, UPCAST: tl.constexpr):
    """Rows ``offs`` of one (b, h) slice (row 0 at ptr) as a (rows, BLOCK_D) tile, zero-padded."""
    tile = tl.load(_rows(ptr, stride_l, offs, offs_d), mask=(offs[:, None] < L) & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _scores(q, k, kpm_row, offs_m, offs_n, Lq, Lk, scale, HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr,
            IEEE: tl.constexpr):
    """S = scale q k^T for one (BLOCK_M x BLOCK_N) tile, and which entries are visible."""
    s = _dot(q, tl.trans(k), IEEE) * scale
    visible = (offs_n[None, :] < Lk) & (offs_m[:, None] < Lq)
    if HAS_KPM:
        pad = tl.load(kpm_row + offs_n, mask=offs_n < Lk, other=1).to(tl.int1)
        visible = visible & ~pad[None, :]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + (Lk - Lq))
    return s, visible


@triton.jit
def _any_key(kpm_row, offs_n, Lk, HAS_KPM: tl.constexpr):
    """Whether keys ``offs_n`` hold one that is not padding (always, without a mask)."""
    if HAS_KPM:
        pad = tl.load(kpm_row + offs_n, mask=offs_n < Lk, other=1).to(tl.int1)
        return tl.sum((~pad).to(tl.int32), 0) > 0
    return Lk > 0  # every tile the loops visit holds keys


@triton.jit
def _causal_key_end(tile, Lq, Lk, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys past the diagonal of a query tile's last row are invisible to the whole tile."""
    if CAUSAL:
        return tl.minimum(Lk, tl.maximum(0, (tile + 1) * BLOCK_M - 1 + Lk - Lq + 1))
    return Lk


@attention_autotune("fwd")
@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D)
    kpm_ptr,  # (B, Lk) bool key padding mask (unused if not HAS_KPM)
    o_ptr,  # (B, H, Lq, D) output
    lse_ptr,  # (B, H, Lq) float32 row logsumexp, output
    stride_qb, stride_qh, stride_ql,  # element strides (batch, head, row) of q; the last dim is contiguous
    stride_kb, stride_kh, stride_kl,  # of k
    stride_vb, stride_vh, stride_vl,  # of v
    stride_ob, stride_oh, stride_ol,  # of o
    H, Lq, Lk, D,  # sizes
    scale,  # softmax scale
    p,  # dropout probability
    seed_ptr,  # () int64 dropout seed, read once per program (unused if not HAS_DROPOUT)
    L_BUCKET,  # autotuning key only: next power of two of max(Lq, Lk)
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, GROUPS_OF_4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_bh = _slice(k_ptr, bh, H, stride_kb, stride_kh)  # row 0 of this (b, h)
    v_bh = _slice(v_ptr, bh, H, stride_vb, stride_vh)
    q = _load_tile(_slice(q_ptr, bh, H, stride_qb, stride_qh), stride_ql, Lq, offs_m, offs_d, D, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bad = tl.zeros([BLOCK_M], tl.int32)  # per row: saw a NaN or +inf visible score
    kpm_row = kpm_ptr + (bh // H) * Lk
    seed = load_seed(seed_ptr, HAS_DROPOUT)
    for start_n in range(0, _causal_key_end(tile, Lq, Lk, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if _any_key(kpm_row, offs_n, Lk, HAS_KPM):  # an all-padding tile changes nothing: skipped
            k = _load_tile(k_bh, stride_kl, Lk, offs_n, offs_d, D, UPCAST)
            s, visible = _scores(q, k, kpm_row, offs_m, offs_n, Lq, Lk, scale, HAS_KPM, CAUSAL, IEEE)
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
                keep = dropout_keep_rows(seed, bh * Lq + offs_m, start_n, Lk, p, BLOCK_M, BLOCK_N, GROUPS_OF_4)
                prob = tl.where(keep, prob / (1.0 - p), 0.0)
            v = _load_tile(v_bh, stride_vl, Lk, offs_n, offs_d, D, UPCAST)
            acc = acc * alpha[:, None] + _dot(prob.to(v.dtype), v, IEEE)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    # A NaN or +inf visible score: the row's out and lse are NaN (as PyTorch's softmax gives).
    out = tl.where(bad[:, None] > 0, float("nan"), out)
    lse = tl.where(bad > 0, float("nan"), lse)
    tl.store(_rows(_slice(o_ptr, bh, H, stride_ob, stride_oh), stride_ol, offs_m, offs_d),
             out.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))
    tl.store(lse_ptr + bh * Lq + offs_m, lse, mask=offs_m < Lq)


@triton.jit
def _attn_bwd_preprocess(
    o_ptr, do_ptr,  # (B, H, Lq, D) output and its gradient
    delta_ptr,  # (B, H, Lq) float32 rowsum(dO O), output
    stride_ob, stride_oh, stride_ol,  # element strides (batch, head, row) of o; the last dim is contiguous
    stride_dob, stride_doh, stride_dol,  # of do
    H, Lq, D,  # sizes
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_m[:, None] < Lq) & (offs_d[None, :] < D)
    o = tl.load(_rows(_slice(o_ptr, bh, H, stride_ob, stride_oh), stride_ol, offs_m, offs_d), mask=inside,
                other=0.0).to(tl.float32)
    do = tl.load(_rows(_slice(do_ptr, bh, H, stride_dob, stride_doh), stride_dol, offs_m, offs_d), mask=inside,
                 other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh * Lq + offs_m, tl.sum(o * do, 1), mask=offs_m < Lq)


@triton.jit
def _backward_tile(q, do, k, v, kpm_row, lse, delta, offs_m, start_n, bh, Lq, Lk, scale, p, seed,
                   HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr,
                   GROUPS_OF_4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For one (query tile offs_m, key block start_n + [0, BLOCK_N)): P r (the dropped probabilities, for dV) and
    dS = P (dP r - delta) with dP = dO V^T, P = e^(S - lse) recomputed (0 where invisible or where the
    row saw nothing, lse = -inf)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    s, visible = _scores(q, k, kpm_row, offs_m, offs_n, Lq, Lk, scale, HAS_KPM, CAUSAL, IEEE)
    seen = lse != float("-inf")  # a NaN lse (a NaN or +inf score in the forward) gives NaN gradients
    prob = tl.where(visible & seen[:, None], tl.exp(s - tl.where(seen, lse, 0.0)[:, None]), 0.0)
    dp = _dot(do, tl.trans(v), IEEE)
    prob_dropped = prob
    if HAS_DROPOUT:
        keep = dropout_keep_rows(seed, bh * Lq + offs_m, start_n, Lk, p, BLOCK_M, BLOCK_N, GROUPS_OF_4)
        prob_dropped = tl.where(keep, prob / (1.0 - p), 0.0)
        dp = tl.where(keep, dp / (1.0 - p), 0.0)
    return prob_dropped, prob * (dp - delta[:, None])


@attention_autotune("bwd")
@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, kpm_ptr,  # as in the forward
    do_ptr,  # (B, H, Lq, D) gradient of the output
    lse_ptr, delta_ptr,  # (B, H, Lq) float32
    dk_ptr, dv_ptr,  # (B, H, Lk, D) outputs
    stride_qb, stride_qh, stride_ql,  # element strides (batch, head, row) of q; the last dim is contiguous
    stride_kb, stride_kh, stride_kl,  # of k
    stride_vb, stride_vh, stride_vl,  # of v
    stride_dob, stride_doh, stride_dol,  # of do
    stride_dkb, stride_dkh, stride_dkl,  # of dk
    stride_dvb, stride_dvh, stride_dvl,  # of dv
    H, Lq, Lk, D, scale, p, seed_ptr, L_BUCKET,
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, GROUPS_OF_4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_bh = _slice(q_ptr, bh, H, stride_qb, stride_qh)  # row 0 of this (b, h)
    do_bh = _slice(do_ptr, bh, H, stride_dob, stride_doh)
    k = _load_tile(_slice(k_ptr, bh, H, stride_kb, stride_kh), stride_kl, Lk, offs_n, offs_d, D, UPCAST)
    v = _load_tile(_slice(v_ptr, bh, H, stride_vb, stride_vh), stride_vl, Lk, offs_n, offs_d, D, UPCAST)
    kpm_row = kpm_ptr + (bh // H) * Lk
    seed = load_seed(seed_ptr, HAS_DROPOUT)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first_m = 0
    if CAUSAL:  # queries before this block's first key's diagonal see none of it
        first_m = tl.maximum(0, block * BLOCK_N - (Lk - Lq)) // BLOCK_M * BLOCK_M
    first_m = tl.where(_any_key(kpm_row, offs_n, Lk, HAS_KPM), first_m, Lq)  # all padding: dK = dV = 0
    for start_m in range(first_m, Lq, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(q_bh, stride_ql, Lq, offs_m, offs_d, D, UPCAST)
        do = _load_tile(do_bh, stride_dol, Lq, offs_m, offs_d, D, UPCAST)
        lse = tl.load(lse_ptr + bh * Lq + offs_m, mask=offs_m < Lq, other=float("-inf"))
        delta = tl.load(delta_ptr + bh * Lq + offs_m, mask=offs_m < Lq, other=0.0)
        prob_dropped, ds = _backward_tile(q, do, k, v, kpm_row, lse, delta, offs_m, block * BLOCK_N, bh, Lq, Lk,
                                          scale, p, seed, HAS_KPM, CAUSAL, HAS_DROPOUT, IEEE, GROUPS_OF_4, BLOCK_M,
                                          BLOCK_N)
        dv += _dot(tl.trans(prob_dropped.to(do.dtype)), do, IEEE)
        dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
    kv_mask = (offs_n[:, None] < Lk) & (offs_d[None, :] < D)
    tl.store(_rows(_slice(dk_ptr, bh, H, stride_dkb, stride_dkh), stride_dkl, offs_n, offs_d),
             (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(_rows(_slice(dv_ptr, bh, H, stride_dvb, stride_dvh), stride_dvl, offs_n, offs_d),
             dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@attention_autotune("bwd")
@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, kpm_ptr, do_ptr, lse_ptr, delta_ptr,  # as in the dK/dV kernel
    dq_ptr,  # (B, H, Lq, D) output
    stride_qb, stride_qh, stride_ql,  # element strides (batch, head, row) of q; the last dim is contiguous
    stride_kb, stride_kh, stride_kl,  # of k
    stride_vb, stride_vh, stride_vl,  # of v
    stride_dob, stride_doh, stride_dol,  # of do
    stride_dqb, stride_dqh, stride_dql,  # of dq
    H, Lq, Lk, D, scale, p, seed_ptr, L_BUCKET,
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, GROUPS_OF_4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_bh = _slice(k_ptr, bh, H, stride_kb, stride_kh)  # row 0 of this (b, h)
    v_bh = _slice(v_ptr, bh, H, stride_vb, stride_vh)
    q = _load_tile(_slice(q_ptr, bh, H, stride_qb, stride_qh), stride_ql, Lq, offs_m, offs_d, D, UPCAST)
    do = _load_tile(_slice(do_ptr, bh, H, stride_dob, stride_doh), stride_dol, Lq, offs_m, offs_d, D, UPCAST)
    lse = tl.load(lse_ptr + bh * Lq + offs_m, mask=offs_m < Lq, other=float("-inf"))
    delta = tl.load(delta_ptr + bh * Lq + offs_m, mask=offs_m < Lq, other=0.0)
    kpm_row = kpm_ptr + (bh // H) * Lk
    seed = load_seed(seed_ptr, HAS_DROPOUT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, _causal_key_end(tile, Lq, Lk, BLOCK_M, CAUSAL), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if _any_key(kpm_row, offs_n, Lk, HAS_KPM):  # an all-padding tile adds nothing: skipped
            k = _load_tile(k_bh, stride_kl, Lk, offs_n, offs_d, D, UPCAST)
            v = _load_tile(v_bh, stride_vl, Lk, offs_n, offs_d, D, UPCAST)
            _, ds = _backward_tile(q, do, k, v, kpm_row, lse, delta, offs_m, start_n, bh, Lq, Lk, scale, p, seed,
                                   HAS_KPM, CAUSAL, HAS_DROPOUT, IEEE, GROUPS_OF_4, BLOCK_M, BLOCK_N)
            dq += _dot(ds.to(k.dtype), k, IEEE)
    tl.store(_rows(_slice(dq_ptr, bh, H, stride_dqb, stride_dqh), stride_dql, offs_m, offs_d),
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))


def _flags(q, k, key_padding_mask, causal, dropout_p):
    D = q.shape[-1]
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"fastformer attention (triton): head dim {D} is not supported; use 1 to {MAX_HEAD_DIM}")
    return dict(HAS_KPM=key_padding_mask is not None, CAUSAL=bool(causal), HAS_DROPOUT=dropout_p > 0,
                UPCAST=upcast_dot(q.dtype), IEEE=q.dtype == torch.float32, BLOCK_D=attention_block_d(D),
                GROUPS_OF_4=k.shape[2] % 4 == 0)  # Lk % 4 == 0: one Philox evaluation per 4 probabilities


def rows_like(x):
    """out, dq, dk, dv shaped like x (B, H, L, D): a view of a contiguous (B, L, H, D) tensor, the layout every
    kernel backend writes (csrc/cpu/attention.cpp rows_like, fastformer/ops/attention.py's fake kernels)."""
    B, H, L, D = x.shape
    return x.new_empty(B, L, H, D).transpose(1, 2)


def _strides(t):
    """The (batch, head, row) element strides of t (B, H, L, D) as the kernels take them (last dim contiguous)."""
    return t.stride(0), t.stride(1), t.stride(2)


def attention_fwd(q, k, v, key_padding_mask, causal: bool, dropout_p: float, scale: float, seed):
    check("attention", q, k, v)
    q, k, v = C.attention_layout(q), C.attention_layout(k), C.attention_layout(v)  # in place, unless D is strided
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    out = rows_like(q)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    if q.numel() == 0 or Lk == 0:  # nothing to compute (head dim 0 too): empty or zero rows, lse = -inf
        return out.zero_(), lse.fill_(float("-inf"))
    flags = _flags(q, k, key_padding_mask, causal, dropout_p)
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else q
    grid = lambda meta: (triton.cdiv(Lq, meta["BLOCK_M"]), B * H)  # noqa: E731
    _attn_fwd_kernel[grid](q, k, v, kpm, out, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(out), H, Lq,
                           Lk, D, scale, dropout_p, seed_pointer(seed, lse), length_bucket(max(Lq, Lk)), **flags)
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, key_padding_mask, causal: bool, dropout_p: float, scale: float, seed):
    check("attention", dout, q, k, v, out)
    dout, q, k, v, out = (C.attention_layout(t) for t in (dout, q, k, v, out))
    lse = lse.contiguous()
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    dq, dk, dv = rows_like(q), rows_like(k), rows_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    flags = _flags(q, k, key_padding_mask, causal, dropout_p)
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else q
    delta = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    _attn_bwd_preprocess[(triton.cdiv(Lq, 64), B * H)](out, dout, delta, *_strides(out), *_strides(dout), H, Lq, D,
                                                       BLOCK_M=64, BLOCK_D=flags["BLOCK_D"])
    bucket = length_bucket(max(Lq, Lk))
    seed = seed_pointer(seed, lse)
    _attn_bwd_dkdv_kernel[lambda meta: (triton.cdiv(Lk, meta["BLOCK_N"]), B * H)](
        q, k, v, kpm, dout, lse, delta, dk, dv, *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
        *_strides(dk), *_strides(dv), H, Lq, Lk, D, scale, dropout_p, seed, bucket, **flags)
    _attn_bwd_dq_kernel[lambda meta: (triton.cdiv(Lq, meta["BLOCK_M"]), B * H)](
        q, k, v, kpm, dout, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq),
        H, Lq, Lk, D, scale, dropout_p, seed, bucket, **flags)
    return dq, dk, dv
