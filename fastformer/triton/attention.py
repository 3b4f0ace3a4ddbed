"""Fused masked scaled dot-product attention in Triton, forward and backward (FlashAttention-2).

Shapes: q (B, H, Lq, D), k and v (B, H, Lk, D) contiguous; key padding mask (B, Lk) bool; out like q;
lse (B, H, Lq) float32. D is padded to BLOCK_D (a power of two >= 16) with masked loads; D <= 128.

Forward, grid (ceil(Lq / BLOCK_M), B H): a BLOCK_M tile of queries stays in registers while the program
walks key blocks up to the tile's causal limit (blocks above the diagonal are never visited):
  S = scale Q K^T (tl.dot), invisible keys -> -inf, online softmax m, l, acc = acc e^(m - m') + P r V
writes O = acc / l and lse = m + log l (-inf and O = 0 for a row with no visible key).
Bytes moved: Q, O once; K, V once per query tile: (2 Lq + 2 Lk ceil(Lq / BLOCK_M)) D sizeof(T) per (b, h).
Backward: a preprocessing kernel forms delta = rowsum(dO O); one kernel per key block accumulates dK, dV
over the query tiles that can see it; one kernel per query tile accumulates dQ over its key blocks. No
atomics, no Lq x Lk matrix; probabilities are recomputed from lse: P = e^(S - lse).
Dropout keeps element (b, h, i, j) of P when dropout_keep(seed, ((b H + h) Lq + i) Lk + j) is true,
the same Philox stream as every other backend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastformer.triton._common import MAX_HEAD_DIM, attention_blocks, check, dropout_keep, upcast_dot


@triton.jit
def _scores(q, k_ptrs, kpm_row, offs_m, offs_n, Lq, Lk, d_inside, scale, HAS_KPM: tl.constexpr,
            CAUSAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """S = scale q k^T for one (BLOCK_M x BLOCK_N) tile, and which entries are visible."""
    k = tl.load(k_ptrs, mask=(offs_n[:, None] < Lk) & d_inside[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    visible = (offs_n[None, :] < Lk) & (offs_m[:, None] < Lq)
    if HAS_KPM:
        pad = tl.load(kpm_row + offs_n, mask=offs_n < Lk, other=1).to(tl.int1)
        visible = visible & ~pad[None, :]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + (Lk - Lq))
    return s, visible


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D)
    kpm_ptr,  # (B, Lk) bool key padding mask (unused if not HAS_KPM)
    o_ptr,  # (B, H, Lq, D) output
    lse_ptr,  # (B, H, Lq) float32 row logsumexp, output
    H, Lq, Lk, D,  # sizes
    scale,  # softmax scale
    p,  # dropout probability
    seed,  # dropout seed (int64)
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b = bh // H
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_inside = offs_d < D
    q = tl.load(q_ptr + (bh * Lq + offs_m[:, None]) * D + offs_d[None, :],
                mask=(offs_m[:, None] < Lq) & d_inside[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kpm_row = kpm_ptr + b * Lk
    key_end = Lk
    if CAUSAL:  # keys past the last row's diagonal are invisible to the whole tile
        key_end = tl.minimum(Lk, tl.maximum(0, (tile + 1) * BLOCK_M - 1 + Lk - Lq + 1))
    for start_n in range(0, key_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_ptr + (bh * Lk + offs_n[:, None]) * D + offs_d[None, :]
        s, visible = _scores(q, k_ptrs, kpm_row, offs_m, offs_n, Lq, Lk, d_inside, scale, HAS_KPM, CAUSAL,
                             UPCAST, IEEE)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        prob = tl.exp(s - m_safe[:, None])  # 0 where invisible
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(prob, 1)
        m_i = m_new
        if HAS_DROPOUT:
            index = (bh * Lq + offs_m[:, None]) * Lk + offs_n[None, :]
            prob = tl.where(dropout_keep(seed, index, p), prob / (1.0 - p), 0.0)
        v = tl.load(v_ptr + (bh * Lk + offs_n[:, None]) * D + offs_d[None, :],
                    mask=(offs_n[:, None] < Lk) & d_inside[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(o_ptr + (bh * Lq + offs_m[:, None]) * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & d_inside[None, :])
    tl.store(lse_ptr + bh * Lq + offs_m, lse, mask=offs_m < Lq)


@triton.jit
def _attn_bwd_preprocess(
    o_ptr, do_ptr,  # (B H Lq, D) output and its gradient
    delta_ptr,  # (B H Lq,) float32 rowsum(dO O), output
    rows, D,  # B H Lq and the head dim
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_m[:, None] < rows) & (offs_d[None, :] < D)
    o = tl.load(o_ptr + offs_m[:, None] * D + offs_d[None, :], mask=inside, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offs_m[:, None] * D + offs_d[None, :], mask=inside, other=0.0).to(tl.float32)
    tl.store(delta_ptr + offs_m, tl.sum(o * do, 1), mask=offs_m < rows)


@triton.jit
def _probabilities(s, visible, lse):
    """P = e^(S - lse) on visible entries, 0 elsewhere and on rows that saw nothing (lse = -inf)."""
    seen = lse > float("-inf")
    lse_safe = tl.where(seen, lse, 0.0)
    return tl.where(visible & seen[:, None], tl.exp(s - lse_safe[:, None]), 0.0)


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, kpm_ptr,  # as in the forward
    do_ptr,  # (B, H, Lq, D) gradient of the output
    lse_ptr, delta_ptr,  # (B, H, Lq) float32
    dk_ptr, dv_ptr,  # (B, H, Lk, D) outputs
    H, Lq, Lk, D, scale, p, seed,
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b = bh // H
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_inside = offs_d < D
    kv_mask = (offs_n[:, None] < Lk) & d_inside[None, :]
    k_ptrs = k_ptr + (bh * Lk + offs_n[:, None]) * D + offs_d[None, :]
    v = tl.load(v_ptr + (bh * Lk + offs_n[:, None]) * D + offs_d[None, :], mask=kv_mask, other=0.0)
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
        k = k.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first_m = 0
    if CAUSAL:  # queries before this block's first key's diagonal see none of it
        first_m = tl.maximum(0, block * BLOCK_N - (Lk - Lq)) // BLOCK_M * BLOCK_M
    for start_m in range(first_m, Lq, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_mask = (offs_m[:, None] < Lq) & d_inside[None, :]
        q = tl.load(q_ptr + (bh * Lq + offs_m[:, None]) * D + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(do_ptr + (bh * Lq + offs_m[:, None]) * D + offs_d[None, :], mask=q_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        s, visible = _scores(q, k_ptrs, kpm_ptr + b * Lk, offs_m, offs_n, Lq, Lk, d_inside, scale, HAS_KPM,
                             CAUSAL, UPCAST, IEEE)
        lse = tl.load(lse_ptr + bh * Lq + offs_m, mask=offs_m < Lq, other=float("-inf"))
        delta = tl.load(delta_ptr + bh * Lq + offs_m, mask=offs_m < Lq, other=0.0)
        prob = _probabilities(s, visible, lse)  # (BLOCK_M, BLOCK_N)
        if IEEE:
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            dp = tl.dot(do, tl.trans(v))
        prob_dropped = prob
        if HAS_DROPOUT:
            keep = dropout_keep(seed, (bh * Lq + offs_m[:, None]) * Lk + offs_n[None, :], p)
            prob_dropped = tl.where(keep, prob / (1.0 - p), 0.0)
            dp = tl.where(keep, dp / (1.0 - p), 0.0)
        ds = prob * (dp - delta[:, None])
        if IEEE:
            dv += tl.dot(tl.trans(prob_dropped.to(do.dtype)), do, input_precision="ieee")
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee")
        else:
            dv += tl.dot(tl.trans(prob_dropped.to(do.dtype)), do)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    out_offs = (bh * Lk + offs_n[:, None]) * D + offs_d[None, :]
    tl.store(dk_ptr + out_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, kpm_ptr, do_ptr, lse_ptr, delta_ptr,  # as in the dK/dV kernel
    dq_ptr,  # (B, H, Lq, D) output
    H, Lq, Lk, D, scale, p, seed,
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b = bh // H
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_inside = offs_d < D
    q_mask = (offs_m[:, None] < Lq) & d_inside[None, :]
    q = tl.load(q_ptr + (bh * Lq + offs_m[:, None]) * D + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(do_ptr + (bh * Lq + offs_m[:, None]) * D + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + bh * Lq + offs_m, mask=offs_m < Lq, other=float("-inf"))
    delta = tl.load(delta_ptr + bh * Lq + offs_m, mask=offs_m < Lq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    key_end = Lk
    if CAUSAL:
        key_end = tl.minimum(Lk, tl.maximum(0, (tile + 1) * BLOCK_M - 1 + Lk - Lq + 1))
    for start_n in range(0, key_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < Lk) & d_inside[None, :]
        k_ptrs = k_ptr + (bh * Lk + offs_n[:, None]) * D + offs_d[None, :]
        s, visible = _scores(q, k_ptrs, kpm_ptr + b * Lk, offs_m, offs_n, Lq, Lk, d_inside, scale, HAS_KPM,
                             CAUSAL, UPCAST, IEEE)
        prob = _probabilities(s, visible, lse)
        v = tl.load(v_ptr + (bh * Lk + offs_n[:, None]) * D + offs_d[None, :], mask=kv_mask, other=0.0)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
            k = k.to(tl.float32)
        if IEEE:
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            dp = tl.dot(do, tl.trans(v))
        if HAS_DROPOUT:
            keep = dropout_keep(seed, (bh * Lq + offs_m[:, None]) * Lk + offs_n[None, :], p)
            dp = tl.where(keep, dp / (1.0 - p), 0.0)
        ds = prob * (dp - delta[:, None])
        if IEEE:
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + (bh * Lq + offs_m[:, None]) * D + offs_d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=q_mask)


def _flags(q, key_padding_mask, causal, dropout_p):
    D = q.shape[-1]
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"fastformer attention (triton): head dim {D} is not supported; use 1 to {MAX_HEAD_DIM}")
    return dict(HAS_KPM=key_padding_mask is not None, CAUSAL=bool(causal), HAS_DROPOUT=dropout_p > 0,
                UPCAST=upcast_dot(q.dtype), IEEE=q.dtype == torch.float32, **attention_blocks(D))


def attention_fwd(q, k, v, key_padding_mask, causal: bool, dropout_p: float, scale: float, seed: int):
    check("attention", q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    flags = _flags(q, key_padding_mask, causal, dropout_p)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return out, lse
    if Lk == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else q
    grid = (triton.cdiv(Lq, flags["BLOCK_M"]), B * H)
    _attn_fwd_kernel[grid](q, k, v, kpm, out, lse, H, Lq, Lk, D, scale, dropout_p, seed, **flags)
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, key_padding_mask, causal: bool, dropout_p: float, scale: float,
                  seed: int):
    check("attention", dout, q, k, v, out)
    dout, q, k, v, out, lse = (t.contiguous() for t in (dout, q, k, v, out, lse))
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    flags = _flags(q, key_padding_mask, causal, dropout_p)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else q
    delta = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    rows = B * H * Lq
    _attn_bwd_preprocess[(triton.cdiv(rows, 64),)](out, dout, delta, rows, D, BLOCK_M=64,
                                                   BLOCK_D=flags["BLOCK_D"])
    _attn_bwd_dkdv_kernel[(triton.cdiv(Lk, flags["BLOCK_N"]), B * H)](
        q, k, v, kpm, dout, lse, delta, dk, dv, H, Lq, Lk, D, scale, dropout_p, seed, **flags)
    _attn_bwd_dq_kernel[(triton.cdiv(Lq, flags["BLOCK_M"]), B * H)](
        q, k, v, kpm, dout, lse, delta, dq, H, Lq, Lk, D, scale, dropout_p, seed, **flags)
    return dq, dk, dv
