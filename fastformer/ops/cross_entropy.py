"""ops.cross_entropy: label-smoothed cross-entropy over the last dim, one loss per row, fused.

Ops ``fastformer::cross_entropy_fwd`` / ``cross_entropy_bwd`` (C++ kernels, csrc/cpu/cross_entropy.cpp and
csrc/cuda/cross_entropy.cu) and their ``_py`` twins (torch, triton, cuda_sim, implemented here); autograd
in C++ (csrc/autograd/cross_entropy.cpp), checks in C++ (csrc/ops.h). Forward reads the logits once and
keeps one logsumexp per row; backward reads them once more and writes the gradient: no log-probabilities
(R x V) in memory, where the PyTorch composition (float(), log_softmax, gather, mean) writes and rereads
several.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fastformer import _dispatch
from fastformer.ops import _registry
from fastformer.ops._registry import C


def _acc(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _fake_fwd(logits, target, label_smoothing, ignore_index):
    _registry.same_device("cross_entropy", "logits", logits, target=target)
    out = logits.new_empty(logits.shape[:-1], dtype=_acc(logits))
    return out, torch.empty_like(out), torch.empty_like(out)


def _fake_bwd(dloss, dnll, logits, target, lse, label_smoothing, ignore_index):
    return _registry.out_like(logits)


def _py_fwd(logits, target, label_smoothing, ignore_index, backend):
    C.check_cross_entropy(logits, target, label_smoothing, ignore_index)
    return _dispatch.implementation("cross_entropy", "fwd", backend)(logits.contiguous(), target.contiguous(),
                                                                      label_smoothing, ignore_index)


def _py_bwd(dloss, dnll, logits, target, lse, label_smoothing, ignore_index, backend):
    C.check_cross_entropy_bwd(dloss, dnll, logits, target, lse)
    return _dispatch.implementation("cross_entropy", "bwd", backend)(
        dloss.contiguous(), dnll.contiguous(), logits.contiguous(), target.contiguous(), lse.contiguous(),
        label_smoothing, ignore_index)


_registry.register("cross_entropy", fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, py_fwd=_py_fwd, py_bwd=_py_bwd)


def cross_entropy(logits: Tensor, target: Tensor, *, label_smoothing: float = 0.0, ignore_index: int = -100,
                  return_nll: bool = False, backend: str | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Per-row cross-entropy of ``logits`` (..., V) against int64 class indices ``target`` (...).

    loss = (1 - e) nll + e (lse - mean_c logits_c) with nll = lse - logits[target], lse = logsumexp over
    the V classes, e = ``label_smoothing`` in [0, 1]: torch's ``F.cross_entropy(..., reduction="none",
    label_smoothing=e)``. Rows whose target is ``ignore_index`` give 0 and no gradient; any other target
    must be in [0, V) (ValueError otherwise). The losses have target's shape, in float32 (float64 for
    float64 logits), whatever the logits' dtype; sum or average them as the task needs. ``return_nll=True``
    also returns the plain negative log-likelihood per row (the perplexity's numerator), from the same pass.
    """
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise ValueError(f"fastformer cross_entropy: label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"fastformer cross_entropy: ignore_index must be an int, got {ignore_index!r}")
    try:
        fwd = _dispatch.forward("cross_entropy", backend, logits)
        loss, nll, _ = fwd(logits, target, label_smoothing, ignore_index)
    except (TypeError, ValueError, RuntimeError):
        _registry.check_types("cross_entropy", locals())
        raise
    return (loss, nll) if return_nll else loss
