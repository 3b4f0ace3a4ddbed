"""ops.layer_norm_residual: y = LayerNorm(residual + dropout(x)) over the last dim.

Custom ops ``fastformer::layer_norm_residual_fwd`` (returns y, s = residual + dropout(x), and the
row mean and rstd saved for backward) and ``fastformer::layer_norm_residual_bwd`` (dx, dresidual,
dweight, dbias, taking the gradient of both y and s so the pre-norm form works).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastformer import _dispatch
from fastformer.ops import _checks


@torch.library.custom_op("fastformer::layer_norm_residual_fwd", mutates_args=())
def layer_norm_residual_fwd(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float,
                            dropout_p: float, seed: Tensor, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    impl = _dispatch.implementation("layer_norm_residual", "fwd", backend)
    return impl(x, residual, weight, bias, eps, dropout_p, int(seed))


@layer_norm_residual_fwd.register_fake
def _(x, residual, weight, bias, eps, dropout_p, seed, backend):
    stat_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    stats = x.shape[:-1]
    return (torch.empty_like(x), torch.empty_like(x), x.new_empty(stats, dtype=stat_dtype),
            x.new_empty(stats, dtype=stat_dtype))


@torch.library.custom_op("fastformer::layer_norm_residual_bwd", mutates_args=())
def layer_norm_residual_bwd(dy: Tensor, ds: Optional[Tensor], s: Tensor, weight: Tensor, mean: Tensor,
                            rstd: Tensor, dropout_p: float, seed: Tensor,
                            backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    impl = _dispatch.implementation("layer_norm_residual", "bwd", backend)
    return impl(dy, ds, s, weight, mean, rstd, dropout_p, int(seed))


@layer_norm_residual_bwd.register_fake
def _(dy, ds, s, weight, mean, rstd, dropout_p, seed, backend):
    return torch.empty_like(s), torch.empty_like(s), torch.empty_like(weight), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    _, _, weight, _, _, dropout_p, seed, backend = inputs
    _, s, mean, rstd = output
    ctx.save_for_backward(s, weight, mean, rstd, seed)
    ctx.args = (dropout_p, backend)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros


def _backward(ctx, dy, ds, _dmean, _drstd):
    s, weight, mean, rstd, seed = ctx.saved_tensors
    dropout_p, backend = ctx.args
    dy = torch.zeros_like(s) if dy is None else dy.contiguous()
    ds = None if ds is None else ds.contiguous()
    dx, dresidual, dweight, dbias = layer_norm_residual_bwd(dy, ds, s, weight, mean, rstd, dropout_p, seed, backend)
    return dx, dresidual, dweight, dbias, None, None, None, None


layer_norm_residual_fwd.register_autograd(_backward, setup_context=_setup_context)


def layer_norm_residual(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, *, eps: float = 1e-5,
                        dropout_p: float = 0.0, prenorm: bool = False, backend: Optional[str] = None):
    """y = LayerNorm(residual + dropout(x)) over the last dim, with weight and bias of shape (N,).

    prenorm=True returns (y, residual + dropout(x)), the pre-norm residual stream.
    """
    op = "layer_norm_residual"
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        _checks.tensor(t, name, op)
    _checks.floating(x, "x", op)
    _checks.same_dtype_device(op, "x", x, residual=residual, weight=weight, bias=bias)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"fastformer layer_norm_residual: x must be (..., N) with N > 0, got {tuple(x.shape)}")
    if residual.shape != x.shape:
        raise ValueError(f"fastformer layer_norm_residual: residual {tuple(residual.shape)} must have x's shape "
                         f"{tuple(x.shape)}")
    N = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if tuple(t.shape) != (N,):
            raise ValueError(f"fastformer layer_norm_residual: {name} must have shape ({N},), got {tuple(t.shape)}")
    eps = _checks.finite(eps, "eps", op, positive=True)
    dropout_p = _checks.dropout_p(dropout_p, op)
    name = _dispatch.resolve(op, backend, x.device, x.dtype)
    seed = _checks.dropout_seed(dropout_p)
    y, s, _, _ = layer_norm_residual_fwd(x.contiguous(), residual.contiguous(), weight.contiguous(),
                                         bias.contiguous(), eps, dropout_p, seed, name)
    return (y, s) if prenorm else y
