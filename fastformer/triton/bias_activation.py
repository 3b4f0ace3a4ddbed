"""y = dropout(act(x + bias)) over the last dim in Triton, forward and backward; act = relu, gelu (exact, erf)
or silu, a constexpr (one compiled kernel per activation).

x, y, dy, saved, dx: (R, N) row-major in x's dtype; bias, dbias (N,) in bias's dtype; float32 math.
Tiles of (BLOCK_R, BLOCK_N): program (i, j) of the forward takes rows i BLOCK_R .. and columns j BLOCK_N ..
Forward: y = act(x + b) r (r: the keep-mask of _common.dropout_keep_rows at the element's flat index row N +
col, one Philox evaluation per 4 elements when N is a multiple of 4, scaled by 1/(1-p); the seed read by
each program from the op's 0-dim int64 seed tensor). Bytes per element: x read, y written (2 sizeof(T)),
the bias once per tile.
Backward, dz = dy act'(h) r: relu from the saved y (dz = dy / (1 - p) where y > 0, no Philox), gelu and silu
from the saved x (h = x + b, the mask regenerated). Two stages without atomics: (1) program (c, j) walks the
ROWS rows of chunk c (BLOCK_R at a time) for columns j BLOCK_N .., writes dx and keeps the column sums of dz
in registers, stored as row c of a (P, N) float32 buffer; (2) _dbias_reduce_kernel sums the P partials of each
column in a fixed order (the split depends on R only) and writes dbias in bias's dtype. Bytes per element:
dy, saved read, dx written (3 sizeof(T)), plus P N 8 bytes of partials.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastformer.triton import INTERPRET
from fastformer.triton._common import check, dropout_keep_rows, load_seed, seed_pointer

BLOCK_R = 8 if INTERPRET else 16  # rows per tile
MAX_BLOCK_N = 128 if INTERPRET else 1024  # columns per tile, at most (a power of two >= 4: Philox groups of 4)
MIN_CHUNK_ROWS, MAX_CHUNKS = 32, 256  # backward: rows per chunk at least, chunks at most
REDUCE_BLOCK_P, REDUCE_BLOCK_N = 64, 32  # stage two: partial rows per step, columns per program


@triton.jit
def _act(h, ACT: tl.constexpr):
    """act(h) for the activation code ACT of csrc/activation.h: 0 relu, 1 gelu (exact), 2 silu."""
    if ACT == 0:
        return tl.where((h > 0) | (h != h), h, 0.0)  # NaN stays NaN, as torch.relu
    elif ACT == 1:
        return 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
    else:
        return h / (1.0 + tl.exp(-h))


@triton.jit
def _act_grad(h, ACT: tl.constexpr):
    if ACT == 1:  # Phi(h) + h phi(h)
        return 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476)) + h * 0.3989422804014327 * tl.exp(-0.5 * h * h)
    else:  # silu: s (1 + h (1 - s))
        s = 1.0 / (1.0 + tl.exp(-h))
        return s * (1.0 + h * (1.0 - s))


@triton.jit
def _tile(first_row, first_col, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """rows (int64), cols, inside (rows < R and cols < N) and the offsets rows N + cols of a tile."""
    rows = first_row.to(tl.int64) + tl.arange(0, BLOCK_R)
    cols = first_col + tl.arange(0, BLOCK_N)
    inside = (rows < R)[:, None] & (cols < N)[None, :]
    return rows, cols, inside, rows[:, None] * N + cols[None, :]


@triton.jit
def _bias_act_fwd_kernel(
    x_ptr,  # (R, N) input
    b_ptr,  # (N,) bias
    y_ptr,  # (R, N) output
    R,  # rows
    N,  # row length
    p,  # dropout probability
    seed_ptr,  # () int64 dropout seed, read once per program (unused if not HAS_DROPOUT)
    ACT: tl.constexpr,  # the activation's code (csrc/activation.h): 0 relu, 1 gelu, 2 silu
    HAS_DROPOUT: tl.constexpr,
    GROUPS_OF_4: tl.constexpr,  # N % 4 == 0: one Philox evaluation per 4 elements
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    first_col = tl.program_id(1) * BLOCK_N
    rows, cols, inside, offs = _tile(tl.program_id(0) * BLOCK_R, first_col, R, N, BLOCK_R, BLOCK_N)
    b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = _act(tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32) + b[None, :], ACT)
    if HAS_DROPOUT:
        keep = dropout_keep_rows(load_seed(seed_ptr, HAS_DROPOUT), rows, first_col, N, p, BLOCK_R, BLOCK_N,
                                 GROUPS_OF_4)
        y = tl.where(keep, y / (1.0 - p), 0.0 * y)  # 0 * y: a dropped NaN stays NaN, as y * mask does
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _bias_act_bwd_kernel(
    dy_ptr,  # (R, N) gradient of y
    s_ptr,  # (R, N) saved: y (relu) or x (gelu, silu)
    b_ptr,  # (N,) bias
    dx_ptr,  # (R, N) gradient of x, written
    part_ptr,  # (P, N) float32 partial dbias rows, written
    R,  # rows
    N,  # row length
    p,  # dropout probability
    seed_ptr,  # () int64 dropout seed, read once per program (unused if not HAS_DROPOUT; relu needs no mask)
    ROWS,  # rows per chunk, a multiple of BLOCK_R
    ACT: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    GROUPS_OF_4: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    chunk = tl.program_id(0)
    first_col = tl.program_id(1) * BLOCK_N
    cols = first_col + tl.arange(0, BLOCK_N)
    b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    seed = load_seed(seed_ptr, HAS_DROPOUT)
    db = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)  # summed over its rows at the end
    for first in range(0, ROWS, BLOCK_R):
        rows, _, inside, offs = _tile(chunk.to(tl.int64) * ROWS + first, first_col, R, N, BLOCK_R, BLOCK_N)
        dy = tl.load(dy_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        if ACT == 0:
            dz = tl.where(s > 0, dy / (1.0 - p), 0.0)
        else:
            dz = dy * _act_grad(s + b[None, :], ACT)
            if HAS_DROPOUT:
                keep = dropout_keep_rows(seed, rows, first_col, N, p, BLOCK_R, BLOCK_N, GROUPS_OF_4)
                dz = tl.where(keep, dz / (1.0 - p), 0.0 * dz)
        tl.store(dx_ptr + offs, dz.to(dx_ptr.dtype.element_ty), mask=inside)
        db += tl.where(inside, dz, 0.0)
    tl.store(part_ptr + chunk.to(tl.int64) * N + cols, tl.sum(db, 0), mask=cols < N)


@triton.jit
def _dbias_reduce_kernel(
    part_ptr,  # (P, N) float32 partial dbias rows
    db_ptr,  # (N,) dbias, written in bias's dtype
    P,  # partial rows (backward chunks)
    N,  # row length
    BLOCK_P: tl.constexpr,  # partial rows per step
    BLOCK_N: tl.constexpr,  # columns per program
):
    # Program j sums columns j BLOCK_N ... over the P partial rows: BLOCK_P rows per step into a
    # (BLOCK_P, BLOCK_N) accumulator, then over its rows; a fixed order for a given P and N.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_P)
    db = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for first in range(0, P, BLOCK_P):
        inside = ((first + rows) < P)[:, None] & (cols < N)[None, :]
        db += tl.load(part_ptr + (first + rows).to(tl.int64)[:, None] * N + cols[None, :], mask=inside, other=0.0)
    tl.store(db_ptr + cols, tl.sum(db, 0).to(db_ptr.dtype.element_ty), mask=cols < N)


def _block_n(N: int) -> int:
    return min(MAX_BLOCK_N, max(4, triton.next_power_of_2(N)))


def _bias(bias: torch.Tensor) -> torch.Tensor:
    """The bias as the kernels read it: float64 (which Triton's GPU kernels would compute in) as float32."""
    return bias.to(torch.float32) if bias.dtype == torch.float64 else bias


def bias_activation_fwd(x, bias, activation: int, dropout_p: float, seed):
    check("bias_activation", x)
    x, b = x.contiguous(), _bias(bias.contiguous())
    y = torch.empty_like(x)
    N = x.shape[-1]
    if x.numel() == 0:
        return y
    R = x.numel() // N
    block_n = _block_n(N)
    _bias_act_fwd_kernel[(triton.cdiv(R, BLOCK_R), triton.cdiv(N, block_n))](
        x, b, y, R, N, dropout_p, seed_pointer(seed, y), ACT=activation, HAS_DROPOUT=dropout_p > 0,
        GROUPS_OF_4=N % 4 == 0, BLOCK_R=BLOCK_R, BLOCK_N=block_n, num_warps=4)
    return y


def bias_activation_bwd(dy, saved, bias, activation: int, dropout_p: float, seed):
    check("bias_activation", dy, saved)
    dy, saved, b = dy.contiguous(), saved.contiguous(), _bias(bias.contiguous())
    dx = torch.empty_like(saved)
    N = saved.shape[-1]
    R = saved.numel() // N if N else 0
    if R == 0:
        return dx, torch.zeros_like(bias)
    block_n = _block_n(N)
    # Chunks of at least MIN_CHUNK_ROWS rows (a multiple of BLOCK_R), at most MAX_CHUNKS of them: R decides.
    rows = BLOCK_R * max(MIN_CHUNK_ROWS // BLOCK_R, triton.cdiv(triton.cdiv(R, BLOCK_R), MAX_CHUNKS))
    chunks = triton.cdiv(R, rows)
    part = torch.empty(chunks, N, dtype=torch.float32, device=saved.device)
    _bias_act_bwd_kernel[(chunks, triton.cdiv(N, block_n))](
        dy, saved, b, dx, part, R, N, dropout_p, seed_pointer(seed, part), rows, ACT=activation,
        HAS_DROPOUT=dropout_p > 0, GROUPS_OF_4=N % 4 == 0, BLOCK_R=BLOCK_R, BLOCK_N=block_n, num_warps=4)
    dbias = torch.empty_like(b)
    _dbias_reduce_kernel[(triton.cdiv(N, REDUCE_BLOCK_N),)](part, dbias, chunks, N, BLOCK_P=REDUCE_BLOCK_P,
                                                            BLOCK_N=REDUCE_BLOCK_N, num_warps=4)
    return dx, dbias if dbias.dtype == bias.dtype else dbias.to(bias.dtype)
