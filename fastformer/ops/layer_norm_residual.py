"""ops.layer_norm_residual: y = LayerNorm(residual + dropout(x)) over the last dim.

Ops ``fastformer::layer_norm_residual_fwd`` (returns y, s = residual + dropout(x), and the row mean and
rstd saved for backward) and ``layer_norm_residual_bwd`` (dx, dresidual, dweight, dbias from the
gradients of both y and s, so the pre-norm form works): C++ kernels in csrc/cpu/layer_norm_residual.cpp
and csrc/cuda/layer_norm_residual.cu, and ``_py`` twins (torch, triton, cuda_sim, implemented here);
autograd in C++ (csrc/autograd/layer_norm_residual.cpp), checks in C++ (csrc/ops.h).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastformer import _dispatch
from fastformer.ops import _registry
from fastformer.ops._registry import C, dropout_seed, out_like


def _fake_fwd(x, residual, weight, bias, eps, dropout_p, seed):
    _registry.same_device("layer_norm_residual", "x", x, residual=residual, weight=weight, bias=bias)
    C.check_seed(seed, dropout_p, x, "layer_norm_residual")  # a seed on "meta" beside CPU inputs lands here
    stat_dtype = torch.float64 if residual.dtype == torch.float64 else torch.float32
    stats = x.shape[:-1]
    return (out_like(residual), out_like(residual), x.new_empty(stats, dtype=stat_dtype),
            x.new_empty(stats, dtype=stat_dtype))


def _fake_bwd(dy, ds, s, weight, mean, rstd, dropout_p, seed, dx_dtype):
    C.check_seed(seed, dropout_p, s, "layer_norm_residual")
    dx = torch.empty_like(s, dtype=s.dtype if dx_dtype is None else dx_dtype, memory_format=torch.contiguous_format)
    return dx, out_like(s), out_like(weight), out_like(weight)


def _py_fwd(x, residual, weight, bias, eps, dropout_p, seed, backend):
    C.check_layer_norm_residual(x, residual, weight, bias, eps, dropout_p)
    C.check_seed(seed, dropout_p, x, "layer_norm_residual")
    impl = _dispatch.implementation("layer_norm_residual", "fwd", backend)
    return impl(x.contiguous(), residual.contiguous(), weight.contiguous(), bias.contiguous(), eps, dropout_p, seed)


def _py_bwd(dy, ds, s, weight, mean, rstd, dropout_p, seed, dx_dtype, backend):
    C.check_layer_norm_residual_bwd(dy, ds, s, weight, mean, rstd, dropout_p, dx_dtype)
    C.check_seed(seed, dropout_p, s, "layer_norm_residual")
    impl = _dispatch.implementation("layer_norm_residual", "bwd", backend)
    ds = None if ds is None else ds.contiguous()
    return impl(dy.contiguous(), ds, s.contiguous(), weight.contiguous(), mean.contiguous(), rstd.contiguous(),
                dropout_p, seed, s.dtype if dx_dtype is None else dx_dtype)


_registry.register("layer_norm_residual", fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, py_fwd=_py_fwd, py_bwd=_py_bwd)


def layer_norm_residual(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, *, eps: float = 1e-5,
                        dropout_p: float = 0.0, prenorm: bool = False, backend: Optional[str] = None):
    """y = LayerNorm(residual + dropout(x)) over the last dim, with weight and bias of shape (N,).

    prenorm=True returns (y, residual + dropout(x)), the pre-norm residual stream.
    """
    try:
        fwd = _dispatch.forward("layer_norm_residual", backend, x)
        y, s, _, _ = fwd(x, residual, weight, bias, eps, dropout_p, dropout_seed(dropout_p, "layer_norm_residual", x))
    except (TypeError, ValueError, RuntimeError):
        _registry.check_types("layer_norm_residual", locals())
        raise
    return (y, s) if prenorm else y
