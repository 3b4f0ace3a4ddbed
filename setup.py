"""Builds the pybind11 extension ``fastformer._C``.

CPU kernels (csrc/cpu/*.cpp) are always compiled. The CUDA kernels (csrc/cuda/*.cu) are compiled
when torch is a CUDA build, nvcc is found, and either a GPU is visible or FASTFORMER_FORCE_CUDA=1;
FASTFORMER_FORCE_CUDA=0 skips them. TORCH_CUDA_ARCH_LIST selects the architectures (torch's own rule).

FASTFORMER_CPU_CAPABILITY=avx512|avx2|default picks the SIMD level of ATen's at::vec used by the
CPU kernels; by default the best one this machine's CPU reports.
"""
import glob
import json
import os
import shutil

import torch
from setuptools import setup
from setuptools.command.build_py import build_py
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

ROOT = os.path.dirname(os.path.abspath(__file__))


def cpu_capability():
    """ATen's vectorization level for the CPU kernels, from the env or /proc/cpuinfo."""
    wanted = os.environ.get("FASTFORMER_CPU_CAPABILITY", "").lower()
    if not wanted:
        try:
            flags = set(open("/proc/cpuinfo").read().split())
        except OSError:
            flags = set()
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
            wanted = "avx512"
        elif {"avx2", "fma", "f16c"} <= flags:
            wanted = "avx2"
        else:
            wanted = "default"
    if wanted == "avx512":
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if wanted == "avx2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    if wanted == "default":
        return []
    raise SystemExit(f"FASTFORMER_CPU_CAPABILITY={wanted!r}: expected avx512, avx2 or default")


def want_cuda():
    force = os.environ.get("FASTFORMER_FORCE_CUDA")
    if force == "0":
        return False
    have_toolkit = torch.version.cuda is not None and CUDA_HOME is not None and (
        shutil.which("nvcc") or os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")))
    if force == "1":
        if not have_toolkit:
            raise SystemExit("FASTFORMER_FORCE_CUDA=1 but torch is not a CUDA build or nvcc/CUDA_HOME "
                             f"was not found (torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME})")
        return True
    return bool(have_toolkit and torch.cuda.is_available())


def extension():
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    with_cuda = want_cuda() and bool(cuda_sources)
    if want_cuda() and not cuda_sources:
        print("fastformer: CUDA requested but csrc/cuda/ holds no .cu sources yet; building the CPU kernels only")
    sources = ["csrc/fastformer.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    cxx = ["-O3", "-fopenmp", f'-DFASTFORMER_TORCH_VERSION="{torch.__version__}"'] + cpu_capability()
    include_dirs = [os.path.join(ROOT, "csrc")]
    if not with_cuda:
        return CppExtension("fastformer._C", sources, include_dirs=include_dirs,
                            extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])
    # torch's CUDA headers include cusparse.h, which the pip wheels keep under nvidia/cu13/include.
    import nvidia
    for base in nvidia.__path__:
        include_dirs += glob.glob(os.path.join(base, "cu*", "include"))
    nvcc = ["-O3", "--use_fast_math", "-lineinfo", "-DFASTFORMER_WITH_CUDA"]
    return CUDAExtension("fastformer._C", sources + cuda_sources, include_dirs=include_dirs,
                         extra_compile_args={"cxx": cxx + ["-DFASTFORMER_WITH_CUDA"], "nvcc": nvcc},
                         extra_link_args=["-fopenmp"])


class BuildPyWithInfo(build_py):
    """Records which torch the extension is compiled against, so a mismatch at import is explained."""

    def run(self):
        super().run()
        info = {"torch": torch.__version__, "cuda": want_cuda()}
        target = os.path.join(self.build_lib, "fastformer", "_build_info.json")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            json.dump(info, f)


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True), "build_py": BuildPyWithInfo},
)
