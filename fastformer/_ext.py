"""Loads the compiled extension ``fastformer._C``, which registers the ``fastformer::`` ops.

fastformer does not work without it (every op, the reference backend's too, is registered there), so
``import fastformer`` fails when it cannot be loaded, with a message that says why: the extension is
compiled against one torch release's C++ ABI, and imported beside another release it fails with an
undefined-symbol error; the message names the torch that built it, the torch that runs, and the fix.

A source checkout after `pip install .` has no ``_C`` of its own (pip puts it in site-packages), yet
``python -m fastformer.train`` run from the checkout's root imports the checkout's package. Then the
installed copy's ``_C`` is loaded from the other ``sys.path`` entry that holds one.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
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


def _installed_elsewhere() -> str | None:
    """The path of fastformer/_C<suffix> in another sys.path entry than this package's (an installed copy)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(os.path.join(entry or os.getcwd(), "fastformer"))
        if folder == here:
            continue
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "_C" + suffix)
            if os.path.isfile(path):
                return path
    return None


def _import_c():
    """fastformer._C from this package, else (a checkout without a build) the installed copy's."""
    try:
        return import_module("fastformer._C")
    except ModuleNotFoundError:
        path = _installed_elsewhere()
        if path is None:
            raise
        spec = importlib.util.spec_from_file_location("fastformer._C", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["fastformer._C"] = module
        return module


def _load():
    global _C, _error
    try:
        module = _import_c()
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
