"""Backend ``cuda_sim``: the CUDA kernels of csrc/cuda/, unchanged, executed on CPU tensors.

Test equipment (DESIGN.md, "Running CUDA and Triton code on machines with no GPU"), never a path for
users: the launchers csrc/cuda/<op>.cu and their kernels csrc/cuda/<op>.cuh are compiled as plain C++
against the CPU SIMT execution model csrc/cuda_sim/simt.h, which runs every CUDA thread of a block as
a fiber, treats __syncthreads, __syncwarp and warp shuffles as barriers, raises on divergent barriers
and deadlocks, and shuffles the order of warps and lanes between barriers from a schedule seed.

Each op is its own extension ``fastformer_cuda_sim_<op>`` (csrc/cuda_sim/<op>.cpp), compiled on first
use with ``torch.utils.cpp_extension.load`` (about a minute per op on 2 cores) and cached under
``TORCH_EXTENSIONS_DIR``. The sources come from ``fastformer/_csrc`` (copied there by ``pip install``)
or from ``csrc/`` beside the package (an editable install).

The schedule seed defaults to ``FASTFORMER_CUDA_SIM_SEED`` (1 if unset; 0 runs warps and lanes in
index order) and is changed with ``set_schedule_seed``.
"""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

OPS = ("attention", "softmax", "layer_norm_residual")


def _find_sources() -> Path:
    package = Path(__file__).resolve().parent.parent
    for root in (package / "_csrc", package.parent / "csrc"):
        if (root / "cuda_sim" / "simt.cpp").is_file():
            return root
    raise ImportError("the CUDA kernel sources (fastformer/_csrc or csrc/) are missing from this installation")


SOURCE_ROOT = _find_sources()
if shutil.which(os.environ.get("CXX", "c++")) is None:
    raise ImportError("no C++ compiler on PATH (the cuda_sim backend compiles the CUDA kernels on first use)")

_lock = threading.Lock()
_modules: dict[tuple[str, str], object] = {}
_seed = int(os.environ.get("FASTFORMER_CUDA_SIM_SEED", "1"))


def build(name: str, sources: list[str], *, root: str | os.PathLike | None = None, verbose: bool = False):
    """Compiles C++ ``sources`` (which include csrc/cuda/ kernels) with the SIMT model into extension ``name``.

    ``root`` is the csrc/ tree on the include path (the installed one by default); simt.cpp is added.
    """
    from torch.utils import cpp_extension

    base = Path(root) if root is not None else SOURCE_ROOT
    return cpp_extension.load(
        name=name,
        sources=[str(s) for s in sources] + [str(base / "cuda_sim" / "simt.cpp")],
        extra_include_paths=[str(base)],
        extra_cflags=["-O2", "-fopenmp", "-Wno-unknown-pragmas"],
        extra_ldflags=["-fopenmp"],
        verbose=verbose,
    )


def load(op: str, *, root: str | os.PathLike | None = None, variant: str = "", verbose: bool = False):
    """The compiled extension of ``op`` (built on first use).

    ``root`` builds from another copy of the csrc/ tree (the mutation tests build a kernel with a barrier
    deleted this way); ``variant`` names that build so it is cached apart from the real one.
    """
    if op not in OPS:
        raise ValueError(f"cuda_sim: unknown op {op!r}; choose one of {OPS}")
    key = (op, variant)
    with _lock:
        if key not in _modules:
            base = Path(root) if root is not None else SOURCE_ROOT
            name = f"fastformer_cuda_sim_{op}" + (f"_{variant}" if variant else "")
            module = build(name, [base / "cuda_sim" / f"{op}.cpp"], root=base, verbose=verbose)
            module.set_schedule_seed(_seed)
            _modules[key] = module
        return _modules[key]


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


def _entry(op: str, phase: str):
    fn_name = f"{op}_{phase}"

    def run(*args):
        return getattr(load(op), fn_name)(*args)

    run.__name__ = fn_name
    run.__doc__ = f"{op} {phase} on the CUDA kernels executed by the CPU SIMT model (built on first use)."
    return run


attention_fwd = _entry("attention", "fwd")
attention_bwd = _entry("attention", "bwd")
softmax_fwd = _entry("softmax", "fwd")
softmax_bwd = _entry("softmax", "bwd")
layer_norm_residual_fwd = _entry("layer_norm_residual", "fwd")
layer_norm_residual_bwd = _entry("layer_norm_residual", "bwd")
