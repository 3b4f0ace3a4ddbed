"""Process settings for training and benchmarking on CPUs: the malloc policy and the precision.

keep_freed_memory()
    A training step on CPU allocates and frees the same large tensors every step (the logits and their
    gradient: tokens x vocab floats, ~100 MB at the small config's 4,096-token batches; the activations,
    several MB each). glibc's malloc serves blocks above its mmap threshold (at most 32 MB) with a fresh
    mmap and unmaps them on free, and trims the heap top, so every step the kernel faults in and zeroes
    those pages again: ~2 us per 4 KiB page on the development VM, hundreds of ms a step. Telling malloc
    never to mmap (M_MMAP_MAX = 0) and never to trim (M_TRIM_THRESHOLD = huge) keeps freed memory in the
    heap for the next step (freed neighbours coalesce, so after a few steps the step's blocks are
    reused). The price: the process keeps its peak memory until it exits. Measured on
    the 2-core VM, side by side: a training step of the small config took 20-35% less time (fastformer and
    torch.nn.Transformer alike). The same as starting Python with MALLOC_MMAP_MAX_=0
    MALLOC_TRIM_THRESHOLD_=<huge>, applied from inside the process; a no-op where the C library is not glibc.

native_bf16_cpu()
    Whether this CPU has bfloat16 dot-product instructions (AVX512_BF16 or AMX-BF16), with which
    oneDNN's bfloat16 matmuls run at about twice the float32 rate (measured 2.0-2.6x on the AVX512_BF16
    development VM at the small config's shapes). Without them bfloat16 matmuls are emulated and no faster.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_MAX = -4


@functools.cache
def keep_freed_memory() -> bool:
    """Makes glibc's malloc keep freed memory for reuse (see the module docstring). Returns whether it
    applied (glibc on Linux); idempotent."""
    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


@functools.cache
def native_bf16_cpu() -> bool:
    """Whether the CPU has bfloat16 dot-product instructions (Linux: the avx512_bf16 or amx_bf16 flag of
    /proc/cpuinfo; elsewhere False)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False
