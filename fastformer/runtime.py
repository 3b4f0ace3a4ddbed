"""Process settings for training and benchmarking on CPUs: the malloc policy, oneDNN's cache and the precision.

keep_freed_memory()
    A training step on CPU allocates and frees the same large tensors every step (the logits and their
    gradient: tokens x vocab floats, ~100 MB at the small config's 4,096-token batches; the activations,
    several MB each). glibc's malloc serves blocks above its mmap threshold (at most 32 MB) with a fresh
    mmap and unmaps them on free, and trims the heap top, so every step the kernel faults in and zeroes
    those pages again. Telling malloc never to mmap (M_MMAP_MAX = 0) and never to trim (M_TRIM_THRESHOLD =
    huge) keeps freed memory in the heap for the next step (freed neighbours coalesce, so after a few steps
    the step's blocks are reused). The price: the process keeps its peak memory until it exits. Side by
    side, a training step of the small config took less time so, fastformer's and torch.nn.Transformer's
    alike (measured: docs/training.md, "Precision, memory, threads, compile"). The same as starting Python
    with MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<huge>, applied from inside the process; a no-op where the
    C library is not glibc.

trim_freed_memory(limit_bytes)
    The bound on what keep_freed_memory keeps. Batches differ in shape from step to step, so the heap that
    never gives memory back fragments: the default training run's resident memory grew far beyond what a
    step needs over its 30 minutes (docs/training.md). Called after each update, this hands
    the heap's free pages back to the kernel (glibc's malloc_trim(0): madvise(MADV_DONTNEED) on every free
    page, the heap's layout unchanged) whenever resident memory is above the limit, so the next steps
    fault in only what they touch. Costs a read of /proc/self/statm per update, and a trim (a few ms,
    then some re-faulted pages) only when the limit is crossed.

bound_onednn_cache(capacity)
    torch's bfloat16 matmuls on the CPU go through ideep and oneDNN, and each keeps what it builds for a
    shape in a cache of 1,024 entries by default: oneDNN its primitives (JIT code and buffers sized by the
    shapes), ideep its computations. A training run's batches differ in shape from step to step, so both
    grow for as long as new shapes come, and none of it is free heap (trim_freed_memory cannot give it
    back); with both bounded to 64 entries the growth stops (measured: docs/training.md). The trainer
    sets both (ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY) to ONEDNN_CACHE_CAPACITY, enough for
    one update's products (about 10 distinct shapes x forward and two backward passes), so shapes that
    repeat within an update still hit; a value the user set wins.

provenance()
    Where a measured figure came from: the CPU, fastformer's CPU kernel level, torch, the source commit,
    the date and the command, written beside each result (the training run's summary record), so that a
    figure quoted in the docs names what made it.

native_bf16_cpu()
    Whether this CPU has bfloat16 dot-product instructions (AVX512_BF16 or AMX-BF16), with which
    oneDNN's bfloat16 matmuls beat float32 ones (measured: docs/training.md). Without them bfloat16 matmuls
    are emulated and no faster.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import functools
import os
import platform
import shlex
import subprocess
import sys

ONEDNN_CACHE_CAPACITY = 64  # oneDNN primitives and ideep computations kept by a trainer (bound_onednn_cache)
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_MAX = -4


def _glibc(name: str, argtypes: tuple):
    """The C library's function ``name`` (returning int), or None where it has none (not Linux, or not
    glibc: musl has neither mallopt nor malloc_trim)."""
    if platform.system() != "Linux":
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


@functools.cache
def keep_freed_memory() -> bool:
    """Makes glibc's malloc keep freed memory for reuse (see the module docstring). Returns whether it
    applied (glibc on Linux); idempotent."""
    mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int))
    return mallopt is not None and bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def bound_onednn_cache(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Bounds oneDNN's primitive cache and ideep's computation cache to ``capacity`` entries each, unless
    ONEDNN_PRIMITIVE_CACHE_CAPACITY or LRU_CACHE_CAPACITY is set already (see the module docstring). Takes
    effect only before the process's first bfloat16 matmul on the CPU (both read their variable once, when
    first used): call it at start-up."""
    for variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(variable, str(capacity))


def resident_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


_malloc_trim = functools.cache(lambda: _glibc("malloc_trim", (ctypes.c_size_t,)))


def trim_freed_memory(limit_bytes: int) -> bool:
    """Returns the heap's free pages to the kernel when resident memory exceeds ``limit_bytes`` (see the
    module docstring); whether it trimmed. A no-op for a limit <= 0 or where the C library is not glibc."""
    trim = _malloc_trim()  # cached: called after every update
    if limit_bytes <= 0 or trim is None or resident_bytes() <= limit_bytes:
        return False
    trim(0)
    return True


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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _source_commit() -> str:
    """The git commit of the source tree the package runs from ("+dirty" with uncommitted changes), or
    "unknown" outside a git checkout (an installed wheel)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance() -> dict:
    """What made a measurement: cpu, cpu_level (fastformer's CPU kernels), cores, torch, commit, date (UTC),
    command (as typed: ``python -m <module> <args>`` for a module run with -m)."""
    import torch

    import fastformer

    argv = list(sys.argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        argv = ["python", "-m", spec.name.removesuffix(".__main__")] + argv[1:]
    elif argv and argv[0].endswith(".py"):  # a script: python tools/x.py ...
        argv = ["python"] + argv
    return {"cpu": _cpu_model(), "cpu_level": fastformer.cpu_capability(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "commit": _source_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "command": shlex.join(argv)}
