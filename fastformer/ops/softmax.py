"""ops.softmax: softmax over the last dim of scale * x with masked positions set to -inf.

Ops ``fastformer::softmax_fwd`` / ``softmax_bwd`` (C++ kernels, csrc/cpu/softmax.cpp and
csrc/cuda/softmax.cu) and their ``_py`` twins (torch, triton, cuda_sim, implemented here); autograd in C++
(csrc/autograd/softmax.cpp), checks in C++ (csrc/ops.h). The mask is bool and broadcastable to x; the
kernels read it through a broadcast view (no copy). A fully masked row gives zeros.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastformer import _dispatch
from fastformer.ops import _registry
from fastformer.ops._registry import C, out_like


def _fake_fwd(x, mask, scale):
    _registry.same_device("softmax", "x", x, mask=mask)
    return out_like(x)


def _fake_bwd(dy, y, scale):
    return out_like(y)


def _py_fwd(x, mask, scale, backend):
    C.check_softmax(x, mask, scale)
    mask = None if mask is None else mask.expand(x.shape)
    return _dispatch.implementation("softmax", "fwd", backend)(x.contiguous(), mask, scale)


def _py_bwd(dy, y, scale, backend):
    C.check_softmax_bwd(dy, y)
    return _dispatch.implementation("softmax", "bwd", backend)(dy.contiguous(), y.contiguous(), scale)


_registry.register("softmax", fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, py_fwd=_py_fwd, py_bwd=_py_bwd)


def softmax(x: Tensor, *, mask: Optional[Tensor] = None, scale: float = 1.0, backend: Optional[str] = None) -> Tensor:
    """softmax(scale * x, with mask == True positions set to -inf) over the last dim.

    mask is bool and broadcastable to x. A fully masked row returns zeros.
    """
    try:
        return _dispatch.forward("softmax", backend, x)(x, mask, scale)
    except (TypeError, ValueError, RuntimeError):
        _registry.check_types("softmax", locals())
        raise
