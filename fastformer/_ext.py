"""Loads the compiled extension ``fastformer._C`` and explains, in words, why it cannot be used.

The extension is compiled against one torch release's C++ ABI. Imported beside another release it
fails with an undefined-symbol error; this module turns that into a message that says which torch
built it, which torch is running, and how to rebuild.
"""
from __future__ import annotations

import json
import os
from importlib import import_module

import torch

_C = None
_error: str | None = None


def _built_against() -> str | None:
    path = os.path.join(os.path.dirname(__file__), "_build_info.json")
    try:
        with open(path) as f:
            return json.load(f).get("torch")
    except (OSError, ValueError):
        return None


def _load():
    global _C, _error
    try:
        module = import_module("fastformer._C")
    except ImportError as exc:
        built = _built_against()
        if built is not None and built != torch.__version__:
            _error = (f"fastformer._C was built against torch {built} but torch {torch.__version__} is "
                      f"installed; reinstall fastformer with this torch: pip install --force-reinstall "
                      f"--no-deps . (underlying error: {exc})")
        else:
            _error = (f"fastformer._C could not be imported ({exc}); build it with `pip install .` from "
                      f"the source tree (a C++ compiler is needed)")
        return
    built = getattr(module, "TORCH_VERSION", "unknown")
    if built != torch.__version__:
        _error = (f"fastformer._C was built against torch {built} but torch {torch.__version__} is "
                  f"installed; reinstall fastformer with this torch: pip install --force-reinstall --no-deps .")
        return
    _C = module


def extension():
    """The loaded ``fastformer._C`` module; raises RuntimeError with the reason if it is unusable."""
    if _C is None:
        raise RuntimeError(_error)
    return _C


def available() -> bool:
    return _C is not None


def error() -> str | None:
    return _error


_load()
