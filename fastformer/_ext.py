"""Loads the compiled extension ``fastformer._C``, which registers the ``fastformer::`` ops, and the CPU
kernels of one instruction-set level.

fastformer does not work without it (every op, the reference backend's too, is registered there), so
``import fastformer`` fails when it cannot be loaded, with a message that says why: the extension is
compiled against one torch release's C++ ABI, and imported beside another release it fails with an
undefined-symbol error; the message names the torch that built it, the torch that runs, and the fix.

A source checkout after `pip install .` has no ``_C`` of its own (pip puts it in site-packages), yet
``python -m fastformer.train`` run from the checkout's root imports the checkout's package. Then the
installed copy's ``_C`` is loaded from the other ``sys.path`` entry that holds one.

The CPU kernels are built once per level (``default``, ``avx2``, ``avx512``) as modules
``fastformer._cpu_<level>``; the best level this CPU supports is loaded, or the one that the environment
variable FASTFORMER_CPU_CAPABILITY names when it is lower (read here, at import, so it needs no rebuild).
A level above the CPU's is refused with a warning: its instructions would kill the process (SIGILL).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from importlib import import_module

import torch

_C = None
_error: str | None = None
CPU_LEVELS = ("default", "avx2", "avx512")  # lowest first
_cpu_level: str | None = None


def _built_against() -> str | None:
    path = os.path.join(os.path.dirname(__file__), "_build_info.json")
    try:
        with open(path) as f:
            return json.load(f).get("torch")
    except (OSError, ValueError):
        return None


def _installed_elsewhere(name: str) -> str | None:
    """The path of fastformer/<name><suffix> in another sys.path entry than this package's (an installed copy)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(os.path.join(entry or os.getcwd(), "fastformer"))
        if folder == here:
            continue
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, name + suffix)
            if os.path.isfile(path):
                return path
    return None


def _import_extension(name: str):
    """fastformer.<name> from this package, else (a checkout without a build) the installed copy's."""
    try:
        return import_module(f"fastformer.{name}")
    except ModuleNotFoundError:
        path = _installed_elsewhere(name)
        if path is None:
            raise
        spec = importlib.util.spec_from_file_location(f"fastformer.{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[f"fastformer.{name}"] = module
        return module


def choose_cpu_level(wanted: str | None, best: str) -> str:
    """The CPU kernel level to load: ``wanted`` (FASTFORMER_CPU_CAPABILITY) when set and not above
    ``best`` (what the CPU supports), else ``best``. ValueError for an unknown name."""
    if not wanted:
        return best
    wanted = wanted.strip().lower()
    if wanted not in CPU_LEVELS:
        raise ValueError(f"FASTFORMER_CPU_CAPABILITY={wanted!r}: expected one of {', '.join(CPU_LEVELS)}")
    if CPU_LEVELS.index(wanted) > CPU_LEVELS.index(best):
        warnings.warn(f"FASTFORMER_CPU_CAPABILITY={wanted}: this CPU supports at most {best}; using {best}",
                      RuntimeWarning, stacklevel=3)
        return best
    return wanted


def _load_cpu_kernels(module) -> str:
    """Installs the chosen level's kernels in _C; returns the level. Falls back to lower levels that were
    built when the chosen one was not (a build for another architecture has the default level only)."""
    level = choose_cpu_level(os.environ.get("FASTFORMER_CPU_CAPABILITY"), module.best_cpu_level())
    for candidate in reversed(CPU_LEVELS[: CPU_LEVELS.index(level) + 1]):
        try:
            kernels = _import_extension(f"_cpu_{candidate}")
        except ModuleNotFoundError:
            continue
        return module.set_cpu_kernels(kernels.kernels)
    raise ImportError(f"no CPU kernel module fastformer._cpu_<level> was found for level {level} or below; "
                      "rebuild fastformer (pip install .)")


def _load():
    global _C, _error, _cpu_level
    try:
        module = _import_extension("_C")
    except ImportError as exc:
        built = _built_against()
        if built is not None and built != torch.__version__:
            _error = (f"fastformer._C was built against torch {built} but torch {torch.__version__} is "
                      f"installed; reinstall fastformer with this torch: pip install --force-reinstall "
                      f"--no-deps --no-build-isolation . (underlying error: {exc})")
        else:
            _error = (f"fastformer._C could not be imported ({exc}); build it with `pip install .` from "
                      f"the source tree (a C++ compiler is needed)")
        return
    built = getattr(module, "TORCH_VERSION", "unknown")
    if built != torch.__version__:
        _error = (f"fastformer._C was built against torch {built} but torch {torch.__version__} is "
                  f"installed; reinstall fastformer with this torch: pip install --force-reinstall --no-deps "
                  f"--no-build-isolation .")
        return
    try:
        _cpu_level = _load_cpu_kernels(module)
    except (ImportError, ValueError) as exc:
        _error = f"fastformer's CPU kernels could not be loaded: {exc}"
        return
    _C = module


def cpu_capability() -> str:
    """The instruction-set level of the CPU kernels in use: "avx512", "avx2" or "default"."""
    extension()
    return _cpu_level


def int8_providers() -> dict:
    """Which kernel computes a quantized model's int8 products on this CPU (csrc/gemm/int8_linear.cpp,
    csrc/gemm/int8_onednn.h): fastformer's own (VNNI, AVX2 or plain; the best first) or oneDNN's through torch
    ("onednn": AMX tiles where the CPU has them). The rule: oneDNN's on a CPU with AMX for products of at least
    32 rows and 2^22 multiply-adds (M N K), our own otherwise; ``FASTFORMER_INT8_PROVIDER`` (a variant's name,
    "fastformer" or "auto") forces one. Every variant gives the same int32 sums and so the same outputs.
    ``C.int8_variant_for(M, N, K)`` answers for one product. ``print(fastformer.int8_providers())``."""
    C = extension()
    rows, products = C.int8_onednn_rule()
    forced = C.int8_provider()  # FASTFORMER_INT8_PROVIDER, read where C++ reads it
    return {
        "level": _cpu_level,
        "amx_int8": C.cpu_has_amx_int8(),
        "vnni_or_amx": C.cpu_has_int8_dot(),
        "variants": C.int8_variants(),
        "forced": None if forced == "auto" else forced,
        "rule": f"onednn on a CPU with AMX for at least {rows} rows and {products:,.0f} multiply-adds (M N K), "
                f"else {C.int8_variants()[0]}",
        f"below {rows} rows or {products:,.0f} multiply-adds": C.int8_variant_for(1, 1, 1),
        "above both": C.int8_variant_for(1024, 1024, 1024),
    }


def extension():
    """The loaded ``fastformer._C`` module; raises ImportError with the reason if it is unusable."""
    if _C is None:
        raise ImportError(_error)
    return _C


def available() -> bool:
    return _C is not None


def error() -> str | None:
    return _error


_load()
C = extension()  # raises ImportError (so `import fastformer` fails) with the reason when _C is unusable
