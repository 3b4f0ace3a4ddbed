"""What a training step moves that it had already computed: its casts and copies, counted and attributed
(issue 52).

Two observers of one step, since neither sees everything:

- a dispatch mode (``CopyCounter``) sees every ATen call the step makes from Python and autograd: casts
  (``_to_copy``), ``copy_``, ``clone``, zero-filled gradient buffers (``new_zeros``/``zeros`` of the backward's
  ``select_backward`` and friends), and the GEMMs (``mm``, ``addmm``, ``bmm``, ``baddbmm``, and fastformer's
  ``weight_grad``: a weight's gradient in bf16 on the CPU); each is attributed to
  the autograd node running it (``ToCopyBackward0``: a cast's backward) or to the forward;
- the profiler (``profile_step``) sees ``aten::copy_`` also where an ATen kernel calls it internally (``addmm``
  broadcasting its bias into the output before the product), with its shapes, and the time by kernel class:
  GEMM, fastformer's own ops, copies and casts, other (elementwise, reductions, the optimizer).

A copy counts when it moves at least ``MIN_ELEMENTS`` (4,096) elements: activations and weights, not the
scalars and the small per-parameter tensors of the optimizer's bookkeeping. tools/profile_step.py prints the
report for a step (the GPU check runs it on a GPU); tests/train/test_step_copies.py holds the step to issue
52's bounds.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MIN_ELEMENTS = 4096

aten = torch.ops.aten
# fastformer's own GEMM in a step: a weight's gradient in bf16 on the CPU (csrc/gemm/weight_grad.cpp)
FASTFORMER_GEMMS = ("fastformer::weight_grad",)
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.addmm_.default,
         aten.mm.out, aten.addmm.out, torch.ops.fastformer.weight_grad.default}
# Calls that move data already computed (a cast is a copy into another dtype); zero-filled buffers count as
# the first half of a scatter-style copy (select_backward: zeros of the full size, then the slice copied in).
COPIES = {aten._to_copy.default, aten.copy_.default, aten.clone.default, aten.new_zeros.default,
          aten.zeros.default, aten.select_backward.default, aten.slice_backward.default, aten.stack.default,
          aten.cat.default, aten._foreach_copy_.default}


def _numel(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


class CopyCounter(TorchDispatchMode):
    """Counts GEMMs and the copies of at least ``min_elements`` elements, by (op, autograd node)."""

    def __init__(self, min_elements: int = MIN_ELEMENTS):
        super().__init__()
        self.min_elements, self.gemms = min_elements, 0
        self.copies: Counter = Counter()  # (op, where) -> calls
        self.elements: Counter = Counter()  # (op, where) -> elements moved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in GEMMS:
            self.gemms += 1
        elif func in COPIES:
            n = _numel(out)
            if n >= self.min_elements:
                node = torch._C._current_autograd_node()
                key = (str(func.overloadpacket.__name__), type(node).__name__ if node is not None else "forward")
                self.copies[key] += 1
                self.elements[key] += n
        return out

    @property
    def total(self) -> int:
        return sum(self.copies.values())


def _triton_kernel_names() -> frozenset[str]:
    """The names of fastformer's Triton kernels (fastformer/triton/*.py), as a GPU profile lists them; empty
    without Triton."""
    import importlib
    import pkgutil

    names = set()
    try:
        import fastformer.triton as package
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"fastformer.triton.{info.name}")
            for obj in vars(module).values():
                fn = obj  # a triton.jit function, or an autotuner around one: the Python function inside
                while hasattr(fn, "fn"):
                    fn = fn.fn
                if fn is not obj and type(obj).__module__.startswith("triton"):
                    names.add(fn.__name__)
    except ImportError:
        pass
    return frozenset(names)


def kernel_class(name: str, triton_kernels: frozenset[str] = frozenset()) -> str:
    """The class of a profiler event (an ATen op on the CPU, a kernel on a GPU): "gemm", "fastformer" (the
    fastformer:: ops, the CUDA kernels of namespace fastformer, the Triton kernels ``triton_kernels``), "copy"
    or "other"."""
    low = name.lower()
    if name in FASTFORMER_GEMMS:
        return "gemm"
    if name.startswith("fastformer::") or "fastformer" in low or name in triton_kernels:
        return "fastformer"
    if any(k in low for k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "gemm", "xmma", "cutlass",
                              "nvjet", "sm90_", "sm80_", "cublas")):
        return "gemm"
    if any(k in low for k in ("aten::copy_", "aten::_to_copy", "aten::clone", "copy_kernel", "direct_copy")):
        return "copy"
    return "other"


@dataclass
class StepTraffic:
    """One profiled step: the profiler's ``aten::copy_`` calls of >= MIN_ELEMENTS (inside ATen kernels too), the
    dispatch counter's view, and the self time by kernel class (device time on a GPU, CPU time elsewhere)."""
    gemms: int
    profiler_copies: int
    counter: CopyCounter
    seconds_by_class: dict[str, float]

    @property
    def copies_per_gemm(self) -> float:
        return self.profiler_copies / max(self.gemms, 1)

    def markdown(self, title: str = "Copies and casts of one step") -> str:
        total = sum(self.seconds_by_class.values()) or math.inf
        lines = [f"#### {title}", "",
                 f"{self.profiler_copies} `aten::copy_` of >= {self.counter.min_elements:,} elements (profiler, "
                 f"inside ATen kernels too) for {self.gemms} GEMMs: {self.copies_per_gemm:.2f} a GEMM; "
                 f"{self.counter.total} casts and copies seen from Python and autograd:", "",
                 "| op | where | calls | elements |", "|---|---|---:|---:|"]
        for (op, where), n in self.counter.copies.most_common():
            lines.append(f"| {op} | {where} | {n} | {self.counter.elements[(op, where)]:,} |")
        lines += ["", "| kernel class | self time (ms) | share |", "|---|---:|---:|"]
        for cls in ("gemm", "fastformer", "copy", "other"):
            s = self.seconds_by_class.get(cls, 0.0)
            lines.append(f"| {cls} | {s * 1e3:.2f} | {s / total:.1%} |")
        return "\n".join(lines) + "\n"


def profile_step(step: Callable[[], object], device: torch.device, min_elements: int = MIN_ELEMENTS) -> StepTraffic:
    """Runs ``step`` once under the profiler (with shapes) and the dispatch counter (warm it up first: the first
    step allocates optimizer state)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    counter = CopyCounter(min_elements)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        with counter:
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    copies = 0
    seconds: Counter = Counter()
    triton_kernels = _triton_kernel_names() if device.type == "cuda" else frozenset()
    for event in prof.events():
        if event.name == "aten::copy_" and event.input_shapes and event.input_shapes[0]:
            if math.prod(event.input_shapes[0]) >= min_elements:
                copies += 1
        if device.type == "cuda":
            if event.device_type == torch.autograd.DeviceType.CUDA:
                seconds[kernel_class(event.name, triton_kernels)] += event.self_device_time_total / 1e6
        elif event.device_type == torch.autograd.DeviceType.CPU and event.name.startswith(("aten::", "fastformer::")):
            seconds[kernel_class(event.name)] += event.self_cpu_time_total / 1e6
    return StepTraffic(counter.gemms, copies, counter, dict(seconds))
