"""Argument checks shared by the ops: every backend sees inputs that passed these, so bad input
gives the same clear Python exception everywhere (ValueError for values, shapes, dtypes, devices)."""
from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor(t, name: str, op: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"fastformer {op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def floating(t: torch.Tensor, name: str, op: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"fastformer {op}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def same_dtype_device(op: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.dtype != ref.dtype:
            raise ValueError(f"fastformer {op}: {name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; "
                             f"cast them to one dtype")
        if t.device != ref.device:
            raise ValueError(f"fastformer {op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def bool_mask(mask: torch.Tensor, name: str, op: str, device: torch.device) -> None:
    tensor(mask, name, op)
    if mask.dtype != torch.bool:
        raise ValueError(f"fastformer {op}: {name} must be a bool tensor (True = masked), got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"fastformer {op}: {name} is on {mask.device} but the inputs are on {device}")


def dropout_p(p, op: str) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 <= float(p) < 1.0):
        raise ValueError(f"fastformer {op}: dropout_p must be a number in [0, 1), got {p!r}")
    return float(p)


def finite(x, name: str, op: str, positive: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
        raise ValueError(f"fastformer {op}: {name} must be a finite number, got {x!r}")
    if positive and float(x) < 0:
        raise ValueError(f"fastformer {op}: {name} must be >= 0, got {x!r}")
    return float(x)


def dropout_seed(p: float) -> torch.Tensor:
    """The call's dropout seed: one draw from torch's default generator when p > 0 (so
    torch.manual_seed makes dropout reproducible on every backend), else a constant."""
    if p > 0:
        return torch.randint(0, 2**62, (), dtype=torch.int64)
    return torch.zeros((), dtype=torch.int64)
