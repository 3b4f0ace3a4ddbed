"""ops.layer_norm_residual: y = LayerNorm(residual + dropout(x + x_bias)) over the last dim.

Ops ``fastformer::layer_norm_residual_fwd`` (returns y, s = residual + dropout(x + x_bias), the row mean and
rstd saved for backward, and y_c = y in the compute dtype, empty when not requested) and
``layer_norm_residual_bwd`` (dx, dresidual, dweight, dbias, dx_bias from the gradients of y, s and y_c, so
the pre-norm form and the compute-dtype output work): C++ kernels in csrc/cpu/layer_norm_residual.cpp and
csrc/cuda/layer_norm_residual.cu, and ``_py`` twins (torch, triton, cuda_sim, implemented here); autograd in
C++ (csrc/autograd/layer_norm_residual.cpp), checks in C++ (csrc/ops.h).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastformer import _dispatch
from fastformer.ops import _registry
from fastformer.ops._registry import C, dropout_seed, out_like


def _compute_out(residual, compute_dtype):
    """The fake y_c: residual's shape in compute_dtype, or empty (0,) when there is none to write."""
    if compute_dtype is None or compute_dtype == residual.dtype:
        return residual.new_empty(0)
    return torch.empty_like(residual, dtype=compute_dtype, memory_format=torch.contiguous_format)


def _fake_fwd(x, residual, weight, bias, eps, dropout_p, seed, x_bias, compute_dtype):
    _registry.same_device("layer_norm_residual", "x", x, residual=residual, weight=weight, bias=bias, x_bias=x_bias)
    C.check_seed(seed, dropout_p, x, "layer_norm_residual")  # a seed on "meta" beside CPU inputs lands here
    stat_dtype = torch.float64 if residual.dtype == torch.float64 else torch.float32
    stats = x.shape[:-1]
    return (out_like(residual), out_like(residual), x.new_empty(stats, dtype=stat_dtype),
            x.new_empty(stats, dtype=stat_dtype), _compute_out(residual, compute_dtype))


def _fake_bwd(dy, ds, s, weight, mean, rstd, dropout_p, seed, dx_dtype, dy_c, x_bias):
    C.check_seed(seed, dropout_p, s, "layer_norm_residual")
    dx = torch.empty_like(s, dtype=s.dtype if dx_dtype is None else dx_dtype, memory_format=torch.contiguous_format)
    dx_bias = weight.new_empty(0) if x_bias is None else out_like(x_bias)
    return dx, out_like(s), out_like(weight), out_like(weight), dx_bias


def _py_fwd(x, residual, weight, bias, eps, dropout_p, seed, x_bias, compute_dtype, backend):
    C.check_layer_norm_residual(x, residual, weight, bias, eps, dropout_p, x_bias, compute_dtype)
    C.check_seed(seed, dropout_p, x, "layer_norm_residual")
    impl = _dispatch.implementation("layer_norm_residual", "fwd", backend)
    x_bias = None if x_bias is None else x_bias.contiguous()
    return impl(x.contiguous(), residual.contiguous(), weight.contiguous(), bias.contiguous(), eps, dropout_p, seed,
                x_bias, residual.dtype if compute_dtype is None else compute_dtype)


def _py_bwd(dy, ds, s, weight, mean, rstd, dropout_p, seed, dx_dtype, dy_c, x_bias, backend):
    C.check_layer_norm_residual_bwd(dy, ds, s, weight, mean, rstd, dropout_p, dx_dtype, dy_c, x_bias)
    C.check_seed(seed, dropout_p, s, "layer_norm_residual")
    impl = _dispatch.implementation("layer_norm_residual", "bwd", backend)
    ds, dy_c, x_bias = (None if t is None else t.contiguous() for t in (ds, dy_c, x_bias))
    return impl(dy.contiguous(), ds, s.contiguous(), weight.contiguous(), mean.contiguous(), rstd.contiguous(),
                dropout_p, seed, s.dtype if dx_dtype is None else dx_dtype, dy_c, x_bias)


_registry.register("layer_norm_residual", fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, py_fwd=_py_fwd, py_bwd=_py_bwd)


def layer_norm_residual(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, *, eps: float = 1e-5,
                        dropout_p: float = 0.0, prenorm: bool = False, x_bias: Optional[Tensor] = None,
                        compute_dtype: Optional[torch.dtype] = None, backend: Optional[str] = None):
    """y = LayerNorm(s) over the last dim, s = residual + dropout(x + x_bias), weight and bias of shape (N,).

    x_bias (N,), optional, any floating dtype: the branch's bias (the bias of the projection that made x, run
    without it), added before dropout; its gradient is the sum over rows of dx, reduced in float32.
    prenorm=True returns (y, s), the pre-norm residual stream.
    compute_dtype (torch.float16, torch.bfloat16, or residual's dtype): the normalized output is also written
    in that dtype by the same kernel pass, for the next GEMM. Post-norm then returns (y, y_c), y in residual's
    dtype (the stream) and y_c = y.to(compute_dtype); pre-norm returns (y_c, s). With compute_dtype equal to
    residual's dtype y_c is y itself (no extra output). Gradients of both y and y_c are taken; they add.
    """
    try:
        fwd = _dispatch.forward("layer_norm_residual", backend, x)
        y, s, _, _, y_c = fwd(x, residual, weight, bias, eps, dropout_p,
                              dropout_seed(dropout_p, "layer_norm_residual", x), x_bias, compute_dtype)
    except (TypeError, ValueError, RuntimeError):
        _registry.check_types("layer_norm_residual", locals())
        raise
    if compute_dtype is None:
        return (y, s) if prenorm else y
    if compute_dtype == residual.dtype:
        y_c = y
    return (y_c, s) if prenorm else (y, y_c)
