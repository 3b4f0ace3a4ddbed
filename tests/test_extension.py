"""The compiled extension: built against the running torch, registers every op, and a mismatch is explained."""
import os
import subprocess
import sys

import pytest
import torch

import fastformer
from fastformer import _ext
from fastformer.ops import OPS

DISPATCH_KEYS = ("CPU", "Autograd")


def test_extension_matches_running_torch():
    assert _ext.extension().TORCH_VERSION == torch.__version__
    assert fastformer.backends()["cpu"] is True


def test_every_op_is_registered_in_cpp():
    # The op list comes from csrc/ops.h; each op has C++ CPU and autograd kernels, its _py twin C++
    # autograd and a Python implementation, and all four a fake kernel (registered by fastformer.ops);
    # fastformer.ops exports a public function of the op's name for each, and besides them only the two of
    # the deferred value checks (fastformer/ops/deferred.py).
    assert OPS and len(set(OPS)) == len(OPS), OPS
    assert set(fastformer.ops.__all__) == {"OPS", *OPS, "deferred_checks", "check_deferred"}, fastformer.ops.__all__
    assert all(callable(getattr(fastformer.ops, op)) for op in OPS)
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in OPS:
        for phase in ("fwd", "bwd"):
            name = f"fastformer::{op}_{phase}"
            assert has(name, "CPU"), name
            assert has(f"{name}_py", "CompositeExplicitAutograd"), name
            for n in (name, f"{name}_py"):
                assert has(n, "Meta"), f"{n}: no fake kernel"
        assert has(f"fastformer::{op}_fwd", "Autograd") and has(f"fastformer::{op}_fwd_py", "Autograd")


def test_torch_mismatch_gives_a_clear_error(monkeypatch):
    # What a user sees when fastformer._C was compiled against another torch: the import fails with an
    # undefined symbol, and fastformer turns it into a message naming both versions and the fix.
    def broken_import(name):
        raise ImportError("fastformer/_C.so: undefined symbol: _ZN3c1017SomethingChangedEv")

    monkeypatch.setattr(_ext, "import_module", broken_import)
    monkeypatch.setattr(_ext, "_built_against", lambda: "2.0.0")
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_error", None)
    _ext._load()
    assert not _ext.available()
    message = _ext.error()
    assert "built against torch 2.0.0" in message and torch.__version__ in message
    assert "pip install --force-reinstall --no-deps --no-build-isolation ." in message
    with pytest.raises(ImportError, match="built against torch 2.0.0"):
        _ext.extension()


def test_import_fails_with_the_reason_when_the_extension_is_unusable():
    # fastformer cannot work without _C (every op is registered there): `import fastformer` must fail
    # with the reason, not later with an obscure error. A stand-in _C that lacks the version attribute
    # is loaded in a fresh interpreter.
    code = (
        "import sys, types, torch\n"
        "sys.modules['fastformer._C'] = types.ModuleType('fastformer._C')\n"
        "sys.modules['fastformer._C'].TORCH_VERSION = '0.0.1'\n"
        "import fastformer\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "built against torch 0.0.1" in result.stderr


def test_checkout_without_a_build_uses_the_installed_extension(tmp_path):
    # `pip install .` puts _C in site-packages, not in the checkout; `python -m fastformer.train` run from
    # the checkout's root imports the checkout's package, which must then load the installed _C (not fail,
    # and not fall back to slower code). Simulated: a copy of the package without _C as the working folder.
    import os
    import shutil
    from pathlib import Path

    package = Path(fastformer.__file__).parent
    shutil.copytree(package, tmp_path / "fastformer",
                    ignore=shutil.ignore_patterns("_C*.so", "_cpu_*.so", "_csrc", "__pycache__", "_build_info.json"))
    code = ("import sys, fastformer, fastformer._C as C; print(fastformer.__file__); print(C.__file__); "
            "print(sys.modules[f'fastformer._cpu_{fastformer.cpu_capability()}'].__file__); "
            "print(fastformer.backends()['cpu'])")
    env = dict(os.environ, PYTHONPATH=str(package.parent))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    checkout_init, extension, kernels, cpu = result.stdout.split()
    assert Path(checkout_init).parent == tmp_path / "fastformer"
    assert Path(extension).parent == package and Path(kernels).parent == package and cpu == "True"


@pytest.mark.skipif(bool(os.environ.get("FASTFORMER_TEST_BACKENDS")), reason="the tested backends were narrowed on purpose")
def test_the_test_extra_brings_what_cuda_sim_needs():
    # pip install ".[test]" must be enough to execute the CUDA kernels on the CPU: without ninja the
    # cuda_sim backend is unavailable and every test of it would silently drop out of the run.
    from fastformer import _dispatch

    usable, reason = _dispatch.status("cuda_sim")
    assert usable, reason
