"""y = LayerNorm(residual + dropout(x)) over the last dim in Triton, forward and backward.

Forward, one program per row of N (N <= MAX_N, the whole row in one block):
  s = residual + x * r (r: dropout factor from fastformer/triton/_common.dropout_keep), stored, then
  reloaded so mean and variance are those of the s returned (rounded to its dtype); two-pass variance;
  y = (s - mean) rstd w + b. Bytes moved per row: x, residual read, s, y written (4 N sizeof(T)), plus
  the weights (cached).
Backward, in two stages without atomics: each program takes ROWS rows, writes dx, dresidual for them
and keeps dweight, dbias partial sums in registers, stored as one row of a (programs, N) float32
buffer; the host sums the partials (stage two). Bytes moved per row: dy, s read; dx, dresidual written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastformer.triton._common import check, dropout_keep

MAX_N = 16384


@triton.jit
def _lnr_fwd_kernel(
    x_ptr,  # (R, N) branch input, dropped out
    res_ptr,  # (R, N) residual
    w_ptr,  # (N,) LayerNorm weight
    b_ptr,  # (N,) LayerNorm bias
    y_ptr,  # (R, N) output
    s_ptr,  # (R, N) residual + dropout(x), output
    mean_ptr,  # (R,) float32 row mean, output
    rstd_ptr,  # (R,) float32 row 1/sqrt(var + eps), output
    N,  # row length
    eps,  # LayerNorm epsilon
    p,  # dropout probability
    seed,  # dropout seed (int64)
    HAS_DROPOUT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    offs = row * N + cols
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, offs, p)
        x = tl.where(keep, x / (1.0 - p), 0.0)
    s = tl.load(res_ptr + offs, mask=inside, other=0.0).to(tl.float32) + x
    tl.store(s_ptr + offs, s.to(s_ptr.dtype.element_ty), mask=inside)
    s = tl.load(s_ptr + offs, mask=inside, other=0.0).to(tl.float32)  # the rounded s that is returned
    mean = tl.sum(s, 0) / N
    centered = tl.where(inside, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (centered * rstd * w + b).to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _lnr_bwd_kernel(
    dy_ptr,  # (R, N) gradient of y
    ds_ptr,  # (R, N) gradient of the s output (unused if not HAS_DS)
    s_ptr,  # (R, N) saved residual + dropout(x)
    w_ptr,  # (N,) LayerNorm weight
    mean_ptr,  # (R,) saved mean
    rstd_ptr,  # (R,) saved rstd
    dx_ptr,  # (R, N) gradient of x, written
    dres_ptr,  # (R, N) gradient of residual, written
    dw_part_ptr,  # (programs, N) float32 partial dweight, written
    db_part_ptr,  # (programs, N) float32 partial dbias, written
    R,  # rows
    N,  # row length
    p,  # dropout probability
    seed,  # dropout seed
    ROWS,  # rows per program
    HAS_DS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_N], tl.float32)
    for i in range(0, ROWS):
        row = pid.to(tl.int64) * ROWS + i
        if row < R:
            offs = row * N + cols
            dy = tl.load(dy_ptr + offs, mask=inside, other=0.0).to(tl.float32)
            s = tl.load(s_ptr + offs, mask=inside, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + row)
            rstd = tl.load(rstd_ptr + row)
            xhat = tl.where(inside, (s - mean) * rstd, 0.0)
            g = dy * w
            d = rstd * (g - tl.sum(g, 0) / N - xhat * (tl.sum(g * xhat, 0) / N))
            if HAS_DS:
                d += tl.load(ds_ptr + offs, mask=inside, other=0.0).to(tl.float32)
            tl.store(dres_ptr + offs, d.to(dres_ptr.dtype.element_ty), mask=inside)
            if HAS_DROPOUT:
                keep = dropout_keep(seed, offs, p)
                d = tl.where(keep, d / (1.0 - p), 0.0)
            tl.store(dx_ptr + offs, d.to(dx_ptr.dtype.element_ty), mask=inside)
            dw += dy * xhat
            db += dy
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=inside)
    tl.store(db_part_ptr + pid * N + cols, db, mask=inside)


def _block(N: int) -> int:
    if N > MAX_N:
        raise ValueError(f"fastformer layer_norm_residual (triton): rows of {N} exceed the supported {MAX_N}; "
                         f"use backend 'cuda', 'cpu' or 'torch'")
    return triton.next_power_of_2(N)


def layer_norm_residual_fwd(x, residual, weight, bias, eps: float, dropout_p: float, seed: int):
    check("layer_norm_residual", x, residual, weight, bias)
    x, residual, weight, bias = (t.contiguous() for t in (x, residual, weight, bias))
    N = x.shape[-1]
    R = x.numel() // N
    y, s = torch.empty_like(x), torch.empty_like(x)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if R:
        block = _block(N)
        _lnr_fwd_kernel[(R,)](x, residual, weight, bias, y, s, mean, rstd, N, eps, dropout_p, seed,
                              HAS_DROPOUT=dropout_p > 0, BLOCK_N=block, num_warps=4 if block <= 2048 else 8)
    return y, s, mean, rstd


def layer_norm_residual_bwd(dy, ds, s, weight, mean, rstd, dropout_p: float, seed: int):
    check("layer_norm_residual", dy, s, weight)
    dy, s, weight, mean, rstd = (t.contiguous() for t in (dy, s, weight, mean, rstd))
    ds = None if ds is None else ds.contiguous()
    N = s.shape[-1]
    R = s.numel() // N
    dx, dres = torch.empty_like(s), torch.empty_like(s)
    rows = max(1, triton.cdiv(R, 256))  # at most ~256 partial rows for the second stage
    programs = triton.cdiv(R, rows) if R else 0
    dw_part = torch.empty(programs, N, dtype=torch.float32, device=s.device)
    db_part = torch.empty_like(dw_part)
    if R:
        block = _block(N)
        _lnr_bwd_kernel[(programs,)](dy, ds if ds is not None else dy, s, weight, mean, rstd, dx, dres, dw_part,
                                     db_part, R, N, dropout_p, seed, ROWS=rows, HAS_DS=ds is not None,
                                     HAS_DROPOUT=dropout_p > 0, BLOCK_N=block, num_warps=4 if block <= 2048 else 8)
    # Stage two: the partial sums, reduced in a fixed order.
    return dx, dres, dw_part.sum(0).to(s.dtype), db_part.sum(0).to(s.dtype)
