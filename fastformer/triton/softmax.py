"""Masked, scaled softmax over the last dim in Triton, forward and backward.

Rows of N <= WHOLE_ROW_MAX_N (attention's scores up to 4,096 keys): whole rows in a (BLOCK_R, BLOCK_N)
tile of several rows per program (_common.whole_row_tile: 8 rows of 512 on 8 warps, a row per warp as in
the CUDA warp layout). Forward reads x (and the mask) once and writes y once: 2 N sizeof(T) per row, plus
N mask bytes; backward reads y and dy once and writes dx once: 3 N sizeof(T).
Longer rows: one program per row of N. Forward: a first loop over BLOCK_N chunks keeps the running max m
and sum l (online softmax: l = l e^(m - m') + sum e^(a - m')), a second loop writes y = e^(a - m) / l.
Bytes moved per row: x read twice (the second read mostly from L2) and y written once: about
3 N sizeof(T), plus N mask bytes twice. Backward, per row: one loop for sum(dy y), one writing dx = scale y (dy - sum);
reads y and dy twice, writes dx once.
A fully masked row (or one of -inf logits) has m = -inf and gives zeros; a NaN or +inf logit that is not
masked makes the whole row NaN, as torch.softmax does (a per-lane or per-element flag, checked once per
row). The mask
is addressed through a per-row offset table (int64, one entry per row) and a column stride, so any
broadcast mask works without a copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastformer.triton._common import (check, online_softmax_step, online_softmax_total, row_blocks, row_tile,
                                       whole_row_tile)

WHOLE_ROW_MAX_N = 4096  # rows up to this length are held whole in registers


@triton.jit
def _masked_scaled(x_row, mask_row, mask_col_stride, cols, N, scale, HAS_MASK: tl.constexpr):
    """scale * x[cols] in float32, -inf where masked or past the row's end (set after the scaling: a
    -inf lane times a scale <= 0 would be NaN or +inf)."""
    inside = cols < N
    a = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32) * scale
    dead = cols >= N
    if HAS_MASK:
        masked = tl.load(mask_row + cols * mask_col_stride, mask=inside, other=1).to(tl.int1)
        dead = dead | masked
    return tl.where(dead, float("-inf"), a)


@triton.jit
def _softmax_fwd_rows_kernel(
    x_ptr,  # (R, N) input, contiguous
    y_ptr,  # (R, N) output
    mask_ptr,  # bool mask, addressed as mask_ptr + mask_rows[r] + col * mask_col_stride (unused if not HAS_MASK)
    mask_rows_ptr,  # (R,) int64 offset of each row's mask
    mask_col_stride,  # stride of the mask along the last dim (0 when broadcast)
    R,  # rows
    N,  # row length, <= BLOCK_N
    scale,  # multiplier applied to x before the softmax
    HAS_MASK: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # next power of two >= N
):
    rows, cols, live, inside, offs = row_tile(tl.program_id(0) * BLOCK_R, R, N, BLOCK_R, BLOCK_N)
    a = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32) * scale
    dead = ~inside
    if HAS_MASK:
        mask_rows = tl.load(mask_rows_ptr + rows, mask=live, other=0)
        masked = tl.load(mask_ptr + mask_rows[:, None] + cols[None, :] * mask_col_stride, mask=inside, other=1)
        dead = dead | masked.to(tl.int1)
    a = tl.where(dead, float("-inf"), a)  # set after the scaling: -inf times a scale <= 0 is NaN or +inf
    # A NaN or +inf logit that is not masked makes every y of its row NaN (torch.softmax does the same);
    # it counts as -inf for the max, so the max stays finite or -inf.
    unbounded = (a != a) | (a == float("inf"))
    bad = tl.max(unbounded.to(tl.int32), 1) > 0
    m = tl.max(tl.where(unbounded, float("-inf"), a), 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # a fully masked row: every e^(a - m) is 0, zeros
    m = tl.where(bad, float("nan"), m)  # then every e, the sum and every y of the row are NaN
    e = tl.exp(a - m[:, None])
    total = tl.sum(e, 1)
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(y_ptr + offs, (e * inv[:, None]).to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _softmax_bwd_rows_kernel(
    dy_ptr,  # (R, N) gradient of y
    y_ptr,  # (R, N) forward output
    dx_ptr,  # (R, N) gradient of x, written
    R,  # rows
    N,  # row length, <= BLOCK_N
    scale,  # the forward's scale
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # next power of two >= N
):
    _, _, _, inside, offs = row_tile(tl.program_id(0) * BLOCK_R, R, N, BLOCK_R, BLOCK_N)
    y = tl.load(y_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    dot = tl.sum(y * dy, 1)
    tl.store(dx_ptr + offs, (scale * y * (dy - dot[:, None])).to(dx_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _softmax_fwd_kernel(
    x_ptr,  # (R, N) input, contiguous
    y_ptr,  # (R, N) output
    mask_ptr,  # bool mask, addressed as mask_ptr + mask_rows[r] + col * mask_col_stride (unused if not HAS_MASK)
    mask_rows_ptr,  # (R,) int64 offset of each row's mask
    mask_col_stride,  # stride of the mask along the last dim (0 when broadcast)
    N,  # row length
    scale,  # multiplier applied to x before the softmax
    HAS_MASK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * N
    y_row = y_ptr + row * N
    mask_row = mask_ptr
    if HAS_MASK:
        mask_row = mask_ptr + tl.load(mask_rows_ptr + row)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)  # per-lane running max
    l = tl.zeros([BLOCK_N], tl.float32)  # per-lane running sum of e^(a - m)
    bad = tl.zeros([BLOCK_N], tl.int32)  # per-lane: saw a NaN or +inf (not masked)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        a = _masked_scaled(x_row, mask_row, mask_col_stride, cols, N, scale, HAS_MASK)
        m, l, bad = online_softmax_step(m, l, bad, a)  # NaN / +inf count as -inf; the row is set to NaN below
    row_max_safe, total = online_softmax_total(m, l)
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)  # fully masked row: zeros
    # A NaN or +inf logit that is not masked makes every y of the row NaN (torch.softmax does the same).
    row_max_safe = tl.where(tl.max(bad, 0) > 0, float("nan"), row_max_safe)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        a = _masked_scaled(x_row, mask_row, mask_col_stride, cols, N, scale, HAS_MASK)
        y = tl.exp(a - row_max_safe) * inv
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _softmax_bwd_kernel(
    dy_ptr,  # (R, N) gradient of y
    y_ptr,  # (R, N) forward output
    dx_ptr,  # (R, N) gradient of x, written
    N,  # row length
    scale,  # the forward's scale
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inside = cols < N
        y = tl.load(y_ptr + row * N + cols, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * N + cols, mask=inside, other=0.0).to(tl.float32)
        acc += y * dy
    dot = tl.sum(acc, 0)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inside = cols < N
        y = tl.load(y_ptr + row * N + cols, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * N + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * N + cols, (scale * y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=inside)


def _mask_rows(mask: torch.Tensor, shape) -> tuple[torch.Tensor, int]:
    """(R,) int64 offsets of each row's mask in the broadcast view, and the mask's last-dim stride."""
    view = mask.expand(shape)
    offsets = torch.zeros(shape[:-1], dtype=torch.int64, device=mask.device)
    for dim, (size, stride) in enumerate(zip(shape[:-1], view.stride()[:-1])):
        index = torch.arange(size, dtype=torch.int64, device=mask.device) * stride
        offsets += index.view([size if d == dim else 1 for d in range(len(shape) - 1)])
    return offsets.reshape(-1), view.stride(-1)


def softmax_fwd(x: torch.Tensor, mask, scale: float) -> torch.Tensor:
    check("softmax", x)
    x = x.contiguous()
    N = x.shape[-1]
    R = x.numel() // N if N else 0
    y = torch.empty_like(x)
    if R == 0:
        return y
    if mask is not None:
        rows, col_stride = _mask_rows(mask, x.shape)
        mask_args = (mask, rows, col_stride)
    else:
        mask_args = (x, x, 0)
    if N <= WHOLE_ROW_MAX_N:
        tile = whole_row_tile(N)
        _softmax_fwd_rows_kernel[(triton.cdiv(R, tile["BLOCK_R"]),)](x, y, *mask_args, R, N, scale,
                                                                     HAS_MASK=mask is not None, **tile)
    else:
        _softmax_fwd_kernel[(R,)](x, y, *mask_args, N, scale, HAS_MASK=mask is not None, **row_blocks(N))
    return y


def softmax_bwd(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    check("softmax", dy, y)
    dy, y = dy.contiguous(), y.contiguous()
    N = y.shape[-1]
    R = y.numel() // N if N else 0
    dx = torch.empty_like(y)
    if R and N <= WHOLE_ROW_MAX_N:
        tile = whole_row_tile(N)
        _softmax_bwd_rows_kernel[(triton.cdiv(R, tile["BLOCK_R"]),)](dy, y, dx, R, N, scale, **tile)
    elif R:
        _softmax_bwd_kernel[(R,)](dy, y, dx, N, scale, **row_blocks(N))
    return dx
