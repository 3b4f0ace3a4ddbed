"""The one dispatcher: picks a backend for a call and finds its implementation.

Backends and what they run:
  torch     plain PyTorch (fastformer/ops/reference.py), any device, float16/bfloat16/float32/float64
  cpu       C++ kernels in fastformer._C, CPU tensors, float16/bfloat16/float32/float64
  cuda      CUDA kernels in fastformer._C, CUDA tensors (compiled where nvcc and a CUDA torch exist)
  triton    Triton kernels, CUDA tensors (or CPU tensors under TRITON_INTERPRET=1)
  cuda_sim  the CUDA kernels run by the CPU SIMT execution model: test equipment, CPU tensors

cpu and cuda are the registered ops ``torch.ops.fastformer.<op>_<fwd|bwd>`` (C++ kernels for the CPU and
CUDA dispatch keys, C++ autograd); torch, triton and cuda_sim run through the twin ops
``torch.ops.fastformer.<op>_<fwd|bwd>_py(..., backend)``, whose Python implementation calls
``<op>_<fwd|bwd>`` of reference.py (torch), ``fastformer.triton.<op>`` (triton) or ``fastformer.cuda_sim``.

``forward(op, backend, x)`` gives the forward op that runs a call, cached per (op, requested backend,
device, dtype): the per-call cost is one dict lookup. The automatic choice on a GPU also checks the
backend's limits (head dim, row length) per call, so ``backend=None`` never picks one that refuses.

Precedence: the call's ``backend=`` argument, then ``set_backend()``, then the FASTFORMER_BACKEND
environment variable (read at import), then the automatic choice by device.
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Callable

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
                           "rebuild against the CUDA torch you run: FASTFORMER_FORCE_CUDA=1 pip install "
                           "--no-build-isolation --force-reinstall --no-deps .")
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


def _gpu_order(device: torch.device, op: str | None = None, dtype: torch.dtype | None = None) -> list[str]:
    """The available GPU backends for ``device`` in order of preference: as measured for its compute
    capability, ``op`` and ``dtype`` where fastformer/ops/gpu_table.py has them (tools/gpu_choice.py writes it
    from a GPU run's op benchmarks), else the rule of thumb: triton first on 8.0 and newer, cuda first before."""
    from fastformer.ops.gpu_table import TABLE
    major, minor = torch.cuda.get_device_capability(device)
    dtype_name = str(dtype).removeprefix("torch.")
    measured = TABLE.get(f"{major}.{minor}", {}).get(op, {}).get(dtype_name)
    order = measured[0] if measured else (("triton", "cuda") if major >= 8 else ("cuda", "triton"))
    return [n for n in order if status(n)[0]]


def _automatic(device: torch.device) -> str:
    if device.type == "cuda":
        return (_gpu_order(device) + ["torch"])[0]
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


def _fits(op: str, name: str, x: torch.Tensor) -> bool:
    """Whether GPU backend ``name`` takes ``op`` on inputs whose first tensor is ``x`` (its documented limits)."""
    if op in ("attention", "attention_varlen"):  # q (B, H, L, D) or packed (T, H, D); cuda and triton alike
        return x.dim() == (4 if op == "attention" else 3) and x.shape[-1] <= _ext.extension().GPU_MAX_HEAD_DIM
    if op == "layer_norm_residual" and name == "triton":
        from fastformer.triton.layer_norm_residual import MAX_N
        return x.dim() >= 1 and x.shape[-1] <= MAX_N
    return True


def kernel(op: str, phase: str, backend: str, *, eager: bool = False) -> Callable:
    """The registered op that runs ``op``'s ``phase`` on ``backend``, taking the schema's arguments without
    ``backend``: ``torch.ops.fastformer.<op>_<phase>`` for cpu and cuda, the ``_py`` twin bound to the name
    for the others. ``eager=True`` gives a C++ entry that skips the OpOverload's Python frame: for the cpu and
    cuda forward ``fastformer._C.EAGER_FWD[op]`` (the dispatcher's typed call, without the JIT's argument
    matching and boxing; anything unusual goes to the OpOverload: csrc/fastformer.cpp), else
    ``OpOverload._op`` (bound to the backend's name by functools.partial). torch.compile traces the
    OpOverload itself."""
    if eager and phase == "fwd" and backend in ("cpu", "cuda"):
        return _ext.extension().EAGER_FWD[op]
    packet = getattr(torch.ops.fastformer, f"{op}_{phase}" + ("" if backend in ("cpu", "cuda") else "_py"))
    overload = packet.default._op if eager else packet.default
    if backend in ("cpu", "cuda"):
        return overload
    if eager:  # a partial, not a lambda: no Python frame between the caller and the op (tests/gpu)
        return functools.partial(overload, backend=backend)
    return lambda *args: overload(*args, backend)


def _gpu_automatic(op: str, device: torch.device, dtype: torch.dtype, eager: bool) -> Callable:
    """Forward of ``op`` on a CUDA device: the preferred GPU backend whose limits hold for the call, else torch."""
    candidates = [(n, kernel(op, "fwd", n, eager=eager)) for n in _gpu_order(device, op, dtype)]
    fallback = kernel(op, "fwd", "torch", eager=eager)

    def run(*args):
        for name, fn in candidates:
            if _fits(op, name, args[0]):
                return fn(*args)
        return fallback(*args)

    return run


_forward_cache: dict[tuple, tuple[Callable, Callable]] = {}  # key -> (eager entry, traceable entry)
_compiling = torch.compiler.is_compiling


def forward(op: str, backend: str | None, x) -> Callable:
    """The forward op that runs ``op`` for a call whose first tensor is ``x`` (cached; see the module doc)."""
    requested = backend if backend is not None else _default
    try:
        key = (op, requested, x.device, x.dtype)
    except AttributeError:
        raise ValueError(f"fastformer {op}: expected a torch.Tensor, got {type(x).__name__}") from None
    entry = _forward_cache.get(key)
    if entry is None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"fastformer {op}: expected a torch.Tensor, got {type(x).__name__}")
        explicit = requested if requested is not None else _env
        if explicit is None and x.device.type == "cuda":
            entry = (_gpu_automatic(op, x.device, x.dtype, True), _gpu_automatic(op, x.device, x.dtype, False))
        else:
            name = resolve(op, explicit, x.device, x.dtype)
            entry = (kernel(op, "fwd", name, eager=True), kernel(op, "fwd", name))
        _forward_cache[key] = entry
    return entry[1] if _compiling() else entry[0]


@functools.cache
def implementation(op: str, phase: str, backend: str):
    """The Python function computing ``op``'s ``phase`` ("fwd" or "bwd") on backend torch, triton or cuda_sim."""
    if backend == "torch":
        from fastformer.ops import reference
        return getattr(reference, f"{op}_{phase}")
    if backend == "triton":
        return getattr(importlib.import_module(f"fastformer.triton.{op}"), f"{op}_{phase}")
    if backend == "cuda_sim":
        return importlib.import_module("fastformer.cuda_sim").entry(op, phase)
    raise ValueError(f"unknown fastformer backend {backend!r}")
