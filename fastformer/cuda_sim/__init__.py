"""Backend ``cuda_sim``: the CUDA kernels of csrc/cuda/, unchanged, executed on CPU tensors.

Test equipment (docs/cuda-kernels.md, "The CPU SIMT model"), never a path for
users: the launchers csrc/cuda/<op>.cu and their kernels csrc/cuda/<op>.cuh are compiled as plain C++
against the CPU SIMT execution model csrc/cuda_sim/simt.h, which runs every CUDA thread of a block as
a fiber, treats __syncthreads, __syncwarp and warp shuffles as barriers, raises on divergent barriers
and deadlocks, and shuffles the order of warps and lanes between barriers from a schedule seed.

Each op is its own extension ``fastformer_cuda_sim_<op>`` (csrc/cuda_sim/binding.cpp built with
-DFF_SIM_OP=<op>; the fused Adam, not an op, is ``fastformer_cuda_sim_adam``: ``adam_step``), compiled on first use with ``torch.utils.cpp_extension.load`` (about a minute per
op on 2 cores) and cached under ``TORCH_EXTENSIONS_DIR``. The sources come from ``fastformer/_csrc`` (copied there by ``pip install``)
or from ``csrc/`` beside the package (an editable install).

The schedule seed defaults to ``FASTFORMER_CUDA_SIM_SEED`` (1 if unset; 0 runs warps and lanes in
index order) and is changed with ``set_schedule_seed``. The model plays a GPU of compute capability 8.0
(float16 and bfloat16 attention on the tensor-core kernels) unless ``compute_capability`` says otherwise.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
from pathlib import Path

import torch

from fastformer._ext import C

OPS = tuple(C.OPS)  # the op list of csrc/ops.h


def _find_sources() -> Path:
    package = Path(__file__).resolve().parent.parent
    for root in (package / "_csrc", package.parent / "csrc"):
        if (root / "cuda_sim" / "simt.cpp").is_file():
            return root
    raise ImportError("the CUDA kernel sources (fastformer/_csrc or csrc/) are missing from this installation")


SOURCE_ROOT = _find_sources()
if shutil.which(os.environ.get("CXX", "c++")) is None:
    raise ImportError("no C++ compiler on PATH (the cuda_sim backend compiles the CUDA kernels on first use)")


def _find_ninja() -> bool:
    """torch.utils.cpp_extension.load runs ``ninja`` from PATH: the ninja package's (the test extra brings
    it) is put there when its folder is not, e.g. when the venv's pytest runs without the venv activated."""
    try:
        import ninja
    except ImportError:
        return shutil.which("ninja") is not None
    folder = getattr(ninja, "BIN_DIR", "")
    if folder and os.path.isfile(os.path.join(folder, "ninja")) and shutil.which("ninja") is None:
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


if not _find_ninja():
    raise ImportError("no ninja executable (the cuda_sim backend compiles the CUDA kernels on first use): "
                      "pip install ninja, which pip install \".[test]\" brings")

_lock = threading.Lock()
_modules: dict[str, object] = {}
_seed = int(os.environ.get("FASTFORMER_CUDA_SIM_SEED", "1"))
_capability = 80  # the GPU generation the model plays (10 major + minor): the launchers choose kernels by it


def build(name: str, sources: list, *, defines: tuple = (), verbose: bool = False):
    """Compiles C++ ``sources`` (which include csrc/cuda/ kernels) and the SIMT model into extension ``name``.

    The csrc/ tree is on the include path ("cuda/common.cuh", "cuda/softmax.cu", ...); ``defines`` are
    extra -D flags.
    """
    from torch.utils import cpp_extension

    # torch's extension cache (TORCH_EXTENSIONS_DIR) keys builds by name and sources, not by torch
    # release: the name carries the release, so another torch never loads this one's build.
    return cpp_extension.load(
        name=f"{name}_torch_{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}",
        sources=[str(s) for s in sources] + [str(SOURCE_ROOT / "cuda_sim" / "simt.cpp")],
        extra_include_paths=[str(SOURCE_ROOT)],
        extra_cflags=["-O2", "-fopenmp", "-fno-strict-aliasing", "-Wno-unknown-pragmas"] + [f"-D{d}" for d in defines],
        extra_ldflags=["-fopenmp"],
        verbose=verbose,
    )


def load(op: str, *, verbose: bool = False):
    """The compiled extension of ``op`` (built on first use, then cached)."""
    if op not in OPS:
        raise ValueError(f"cuda_sim: unknown op {op!r}; choose one of {OPS}")
    with _lock:
        if op not in _modules:
            module = build(f"fastformer_cuda_sim_{op}", [SOURCE_ROOT / "cuda_sim" / "binding.cpp"],
                           defines=(f"FF_SIM_OP={op}",), verbose=verbose)
            module.set_schedule_seed(_seed)
            module.set_compute_capability(_capability)
            _modules[op] = module
        return _modules[op]


def set_schedule_seed(seed: int) -> None:
    """Seeds the order in which warps and lanes run between barriers (0 = index order) for every op."""
    global _seed
    if seed < 0:
        raise ValueError(f"cuda_sim: the schedule seed must be >= 0, got {seed}")
    with _lock:
        _seed = int(seed)
        for module in _modules.values():
            module.set_schedule_seed(_seed)


def schedule_seed() -> int:
    return _seed


@contextlib.contextmanager
def compute_capability(capability: int):
    """Within the block the model plays a GPU of this compute capability (10 major + minor; default 80),
    e.g. 60: the launchers then choose the P100 SIMT kernels for float16 too, where 80 takes the
    tensor-core kernels (csrc/cuda/attention_mma.cuh)."""
    global _capability
    if capability < 60:
        raise ValueError(f"cuda_sim: the kernels target compute capability 60 and newer, got {capability}")
    with _lock:
        before, _capability = _capability, int(capability)
        for module in _modules.values():
            module.set_compute_capability(_capability)
    try:
        yield
    finally:
        with _lock:
            _capability = before
            for module in _modules.values():
                module.set_compute_capability(_capability)


@contextlib.contextmanager
def barrier_deleted(op: str, file: str, line: int):
    """Mutation testing: within the block, the ``__syncthreads()`` at ``line`` of the kernel file whose path
    ends with ``file`` (e.g. "cuda/softmax.cuh") is a no-op in ``op``'s kernels, as if deleted from the
    source. Yields the op's extension; its ``deleted_barrier_hits()`` counts the threads that passed it."""
    module = load(op)
    module.delete_barrier(file, int(line))
    try:
        yield module
    finally:
        module.delete_barrier("", 0)


def adam_step(*args):
    """fastformer._C.adam_step's arguments (csrc/optim/optim.h) on the fused Adam's CUDA launcher and kernels
    (csrc/cuda/adam.cu, adam.cuh) executed by the CPU SIMT model, CPU tensors. Not an op: its own extension,
    ``fastformer_cuda_sim_adam`` (csrc/cuda_sim/optim_binding.cpp), built on first use. The launcher trusts its
    arguments as _C's checks left them: call it with what passes ``fastformer._C.adam_step``."""
    with _lock:
        if "adam" not in _modules:
            module = build("fastformer_cuda_sim_adam", [SOURCE_ROOT / "cuda_sim" / "optim_binding.cpp"])
            module.set_schedule_seed(_seed)
            module.set_compute_capability(_capability)
            _modules["adam"] = module
        module = _modules["adam"]
    return module.adam_step(*args)


def entry(op: str, phase: str):
    """``op``'s ``phase`` ("fwd" or "bwd") on the CUDA kernels executed by the CPU SIMT model: the launcher
    of csrc/cuda/<op>.cu, with the signature of csrc/op_entry_points.h (built on first use)."""
    fn_name = f"{op}_{phase}"

    def run(*args):
        return getattr(load(op), fn_name)(*args)

    run.__name__ = fn_name
    return run
