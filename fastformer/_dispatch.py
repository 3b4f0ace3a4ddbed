"""The one dispatcher: picks a backend for a call and finds its implementation.

Backends and what they run:
  torch     plain PyTorch (fastformer/ops/reference.py), any device, float16/bfloat16/float32/float64
  cpu       C++ kernels in fastformer._C, CPU tensors, float16/bfloat16/float32/float64
  cuda      CUDA kernels in fastformer._C, CUDA tensors (compiled where nvcc and a CUDA torch exist)
  triton    Triton kernels, CUDA tensors (or CPU tensors under TRITON_INTERPRET=1)
  cuda_sim  the CUDA kernels run by the CPU SIMT execution model: test equipment, CPU tensors

Implementations are found by name: ``<op>_<fwd|bwd>`` in reference.py for torch,
``_C.<op>_<fwd|bwd>_<backend>`` for cpu and cuda, ``fastformer.triton.<op>.<op>_<fwd|bwd>`` for
triton, ``fastformer.cuda_sim.<op>_<fwd|bwd>`` for cuda_sim.

Precedence: the call's ``backend=`` argument, then ``set_backend()``, then the FASTFORMER_BACKEND
environment variable (read at import), then the automatic choice by device.
"""
from __future__ import annotations

import importlib
import os

import torch

from fastformer import _ext

NAMES = ("torch", "cpu", "cuda", "triton", "cuda_sim")

_HALF_AND_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_ALL_FLOAT = _HALF_AND_FLOAT + (torch.float64,)


def _check_name(name: str) -> str:
    if name not in NAMES:
        raise ValueError(f"unknown fastformer backend {name!r}; choose one of {', '.join(NAMES)}")
    return name


_default: str | None = None
_env = os.environ.get("FASTFORMER_BACKEND") or None
if _env is not None:
    _check_name(_env)


def set_backend(name: str | None) -> None:
    """Sets the process-wide default backend (``None`` restores the automatic choice)."""
    global _default
    _default = None if name is None else _check_name(name)


def _module_status(name: str, module: str) -> tuple[bool, str]:
    """A backend implemented by an importable module: usable iff the module imports here."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return False, f"the {name} backend is not available ({exc})"
    return True, ""


def _status(name: str) -> tuple[bool, str]:
    """(usable, reason if not) for a backend on this machine."""
    if name == "torch":
        return True, ""
    if name == "cpu":
        return (_ext.available(), _ext.error() or "")
    if name == "cuda":
        if not _ext.available():
            return False, _ext.error() or ""
        if not getattr(_ext.extension(), "WITH_CUDA", False):
            return False, ("fastformer._C was built without CUDA kernels (no GPU or nvcc at build time); "
                           "rebuild with FASTFORMER_FORCE_CUDA=1 pip install .")
        if not torch.cuda.is_available():
            return False, "no CUDA device is visible"
        return True, ""
    if name == "triton":
        return _module_status(name, "fastformer.triton")
    return _module_status(name, "fastformer.cuda_sim")


_status_cache: dict[str, tuple[bool, str]] = {}


def status(name: str) -> tuple[bool, str]:
    if name not in _status_cache:
        _status_cache[name] = _status(name)
    return _status_cache[name]


def backends() -> dict[str, bool]:
    """Which backends can run on this machine, e.g. ``{"torch": True, "cpu": True, "cuda": False, ...}``."""
    return {name: status(name)[0] for name in NAMES}


def _supported_dtypes(name: str, device: torch.device) -> tuple[torch.dtype, ...]:
    if name in ("torch", "cpu"):
        return _ALL_FLOAT
    if name == "cuda" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return (torch.float16, torch.float32)
    return _HALF_AND_FLOAT


def _interpreting_triton() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _device_ok(name: str, device: torch.device) -> tuple[bool, str]:
    if name == "torch":
        return True, ""
    if name in ("cpu", "cuda_sim"):
        return device.type == "cpu", f"it runs on CPU tensors, got {device.type} tensors"
    if name == "cuda":
        return device.type == "cuda", f"it runs on CUDA tensors, got {device.type} tensors"
    want = "cpu" if _interpreting_triton() else "cuda"
    return device.type == want, (f"it runs on {want} tensors here (TRITON_INTERPRET="
                                 f"{os.environ.get('TRITON_INTERPRET', '0')}), got {device.type} tensors")


def _automatic(device: torch.device) -> str:
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        order = ("triton", "cuda") if major >= 8 else ("cuda", "triton")
        for name in order + ("torch",):
            if status(name)[0]:
                return name
    if device.type == "cpu" and status("cpu")[0]:
        return "cpu"
    return "torch"


def resolve(op: str, backend: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that runs ``op`` for inputs on ``device`` in ``dtype``, or a clear error."""
    explicit = backend if backend is not None else (_default if _default is not None else _env)
    if explicit is None:
        return _automatic(device)
    name = _check_name(explicit)
    usable, reason = status(name)
    if not usable:
        raise RuntimeError(f"fastformer {op}: backend {name!r} cannot run here: {reason}. "
                           f"Available backends: {[n for n, ok in backends().items() if ok]}.")
    ok, reason = _device_ok(name, device)
    if not ok:
        raise ValueError(f"fastformer {op}: backend {name!r} cannot run these inputs: {reason}; "
                         f"move the tensors or pick another backend")
    if dtype not in _supported_dtypes(name, device):
        raise ValueError(f"fastformer {op}: backend {name!r} does not support {dtype}; it supports "
                         f"{[str(d) for d in _supported_dtypes(name, device)]}")
    return name


def implementation(op: str, phase: str, backend: str):
    """The function computing ``op``'s ``phase`` ("fwd" or "bwd") on ``backend``."""
    if backend == "torch":
        from fastformer.ops import reference
        return getattr(reference, f"{op}_{phase}")
    if backend in ("cpu", "cuda"):
        return getattr(_ext.extension(), f"{op}_{phase}_{backend}")
    if backend == "triton":
        return getattr(importlib.import_module(f"fastformer.triton.{op}"), f"{op}_{phase}")
    if backend == "cuda_sim":
        return getattr(importlib.import_module("fastformer.cuda_sim"), f"{op}_{phase}")
    raise ValueError(f"unknown fastformer backend {backend!r}")
