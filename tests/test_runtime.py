"""fastformer.runtime: the malloc policy really stops re-faulting freed memory; the bf16 probe reads
the CPU flags."""
import platform
import subprocess
import sys

import pytest

from fastformer.runtime import native_bf16_cpu

# A child process runs ten "steps", each allocating, writing and freeing the same five large tensors
# (304 MiB), and counts the minor page faults of the last seven steps together. Under glibc's default
# policy every block is unmapped on free and all its pages fault anew each step; after
# keep_freed_memory() the freed blocks coalesce in the heap within a few steps and later steps reuse
# them. (Not every later step is free of faults: how the freed blocks coalesce depends on the small
# allocations between them, and an occasional step still grows the heap by one block; measured over
# 36 runs: 0-16,384 faults in the last seven steps, against about 545,000 under the default policy.)
_STEPS = """
import resource, sys, torch
from fastformer.runtime import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
sizes = [25 << 20, 8 << 20, 25 << 20, 2 << 20, 16 << 20]  # floats
faults = []
for step in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(n) for n in sizes]
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sum(faults[3:]))
"""
PAGES = 7 * (76 << 20) * 4 // 4096  # pages allocated in the last seven steps


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_keep_freed_memory_stops_refaulting():
    def run(policy):
        out = subprocess.run([sys.executable, "-c", _STEPS, policy], capture_output=True, text=True, check=True)
        applied, refaults = out.stdout.split()
        return applied == "True", int(refaults)

    applied, refaults = run("keep")
    default_applied, default_refaults = run("default")
    assert applied and not default_applied
    assert default_refaults > PAGES // 2, "the default policy was expected to fault the pages in again"
    assert refaults < PAGES // 10, f"{refaults} page faults in the last seven steps ({PAGES} pages allocated)"


def test_native_bf16_cpu_reads_the_flags():
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    assert native_bf16_cpu() == bool({"avx512_bf16", "amx_bf16"} & set(flags))


# A child process keeps freed memory, frees 512 MiB it wrote, then asks trim_freed_memory for a limit
# above its resident memory (nothing happens) and one below it (the free pages go back).
_TRIM = """
import torch
from fastformer.runtime import keep_freed_memory, resident_bytes, trim_freed_memory
assert keep_freed_memory()
x = torch.ones(128 << 20)  # 512 MiB, from the heap (no mmap under keep_freed_memory)
del x
held = resident_bytes()
print(held, trim_freed_memory(held + (256 << 20)), resident_bytes(), trim_freed_memory(held - (256 << 20)),
      resident_bytes(), trim_freed_memory(0))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_trim_freed_memory_returns_kept_pages_above_the_limit():
    out = subprocess.run([sys.executable, "-c", _TRIM], capture_output=True, text=True, check=True).stdout.split()
    held, above, after_above, below, after_below, zero = out
    assert above == "False" and int(after_above) > int(held) - (64 << 20), "trimmed below the limit"
    assert below == "True", "not trimmed although resident memory was above the limit"
    assert int(after_below) < int(held) - (400 << 20), f"resident {after_below} after the trim, {held} before"
    assert zero == "False", "a limit of 0 means no limit"
