"""Launch plans: the triton backend's calls replayed from C++ with no Python per call, and their recorder.

How a call reaches its kernels (csrc/triton/plans.cpp has the C++ half): ``fastformer::<op>_<phase>_py``
with backend "triton" on CUDA tensors runs a C++ kernel that checks and prepares the arguments as the C++
backends do (csrc/ops.h), computes the call's configuration key (op, phase; each tensor's dtype, device,
sizes, strides, 16-byte alignment and which earlier argument it is; None-ness; every scalar's value) and

- replays the configuration's plan when it has one: allocations, kernel launches (cuLaunchKernel on the
  current stream, the parameters packed in C++), outputs; no Python;
- else calls ``_run`` below, which runs ``fastformer.triton.<op>.<op>_<phase>`` in Python, recording what it
  does when the configuration is seen for the second time. A first sight runs unrecorded: a run whose
  shapes vary (plain ``python -m fastformer.train``, every batch a new (B, S, T)) meets most configurations
  once, and recording one costs more than the Python call it would replace.

The table of configurations is bounded (``set_capacity``, 4,096 by default): a new configuration that finds
it full evicts the least recently used eighth, so plans that keep being replayed stay.

What is recorded (``_Recording``), while the Python implementation runs:
- ATen ops, through a TorchDispatchMode: allocations (``torch.empty``, ``empty_like``, ``new_empty``,
  ``empty_strided``, ``new_empty_strided``: sizes, strides, dtype) and views (which tensor each is a view
  of). Any other ATen op (a copy, a fill, a sum, ``.contiguous()`` that copies, an ``.item()``) makes the
  configuration refused: it runs in Python for as long as it stays in the table, as before, and
  ``stats()`` counts it under that reason.
- Kernel launches, by wrapping Triton's launcher (``CompiledKernel.run``, the same in Triton 3.6 and 3.8):
  the CUfunction Triton loaded, threads (32 x num_warps), dynamic shared memory, the grid, and each
  parameter: a pointer into an input or an allocation at a byte offset (views resolved to their root), a
  scalar's bits by the kernel signature's type (i32, i64, fp32, ...), or a null pointer for Triton's
  trailing scratch parameters, whose count and sizes come from the kernel's PTX (``.entry`` parameter list)
  and are checked in C++ against cuFuncGetParamInfo. Kernels that need scratch memory, more than one CTA per
  cluster, cooperative or PDL launches, tensor descriptors or 16-bit scalars are refused. The kernels of a
  plan handed to C++ are kept alive here (C++ launches their CUfunctions); those of a refused recording are
  not.
- Not Triton's autotuner: when it benchmarks candidates (``Autotuner._bench``, on a key it has not tuned),
  the recording is suspended for the benchmark: this thread's launches are not recorded and every dispatch
  mode is off (``_unrecorded``). The benchmark then times the candidates as it would without plans (no
  recorder's host time added to short kernels), its allocations and cache flushes do not refuse the
  configuration, and no candidate's kernel is kept alive; the recording goes on with the tuned launch.

Counters (``stats()``, per op and phase; ``summary()`` sums them into one line for logs: fastformer.train
prints it and writes it into its run's summary record).

Under TRITON_INTERPRET=1 (CPU tensors, CI) ``on_cpu(True)`` registers the same C++ kernel for CPU tensors;
the interpreter's launches are then recorded by wrapping ``InterpretedFunction.run`` and replayed through
``_run_interpreted``, one Python call per launch: test equipment for everything but cuLaunchKernel.

The protocol with C++. ``_run`` returns (outputs, status, payload): the status codes (PLAN with a
``PlanDescription``, REFUSED with a reason, NOT_RECORDED with None) and the parameter kinds are C++'s
(``C.TRITON_PLAN_STATUS``, ``C.TRITON_PLAN_PARAM_KINDS``: csrc/triton/plans.cpp ``Status``, ``Param::Kind``),
read here, not restated. The description is the named tuples below (C++ reads them by position, in the order of
their fields): ``PlanDescription(allocs, launches, outputs)`` of ``Alloc``, ``Launch`` (``KernelRef``, grid,
``Param`` list) and ``Output``.

The recorder reads Triton's internals (``CompiledKernel.run``'s launcher arguments, ``Autotuner._bench``,
``InterpretedFunction.run``, a compiled kernel's metadata and PTX): it records only under the Triton versions in
``RECORDER_TRITON_VERSIONS``, those its tests have passed on (tests/ops/test_triton_plans.py here,
tests/gpu/test_triton_plans_on_cuda.py on a GPU). Under another, every configuration is refused with that reason
(its calls run in Python, correct, as without plans) and one warning says so.

The rule for a Triton wrapper (``fastformer.triton.<op>.<op>_<phase>``) that plans replay: everything it
decides (tiles, grids, allocations, the autotuner's key, scalars passed to kernels) depends only on the call's
key (the module docstring's first part; docs/triton-kernels.md), and the only ATen ops it runs are allocations
and views; it reads no tensor's values on the host and keeps no state between calls. A wrapper that breaks the
second rule is refused (safe: it runs in Python); one that breaks the first would replay a stale decision, and
nothing can detect it: that rule is the wrapper author's.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import re
import struct
import threading
import warnings
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fastformer import _dispatch
from fastformer._ext import C
from fastformer.triton import INTERPRET

# _run's status: a plan, a refusal (reason), or no recording asked for (csrc/triton/plans.cpp Status).
PLAN, REFUSED, NOT_RECORDED = (C.TRITON_PLAN_STATUS[k] for k in ("plan", "refused", "not_recorded"))
# Parameter kinds (csrc/triton/plans.cpp Param::Kind).
INPUT, ALLOC, VALUE, NULL = (C.TRITON_PLAN_PARAM_KINDS[k] for k in ("input", "alloc", "value", "null"))

# The Triton versions (major.minor) whose internals the recorder reads as written here.
RECORDER_TRITON_VERSIONS = ("3.6", "3.8")


class Alloc(NamedTuple):
    """An allocation of the call (``torch.empty`` and its kin), made again by each replay."""
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype


class KernelRef(NamedTuple):
    """The kernel of a launch: a compiled kernel's CUfunction (interpreted -1), or under the interpreter the
    id of an entry of ``_interpreted`` (function 0)."""
    function: int
    interpreted: int
    threads: int  # 32 x num_warps
    shared: int   # dynamic shared memory, bytes
    name: str


class Param(NamedTuple):
    """One kernel parameter: INPUT (index: argument position, value: byte offset), ALLOC (index: allocation,
    value: byte offset), VALUE (value: the bits) or NULL; size: the bytes the function reads."""
    kind: int
    index: int
    value: int
    size: int


class Launch(NamedTuple):
    kernel: KernelRef
    grid: tuple[int, int, int]
    params: list[Param]


class Output(NamedTuple):
    """An output: allocation ``alloc`` whole, or a view of it (sizes, strides, storage offset)."""
    alloc: int
    whole: bool
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


class PlanDescription(NamedTuple):
    """What ``_Recording.result`` hands to C++ (csrc/triton/plans.cpp ``parse``)."""
    allocs: list[Alloc]
    launches: list[Launch]
    outputs: list[Output]


def recorder_supports(version: str) -> bool:
    """Whether the recorder reads this Triton version's internals as written here (RECORDER_TRITON_VERSIONS)."""
    return ".".join(version.split(".")[:2]) in RECORDER_TRITON_VERSIONS


def _unsupported_triton() -> str | None:
    """The refusal of every recording under a Triton the recorder does not know (one warning), or None."""
    import triton

    if recorder_supports(triton.__version__):
        return None
    reason = (f"Triton {triton.__version__} is not a version the launch-plan recorder knows "
              f"({', '.join(RECORDER_TRITON_VERSIONS)})")
    global _warned_version
    if not _warned_version:
        _warned_version = True
        warnings.warn(f"fastformer: {reason}: triton calls run in Python, correct but with Python's cost per call",
                      RuntimeWarning, stacklevel=3)
    return reason


_warned_version = False

_ALLOCATIONS = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                          torch.ops.aten.new_empty.default, torch.ops.aten.empty_strided.default,
                          torch.ops.aten.new_empty_strided.default})
_INT_BYTES = {"i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "u1": 1, "u8": 1, "u16": 2, "u32": 4, "u64": 8}
_MASK64 = (1 << 64) - 1


def stats() -> dict:
    """Per op and phase (``"attention_fwd"``, ...): ``replays`` (calls replayed from C++), ``python`` (calls
    run in Python: first sights, recordings, and every call of a refused configuration), ``first_sight``
    (among those, calls of a configuration not in the table: unrecorded), ``recorded``, ``refused`` and
    ``evicted`` (configurations); ``refused_reasons`` {reason: refusals}; ``configurations`` (in the table
    now) and ``capacity`` (its bound)."""
    return C.triton_plans_stats()


def summary(counts: dict | None = None) -> str | None:
    """The counters of ``stats()`` (or ``counts``, a dict it returned) summed over ops and phases, in one line:

        triton plans: 41 configurations, 38 recorded, 3 refused (2: runs aten.copy_.default in torch;
        1: ...), 0 evicted; 12,345 replays (99.0% of calls), 120 python calls (45 first sights)

    (one line; reasons by count, most first). None when no call was counted: the backend was not triton on
    CUDA tensors (or, under the interpreter, plans were not on for CPU tensors), or plans were off."""
    counts = stats() if counts is None else counts
    per_op = [c for c in counts.values() if isinstance(c, dict) and "replays" in c]
    total = {k: sum(c[k] for c in per_op) for k in ("replays", "python", "first_sight", "recorded", "refused",
                                                    "evicted")}
    calls = total["replays"] + total["python"]
    if calls == 0:
        return None
    reasons = sorted(counts["refused_reasons"].items(), key=lambda kv: (-kv[1], kv[0]))
    refused = f"{total['refused']:,} refused"
    if reasons:
        refused += " (" + "; ".join(f"{n:,}: {reason}" for reason, n in reasons) + ")"
    return (f"triton plans: {counts['configurations']:,} configurations, {total['recorded']:,} recorded, {refused}, "
            f"{total['evicted']:,} evicted; {total['replays']:,} replays ({100 * total['replays'] / calls:.1f}% of "
            f"calls), {total['python']:,} python calls ({total['first_sight']:,} first sights)")


def clear() -> None:
    """Forgets every configuration and counter: each configuration's next call is a first sight again."""
    C.triton_plans_clear()


def set_capacity(capacity: int) -> int:
    """Bounds the table to ``capacity`` configurations (4,096 by default), evicting the least recently used
    past it; returns the previous bound."""
    return C.triton_plans_set_capacity(int(capacity))


def set_enabled(on: bool) -> None:
    """Replays on (the default) or off: every triton call then runs its Python implementation, as
    FASTFORMER_TRITON_PLANS=0 in the environment does from the start."""
    C.triton_plans_set_enabled(bool(on))


def enabled() -> bool:
    return C.triton_plans_enabled()


def on_cpu(on: bool) -> None:
    """Records and replays the interpreter's kernels on CPU tensors (TRITON_INTERPRET=1): test equipment."""
    if on and not INTERPRET:
        raise RuntimeError("fastformer triton plans on CPU tensors need TRITON_INTERPRET=1 (set before import)")
    C.triton_plans_on_cpu(bool(on))


# ---- what C++ calls ----

def _run(op: str, phase: str, record: bool, args: tuple):
    """``fastformer.triton.<op>.<op>_<phase>(*args)`` (the arguments as csrc/ops.h's adapter prepared them),
    with autocast off as for every Python-written backend; recorded when ``record``. Returns (outputs,
    status, payload): (outputs, PLAN, a PlanDescription), (outputs, REFUSED, the reason) or (outputs,
    NOT_RECORDED, None)."""
    fn = _dispatch.implementation(op, phase, "triton")
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    autocast = torch.autocast(device.type, enabled=False) if torch.is_autocast_enabled(device.type) else None
    unsupported = _unsupported_triton() if record else None
    with autocast or contextlib.nullcontext():
        if not record:
            return fn(*args), NOT_RECORDED, None
        if unsupported:
            return fn(*args), REFUSED, unsupported
        with _recorded(args, device) as recording:
            out = fn(*args)
    status, payload = recording.result(out)
    return out, status, payload


@contextlib.contextmanager
def _recorded(args: tuple, device: torch.device):
    """Records what this thread does inside (a _Recording of a call with arguments ``args`` on ``device``)."""
    _install_hooks()
    recording = _Recording(args, device)
    _local.recording = recording
    try:
        with _Watch(recording):
            yield recording
    finally:
        _local.recording = None


@contextlib.contextmanager
def _unrecorded():
    """Inside a recording, what runs here is not the call's (the autotuner's benchmark): this thread's
    launches go straight to Triton and ATen ops to their kernels, past every dispatch mode (the _Watch and
    any outer one: the candidates' launches are the autotuner's, not the call's)."""
    recording = getattr(_local, "recording", None)
    _local.recording = None
    try:
        with _disable_current_modes():
            yield
    finally:
        _local.recording = recording


def _run_interpreted(kernel: int, grid: tuple, bits: list) -> None:
    """One launch of a replayed plan under the interpreter: the recorded kernel and constexprs, each
    parameter rebuilt from its bits (a pointer as a one-element tensor at that address, which is all the
    interpreter reads of it)."""
    fn, names, constexprs, types = _interpreted[kernel]
    values, params = [], iter(zip(bits, types))
    for name in names:
        if name in constexprs:
            values.append(constexprs[name])
            continue
        value, kind = next(params)
        values.append(_at(value, kind) if isinstance(kind, torch.dtype) else _decode(value, kind))
    fn.run(*values, grid=grid, warmup=False)


# ---- the recorder ----

_local = threading.local()  # .recording: the _Recording of this thread's call, if one is being recorded
_compiled: dict[int, object] = {}  # CUfunction -> its CompiledKernel: plans launch it, so it stays loaded
_interpreted: list[tuple] = []  # interpreted kernel id -> (function, argument names, constexprs, parameter types)


class _Recording:
    """What one Python run of a triton call does (see the module docstring)."""

    def __init__(self, args: tuple, device: torch.device):
        self.device = device
        # id(tensor) -> (INPUT, position) or (ALLOC, index); an argument passed twice maps to its first
        # position, as the C++ key's alias rule does.
        self.roots: dict[int, tuple[int, int]] = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and id(a) not in self.roots:
                self.roots[id(a)] = (INPUT, i)
        self.views: dict[int, torch.Tensor] = {}  # id(view) -> the tensor it is a view of
        self.keep: list = [args]  # every tensor whose id is held above stays alive while recording
        self.allocs: list[Alloc] = []
        self.alloc_tensors: list[torch.Tensor] = []
        self.launches: list[Launch] = []
        self.kernels: list = []  # the CompiledKernels launched: kept alive by _compiled once the plan is handed over
        self.refusal: str | None = None
        self.launching = False  # inside a launch: the launcher's own ATen ops (interpreter) are not the call's

    def refuse(self, reason: str) -> None:
        if self.refusal is None:
            self.refusal = reason

    def on_aten(self, func, args, out) -> None:
        if self.launching:
            return
        if func in _ALLOCATIONS:
            if out.device != self.device or out.layout != torch.strided:
                self.refuse(f"allocates a {out.layout} tensor on {out.device}")
                return
            self.roots[id(out)] = (ALLOC, len(self.allocs))
            self.allocs.append(Alloc(tuple(out.shape), tuple(out.stride()), out.dtype))
            self.alloc_tensors.append(out)
            self.keep.append(out)
        elif func.is_view:
            for view in out if isinstance(out, (list, tuple)) else (out,):
                self.views[id(view)] = args[0]
                self.keep.append(view)
        else:
            self.refuse(f"runs {func} in torch")

    def locate(self, t: torch.Tensor):
        """((INPUT or ALLOC, index), byte offset of t's data from that root's), or (None, 0)."""
        obj = t
        while obj is not None:
            root = self.roots.get(id(obj))
            if root is not None:
                return root, t.data_ptr() - obj.data_ptr()
            obj = self.views.get(id(obj))
        return None, 0

    def pointer(self, t, name: str):
        """A pointer parameter (INPUT or ALLOC, index, offset, 8), or None after refusing."""
        if not isinstance(t, torch.Tensor):
            self.refuse(f"{name} receives a {type(t).__name__} as a pointer")
            return None
        root, offset = self.locate(t)
        if root is None:
            self.refuse(f"{name} receives a tensor that is neither an argument nor allocated by the call")
            return None
        return (root[0], root[1], offset & _MASK64, 8)

    def on_compiled(self, kernel, grid: tuple, args: tuple) -> None:
        name = kernel.name
        problem = _unsupported(kernel)
        if problem:
            self.refuse(f"{name} {problem}")
            return
        signature = list(kernel.src.signature.values())
        sizes = _ptx_param_sizes(kernel.asm.get("ptx", ""), name)
        if len(signature) != len(args) or sizes is None:
            self.refuse(f"{name}: its signature, arguments and PTX parameters do not line up")
            return
        params, expected = [], []  # expected: each parameter's size by its type (None: the PTX's, for i1/u1)
        for (arg_name, ty), value in zip(kernel.src.signature.items(), args):
            if ty == "constexpr":
                continue
            if not isinstance(ty, str):
                self.refuse(f"{name} takes a tuple argument ({arg_name})")
                return
            if ty.startswith("*"):
                param = (NULL, 0, 0, 8) if value is None else self.pointer(value, f"{name}.{arg_name}")
                expected.append(8)
            elif ty in _INT_BYTES or ty in ("fp32", "f32", "fp64"):
                param = (VALUE, 0, _bits(ty, value), 8)
                expected.append(None if ty in ("i1", "u1") else _INT_BYTES.get(ty, 8 if ty == "fp64" else 4))
            else:
                self.refuse(f"{name} takes a {ty} argument ({arg_name})")
                return
            if param is None:
                return
            params.append(param)
        # Triton appends hidden pointer parameters (global and profile scratch, null when unused).
        hidden = sizes[len(params):]
        if len(sizes) < len(params) or any(s != 8 for s in hidden) or any(
                e is not None and e != s for e, s in zip(expected, sizes)):
            self.refuse(f"{name}: its PTX parameters ({sizes} bytes) do not match its signature")
            return
        params = [(kind, index, value, s) for (kind, index, value, _), s in zip(params, sizes)]
        params += [(NULL, 0, 0, 8)] * len(hidden)
        self.kernels.append(kernel)
        threads = kernel.metadata.num_warps * kernel.metadata.target.warp_size
        self.launches.append(Launch(KernelRef(kernel.function, -1, threads, kernel.metadata.shared, name), grid,
                                    [Param(*p) for p in params]))

    def on_interpreted(self, fn, args: tuple, kwargs: dict, grid) -> None:
        names = list(inspect.signature(fn.fn).parameters)
        bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in names})
        bound.apply_defaults()
        values = bound.arguments
        constexprs = {n for n, ann in inspect.get_annotations(fn.fn).items() if _is_constexpr(ann)}
        grid = tuple(grid(dict(values)) if callable(grid) else grid)
        params, types = [], []
        for n in names:
            v = values[n]
            if n in constexprs:
                continue
            if isinstance(v, torch.Tensor):
                param = self.pointer(v, f"{fn.fn.__name__}.{n}")
                if param is None:
                    return
                params.append(param)
                types.append(v.dtype)
            elif isinstance(v, (bool, int, float)):
                ty = _interpreter_type(v)
                params.append((VALUE, 0, _bits(ty, v), _INT_BYTES.get(ty, 4)))
                types.append(ty)
            else:
                self.refuse(f"{fn.fn.__name__} takes a {type(v).__name__} argument ({n})")
                return
        _interpreted.append((fn, names, {n: values[n] for n in constexprs}, types))
        self.launches.append(Launch(KernelRef(0, len(_interpreted) - 1, 0, 0, fn.fn.__name__),
                                    grid + (1,) * (3 - len(grid)), [Param(*p) for p in params]))

    def result(self, out):
        if self.refusal:
            return REFUSED, self.refusal
        outputs = []
        for o in out if isinstance(out, tuple) else (out,):
            root, _ = self.locate(o) if isinstance(o, torch.Tensor) else (None, 0)
            if root is None or root[0] != ALLOC:
                return REFUSED, "returns a tensor that it did not allocate"
            outputs.append(Output(root[1], o is self.alloc_tensors[root[1]], tuple(o.shape), tuple(o.stride()),
                                  o.storage_offset()))
        for kernel in self.kernels:
            _compiled.setdefault(kernel.function, kernel)
        return PLAN, PlanDescription(self.allocs, self.launches, outputs)


class _Watch(TorchDispatchMode):
    """The ATen ops of a recorded run, handed to its _Recording (run unchanged)."""

    def __init__(self, recording: _Recording):
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.recording.on_aten(func, args, out)
        return out


def _unsupported(kernel) -> str:
    """Why a compiled kernel's launch cannot be replayed by cuLaunchKernel with these parameters, or ""."""
    meta = kernel.metadata
    if getattr(meta, "num_ctas", 1) != 1 or tuple(getattr(meta, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) != (1, 1, 1):
        return "runs clusters of CTAs"
    if getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False):
        return "needs a cooperative or PDL launch"
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        return "needs scratch memory"
    if getattr(meta, "tensordesc_meta", None):
        return "takes tensor descriptors"
    if not hasattr(kernel.src, "signature"):
        return "has no signature (not compiled from a @triton.jit function)"
    return ""


_ENTRY = r"\.entry\s+{}\s*\((?P<params>[^)]*)\)"
_PARAM_TYPE = re.compile(r"\.[bsuf](\d+)\b")
_ARRAY = re.compile(r"\[(\d+)\]\s*$")


def _ptx_param_sizes(ptx: str, name: str) -> list[int] | None:
    """The byte size of each parameter of kernel ``name`` in its PTX (``.param .u64 .ptr ... x_param_0``,
    ``.param .align 64 .b8 x_param_3[128]``), in order; None when the entry is not found."""
    entry = re.search(_ENTRY.format(re.escape(name)), ptx)
    if entry is None:
        return None
    sizes = []
    for decl in entry.group("params").split(","):
        if not decl.strip():
            continue
        ty = _PARAM_TYPE.search(decl)
        count = _ARRAY.search(decl)
        if ty is None:
            return None
        sizes.append(int(ty.group(1)) // 8 * (int(count.group(1)) if count else 1))
    return sizes


def _bits(ty: str, value) -> int:
    """A scalar parameter's bits as Triton's launcher packs it (little-endian, the low bytes used)."""
    if ty in ("fp32", "f32"):
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if ty == "fp64":
        return struct.unpack("<Q", struct.pack("<d", float(value)))[0]
    return int(value) & _MASK64


def _decode(bits: int, ty: str):
    """The Python value of a scalar parameter's bits (the inverse of _bits)."""
    if ty in ("fp32", "f32"):
        return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]
    if ty == "fp64":
        return struct.unpack("<d", struct.pack("<Q", bits))[0]
    if ty == "i1":
        return bool(bits & 1)
    width = 8 * _INT_BYTES[ty]
    value = bits & ((1 << width) - 1)
    return value - (1 << width) if ty.startswith("i") and value >> (width - 1) else value


def _interpreter_type(v) -> str:
    """The type the interpreter gives a Python scalar argument (triton/runtime/interpreter.py _implicit_cvt)."""
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, float):
        return "fp32"
    if -2**31 <= v < 2**31:
        return "i32"
    if 2**31 <= v < 2**32:
        return "u32"
    return "i64" if -2**63 <= v < 2**63 else "u64"


def _is_constexpr(annotation) -> bool:
    import triton.language as tl
    return annotation is tl.constexpr or (isinstance(annotation, str) and annotation.strip().endswith("constexpr"))


def _at(address: int, dtype: torch.dtype) -> torch.Tensor:
    """A one-element CPU tensor of ``dtype`` at ``address``: a pointer parameter for the interpreter."""
    size = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=dtype)


_hooks_installed = False
_hooks_lock = threading.Lock()


def _install_hooks() -> None:
    """Wraps Triton's launcher (CompiledKernel.run, or InterpretedFunction.run under the interpreter) and the
    autotuner's benchmark of a candidate (Autotuner._bench), once: outside a recording (this thread's
    _local.recording) they behave as before."""
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        from triton.runtime.autotuner import Autotuner

        if INTERPRET:
            from triton.runtime.interpreter import InterpretedFunction

            interpreted_run = InterpretedFunction.run

            @functools.wraps(interpreted_run)
            def run_interpreted(self, *args, grid, warmup, **kwargs):
                recording = getattr(_local, "recording", None)
                if recording is None or warmup:
                    return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)
                recording.on_interpreted(self, args, kwargs, grid)
                recording.launching = True
                try:
                    return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)
                finally:
                    recording.launching = False

            InterpretedFunction.run = run_interpreted
        else:
            from triton.compiler.compiler import CompiledKernel

            launcher = CompiledKernel.__dict__["run"]  # a property: the kernel's launcher

            def recorded_launch(recording, kernel, run, gx, gy, gz, stream, function, *rest):
                # rest: packed metadata, launch metadata, enter hook, exit hook, then the kernel's arguments
                recording.on_compiled(kernel, (gx, gy, gz), rest[4:])
                recording.launching = True
                try:
                    return run(gx, gy, gz, stream, function, *rest)
                finally:
                    recording.launching = False

            def run_property(self):
                run = launcher.fget(self)
                recording = getattr(_local, "recording", None)
                return run if recording is None else functools.partial(recorded_launch, recording, self, run)

            CompiledKernel.run = property(run_property)

        bench = Autotuner._bench  # times one candidate config; run() calls it only for keys not yet tuned

        @functools.wraps(bench)
        def bench_unrecorded(self, *args, **kwargs):
            if getattr(_local, "recording", None) is None:
                return bench(self, *args, **kwargs)
            with _unrecorded():
                return bench(self, *args, **kwargs)

        Autotuner._bench = bench_unrecorded
        _hooks_installed = True
