"""What every op module registers on top of the ops declared in C++ (csrc/ops.h, csrc/fastformer.cpp).

For an op ``<op>`` with phases fwd and bwd, the dispatcher holds ``fastformer::<op>_<phase>`` (C++ kernels
for CPU and CUDA, C++ autograd) and ``fastformer::<op>_<phase>_py`` (the same arguments and ``backend``,
C++ autograd). ``register`` adds, from Python: the fake (meta) kernel of all four, which torch.compile and
export trace with, and the implementation of the ``_py`` twins for the torch, triton and cuda_sim backends.
"""
from __future__ import annotations

import functools
import numbers
from typing import Callable

import torch

from fastformer._ext import C

OPS: tuple[str, ...] = tuple(C.OPS)  # the op list of csrc/ops.h (FASTFORMER_OPS), in its order


def same_device(op: str, first: str, x: torch.Tensor, **others) -> None:
    """Device checks of a fake kernel: a tensor on another device (e.g. "meta" beside CPU tensors) would
    otherwise reach the fake kernel instead of raising, since the dispatcher picks one device's kernel."""
    for name, t in others.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"fastformer {op}: {name} is on {t.device} but {first} is on {x.device}")


def out_like(x: torch.Tensor) -> torch.Tensor:
    """A fake kernel's output shaped like ``x``: contiguous, as every backend's kernels write their outputs
    (they take contiguous copies of their inputs), whatever the strides of ``x``. (torch.empty_like would
    keep the strides of a permuted input, and compiled code then checks the real output against them.)"""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def register(op: str, *, fake_fwd: Callable, fake_bwd: Callable, py_fwd: Callable, py_bwd: Callable,
             fake_fwd_py: Callable | None = None, fake_bwd_py: Callable | None = None) -> None:
    """Fake kernels of ``<op>_fwd``/``<op>_bwd`` and their ``_py`` twins, and the twins' implementation.

    ``py_fwd``/``py_bwd`` take the schema's arguments, ``backend`` last, and run on any device. The twins'
    fake kernels are ``fake_fwd_py``/``fake_bwd_py``, which take ``backend`` last too, where the outputs' strides
    depend on the backend (attention: the torch reference's differ from the kernels'), else the C++ ops' fakes.
    """
    for phase, fake, fake_py, impl in (("fwd", fake_fwd, fake_fwd_py, py_fwd), ("bwd", fake_bwd, fake_bwd_py, py_bwd)):
        name = f"fastformer::{op}_{phase}"
        torch.library.register_fake(name)(fake)
        torch.library.register_fake(f"{name}_py")(fake_py or (lambda *args, fake=fake: fake(*args[:-1])))
        torch.library.impl(f"{name}_py", "CompositeExplicitAutograd")(_without_autocast(impl))


def _without_autocast(impl: Callable) -> Callable:
    """``impl`` run with autocast off on its tensors' device. The op receives tensors already in the
    caller's (autocast) dtype and returns its statistics in float32, as the C++ kernels do; left on,
    autocast would run the torch backend's matmuls in bfloat16 and hand back a bfloat16 lse, which the
    backward's checks (csrc/ops.h check_stats) refuse."""
    @functools.wraps(impl)
    def run(*args):
        device = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        if not torch.is_autocast_enabled(device):
            return impl(*args)
        with torch.autocast(device, enabled=False):
            return impl(*args)
    return run


@functools.cache
def _argument_types(op: str) -> dict[str, str]:
    """name -> schema type ("Tensor", "Optional[Tensor]", "float", "Optional[float]", "bool", "int", "str",
    "Optional[ScalarType]") of the arguments of ``fastformer::<op>_fwd``, as declared once in csrc/ops.h
    (``real_type``: ``type`` shows a ScalarType as int)."""
    schema = getattr(torch.ops.fastformer, f"{op}_fwd").default._schema
    return {arg.name: str(arg.real_type) for arg in schema.arguments}


def _takes(kind: str, value) -> bool:
    if kind.startswith("Optional["):
        return value is None or _takes(kind[len("Optional["):-1], value)
    if kind == "Tensor":
        return isinstance(value, torch.Tensor)
    if kind == "float":
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == "int":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "ScalarType":
        return isinstance(value, torch.dtype)
    return True


def check_types(op: str, arguments: dict) -> None:
    """Raises ValueError naming the first of a public call's ``arguments`` whose Python type ``op``'s schema
    does not take: None or a list for a tensor, a string for a number. The public functions call it when a
    call has failed (so a good call pays nothing for it): the dispatcher's own message for a wrong type
    names the registered op's schema, not the caller's argument, and None for a tensor fails deeper down."""
    for name, kind in _argument_types(op).items():
        if name in arguments and not _takes(kind, arguments[name]):
            value = arguments[name]
            want = {"Tensor": "a torch.Tensor", "Optional[Tensor]": "a torch.Tensor or None", "float": "a number",
                    "Optional[float]": "a number or None", "int": "an int", "bool": "a bool",
                    "str": "a str", "Optional[ScalarType]": "a torch.dtype or None"}.get(kind, kind)
            got = "None" if value is None else type(value).__name__
            raise ValueError(f"fastformer {op}: {name} must be {want}, got {got}")


def dropout_seed(p, op: str, x: torch.Tensor) -> torch.Tensor | None:
    """The call's dropout seed when dropout is on, None without: a 0-dim int64 tensor on the device of the
    inputs (``x``), drawn there by torch's generator of that device. On the CPU that is the default
    generator (torch.manual_seed makes dropout reproducible, on every CPU backend alike). On a GPU it is the
    device's CUDA generator: the draw is a kernel that writes the tensor, so no host sync, and under CUDA
    graph capture torch advances that generator's Philox offset on every replay, so each replay writes a
    new seed into the same tensor, which the kernels read from memory (csrc/ops.h check_seed). A dropout_p
    that is no number (a bool, a string, a tensor) raises ValueError here; its range is checked in C++."""
    if p.__class__ is float and p == 0.0:  # the common case first: a float 0.0, no dropout
        return None
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise ValueError(f"fastformer {op}: dropout_p must be a number in [0, 1), got {p!r}")
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=x.device) if p > 0 else None
