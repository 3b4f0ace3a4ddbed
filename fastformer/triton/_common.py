"""What the Triton kernels share: the block-size table (the one place where tile shapes and warps are
chosen; nothing is autotuned at import), input checks, and the Philox dropout helper."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastformer.triton import INTERPRET

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128


def check(name: str, *tensors: torch.Tensor) -> None:
    """Device and dtype checks every Triton op makes before a launch."""
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


def attention_blocks(head_dim: int) -> dict:
    """Tile shapes of the attention kernels: BLOCK_M queries x BLOCK_N keys, head dim padded to a power
    of two (at least 16, masked), and warps. Smaller tiles for big head dims keep registers in check."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if INTERPRET:
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_D=block_d, num_warps=4)
    if block_d <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=block_d, num_warps=4)
    return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=block_d, num_warps=8)


def row_blocks(n: int) -> dict:
    """Row kernels (softmax, layer norm): a power-of-two chunk of the row per loop step, and warps."""
    block = min(triton.next_power_of_2(max(n, 1)), 4096 if not INTERPRET else 1024)
    return dict(BLOCK_N=block, num_warps=4 if block <= 1024 else 8)


@triton.jit
def dropout_keep(seed, index, p):
    """Keep-mask of elements with int64 flat ``index`` under ``seed``: Philox4x32-10 of counter
    index >> 2, word index & 3, as a uniform (tl.rand's mapping) >= p (csrc/philox.h, bit for bit)."""
    r0, r1, r2, r3 = tl.randint4x(seed, index >> 2)
    word = index & 3
    r = tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3)))
    x = r.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, -x - 1, x)
    return x.to(tl.float32) * 4.6566127342e-10 >= p
