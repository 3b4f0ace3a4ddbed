#!/usr/bin/env python3
"""Checks a CUDA build of fastformer._C: it imports, says WITH_CUDA, and registers a CUDA and a CPU kernel for
every op of its op list (fastformer._C.OPS, from csrc/ops.h); every extension of the build needs libstdc++.so
as torch does (no private C++ runtime), and a TORCH_CHECK that formats integers raises ValueError.

CI installs fastformer the README's way with the CUDA kernels (FASTFORMER_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=8.0
pip install ".[test]") and runs this script on the environment's site-packages; a build into a folder of its
own (never over an installed fastformer) is checked the same way:

    CUDA_HOME=/usr/local/cuda-13.0 FASTFORMER_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=8.0 \\
        python setup.py build --build-base /tmp/ffcuda
    python tools/check_cuda_build.py /tmp/ffcuda/lib.* --expect-arch sm_80

The folder (a build's lib folder, or site-packages) holds the whole package, fastformer/__init__.py and
the compiled fastformer/_C*.so, as a wheel would unpack it. It is put first on sys.path, so
`import fastformer._C` loads the build under test, not another fastformer. No GPU is needed: the kernels are looked up in
the dispatcher, not called. With cuobjdump (on PATH, in CUDA_HOME/bin, or from the nvidia-cuda-cuobjdump wheel) it also
lists the machine code (SASS) architectures in the library and, with --expect-arch, requires them.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

DISPATCH_KEYS = ("CUDA", "CPU")


def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "cuobjdump"))
    try:
        import nvidia  # the nvidia-* wheels' namespace package (nvidia-cuda-cuobjdump: nvidia/cu13/bin)
        for base in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(base, "cu*", "bin", "cuobjdump")))
    except ImportError:
        pass
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


def list_machine_code(so: str, expect: list[str]) -> list[str]:
    """Prints the SASS architectures in the library (cuobjdump --list-elf); returns the failures."""
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print("  cuobjdump not found: machine code not listed (pip install nvidia-cuda-cuobjdump to list it)"
              + (f"; --expect-arch {' '.join(expect)} not checked" if expect else ""))
        return []
    proc = subprocess.run([cuobjdump, "--list-elf", so], capture_output=True, text=True)
    if proc.returncode != 0:
        return [f"cuobjdump --list-elf {so} failed: {proc.stderr.strip()}"]
    cubins = re.findall(r"(\S+)\.(sm_\d+[a-z]?)\.cubin", proc.stdout)
    archs = sorted({sm for _, sm in cubins})
    print(f"  machine code (cuobjdump --list-elf): {', '.join(f'{f}.{sm}' for f, sm in cubins) or 'none'}")
    # nvcc's own resource use of each kernel (tools/kernel_report.py has the NVRTC 12.9 table)
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", so], capture_output=True, text=True).stdout
    kernels = re.findall(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if kernels:
        regs, stack, shared, local = (max(int(k[i]) for k in kernels) for i in range(4))
        print(f"  {len(kernels)} kernels (cuobjdump --dump-resource-usage): at most {regs} registers, {shared} B "
              f"shared memory, {stack} B stack, {local} B local memory (stack + spills) per thread")
    return [f"no {sm} machine code in {os.path.basename(so)} (found: {', '.join(archs) or 'none'})"
            for sm in expect if sm not in archs] + check_listed(re.findall(r"Function (\S+):", usage))


def without_defaulted_tail(name: str, listed: set[str]) -> str:
    """``name`` as the instantiation lists write it: c++filt spells out a defaulted trailing template argument
    (layer_norm_residual's ``typename TX = T``: k<float, 16, float>), the lists leave it out (k<float, 16>).
    A trailing argument equal to the first is dropped when the shorter name is listed."""
    m = re.fullmatch(r"(\w+)<(.*)>", name)
    if name in listed or m is None:
        return name
    args = [a.strip() for a in m.group(2).split(",")]
    while len(args) > 1 and args[-1] == args[0]:
        args.pop()
        shorter = f"{m.group(1)}<{', '.join(args)}>"
        if shorter in listed:
            return shorter
    return name


def check_listed(mangled: list[str]) -> list[str]:
    """Every kernel in the library must be in an `// instantiations:` list of csrc/cuda/*.cuh, so that
    tools/kernel_report.py covers it; returns the failures (a listed kernel no launcher uses is only shown)."""
    cxxfilt = shutil.which("c++filt")
    if not mangled or cxxfilt is None:
        return []
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_report import ROOT, read_header, split_template_ids

    demangled = subprocess.run([cxxfilt], input="\n".join(mangled), capture_output=True, text=True).stdout
    built = set()
    for name in demangled.splitlines():  # "void fastformer::cuda::k<float, 16>(fastformer::cuda::P<float>)"
        name = re.sub(r"^void ", "", name).replace("fastformer::cuda::", "")
        built.add(split_template_ids(name[:name.rindex("(")] if "(" in name else name)[0])
    listed = set()
    for path in glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cuh")):
        listed.update(read_header(path).instantiations)
    built = {without_defaulted_tail(name, listed) for name in built}
    if built - listed:
        return [f"kernels in the build but in no '// instantiations:' list of csrc/cuda/*.cuh (so not in "
                f"docs/kernels.md): {', '.join(sorted(built - listed))}"]
    print(f"  every kernel of the build is in an '// instantiations:' list ({len(built)} of {len(listed)} listed)"
          + (f"; listed but not built: {', '.join(sorted(listed - built))}" if listed - built else ""))
    return []


def check_module(C, lib: str, torch) -> list[str]:
    """WITH_CUDA, the torch it was built against, and every op's CUDA and CPU kernels; returns the failures."""
    failures = []
    print(f"  imported {C.__file__}")
    if os.path.dirname(os.path.abspath(C.__file__)) != os.path.join(lib, "fastformer"):
        failures.append(f"imported {C.__file__}, not the build under {lib}")
    print(f"  built against torch {C.TORCH_VERSION}; running torch {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"  WITH_CUDA = {C.WITH_CUDA}")
    if C.WITH_CUDA is not True:
        failures.append("WITH_CUDA is not True: the CUDA kernels were not compiled in")
    if C.TORCH_VERSION != torch.__version__:
        failures.append(f"built against torch {C.TORCH_VERSION}, running {torch.__version__}")
    for key in DISPATCH_KEYS:
        for name in kernel_ops(C):
            ok = torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
            print(f"  {name:40s} {key:5s} {'ok' if ok else 'MISSING'}")
            if not ok:
                failures.append(f"no {key} kernel registered for {name}")
    from fastformer._elf import links_libstdcxx_dynamically, needed_libraries  # the build's own copy
    for so in sorted(glob.glob(os.path.join(lib, "fastformer", "*.so"))):
        dynamic = links_libstdcxx_dynamically(so)
        print(f"  {os.path.basename(so)}: {'needs libstdc++.so' if dynamic else 'NO libstdc++.so'}")
        if not dynamic:
            failures.append(f"{so} does not need libstdc++.so (needs {needed_libraries(so)}): a static C++ runtime")
    q = torch.empty(2, 3, 5)
    try:  # the shape's integers are formatted through the build's libstdc++
        C.check_attention(q, q, q, None, 0.0, None)
        failures.append("check_attention accepted a 3-D q")
    except ValueError as exc:
        print(f"  a TORCH_CHECK formatting integers raised ValueError: {str(exc).splitlines()[0]}")
        if "got shape [2, 3, 5]" not in str(exc):
            failures.append(f"check_attention's message lacks the shape: {exc}")
    return failures


def kernel_ops(C) -> list[str]:
    """The ops with C++ kernels: fastformer::<op>_fwd and _bwd for every op of C.OPS."""
    return [f"fastformer::{op}_{phase}" for op in C.OPS for phase in ("fwd", "bwd")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Import a CUDA build of fastformer._C and check its CUDA entry points.")
    parser.add_argument("lib", help="the build's lib folder (holding fastformer/_C*.so), "
                                    "e.g. /tmp/ffcuda/lib.linux-x86_64-cpython-311")
    parser.add_argument("--expect-arch", action="append", default=[], metavar="SM",
                        help="fail unless the library holds machine code for this architecture, e.g. sm_80 "
                             "(checked when cuobjdump is found); may be repeated")
    args = parser.parse_args(argv)

    lib = os.path.abspath(args.lib)
    so_files = glob.glob(os.path.join(lib, "fastformer", "_C*.so"))
    if len(so_files) != 1:
        print(f"check_cuda_build: expected one fastformer/_C*.so under {lib}, found {so_files}", file=sys.stderr)
        return 1
    so = so_files[0]
    print(f"fastformer._C: {so}")
    failures = list_machine_code(so, args.expect_arch)

    import torch  # first: loads libc10/libtorch/libcudart, which _C links against

    sys.path.insert(0, lib)
    try:
        import fastformer._C as C
    except ImportError as exc:  # e.g. an entry point of op_entry_points.h that no launcher defines
        failures.append(f"{so} does not import: {exc}")
    else:
        failures += check_module(C, lib, torch)

    if failures:
        print("check_cuda_build: FAILED", file=sys.stderr)
        for f in failures:
            print("  - " + f, file=sys.stderr)
        return 1
    print(f"check_cuda_build: OK, fastformer._C was built with CUDA and registers CUDA and CPU kernels for its "
          f"{len(kernel_ops(C))} kernel ops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
