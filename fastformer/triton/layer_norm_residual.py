"""y = LayerNorm(residual + dropout(x + x_bias)) over the last dim in Triton, forward and backward.

Whole rows (N <= MAX_N) in a (BLOCK_R, BLOCK_N) tile: BLOCK_R rows per program and step, about 16 values
per thread (_common.whole_row_tile; for N = 512, 8 rows and 8 warps).
Forward: s = residual + (x + x_bias) * r (x_bias (N,) optional, loaded once per program; r: dropout factor from fastformer/triton/_common.dropout_keep_rows, one
Philox evaluation per 4 elements when N is a multiple of 4; the seed read by each program from the op's
0-dim int64 seed tensor, _common.load_seed), rounded to its dtype in registers and
stored; mean and variance (two-pass, from the registers) are those of the s returned;
y = (s - mean) rstd w + b, and with a compute dtype C also y_c = y rounded to T then to C (y.to(C)), stored
from the same registers. Bytes moved per row: x, residual read, s, y written (4 N sizeof(T), T the
residual's dtype; N sizeof(x) + 3 N sizeof(T) for a float16/bfloat16 x beside a float32 residual, which
the kernel reads as it is and upcasts in registers), + N sizeof(C) for y_c, plus the weights (cached).
Backward, in two stages without atomics: (1) each program takes ROWS rows (a chunk of steps of BLOCK_R),
writes dx (in x's dtype) and dresidual for them (the gradient reaching y being dy + dy_c, dy_c that of y_c)
and keeps dweight, dbias (and dx_bias = sum of dx, with x_bias) partial sums in registers, stored as one row
of a (2 or 3, programs, N) float32 buffer (at most MAX_PROGRAMS rows each); (2) _lnr_reduce_kernel sums the
partials of each column in a fixed order (the same bits on every run; the order depends on the shape only)
and writes dweight, dbias in weight's dtype and dx_bias in x_bias's: no torch op after the kernels. Bytes
moved per row: dy, s (and ds, dy_c) read; dx, dresidual written; stage two reads 2-3 P N float32 and
writes 2-3 N.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastformer.triton._common import check, dropout_keep_rows, load_seed, row_tile, seed_pointer, whole_row_tile

MAX_N = 16384
MAX_PROGRAMS = 512  # backward: at most this many partial rows (P N 8 bytes for stage two)
REDUCE_BLOCK_P, REDUCE_BLOCK_N = 64, 32  # stage two: partial rows per step, columns per program


@triton.jit
def _lnr_fwd_kernel(
    x_ptr,  # (R, N) branch input, dropped out
    res_ptr,  # (R, N) residual
    w_ptr,  # (N,) LayerNorm weight
    b_ptr,  # (N,) LayerNorm bias
    xb_ptr,  # (N,) the branch's bias, added to x before dropout (unused if not HAS_XB)
    y_ptr,  # (R, N) output
    s_ptr,  # (R, N) residual + dropout(x + x_bias), output
    yc_ptr,  # (R, N) output y_c = y in the compute dtype (unused if not HAS_YC)
    mean_ptr,  # (R,) float32 row mean, output
    rstd_ptr,  # (R,) float32 row 1/sqrt(var + eps), output
    R,  # rows
    N,  # row length
    eps,  # LayerNorm epsilon
    p,  # dropout probability
    seed_ptr,  # () int64 dropout seed, read once per program (unused if not HAS_DROPOUT)
    HAS_DROPOUT: tl.constexpr,
    HAS_XB: tl.constexpr,
    HAS_YC: tl.constexpr,
    GROUPS_OF_4: tl.constexpr,  # N % 4 == 0: one Philox evaluation per 4 elements (dropout_keep_rows)
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # next power of two >= N
):
    rows, cols, live, inside, offs = row_tile(tl.program_id(0) * BLOCK_R, R, N, BLOCK_R, BLOCK_N)
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_XB:
        x += tl.load(xb_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_DROPOUT:
        keep = dropout_keep_rows(load_seed(seed_ptr, HAS_DROPOUT), rows, 0, N, p, BLOCK_R, BLOCK_N, GROUPS_OF_4)
        x = tl.where(keep, x / (1.0 - p), 0.0)
    s = (tl.load(res_ptr + offs, mask=inside, other=0.0).to(tl.float32) + x).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + offs, s, mask=inside)
    s = s.to(tl.float32)  # the statistics are those of the rounded s that is returned
    mean = tl.sum(s, 1) / N
    centered = tl.where(inside, s - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = (centered * rstd[:, None] * w[None, :] + b[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=inside)
    if HAS_YC:
        tl.store(yc_ptr + offs, y.to(yc_ptr.dtype.element_ty), mask=inside)  # from the rounded y: y.to(C)
    tl.store(mean_ptr + rows, mean, mask=live)
    tl.store(rstd_ptr + rows, rstd, mask=live)


@triton.jit
def _lnr_bwd_kernel(
    dy_ptr,  # (R, N) gradient of y
    dyc_ptr,  # (R, N) gradient of y_c, in the compute dtype (unused if not HAS_DYC)
    ds_ptr,  # (R, N) gradient of the s output (unused if not HAS_DS)
    s_ptr,  # (R, N) saved residual + dropout(x)
    w_ptr,  # (N,) LayerNorm weight
    mean_ptr,  # (R,) saved mean
    rstd_ptr,  # (R,) saved rstd
    dx_ptr,  # (R, N) gradient of x, written
    dres_ptr,  # (R, N) gradient of residual, written
    part_ptr,  # (2 or 3, programs, N) float32 partial dweight rows, partial dbias rows (, partial dx_bias), written
    R,  # rows
    N,  # row length
    p,  # dropout probability
    seed_ptr,  # () int64 dropout seed, read once per program (unused if not HAS_DROPOUT)
    ROWS,  # rows per program, a multiple of BLOCK_R
    HAS_DS: tl.constexpr,
    HAS_DYC: tl.constexpr,
    HAS_XB: tl.constexpr,  # write the dx_bias partials (the third block of part_ptr)
    HAS_DROPOUT: tl.constexpr,
    GROUPS_OF_4: tl.constexpr,  # N % 4 == 0: one Philox evaluation per 4 elements (dropout_keep_rows)
    BLOCK_R: tl.constexpr,  # rows per step
    BLOCK_N: tl.constexpr,  # next power of two >= N
):
    pid = tl.program_id(0)
    seed = load_seed(seed_ptr, HAS_DROPOUT)
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)  # summed over the rows at the end
    db = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    dxb = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    for first in range(0, ROWS, BLOCK_R):
        rows, _, live, inside, offs = row_tile(pid.to(tl.int64) * ROWS + first, R, N, BLOCK_R, BLOCK_N)
        dy = tl.load(dy_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        if HAS_DYC:
            dy += tl.load(dyc_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=live, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=live, other=0.0)
        xhat = tl.where(inside, (s - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        mean_g = tl.sum(g, 1) / N
        mean_gx = tl.sum(g * xhat, 1) / N
        d = rstd[:, None] * (g - mean_g[:, None] - xhat * mean_gx[:, None])
        if HAS_DS:
            d += tl.load(ds_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(dres_ptr + offs, d.to(dres_ptr.dtype.element_ty), mask=inside)
        if HAS_DROPOUT:
            keep = dropout_keep_rows(seed, rows, 0, N, p, BLOCK_R, BLOCK_N, GROUPS_OF_4)
            d = tl.where(keep, d / (1.0 - p), 0.0)
        tl.store(dx_ptr + offs, d.to(dx_ptr.dtype.element_ty), mask=inside)
        dw += dy * xhat
        db += dy
        if HAS_XB:
            dxb += d  # columns >= N hold garbage here, never stored
    tl.store(part_ptr + pid.to(tl.int64) * N + cols, tl.sum(dw, 0), mask=cols < N)
    tl.store(part_ptr + (tl.num_programs(0) + pid).to(tl.int64) * N + cols, tl.sum(db, 0), mask=cols < N)
    if HAS_XB:
        tl.store(part_ptr + (2 * tl.num_programs(0) + pid).to(tl.int64) * N + cols, tl.sum(dxb, 0), mask=cols < N)


@triton.jit
def _lnr_reduce_kernel(
    part_ptr,  # (2 or 3, P, N) float32: the partial dweight rows, the partial dbias rows (, dx_bias rows)
    dw_ptr,  # (N,) dweight, written in weight's dtype
    db_ptr,  # (N,) dbias, written in weight's dtype
    dxb_ptr,  # (N,) dx_bias, written in x_bias's dtype (unused if not HAS_XB)
    P,  # partial rows (backward programs)
    N,  # row length
    HAS_XB: tl.constexpr,
    BLOCK_P: tl.constexpr,  # partial rows per step
    BLOCK_N: tl.constexpr,  # columns per program
):
    # Program j sums columns j BLOCK_N ... over the P partial rows: BLOCK_P rows per step into a
    # (BLOCK_P, BLOCK_N) accumulator, then over its rows; a fixed order for a given P and N.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_P)
    dw = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    dxb = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for first in range(0, P, BLOCK_P):
        inside = ((first + rows) < P)[:, None] & (cols < N)[None, :]
        offs = (first + rows).to(tl.int64)[:, None] * N + cols[None, :]
        dw += tl.load(part_ptr + offs, mask=inside, other=0.0)
        db += tl.load(part_ptr + P * N + offs, mask=inside, other=0.0)
        if HAS_XB:
            dxb += tl.load(part_ptr + 2 * P * N + offs, mask=inside, other=0.0)
    tl.store(dw_ptr + cols, tl.sum(dw, 0).to(dw_ptr.dtype.element_ty), mask=cols < N)
    tl.store(db_ptr + cols, tl.sum(db, 0).to(db_ptr.dtype.element_ty), mask=cols < N)
    if HAS_XB:
        tl.store(dxb_ptr + cols, tl.sum(dxb, 0).to(dxb_ptr.dtype.element_ty), mask=cols < N)


def _tile(N: int) -> dict:
    if N > MAX_N:
        raise ValueError(f"fastformer layer_norm_residual (triton): rows of {N} exceed the supported {MAX_N}; "
                         f"use backend 'cuda', 'cpu' or 'torch'")
    return whole_row_tile(N)


def layer_norm_residual_fwd(x, residual, weight, bias, eps: float, dropout_p: float, seed, x_bias,
                            compute_dtype: torch.dtype):
    check("layer_norm_residual", x, residual, weight, bias)
    x, residual, weight, bias = (t.contiguous() for t in (x, residual, weight, bias))
    x_bias = None if x_bias is None else x_bias.contiguous()
    N = x.shape[-1]
    R = x.numel() // N
    y, s = torch.empty_like(residual), torch.empty_like(residual)
    has_yc = compute_dtype != residual.dtype
    y_c = torch.empty_like(residual, dtype=compute_dtype) if has_yc else residual.new_empty(0)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if R:
        tile = _tile(N)
        _lnr_fwd_kernel[(triton.cdiv(R, tile["BLOCK_R"]),)](x, residual, weight, bias,
                                                            x_bias if x_bias is not None else weight, y, s,
                                                            y_c if has_yc else y, mean, rstd, R, N, eps, dropout_p,
                                                            seed_pointer(seed, mean), HAS_DROPOUT=dropout_p > 0,
                                                            HAS_XB=x_bias is not None, HAS_YC=has_yc,
                                                            GROUPS_OF_4=N % 4 == 0, **tile)
    return y, s, mean, rstd, y_c


def layer_norm_residual_bwd(dy, ds, s, weight, mean, rstd, dropout_p: float, seed, dx_dtype: torch.dtype, dy_c,
                            x_bias):
    check("layer_norm_residual", dy, s, weight)
    dy, s, weight, mean, rstd = (t.contiguous() for t in (dy, s, weight, mean, rstd))
    ds, dy_c = (None if t is None else t.contiguous() for t in (ds, dy_c))
    N = s.shape[-1]
    R = s.numel() // N
    dx, dres = torch.empty_like(s, dtype=dx_dtype), torch.empty_like(s)
    dx_bias = weight.new_empty(0) if x_bias is None else torch.empty_like(x_bias)
    if R == 0:
        return dx, dres, torch.zeros_like(weight), torch.zeros_like(weight), dx_bias.zero_()
    tile = _tile(N)
    # Chunks of at least 4 steps, at most MAX_PROGRAMS of them; the split depends on R and N only.
    rows = tile["BLOCK_R"] * max(4, triton.cdiv(triton.cdiv(R, tile["BLOCK_R"]), MAX_PROGRAMS))
    programs = triton.cdiv(R, rows)
    part = torch.empty(2 if x_bias is None else 3, programs, N, dtype=torch.float32, device=s.device)
    _lnr_bwd_kernel[(programs,)](dy, dy_c if dy_c is not None else dy, ds if ds is not None else dy, s, weight,
                                 mean, rstd, dx, dres, part, R, N, dropout_p, seed_pointer(seed, mean), ROWS=rows,
                                 HAS_DS=ds is not None, HAS_DYC=dy_c is not None, HAS_XB=x_bias is not None,
                                 HAS_DROPOUT=dropout_p > 0, GROUPS_OF_4=N % 4 == 0, **tile)
    dweight, dbias = torch.empty_like(weight), torch.empty_like(weight)
    _lnr_reduce_kernel[(triton.cdiv(N, REDUCE_BLOCK_N),)](part, dweight, dbias,
                                                          dx_bias if x_bias is not None else dweight, programs, N,
                                                          HAS_XB=x_bias is not None, BLOCK_P=REDUCE_BLOCK_P,
                                                          BLOCK_N=REDUCE_BLOCK_N, num_warps=4)
    return dx, dres, dweight, dbias, dx_bias
