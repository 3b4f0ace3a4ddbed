"""ops.softmax: softmax over the last dim of scale * x with masked positions set to -inf.

Custom ops ``fastformer::softmax_fwd`` / ``fastformer::softmax_bwd``; the mask reaches the backends
expanded to x's shape (a broadcast view, no copy). A fully masked row gives zeros.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastformer import _dispatch
from fastformer.ops import _checks


@torch.library.custom_op("fastformer::softmax_fwd", mutates_args=())
def softmax_fwd(x: Tensor, mask: Optional[Tensor], scale: float, backend: str) -> Tensor:
    return _dispatch.implementation("softmax", "fwd", backend)(x, mask, scale)


@softmax_fwd.register_fake
def _(x, mask, scale, backend):
    return torch.empty_like(x)


@torch.library.custom_op("fastformer::softmax_bwd", mutates_args=())
def softmax_bwd(dy: Tensor, y: Tensor, scale: float, backend: str) -> Tensor:
    return _dispatch.implementation("softmax", "bwd", backend)(dy, y, scale)


@softmax_bwd.register_fake
def _(dy, y, scale, backend):
    return torch.empty_like(y)


def _setup_context(ctx, inputs, output):
    _, _, scale, backend = inputs
    ctx.save_for_backward(output)
    ctx.args = (scale, backend)


def _backward(ctx, dy):
    (y,) = ctx.saved_tensors
    scale, backend = ctx.args
    return softmax_bwd(dy.contiguous(), y, scale, backend), None, None, None


softmax_fwd.register_autograd(_backward, setup_context=_setup_context)


def softmax(x: Tensor, *, mask: Optional[Tensor] = None, scale: float = 1.0, backend: Optional[str] = None) -> Tensor:
    """softmax(scale * x, with mask == True positions set to -inf) over the last dim.

    mask is bool and broadcastable to x. A fully masked row returns zeros.
    """
    op = "softmax"
    _checks.tensor(x, "x", op)
    _checks.floating(x, "x", op)
    if x.dim() < 1:
        raise ValueError("fastformer softmax: x must have at least one dimension")
    if mask is not None:
        _checks.bool_mask(mask, "mask", op, x.device)
        try:
            shape = torch.broadcast_shapes(mask.shape, x.shape)
        except RuntimeError:
            shape = None
        if shape != x.shape:
            raise ValueError(f"fastformer softmax: mask of shape {tuple(mask.shape)} does not broadcast to x's "
                             f"shape {tuple(x.shape)}")
        mask = mask.expand(x.shape)
    scale = _checks.finite(scale, "scale", op)
    name = _dispatch.resolve(op, backend, x.device, x.dtype)
    return softmax_fwd(x.contiguous(), mask, scale, name)
