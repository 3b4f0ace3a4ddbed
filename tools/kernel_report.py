#!/usr/bin/env python3
"""Resource report of every CUDA kernel instantiation: registers, spills, shared memory, occupancy.

Every kernel header csrc/cuda/<op>.cuh ends with comment lines listing the template instantiations the
launchers use, e.g.

    // instantiations: softmax_fwd_warp_kernel<float, 1> softmax_fwd_warp_kernel<__half, 1>

(template-ids separated by white space, names relative to namespace fastformer::cuda). A header whose
kernels need a newer GPU names the architectures it is built for in a line

    // architectures: sm_80

(the tensor-core kernels: mma.sync and cp.async need sm_80); the others are reported for all. For each
header and each of its architectures (sm_60 = P100, sm_80 = A100) this tool

  1. compiles the header with NVRTC 12.9 (libnvrtc.so.12 from the pip wheel nvidia-cuda-nvrtc-cu12,
     loaded with ctypes; cuda_fp16.h/cuda_bf16.h from nvidia-cuda-runtime-cu12) to PTX, asking for each
     listed template-id with nvrtcAddNameExpression, which instantiates it and gives its mangled name;
  2. assembles the PTX with `ptxas -v` (nvidia-cuda-nvcc-cu12) and reads, per kernel, the registers,
     spill store/load bytes, static shared memory and stack frame;
  3. reads the block size from the kernel's FF_LAUNCH_BOUNDS(n) (`.maxntid n` in the PTX) and computes
     the theoretical occupancy with the rules of CUDA's cuda_occupancy.h (see ARCHS below);
  4. writes docs/kernels.md.

It exits 1 if an instantiation spills, does not compile, has no FF_LAUNCH_BOUNDS, cannot launch (zero
occupancy), or if a header that defines kernels has no `// instantiations:` line. With --check it writes
nothing and also fails when docs/kernels.md's table is not the one the current headers produce.

    pip install "nvidia-cuda-nvrtc-cu12==12.9.*" "nvidia-cuda-runtime-cu12==12.9.*" "nvidia-cuda-nvcc-cu12==12.9.*"
    python tools/kernel_report.py            # regenerate docs/kernels.md
    python tools/kernel_report.py --check    # CI: fail on spills, errors or a stale docs/kernels.md

No GPU and no CUDA toolkit are needed.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import difflib
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESPACE = "fastformer::cuda::"
WHEELS = ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-nvcc-cu12")
TABLE_BEGIN = "<!-- kernel table: generated, compared by --check -->"
TABLE_END = "<!-- end of kernel table -->"


@dataclasses.dataclass(frozen=True)
class Arch:
    """Per-SM limits of one GPU generation, as cuda_occupancy.h (CUDA 12.9) and the CUDA C++ Programming
    Guide ("Technical Specifications per Compute Capability") give them."""

    name: str
    gpu: str
    max_threads_per_sm: int
    max_threads_per_block: int
    max_blocks_per_sm: int
    regs_per_sm: int
    regs_per_block: int
    reg_alloc_unit: int          # registers are allocated per warp in units of this many
    sub_partitions: int          # register file is split over this many warp schedulers
    launch_sub_partitions: int   # ... as the launch check counts them (GP100: as GP10x, 4)
    smem_per_sm: int             # shared memory per SM (sm_80: the largest carveout, 164 KB)
    smem_static_per_block: int   # static __shared__ limit per block
    smem_alloc_unit: int
    smem_reserved_per_block: int  # reserved by the driver per block (sm_80+)

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // 32


ARCHS = {
    "sm_60": Arch("sm_60", "Tesla P100", max_threads_per_sm=2048, max_threads_per_block=1024,
                  max_blocks_per_sm=32, regs_per_sm=65536, regs_per_block=65536, reg_alloc_unit=256,
                  sub_partitions=2, launch_sub_partitions=4, smem_per_sm=64 * 1024, smem_static_per_block=48 * 1024, smem_alloc_unit=256,
                  smem_reserved_per_block=0),
    "sm_80": Arch("sm_80", "A100", max_threads_per_sm=2048, max_threads_per_block=1024,
                  max_blocks_per_sm=32, regs_per_sm=65536, regs_per_block=65536, reg_alloc_unit=256,
                  sub_partitions=4, launch_sub_partitions=4, smem_per_sm=164 * 1024, smem_static_per_block=48 * 1024, smem_alloc_unit=128,
                  smem_reserved_per_block=1024),
}


def round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclasses.dataclass
class Occupancy:
    blocks_per_sm: int
    active_warps: int
    max_warps: int
    limited_by: str

    @property
    def fraction(self) -> float:
        return self.active_warps / self.max_warps


def occupancy(arch: Arch, threads: int, regs: int, smem: int) -> Occupancy:
    """Resident blocks per SM = min over the warp, block, register and shared-memory limits
    (cudaOccMaxActiveBlocksPerMultiprocessor with the default cache config and no dynamic shared memory)."""
    warps = -(-threads // 32)
    limits = {"blocks/SM": arch.max_blocks_per_sm,
              "warps/SM": arch.max_warps_per_sm // warps if threads <= arch.max_threads_per_block else 0}
    regs_per_warp = round_up(regs * 32, arch.reg_alloc_unit)
    if regs_per_warp == 0:
        limits["registers"] = arch.max_blocks_per_sm
    elif (regs_per_warp * round_up(warps, arch.launch_sub_partitions) > arch.regs_per_block
          or regs_per_warp * warps > arch.regs_per_block or regs > 255):
        limits["registers"] = 0
    else:
        warps_per_sub_partition = (arch.regs_per_sm // arch.sub_partitions) // regs_per_warp
        limits["registers"] = warps_per_sub_partition * arch.sub_partitions // warps
    smem_alloc = round_up(smem + arch.smem_reserved_per_block, arch.smem_alloc_unit)
    if smem > arch.smem_static_per_block:
        limits["shared memory"] = 0
    else:
        limits["shared memory"] = arch.smem_per_sm // smem_alloc if smem_alloc else arch.max_blocks_per_sm
    blocks = min(limits.values())
    limited_by = ", ".join(k for k, v in limits.items() if v == blocks)
    return Occupancy(blocks, blocks * warps, arch.max_warps_per_sm, limited_by)


# ---------------------------------------------------------------------------------------------------------
# Headers and their instantiation lists


def strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", " ", src)


def split_template_ids(text: str) -> list[str]:
    """Split 'k<float, 1> k<__half, 2>' on white space (or commas) outside angle brackets/parentheses."""
    ids, cur, depth = [], [], 0
    for ch in text:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        if depth == 0 and (ch.isspace() or ch == ","):
            if cur:
                ids.append("".join(cur))
                cur = []
            continue
        cur.append(ch)
    if cur:
        ids.append("".join(cur))
    # normalise the spacing inside the brackets: "k<float,1>" and "k<float, 1>" name the same kernel
    return [re.sub(r"\s*,\s*", ", ", re.sub(r"\s+", " ", i)) for i in ids]


@dataclasses.dataclass
class Header:
    path: str
    defines_kernels: bool
    instantiations: list[str]
    archs: list[str] | None = None  # None: every architecture of the report

    @property
    def name(self) -> str:
        rel = os.path.relpath(self.path, ROOT)
        return os.path.abspath(self.path) if rel.startswith("..") else rel


def read_header(path: str) -> Header:
    src = open(path).read()
    defines_kernels = re.search(r"\b(FF_GLOBAL|__global__)\b", strip_comments(src)) is not None
    ids: list[str] = []
    for m in re.finditer(r"^[ \t]*//[ \t]*instantiations:(.*)$", src, flags=re.M):
        ids += split_template_ids(m.group(1))
    archs = None
    m = re.search(r"^[ \t]*//[ \t]*architectures:(.*)$", src, flags=re.M)
    if m:
        archs = m.group(1).split()
        unknown = [a for a in archs if a not in ARCHS]
        if unknown:
            raise SystemExit(f"kernel_report: {path}: unknown architectures {unknown} (known: {list(ARCHS)})")
    return Header(path, defines_kernels, list(dict.fromkeys(ids)), archs)  # a repeated id is reported once


def qualified(template_id: str) -> str:
    return template_id if "::" in template_id.split("<", 1)[0] else NAMESPACE + template_id


# ---------------------------------------------------------------------------------------------------------
# Tools: NVRTC (ctypes), ptxas, CUDA headers, all from the nvidia-*-cu12 wheels


def nvidia_path(*parts: str) -> str | None:
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return None
    for base in nvidia.__path__:
        candidate = os.path.join(base, *parts)
        if os.path.exists(candidate):
            return candidate
    return None


class NVRTC:
    def __init__(self, lib_path: str):
        lib_dir = os.path.dirname(lib_path)
        # libnvrtc dlopens its builtins library by name; load it first from the same folder
        for builtins in sorted(glob.glob(os.path.join(lib_dir, "libnvrtc-builtins.so.*"))):
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            break
        self.lib = ctypes.CDLL(lib_path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"{major.value}.{minor.value}"

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(result).decode()}")

    def compile(self, source: str, name: str, options: list[str], name_exprs: list[str]):
        """Returns (ptx or None, log, {name expression: lowered name})."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            for expr in name_exprs:
                self._check(self.lib.nvrtcAddNameExpression(prog, expr.encode()), f"nvrtcAddNameExpression({expr})")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            result = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            log = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            log_text = log.value.decode(errors="replace").strip()
            if result != 0:
                return None, log_text or self.lib.nvrtcGetErrorString(result).decode(), {}
            self._check(self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
            ptx = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
            lowered = {}
            for expr in name_exprs:
                out = ctypes.c_char_p()
                self._check(self.lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)),
                            f"nvrtcGetLoweredName({expr})")
                lowered[expr] = out.value.decode()
            return ptx.value.decode(), log_text, lowered
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


@dataclasses.dataclass
class KernelResources:
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem: int = 0
    stack: int = 0
    threads: int | None = None  # from .maxntid / .reqntid (FF_LAUNCH_BOUNDS)


def parse_ptx_block_sizes(ptx: str) -> dict[str, int]:
    """.entry NAME(params) .maxntid X, Y, Z {  ->  {NAME: X*Y*Z}"""
    sizes = {}
    for chunk in ptx.split(".entry")[1:]:
        name = chunk.split("(", 1)[0].strip()
        directives = chunk.split(")", 1)[1].split("{", 1)[0] if ")" in chunk else ""
        m = re.search(r"\.(?:maxntid|reqntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", directives)
        if m:
            sizes[name] = int(m.group(1)) * int(m.group(2) or 1) * int(m.group(3) or 1)
    return sizes


def parse_ptxas(output: str) -> tuple[dict[str, KernelResources], dict[str, KernelResources]]:
    """ptxas -v output -> ({entry: resources}, {non-inlined device function: resources})."""
    entries: dict[str, KernelResources] = {}
    functions: dict[str, KernelResources] = {}
    entry = props = None
    for line in output.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            entry = entries.setdefault(m.group(1), KernelResources())
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
            props = entries[name] if name in entries else functions.setdefault(name, KernelResources())
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and props is not None:
            props.stack, props.spill_stores, props.spill_loads = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and entry is not None:
            entry.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            entry.smem = int(s.group(1)) if s else 0
    return entries, functions


# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    header: str
    kernel: str
    arch: str
    res: KernelResources | None
    occ: Occupancy | None
    error: str | None = None


def compile_header(nvrtc: NVRTC, ptxas: str, header: Header, arch: Arch, nvrtc_options: list[str],
                   ptxas_options: list[str], tmp: str) -> tuple[list[Row], list[str]]:
    """Compile one header for one architecture; returns the rows and the errors."""
    exprs = ["&" + qualified(i) for i in header.instantiations]
    source = f'#include "{os.path.abspath(header.path)}"\n'
    compute = arch.name.replace("sm_", "compute_")
    options = [f"--gpu-architecture={compute}"] + nvrtc_options
    ptx, log, lowered = nvrtc.compile(source, os.path.basename(header.path) + ".cu", options, exprs)
    if ptx is None:
        msg = f"{header.name} [{arch.name}]: NVRTC failed:\n{log}"
        return [Row(header.name, i, arch.name, None, None, "does not compile") for i in header.instantiations], [msg]
    errors = []
    # CUDA 12.9 deprecates (does not remove) targets before sm_75: not news for a P100 project
    log = "\n".join(line for line in log.splitlines() if "Architectures prior to" not in line).strip()
    if log:
        print(f"  NVRTC log for {header.name} [{arch.name}]:\n{log}")
    ptx_path = os.path.join(tmp, f"{os.path.basename(header.path)}.{arch.name}.ptx")
    with open(ptx_path, "w") as f:
        f.write(ptx)
    cmd = [ptxas, f"-arch={arch.name}", "-v"] + ptxas_options + [ptx_path, "-o", ptx_path + ".cubin"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        msg = f"{header.name} [{arch.name}]: ptxas failed:\n{out}"
        return [Row(header.name, i, arch.name, None, None, "ptxas failed") for i in header.instantiations], [msg]
    entries, functions = parse_ptxas(out)
    for name, res in functions.items():
        if res.spill_stores or res.spill_loads:
            errors.append(f"{header.name} [{arch.name}]: device function {name} spills "
                          f"({res.spill_stores} B stores, {res.spill_loads} B loads)")
    block_sizes = parse_ptx_block_sizes(ptx)
    rows = []
    for template_id, expr in zip(header.instantiations, exprs):
        mangled = lowered[expr]
        res = entries.get(mangled)
        if res is None:
            errors.append(f"{header.name} [{arch.name}]: {template_id} ({mangled}) is not a kernel in ptxas' output")
            rows.append(Row(header.name, template_id, arch.name, None, None, "not a kernel"))
            continue
        res.threads = block_sizes.get(mangled)
        row = Row(header.name, template_id, arch.name, res, None)
        if res.threads is None:
            row.error = "no FF_LAUNCH_BOUNDS"
            errors.append(f"{header.name} [{arch.name}]: {template_id} has no FF_LAUNCH_BOUNDS(threads): "
                          "the block size is needed for the occupancy")
        else:
            row.occ = occupancy(arch, res.threads, res.registers, res.smem)
            if row.occ.blocks_per_sm == 0:
                row.error = "cannot launch"
                errors.append(f"{header.name} [{arch.name}]: {template_id} cannot be resident on an SM "
                              f"({res.threads} threads, {res.registers} registers, {res.smem} B smem)")
        if res.spill_stores or res.spill_loads:
            row.error = "spills"
            errors.append(f"{header.name} [{arch.name}]: {template_id} spills: {res.spill_stores} B stores, "
                          f"{res.spill_loads} B loads ({res.registers} registers, {res.threads} threads)")
        rows.append(row)
    return rows, errors


def tool_versions(ptxas: str, nvrtc: NVRTC) -> list[str]:
    ptxas_version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip()
    release = [line for line in ptxas_version.splitlines() if "release" in line]
    lines = [f"NVRTC {nvrtc.version} (nvrtcVersion)", "ptxas: " + (release[0] if release else "unknown")]
    for wheel in WHEELS:
        try:
            lines.append(f"{wheel} {metadata.version(wheel)}")
        except metadata.PackageNotFoundError:
            pass
    return lines


def render_table(headers: list[Header], rows: list[Row], archs: list[str]) -> str:
    out = [TABLE_BEGIN, ""]
    for a in archs:
        n_inst = sum(len(h.instantiations) for h in headers if h.archs is None or a in h.archs)
        arch_rows = [r for r in rows if r.arch == a and r.res is not None]
        spill = sum(r.res.spill_stores + r.res.spill_loads for r in arch_rows)
        failed = sum(1 for r in rows if r.arch == a and r.error)
        out.append(f"- **{a}** ({ARCHS[a].gpu}): {len(arch_rows)} of {n_inst} instantiations compiled, "
                   f"spill bytes in total: **{spill}**, problems: {failed}")
    out.append("")
    for h in headers:
        out += [f"### `{h.name}`", "",
                "| kernel | arch | threads/block | registers | spill stores / loads (B) | static smem (B) "
                "| stack (B) | blocks/SM | occupancy (active/max warps) | limited by |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            if r.header != h.name:
                continue
            if r.res is None:
                out.append(f"| `{r.kernel}` | {r.arch} | | | | | | | | **{r.error}** |")
                continue
            threads = str(r.res.threads) if r.res.threads else "?"
            if r.occ:
                occ = f"{r.occ.active_warps}/{r.occ.max_warps} ({100 * r.occ.fraction:.0f}%)"
                blocks, limit = str(r.occ.blocks_per_sm), r.occ.limited_by
            else:
                occ = blocks = ""
                limit = ""
            if r.error:
                limit = f"**{r.error}**" + (f"; {limit}" if limit else "")
            spill = f"{r.res.spill_stores} / {r.res.spill_loads}"
            if r.res.spill_stores or r.res.spill_loads:
                spill = f"**{spill}**"
            out.append(f"| `{r.kernel}` | {r.arch} | {threads} | {r.res.registers} | {spill} | {r.res.smem} "
                       f"| {r.res.stack} | {blocks} | {occ} | {limit} |")
        out.append("")
    out.append(TABLE_END)
    return "\n".join(out)


def render_doc(table: str, versions: list[str], nvrtc_options: list[str], ptxas_options: list[str],
               archs: list[str], skipped: list[str]) -> str:
    arch_rows = "\n".join(
        f"| {a.name} | {a.gpu} | {a.max_threads_per_sm} | {a.max_threads_per_block} | {a.max_blocks_per_sm} "
        f"| {a.regs_per_sm} | {a.reg_alloc_unit} per warp | {a.sub_partitions} | {a.smem_per_sm // 1024} KB "
        f"| {a.smem_static_per_block // 1024} KB | {a.smem_alloc_unit} B | {a.smem_reserved_per_block} B |"
        for a in (ARCHS[n] for n in archs))
    skipped_line = (f"Headers without kernels (helpers, not in the table): {', '.join(f'`{s}`' for s in skipped)}.\n"
                    if skipped else "")
    return f"""# CUDA kernel resources (sm_60 and sm_80)

Generated by `python tools/kernel_report.py`; do not edit by hand. CI runs
`python tools/kernel_report.py --check`, which fails if any kernel instantiation spills, fails to compile,
has no `FF_LAUNCH_BOUNDS`, cannot be resident on an SM, if a kernel header has no `// instantiations:`
list, or if this table is not the one the current headers produce.

Every template instantiation listed in the `// instantiations:` comments of `csrc/cuda/*.cuh` is compiled
for **sm_60** (Tesla P100, the target hardware) and **sm_80** (A100) and assembled by `ptxas -v`; a header
with an `// architectures:` line (the tensor-core kernels: sm_80) only for those it names. No GPU
ran these kernels: the numbers are the compiler's, the occupancy is the theoretical one.

Columns: *registers* per thread, *spill* bytes stored to / loaded from local memory per thread (must be
0), *static smem* = `__shared__` bytes per block, *stack* = stack frame bytes per thread, *threads/block*
= the kernel's `FF_LAUNCH_BOUNDS(n)` (the largest block its launcher uses), *blocks/SM* = resident blocks
per SM, *occupancy* = resident warps / the SM's maximum warps, *limited by* = the limit(s) that set
blocks/SM.

{table}

## How this file is made

```
pip install "nvidia-cuda-nvrtc-cu12==12.9.*" "nvidia-cuda-runtime-cu12==12.9.*" "nvidia-cuda-nvcc-cu12==12.9.*"
python tools/kernel_report.py
```

{skipped_line}
1. Each kernel header is compiled on its own as `#include "csrc/cuda/<op>.cuh"` by NVRTC (libnvrtc.so.12,
   loaded with ctypes) to PTX for `compute_60` / `compute_80`, with the options
   `{' '.join(nvrtc_options)}`. Each listed template-id is passed to `nvrtcAddNameExpression` as `&fastformer::cuda::<id>`, which instantiates it;
   `nvrtcGetLoweredName` gives its mangled name.
2. `ptxas -arch=sm_XX -v {' '.join(ptxas_options)}` assembles the PTX; its per-entry "Used N registers,
   M bytes smem" and "S bytes stack frame, A bytes spill stores, B bytes spill loads" lines give the columns.
3. threads/block is the `.maxntid` directive that `FF_LAUNCH_BOUNDS(n)` (`__launch_bounds__(n)`) puts in
   the PTX.
4. Occupancy follows `cudaOccMaxActiveBlocksPerMultiprocessor` of `cuda_occupancy.h` (CUDA 12.9): blocks/SM
   is the minimum of the block limit, the warp limit `floor(max warps / warps per block)`, the register
   limit (registers are allocated per warp, `ceil(regs x 32 / 256) x 256`, in each of the SM's
   sub-partitions: `floor(floor(64K / sub-partitions / regs per warp) x sub-partitions / warps per block)`;
   a block whose warps, rounded up to 4 sub-partitions, need more than 64K registers cannot launch),
   and the shared-memory limit `floor(smem per SM / round_up(static smem + reserved, unit))`. The
   default cache configuration is assumed (on sm_80 the driver picks the carveout, up to 164 KB, that
   the kernel needs); no dynamic shared memory (the kernels use none). When this tool was written, the
   model was checked against `cudaOccMaxActiveBlocksPerMultiprocessor` itself (the header compiled by g++)
   on 54,400 (threads, registers, smem) combinations over 32..1024 threads, 8..253 registers and 0..48 KB
   of shared memory, for both architectures: no difference.

CI's install also compiles the whole extension with nvcc 13.0 for sm_80, and `tools/check_cuda_build.py`
then prints nvcc's own per-kernel numbers (`cuobjdump --dump-resource-usage`; nvcc 13.0's register counts
may differ slightly from NVRTC 12.9's) and fails if the build holds a kernel that is
missing from the `// instantiations:` lists, i.e. from this table.

Tool versions:

{chr(10).join('- ' + v for v in versions)}

Hardware limits used (per SM unless noted; sources: `cuda_occupancy.h` of nvidia-cuda-runtime-cu12 12.9 for
the allocation units, sub-partitions, reserved shared memory and blocks/SM; the CUDA C++ Programming Guide,
"Technical Specifications per Compute Capability", and the P100 / A100 whitepapers for the rest):

| arch | GPU | threads | threads/block | blocks | registers | register unit | sub-partitions | shared memory | static smem/block | smem unit | smem reserved/block |
|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
{arch_rows}
"""


def header_archs(h: Header, archs: list[str]) -> list[str]:
    """The architectures of the report that header h is built for."""
    return [a for a in archs if h.archs is None or a in h.archs]


def extract_table(doc: str) -> str | None:
    if TABLE_BEGIN not in doc or TABLE_END not in doc:
        return None
    return doc[doc.index(TABLE_BEGIN):doc.index(TABLE_END) + len(TABLE_END)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Compile every kernel instantiation of csrc/cuda/*.cuh with NVRTC 12.9 + ptxas -v for sm_60 "
                    "and sm_80, and write registers / spills / shared memory / occupancy to docs/kernels.md.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 on spills or errors and also when the table in --output is "
                             "not the one the current headers produce (CI mode)")
    parser.add_argument("--headers", nargs="+", default=None, metavar="CUH",
                        help="kernel headers to report (default: csrc/cuda/*.cuh)")
    parser.add_argument("--output", default=os.path.join(ROOT, "docs", "kernels.md"),
                        help="the Markdown report to write (or compare with --check); default docs/kernels.md")
    parser.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS),
                        help="architectures (default: sm_60 sm_80)")
    parser.add_argument("--nvrtc", default=None,
                        help="path of libnvrtc.so.12 (default: from the nvidia-cuda-nvrtc-cu12 wheel)")
    parser.add_argument("--ptxas", default=None, help="path of ptxas 12.x (default: from nvidia-cuda-nvcc-cu12)")
    parser.add_argument("--cuda-include", default=None,
                        help="folder with cuda_fp16.h/cuda_bf16.h (default: from nvidia-cuda-runtime-cu12)")
    args = parser.parse_args(argv)

    missing = []
    lib = args.nvrtc or nvidia_path("cuda_nvrtc", "lib", "libnvrtc.so.12")
    ptxas = args.ptxas or nvidia_path("cuda_nvcc", "bin", "ptxas")
    include = args.cuda_include or nvidia_path("cuda_runtime", "include")
    for what, path in (("libnvrtc.so.12", lib), ("ptxas", ptxas), ("CUDA headers", include)):
        if not path:
            missing.append(what)
    if missing:
        print(f"kernel_report: {', '.join(missing)} not found; install the NVRTC 12.9 wheels:\n  pip install "
              + " ".join(f'"{w}==12.9.*"' for w in WHEELS), file=sys.stderr)
        return 2
    nvrtc = NVRTC(lib)

    paths = args.headers or sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cuh")))
    headers, skipped, errors = [], [], []
    for p in paths:
        h = read_header(p)
        if h.instantiations:
            headers.append(h)
        elif h.defines_kernels:
            errors.append(f"{h.name}: defines kernels but has no '// instantiations:' line listing them")
        else:
            skipped.append(h.name)
    if not headers and not errors:
        errors.append("no kernel header with an '// instantiations:' list found in " + " ".join(paths))

    nvrtc_options = ["-std=c++17", "--use_fast_math", f"-I{include}"]  # as setup.py's nvcc flags
    ptxas_options = ["-O3"]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kernel_report_") as tmp:
        for h in headers:
            for a in header_archs(h, args.arch):
                t0 = time.time()
                r, e = compile_header(nvrtc, ptxas, h, ARCHS[a], nvrtc_options, ptxas_options, tmp)
                print(f"  {h.name} [{a}]: {len(h.instantiations)} instantiations, {time.time() - t0:.1f} s")
                rows += r
                errors += e
    # order: header, then its list order, then architecture
    by_key = {(r.header, r.kernel, r.arch): r for r in rows}
    rows = [by_key[(h.name, i, a)] for h in headers for i in h.instantiations for a in header_archs(h, args.arch)]

    table = render_table(headers, rows, args.arch)
    shown = [("kernel", "arch", "thr", "regs", "spill st/ld", "smem", "stack", "occupancy")]
    for r in rows:
        if r.res:
            occ = f"{100 * r.occ.fraction:.0f}%" if r.occ else "?"
            shown.append((r.kernel, r.arch, str(r.res.threads or "?"), str(r.res.registers),
                          f"{r.res.spill_stores}/{r.res.spill_loads}", str(r.res.smem), str(r.res.stack), occ))
        else:
            shown.append((r.kernel, r.arch, "", "", "", "", "", r.error or ""))
    widths = [max(len(s[i]) for s in shown) for i in range(len(shown[0]))]
    for s in shown:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(s, widths)))

    # the doc names the include folder, not this machine's path to it
    nvrtc_doc_options = nvrtc_options[:-1] + ["-I<nvidia/cuda_runtime/include>"]
    doc = render_doc(table, tool_versions(ptxas, nvrtc), nvrtc_doc_options, ptxas_options, args.arch, skipped)
    if args.check:
        try:
            current = extract_table(open(args.output).read())
        except OSError:
            current = None
        if current != table:
            diff = "".join(difflib.unified_diff((current or "").splitlines(True), table.splitlines(True),
                                                os.path.relpath(args.output, ROOT) + " (committed)",
                                                "generated from the current headers"))
            errors.append(f"{os.path.relpath(args.output, ROOT)} is stale: run `python tools/kernel_report.py` "
                          f"and commit it.\n{diff}")
    else:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            f.write(doc)
        print(f"kernel_report: wrote {os.path.relpath(args.output, ROOT)}")

    if errors:
        print("\nkernel_report: FAILED", file=sys.stderr)
        for e in errors:
            print("  - " + e, file=sys.stderr)
        return 1
    print(f"kernel_report: OK, {len(rows)} compiled instantiations ({', '.join(args.arch)}), no spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
