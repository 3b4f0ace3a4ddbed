"""Builds the pybind11 extension ``fastformer._C`` and the CPU kernel modules ``fastformer._cpu_<level>``.

The CPU kernels (LEVEL_SOURCES: the ops' csrc/cpu/*.cpp and the per-level files of the decoding GEMMs,
csrc/gemm/, of the inference room, csrc/inference/, and the optimizer's, csrc/optim/adam_cpu.cpp) are compiled once per instruction-set level:
``default`` (baseline x86-64, or the target's baseline elsewhere) and, on x86-64, ``avx2`` and ``avx512``, each
into a module of its own (csrc/cpu/kernel_table.h says why); the best level the running CPU supports is loaded
at import, or a lower one named by FASTFORMER_CPU_CAPABILITY at run time (fastformer/_ext.py).
FASTFORMER_CPU_LEVELS, a comma list of those names (e.g. "avx2" or "default,avx512"; unset or empty: every
level the target has), builds only the levels it names: a build for one machine, or a CI build whose level
modules another step compiles; "native" names the one level this machine's CPU runs (the rule of
csrc/cpu_levels.cpp best_cpu_level, read from /proc/cpuinfo): the quickest build for this machine only. Import then loads the highest built level at or below the one the CPU
supports (or FASTFORMER_CPU_CAPABILITY names), and fails when there is none. An unknown name stops the build.
The CUDA kernels (csrc/cuda/*.cu) are compiled when torch is a CUDA build, nvcc is found, and either a GPU
is visible or FASTFORMER_FORCE_CUDA=1; FASTFORMER_FORCE_CUDA=0 skips them. TORCH_CUDA_ARCH_LIST selects the
architectures (torch's own rule).
CUDA_HOME is the toolkit folder holding bin/nvcc and lib64/libcudart.so; when it is not set, the first
such folder among nvcc's and /usr/local/cuda is used (an `nvcc` wrapper script elsewhere is not a toolkit).
CI's install compiles the CUDA kernels too (FASTFORMER_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=8.0 around the README's
test command) and checks them with tools/check_cuda_build.py on the installed package.
Each extension is a unity build (unity_sources; FASTFORMER_UNITY_BUILD=0 compiles every source on its own).

Every extension must need libstdc++.so, as torch does: a compiler that links it statically is refused
(BuildExtensionSharingTorchsRuntime).
"""
import glob
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))


def is_cuda_toolkit(path):
    return bool(path) and os.path.isfile(os.path.join(path, "bin", "nvcc")) and any(
        os.path.exists(os.path.join(path, lib, "libcudart.so")) for lib in ("lib64", "lib"))


def find_cuda_home():
    """CUDA_HOME/CUDA_PATH if set, else the toolkit folder of nvcc (two levels up from it) or /usr/local/cuda.
    torch guesses the folder above the first `nvcc` on PATH, which is wrong for a wrapper script such as
    /usr/local/bin/nvcc; so the guess is made here, before torch.utils.cpp_extension reads CUDA_HOME."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    candidates.append("/usr/local/cuda")
    return next((c for c in candidates if is_cuda_toolkit(c)), None)


if os.environ.get("FASTFORMER_FORCE_CUDA") != "0" and find_cuda_home():
    os.environ["CUDA_HOME"] = find_cuda_home()

import torch  # noqa: E402  (after CUDA_HOME is settled: cpp_extension reads it at import)
from setuptools import setup  # noqa: E402
from setuptools.command.build_py import build_py  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME  # noqa: E402


# The CPU kernel levels: compiler flags, and ATen's CPU_CAPABILITY (which selects at::vec's implementation).
CPU_LEVELS = {
    "default": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
}


def cpu_levels():
    """The levels built here: those FASTFORMER_CPU_LEVELS names (a comma list, e.g. "avx2" or
    "default,avx512") when it is set and not empty, else all three on x86-64 and the default elsewhere.
    An unknown name, or an x86-64 level on another architecture, stops the build with the reason."""
    import platform
    machine = platform.machine().lower()
    native = list(CPU_LEVELS) if machine in ("x86_64", "amd64") else ["default"]
    value = os.environ.get("FASTFORMER_CPU_LEVELS", "").strip()
    if not value:
        return native
    wanted = [name.strip().lower() for name in value.split(",") if name.strip()]
    wanted = [native_cpu_level(machine) if name == "native" else name for name in wanted]
    unknown = [name for name in wanted if name not in CPU_LEVELS]
    if unknown or not wanted:
        problem = f"unknown CPU level {', '.join(unknown)}" if unknown else "names no CPU level"
        raise SystemExit(f"FASTFORMER_CPU_LEVELS={value!r}: {problem}; expected a comma-separated list of "
                         f"{', '.join(CPU_LEVELS)} (unset: {', '.join(native)})")
    foreign = [name for name in wanted if name not in native]
    if foreign:
        raise SystemExit(f"FASTFORMER_CPU_LEVELS={value!r}: {', '.join(foreign)} is an x86-64 level; this machine "
                         f"({machine}) builds only {', '.join(native)}")
    levels = [name for name in CPU_LEVELS if name in wanted]
    print(f"fastformer: building the CPU kernel levels {', '.join(levels)} only (FASTFORMER_CPU_LEVELS={value})")
    return levels


def native_cpu_level(machine: str) -> str:
    """The level this CPU runs best: csrc/cpu_levels.cpp best_cpu_level's rule on /proc/cpuinfo's flags (the
    kernel lists what the CPU and the OS support; "default" where there is no /proc/cpuinfo)."""
    if machine not in ("x86_64", "amd64"):
        return "default"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "default"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= set(flags):
        return "avx512"
    if {"avx2", "fma", "f16c"} <= set(flags):
        return "avx2"
    return "default"


def want_cuda():
    force = os.environ.get("FASTFORMER_FORCE_CUDA")
    if force == "0":
        return False
    have_toolkit = torch.version.cuda is not None and is_cuda_toolkit(CUDA_HOME)
    if force == "1":
        if not have_toolkit:
            raise SystemExit("FASTFORMER_FORCE_CUDA=1 but torch is not a CUDA build or CUDA_HOME is not a CUDA "
                             f"toolkit (torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}); set "
                             "CUDA_HOME to the folder holding bin/nvcc and lib64/libcudart.so")
        return True
    return bool(have_toolkit and torch.cuda.is_available())


# The sources compiled once per CPU level (the rest of csrc/gemm and csrc/inference goes into fastformer._C).
LEVEL_SOURCES = sorted(glob.glob("csrc/cpu/*.cpp")) + [
    "csrc/gemm/packed_linear.cpp", "csrc/gemm/int8_linear.cpp", "csrc/gemm/products.cpp", "csrc/gemm/weight_grad.cpp",
    "csrc/inference/decoder_step.cpp", "csrc/inference/search_candidates.cpp", "csrc/optim/adam_cpu.cpp"]
# The headers that declare the CPU kernel table and what crosses it: their digest is the table's layout
# (csrc/cpu/kernel_table.h), compiled into _C and every level module, so a stale module is refused at import.
KERNEL_TABLE_HEADERS = ["csrc/cpu/kernel_table.h", "csrc/ops.h", "csrc/op_entry_points.h", "csrc/gemm/gemm.h",
                        "csrc/gemm/int8_onednn.h", "csrc/inference/inference.h", "csrc/optim/optim.h"]


def kernel_table_digest():
    import hashlib
    digest = hashlib.sha256()
    for path in KERNEL_TABLE_HEADERS:
        with open(os.path.join(ROOT, path), "rb") as f:
            digest.update(f.read())
    return f'-DFASTFORMER_KERNEL_TABLE="{digest.hexdigest()[:16]}"'


# Python's sysconfig CFLAGS, which setuptools puts first on every compile line, carry the interpreter's
# own -g: debug information for torch's headers doubled the compile time of each object (48 s against 24 s
# of CPU for csrc/autograd/attention.cpp) and made the wheel 32 MB. -g0, later on the line, turns it off.
NO_DEBUG_INFO = "-g0"


def unity_sources(name, sources):
    """``sources`` compiled as a few translation units (a unity build): build/unity/<name>_<k>.cpp, each
    #including a contiguous share of them. Every source includes torch's headers, which cost 12-40 s of
    compiling each time (ATen/ATen.h alone 12 s, torch/extension.h 42 s, at -O3): all nine level sources
    as one unit compile in 46 s against 175 s one by one. There are as many units as ninja runs jobs
    (MAX_JOBS, else the CPU count, at most one a source), so a machine's cores stay busy.
    FASTFORMER_UNITY_BUILD=0 compiles every source on its own (an incremental build recompiles one file).
    The sources keep their own names in a namespace of their own (csrc/autograd/<op>.cpp) or an unnamed
    one that no other source of the same unit repeats; each also compiles alone."""
    if os.environ.get("FASTFORMER_UNITY_BUILD", "1") == "0":
        return list(sources)
    jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
    units = max(1, min(jobs, len(sources)))
    folder = os.path.join("build", "unity")
    os.makedirs(os.path.join(ROOT, folder), exist_ok=True)
    paths = []
    for k in range(units):
        share = sources[k * len(sources) // units:(k + 1) * len(sources) // units]
        text = (f"// Generated by setup.py (unity_sources): {name}, unit {k + 1} of {units}.\n"
                + "".join(f'#include "../../{source}"\n' for source in share))
        path = os.path.join(folder, f"{name}_{k}.cpp")
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full) or open(full).read() != text:  # unchanged: ninja keeps the object
            with open(full, "w") as f:
                f.write(text)
        paths.append(path)
    return paths


def cpu_kernel_extension(level):
    """fastformer._cpu_<level>: LEVEL_SOURCES compiled with the level's flags; symbols hidden, so that
    nothing of one level's code can stand in for another's."""
    return CppExtension(f"fastformer._cpu_{level}", unity_sources("level", LEVEL_SOURCES),
                        include_dirs=[os.path.join(ROOT, "csrc")],
                        extra_compile_args={"cxx": ["-O3", NO_DEBUG_INFO, "-fopenmp", "-fvisibility=hidden",
                                                    "-fvisibility-inlines-hidden", kernel_table_digest(),
                                                    f'-DFASTFORMER_CPU_LEVEL="{level}"'] + CPU_LEVELS[level]},
                        extra_link_args=["-fopenmp"])


def core_extension():
    """fastformer._C: op schemas, autograd, the CPU dispatch through the loaded level, CUDA kernels."""
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    with_cuda = want_cuda() and bool(cuda_sources)
    if want_cuda() and not cuda_sources:
        print("fastformer: CUDA requested but csrc/cuda/ holds no .cu sources yet; building the CPU kernels only")
    sources = ["csrc/fastformer.cpp", "csrc/value_checks.cpp", "csrc/cpu_levels.cpp", "csrc/gemm/gemm.cpp",
               "csrc/gemm/int8_onednn.cpp",
               "csrc/inference/decoder.cpp",
               "csrc/inference/beam_search.cpp", "csrc/optim/adam.cpp", "csrc/triton/plans.cpp"]
    sources = unity_sources("core", sources + sorted(glob.glob("csrc/autograd/*.cpp")))
    cxx = ["-O3", NO_DEBUG_INFO, f'-DFASTFORMER_TORCH_VERSION="{torch.__version__}"', kernel_table_digest()]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if not with_cuda:
        return CppExtension("fastformer._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx})
    # torch's CUDA headers include cusparse.h, which torch's pip wheels keep under nvidia/cu13/include.
    # (cu<N> only: the nvidia-cuda-*-cu12 wheels of tools/kernel_report.py hold CUDA 12 headers.)
    import nvidia
    for base in nvidia.__path__:
        include_dirs += sorted(glob.glob(os.path.join(base, "cu[0-9]*", "include")))
    print(f"fastformer: compiling {', '.join(cuda_sources)} with {os.path.join(CUDA_HOME, 'bin', 'nvcc')} for "
          f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(unset: the visible GPUs)')}")
    nvcc = ["-O3", "--use_fast_math", "-lineinfo", "-DFASTFORMER_WITH_CUDA"]
    return CUDAExtension("fastformer._C", sources + cuda_sources, include_dirs=include_dirs,
                         extra_compile_args={"cxx": cxx + ["-DFASTFORMER_WITH_CUDA"], "nvcc": nvcc})


CSRC_SUFFIXES = (".h", ".cuh", ".cu", ".cpp")


def load_elf_reader():
    """fastformer/_elf.py, loaded by path: the package itself is not importable before it is built."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("fastformer_elf", os.path.join(ROOT, "fastformer", "_elf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildExtensionSharingTorchsRuntime(BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension (objects in a folder per extension), then a check that the extension needs
    libstdc++.so like torch does. A compiler that links libstdc++ statically gives _C a private C++
    runtime beside torch's; that copy crashed formatting integers in TORCH_CHECK messages. Such a build
    stops here, saying what to do."""

    def build_extension(self, ext):
        # Objects in a folder per extension: the levels compile the same sources with other flags.
        build_temp, self.build_temp = self.build_temp, os.path.join(self.build_temp, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = build_temp
        built = self.get_ext_fullpath(ext.name)
        if sys.platform.startswith("linux") and not load_elf_reader().links_libstdcxx_dynamically(built):
            os.remove(built)
            raise SystemExit(
                f"fastformer: {os.path.basename(built)} was linked with a static copy of libstdc++ (it does not "
                f"need libstdc++.so, as torch does), by the compiler {os.environ.get('CXX', 'c++')!r}. Two C++ "
                "runtimes in one process crash (formatting a TORCH_CHECK message). Build with a compiler that "
                "links libstdc++ dynamically, e.g. the system one: CXX=g++ CC=gcc CUDAHOSTCXX=g++ pip install "
                "--no-build-isolation .  (and no -static-libstdc++ in LDFLAGS)")


class BuildPyWithInfo(build_py):
    """Records which torch the extension is compiled against, so a mismatch at import is explained, and
    ships the C++/CUDA sources as fastformer/_csrc/ (the tree of csrc/): the cuda_sim backend compiles
    them on first use, also after a non-editable install. An editable install reads ../csrc instead."""

    def run(self):
        super().run()
        info = {"torch": torch.__version__, "cuda": want_cuda()}
        target = os.path.join(self.build_lib, "fastformer", "_build_info.json")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            json.dump(info, f)
        if not getattr(self, "editable_mode", False):
            self.copy_csrc(os.path.join(self.build_lib, "fastformer", "_csrc"))

    def copy_csrc(self, target):
        source = os.path.join(ROOT, "csrc")
        for folder, _, files in os.walk(source):
            for name in sorted(files):
                if name.endswith(CSRC_SUFFIXES):
                    src = os.path.join(folder, name)
                    dst = os.path.join(target, os.path.relpath(src, source))
                    self.mkpath(os.path.dirname(dst))
                    self.copy_file(src, dst)


setup(
    ext_modules=[core_extension()] + [cpu_kernel_extension(level) for level in cpu_levels()],
    cmdclass={"build_ext": BuildExtensionSharingTorchsRuntime, "build_py": BuildPyWithInfo},
)
