"""One binary for every x86-64 CPU, sharing torch's C++ runtime.

The CPU kernels are built once per instruction-set level (default x86-64, AVX2, AVX-512) as modules
fastformer._cpu_<level>; import loads the best level the CPU supports, or the lower one that
FASTFORMER_CPU_CAPABILITY names at run time. A lower level's machine code holds no instruction of a higher
one (checked by disassembly), so a wheel built on an AVX-512 machine runs on an AVX2 one. Every extension
links libstdc++ dynamically, as torch does, so integer-formatting TORCH_CHECK messages raise, not crash.
(CI also runs the CPU parity tests under every level its machine supports: .ci/run.)"""
import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

import fastformer
from fastformer import _ext
from fastformer._elf import links_libstdcxx_dynamically, needed_libraries

PACKAGE = os.path.dirname(fastformer.__file__)
BEST = _ext.extension().best_cpu_level()


def module_file(name):
    found = glob.glob(os.path.join(PACKAGE, f"{name}.*so")) or \
        [p for p in [_ext._installed_elsewhere(name)] if p]
    assert found, f"fastformer.{name} is not built"
    return found[0]


BUILT_LEVELS = [level for level in _ext.CPU_LEVELS if glob.glob(os.path.join(PACKAGE, f"_cpu_{level}.*so"))
                or _ext._installed_elsewhere(f"_cpu_{level}")]
SUPPORTED = [level for level in BUILT_LEVELS if _ext.CPU_LEVELS.index(level) <= _ext.CPU_LEVELS.index(BEST)]


def test_every_level_is_built_on_x86_64():
    import platform
    expected = list(_ext.CPU_LEVELS) if platform.machine() in ("x86_64", "AMD64") else ["default"]
    assert BUILT_LEVELS == expected


def test_the_level_in_use_is_the_best_or_the_one_asked_for():
    assert fastformer.cpu_capability() == _ext.choose_cpu_level(os.environ.get("FASTFORMER_CPU_CAPABILITY"), BEST)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="Linux: /proc/cpuinfo is the independent witness")
def test_cpuid_detection_agrees_with_the_kernel():
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    expected = "avx512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags else \
        "avx2" if {"avx2", "fma", "f16c"} <= flags else "default"
    assert BEST == expected


@pytest.mark.parametrize("wanted, best, expected", [
    (None, "avx512", "avx512"), ("", "avx2", "avx2"), ("default", "avx512", "default"), ("AVX2", "avx512", "avx2"),
    ("avx512", "avx512", "avx512"), ("avx2", "default", "default"), ("avx512", "avx2", "avx2"),
])
def test_choose_cpu_level(wanted, best, expected):
    if wanted and _ext.CPU_LEVELS.index(wanted.lower()) > _ext.CPU_LEVELS.index(best):
        with pytest.warns(RuntimeWarning, match=f"supports at most {best}"):
            assert _ext.choose_cpu_level(wanted, best) == expected
    else:
        assert _ext.choose_cpu_level(wanted, best) == expected


PARITY_SCRIPT = """
import torch, fastformer
from fastformer import ops
from fastformer.ops import reference
assert fastformer.cpu_capability() == {level!r}, fastformer.cpu_capability()
torch.manual_seed(0)
x = torch.randn(7, 97)
mask = torch.rand(7, 97) < 0.3
torch.testing.assert_close(ops.softmax(x, mask=mask, backend="cpu"),
                           ops.softmax(x.double(), mask=mask, backend="torch").float(), rtol=2e-4, atol=2e-6)
q, k, v = (torch.randn(2, 2, 33, 40) for _ in range(3))
torch.testing.assert_close(ops.attention(q, k, v, causal=True, backend="cpu"),
                           ops.attention(q.double(), k.double(), v.double(), causal=True, backend="torch").float(),
                           rtol=2e-4, atol=2e-5)
print("ok", fastformer.cpu_capability())
"""


@pytest.mark.parametrize("level", SUPPORTED)
def test_each_supported_level_loads_and_computes(level):
    done = subprocess.run([sys.executable, "-c", PARITY_SCRIPT.format(level=level)], capture_output=True, text=True,
                          env={**os.environ, "FASTFORMER_CPU_CAPABILITY": level}, timeout=300)
    assert done.returncode == 0 and f"ok {level}" in done.stdout, done.stderr[-3000:]


def test_an_unknown_level_fails_the_import_clearly():
    done = subprocess.run([sys.executable, "-c", "import fastformer"], capture_output=True, text=True,
                          env={**os.environ, "FASTFORMER_CPU_CAPABILITY": "sse9"}, timeout=300)
    assert done.returncode != 0
    assert "FASTFORMER_CPU_CAPABILITY='sse9': expected one of default, avx2, avx512" in done.stderr, done.stderr


def vector_registers(path):
    """Which of xmm/ymm/zmm the machine code of a shared object uses (objdump -d)."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, which the build's linker comes with) is needed"
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                          check=True).stdout
    return {reg for reg in ("%xmm", "%ymm", "%zmm") if reg in text}


@pytest.mark.skipif(BUILT_LEVELS != list(_ext.CPU_LEVELS), reason="x86-64 builds only")
def test_a_lower_level_holds_no_instruction_of_a_higher_one():
    used = {level: vector_registers(module_file(f"_cpu_{level}")) for level in _ext.CPU_LEVELS}
    assert "%ymm" not in used["default"] and "%zmm" not in used["default"], used
    assert "%zmm" not in used["avx2"], used
    assert "%ymm" in used["avx2"] and "%zmm" in used["avx512"], used  # the check can see what it forbids
    assert not {"%ymm", "%zmm"} & vector_registers(module_file("_C")), "fastformer._C must stay baseline"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF: Linux")
def test_every_extension_needs_libstdcxx_like_torch():
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    assert links_libstdcxx_dynamically(torch_lib)
    for name in ["_C"] + [f"_cpu_{level}" for level in BUILT_LEVELS]:
        path = module_file(name)
        assert links_libstdcxx_dynamically(path), f"{path} needs {needed_libraries(path)}: no libstdc++.so"


@pytest.mark.skipif(not sys.platform.startswith("linux") or not shutil.which("g++"), reason="ELF, g++")
def test_the_elf_reader_sees_a_static_libstdcxx(tmp_path):
    # What the build refuses (setup.py): a library that carries its own libstdc++ needs no libstdc++.so.
    source = tmp_path / "lib.cpp"
    source.write_text('#include <sstream>\nstd::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n')
    for flags, dynamic in (([], True), (["-static-libstdc++"], False)):
        lib = tmp_path / f"lib{len(flags)}.so"
        subprocess.run(["g++", "-shared", "-fPIC", *flags, str(source), "-o", str(lib)], check=True)
        assert links_libstdcxx_dynamically(str(lib)) is dynamic, needed_libraries(str(lib))


def test_a_check_that_formats_integers_raises():
    # The message formats the shape's integers through the extension's libstdc++ (the crash of a static copy).
    with pytest.raises(ValueError, match=r"q must be 4-D \(B, H, L, D\), got shape \[2, 3, 5\]"):
        fastformer.ops.attention(torch.randn(2, 3, 5), torch.randn(2, 3, 5), torch.randn(2, 3, 5), backend="cpu")


def test_the_kernel_table_layout_is_derived_from_its_headers():
    """fastformer._C and every level module carry the digest of the headers that declare the CPU kernel
    table (setup.py KERNEL_TABLE_HEADERS): nobody bumps a number by hand, and _C refuses a level module of
    another digest at import (csrc/cpu_levels.cpp set_cpu_kernels)."""
    import ast
    import hashlib

    root = os.path.dirname(PACKAGE)
    setup_py = os.path.join(root, "setup.py")
    if not os.path.exists(setup_py):
        pytest.skip("needs the source checkout (setup.py and csrc/)")
    tree = ast.parse(open(setup_py).read())
    headers = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                   and getattr(node.targets[0], "id", None) == "KERNEL_TABLE_HEADERS")
    digest = hashlib.sha256()
    for path in headers:
        with open(os.path.join(root, path), "rb") as f:
            digest.update(f.read())
    assert _ext.C.KERNEL_TABLE == digest.hexdigest()[:16]
    loaded = sys.modules[f"fastformer._cpu_{fastformer.cpu_capability()}"]  # CI runs this file at every level
    assert loaded.KERNEL_TABLE == _ext.C.KERNEL_TABLE
