"""What the Triton kernels share: the block-size tables (the one place where tile shapes, warps and
pipeline stages are chosen: fixed for the row kernels, autotuned candidates for attention), input checks,
and the Philox dropout helpers (the seed read from device memory, the keep-masks)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastformer._ext import C
from fastformer.triton import INTERPRET

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = C.GPU_MAX_HEAD_DIM  # csrc/ops.h kGpuMaxHeadDim, the cuda kernels' bound too


def check(name: str, *tensors: torch.Tensor) -> None:
    """Device and dtype checks every Triton op makes before a launch: the backend's own limits (the
    argument checks of csrc/ops.h ran before; the dispatcher already routed by device and dtype, this
    guards a direct call of fastformer.triton)."""
    want = "cpu" if INTERPRET else "cuda"
    for t in tensors:
        if t.device.type != want:
            raise ValueError(f"fastformer {name} (triton): expects {want} tensors here "
                             f"(TRITON_INTERPRET={'1' if INTERPRET else '0'}), got {t.device}")
        if t.dtype not in DTYPES:
            raise ValueError(f"fastformer {name} (triton): dtype {t.dtype} is not supported; use float16, "
                             f"bfloat16 or float32")


def upcast_dot(dtype: torch.dtype) -> bool:
    """The interpreter computes tl.dot on bfloat16 operands wrongly: there (only) the kernels cast
    bfloat16 tiles to float32 before their dots. On a GPU the bfloat16 dot runs as written."""
    return INTERPRET and dtype == torch.bfloat16


def attention_block_d(head_dim: int) -> int:
    """The head dim padded to a power of two (at least 16; the padding is masked)."""
    return max(16, triton.next_power_of_2(head_dim))


def length_bucket(length: int) -> int:
    """The autotuning key's sequence length: the next power of two, so a run whose batches come in many
    lengths tunes once per bucket, not once per length."""
    return triton.next_power_of_2(max(length, 1))


# Autotuned candidates of the attention kernels (BLOCK_M queries x BLOCK_N keys, warps, pipeline stages),
# for Ampere and Hopper: bigger query tiles amortise K/V loads, and the head dim 128 lists keep the
# registers and shared memory of a tile within one SM's. The autotuner benchmarks the candidates once per
# (length bucket, head dim, mask, causal, dropout, varlen, dtype) and keeps the fastest. The interpreter
# takes one small tile (no benchmarking; its speed is not the GPU's).
_FWD_CANDIDATES = {64: [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2), (128, 128, 8, 2)],
                   128: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2)]}
_BWD_CANDIDATES = {64: [(64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 32, 4, 2)],
                   128: [(64, 64, 8, 1), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1)]}


# FASTFORMER_TRITON_AUTOTUNE=0 (read at import): every attention launch takes one tile that every head dim
# fits, _UNTUNED, instead of benchmarking the candidates: for correctness runs on a GPU (tests/gpu), where
# autotuning would compile and time several kernels for each new key.
AUTOTUNE = os.environ.get("FASTFORMER_TRITON_AUTOTUNE", "1") != "0"
_UNTUNED = (64, 64, 4, 2)  # BLOCK_M, BLOCK_N, warps, stages

# The autotuning key: argument names of the attention kernels (Triton adds the tensors' dtypes).
_ATTENTION_KEY = ["L_BUCKET", "D", "HAS_KPM", "CAUSAL", "HAS_DROPOUT", "VARLEN"]


def attention_shapes(kind: str, interpret: bool = INTERPRET, autotune: bool = AUTOTUNE) -> list[tuple]:
    """The (BLOCK_M, BLOCK_N, warps, stages) the forward ("fwd") or backward ("bwd") attention kernels may
    run with: one small tile in the interpreter, _UNTUNED when autotuning is off, else every candidate."""
    if interpret:
        return [(32, 32, 4, 1)]
    if not autotune:
        return [_UNTUNED]
    table = _FWD_CANDIDATES if kind == "fwd" else _BWD_CANDIDATES
    return list(dict.fromkeys(c for cands in table.values() for c in cands))


def attention_autotune(kind: str):
    """The triton.autotune decorator of the forward ("fwd") or backward ("bwd") attention kernels: every
    shape of attention_shapes as a Config; several are pruned per call to those listed for the call's
    BLOCK_D (<= 64, or 128)."""
    table = _FWD_CANDIDATES if kind == "fwd" else _BWD_CANDIDATES
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
               for m, n, w, st in attention_shapes(kind)]

    def prune(configs, named_args, **kwargs):  # called only with more than one config: autotuning on a GPU
        wanted = set(table[64 if kwargs["BLOCK_D"] <= 64 else 128])
        return [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]

    return triton.autotune(configs=configs, key=_ATTENTION_KEY, prune_configs_by={"early_config_prune": prune})


def whole_row_tile(n: int) -> dict:
    """Row kernels that hold whole rows (layer norm; softmax up to 4,096): a (BLOCK_R, BLOCK_N) tile of
    BLOCK_R rows per program and step, BLOCK_N the next power of two >= n; several short rows per program,
    about 16 values per thread (n = 512: 8 rows and 8 warps, a row per warp as in the CUDA warp layout)."""
    block_n = triton.next_power_of_2(max(n, 1))
    block_r = max(1, min(16, 4096 // block_n))
    return dict(BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4 if block_r * block_n <= 2048 else 8)


def row_blocks(n: int) -> dict:
    """Row kernels (softmax, layer norm): a power-of-two chunk of the row per loop step, and warps."""
    block = min(triton.next_power_of_2(max(n, 1)), 4096 if not INTERPRET else 1024)
    return dict(BLOCK_N=block, num_warps=4 if block <= 1024 else 8)


@triton.jit
def _kept(word, p):
    """A Philox word as a uniform in [0, 1) (tl.rand's mapping: int32 x -> (x < 0 ? -x - 1 : x) 2^-31, in
    float32), kept iff >= p (csrc/philox.h, bit for bit)."""
    x = word.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, -x - 1, x)
    return x.to(tl.float32) * 4.6566127342e-10 >= p


def seed_pointer(seed, dummy: torch.Tensor) -> torch.Tensor:
    """The kernels' ``seed_ptr`` argument: the call's dropout seed, a 0-dim int64 tensor on the inputs'
    device (checked by csrc/ops.h check_seed), or ``dummy`` without dropout (never read then)."""
    return dummy if seed is None else seed


@triton.jit
def load_seed(seed_ptr, HAS_DROPOUT: tl.constexpr):
    """The dropout seed, read once by each program from the tensor ``seed_ptr`` points to (never passed by
    value: a replayed CUDA graph finds the new seed that torch's generator wrote there); 0 without dropout
    (not read)."""
    return tl.load(seed_ptr) if HAS_DROPOUT else 0


@triton.jit
def dropout_keep(seed, index, p):
    """Keep-mask of elements with int64 flat ``index`` under ``seed``: Philox4x32-10 of counter
    index >> 2, word index & 3 (one Philox evaluation per element)."""
    r0, r1, r2, r3 = tl.randint4x(seed, index >> 2)
    word = index & 3
    return _kept(tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3))), p)


@triton.jit
def dropout_keep_rows(seed, rows, first_col, N, p, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUPS_OF_4: tl.constexpr):
    """Keep-mask of the (BLOCK_R, BLOCK_N) tile of elements rows N + first_col + [0, BLOCK_N) of an (R, N)
    tensor (row_tile's tile, or a tile of attention's (B H Lq, Lk) probabilities), the same bits as
    dropout_keep. With GROUPS_OF_4 (N and first_col multiples of 4, so every group of 4 columns is one
    Philox counter) one Philox evaluation serves 4 consecutive elements: counters
    (rows N + first_col) / 4 + g for the BLOCK_N / 4 groups g, whose four words are interleaved into the
    elements 4 g .. 4 g + 3 (join and reshape keep the order): a quarter of the integer work, which at
    p > 0 would otherwise outweigh a row kernel's memory traffic."""
    if GROUPS_OF_4:
        counter = rows[:, None] * (N // 4) + (first_col // 4 + tl.arange(0, BLOCK_N // 4))[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, counter)  # each (BLOCK_R, BLOCK_N / 4)
        words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK_R, BLOCK_N])  # [.., g, x, y]: word 2x + y
        return _kept(words, p)
    else:
        return dropout_keep(seed, rows[:, None] * N + first_col + tl.arange(0, BLOCK_N)[None, :], p)


@triton.jit
def row_tile(first_row, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (BLOCK_R, BLOCK_N) tile of whole rows first_row .. first_row + BLOCK_R - 1 of an (R, N) row-major
    tensor (whole_row_tile): rows (int64), cols, live (rows < R), inside (live and cols < N) and the
    element offsets rows N + cols."""
    rows = first_row.to(tl.int64) + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    live = rows < R
    inside = live[:, None] & (cols < N)[None, :]
    return rows, cols, live, inside, rows[:, None] * N + cols[None, :]


@triton.jit
def online_softmax_step(m, l, bad, a):
    """One chunk of an online softmax, per lane: the running max m and sum l of e^(a - m) take the chunk's
    values a (-inf where masked or past the row); a NaN or +inf value sets the lane's ``bad`` flag and
    counts as -inf (the caller turns the row NaN), so m stays finite. Returns (m, l, bad)."""
    unbounded = (a != a) | (a == float("inf"))
    bad = bad | unbounded.to(tl.int32)
    a = tl.where(unbounded, float("-inf"), a)
    m_new = tl.maximum(m, a)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l = l * tl.exp(m - m_safe) + tl.exp(a - m_safe)
    return m_new, l, bad


@triton.jit
def online_softmax_total(m, l):
    """The lanes' (m, l) merged: (the row max, or 0 when every value was -inf; the row's sum of
    e^(a - that max))."""
    row_max = tl.max(m, 0)
    row_max_safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    return row_max_safe, tl.sum(l * tl.exp(m - row_max_safe), 0)
