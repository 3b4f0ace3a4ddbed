"""Loads the compiled extension ``fastformer._C``, which registers the ``fastformer::`` ops.

fastformer does not work without it (every op, the reference backend's too, is registered there), so
``import fastformer`` fails when it cannot be loaded, with a message that says why: the extension is
compiled against one torch release's C++ ABI, and imported beside another release it fails with an
undefined-symbol error; the message names the torch that built it, the torch that runs, and the fix.
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
