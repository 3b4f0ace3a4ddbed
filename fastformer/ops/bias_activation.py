"""ops.bias_activation: y = dropout(act(x + bias)) over the last dim, fused; act = relu, gelu (exact) or silu.

The feed-forward's first projection runs as a product without bias, then this op adds the bias, applies the
activation (fastformer/nn/config.py ACTIVATIONS) and the activation dropout in one pass, writing x's dtype:
one read of x and one write of y, where the PyTorch code it replaces (x + bias, the activation, dropout)
writes and rereads two or three tensors, and its backward as many again.

Ops ``fastformer::bias_activation_fwd`` (returns y) and ``bias_activation_bwd`` (dx, dbias from dy and the
tensor forward saved: y for relu, x for gelu and silu): C++ kernels in csrc/cpu/bias_activation.cpp and
csrc/cuda/bias_activation.cu, and ``_py`` twins (torch, triton, cuda_sim, implemented here); autograd in C++
(csrc/autograd/bias_activation.cpp), checks in C++ (csrc/ops.h). The schemas take the activation's name
(``str activation``); the checks turn it into its code (csrc/activation.h: the index in ``ACTIVATIONS``),
which every backend's entry points take.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastformer import _dispatch
from fastformer.ops import _registry
from fastformer.ops._registry import C, dropout_seed, out_like

ACTIVATIONS: tuple[str, ...] = tuple(C.ACTIVATIONS)  # the names, indexed by code (csrc/ops.h kActivationNames)


def _fake_fwd(x, bias, activation, dropout_p, seed):
    _registry.same_device("bias_activation", "x", x, bias=bias)
    C.check_seed(seed, dropout_p, x, "bias_activation")  # a seed on "meta" beside CPU inputs lands here
    return out_like(x)


def _fake_bwd(dy, saved, bias, activation, dropout_p, seed):
    C.check_seed(seed, dropout_p, saved, "bias_activation")
    return out_like(saved), out_like(bias)


def _py_fwd(x, bias, activation, dropout_p, seed, backend):
    code = C.check_bias_activation(x, bias, activation, dropout_p)
    C.check_seed(seed, dropout_p, x, "bias_activation")
    impl = _dispatch.implementation("bias_activation", "fwd", backend)
    return impl(x.contiguous(), bias.contiguous(), code, dropout_p, seed)


def _py_bwd(dy, saved, bias, activation, dropout_p, seed, backend):
    code = C.check_bias_activation_bwd(dy, saved, bias, activation, dropout_p)
    C.check_seed(seed, dropout_p, saved, "bias_activation")
    impl = _dispatch.implementation("bias_activation", "bwd", backend)
    return impl(dy.contiguous(), saved.contiguous(), bias.contiguous(), code, dropout_p, seed)


_registry.register("bias_activation", fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, py_fwd=_py_fwd, py_bwd=_py_bwd)


def bias_activation(x: Tensor, bias: Tensor, *, activation: str = "relu", dropout_p: float = 0.0,
                    backend: Optional[str] = None) -> Tensor:
    """dropout(act(x + bias)) over the last dim of x (..., N), bias (N,), in x's dtype, computed in float32.

    activation: "relu", "gelu" (exact, erf) or "silu" (fastformer/nn/config.py ACTIVATIONS). bias may have any
    floating dtype (typically the float32 master bias beside a float16 or bfloat16 x); its gradient comes in
    its dtype, summed over the rows in float32 in a fixed order. With dropout_p > 0 the kept elements are
    scaled by 1/(1 - p); the mask is Philox's (csrc/philox.h) at the element's flat row-major index in x, the
    same on every backend for the same seed (torch.manual_seed on the CPU), regenerated in backward, never
    stored.
    """
    try:
        fwd = _dispatch.forward("bias_activation", backend, x)
        return fwd(x, bias, activation, dropout_p, dropout_seed(dropout_p, "bias_activation", x))
    except (TypeError, ValueError, RuntimeError):
        _registry.check_types("bias_activation", locals())
        raise
