"""ops.attention: masked scaled dot-product attention with optional attention dropout.

    out = dropout(softmax(scale q k^T, masked)) v    per (batch, head)

Ops ``fastformer::attention_fwd`` (returns out and the row logsumexp) and ``attention_bwd`` (recomputes
the probabilities from the logsumexp), C++ kernels in csrc/cpu/attention.cpp and csrc/cuda/attention.cu,
and their ``_py`` twins (torch, triton, cuda_sim, implemented here); autograd in C++
(csrc/autograd/attention.cpp), checks in C++ (csrc/ops.h); fake kernels here serve torch.compile.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastformer import _dispatch
from fastformer.ops import _registry
from fastformer.ops._registry import C, dropout_seed, out_like


def rows_like(x: Tensor) -> Tensor:
    """An output of the C++ kernels shaped like x (B, H, L, D) in their layout (csrc/cpu/attention.cpp
    rows_like, the same rule): on the CPU, always a view (B, H, L, D) of a contiguous (B, L, H, D) tensor, as
    torch's CPU sdpa writes its output and gradients (transformers' projections then take out, dq, dk, dv
    without a copy); the CUDA kernels, and the Python backends, write contiguous outputs."""
    if x.device.type == "cpu":
        return x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2)
    return out_like(x)


def _fake_fwd(q, k, v, key_padding_mask, causal, dropout_p, scale, seed, like=rows_like):
    _registry.same_device("attention", "q", q, k=k, v=v, key_padding_mask=key_padding_mask)
    C.check_seed(seed, dropout_p, q, "attention")  # a seed on "meta" beside CPU inputs lands here
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return like(q), q.new_empty(q.shape[:3], dtype=lse_dtype)


def _fake_bwd(dout, q, k, v, out, lse, key_padding_mask, causal, dropout_p, scale, seed, like=rows_like):
    C.check_seed(seed, dropout_p, q, "attention")
    return like(q), like(k), like(v)


def _py_fwd(q, k, v, key_padding_mask, causal, dropout_p, scale, seed, backend):
    scale = C.check_attention(q, k, v, key_padding_mask, dropout_p, scale)
    C.check_seed(seed, dropout_p, q, "attention")
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    impl = _dispatch.implementation("attention", "fwd", backend)
    return impl(q.contiguous(), k.contiguous(), v.contiguous(), mask, causal, dropout_p, scale, seed)


def _py_bwd(dout, q, k, v, out, lse, key_padding_mask, causal, dropout_p, scale, seed, backend):
    C.check_attention_bwd(dout, q, k, v, out, lse, key_padding_mask, dropout_p)
    scale = C.check_attention(q, k, v, key_padding_mask, dropout_p, scale)
    C.check_seed(seed, dropout_p, q, "attention")
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    impl = _dispatch.implementation("attention", "bwd", backend)
    return impl(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
                mask, causal, dropout_p, scale, seed)


_registry.register("attention", fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, py_fwd=_py_fwd, py_bwd=_py_bwd,
                   fake_fwd_py=lambda *args: _fake_fwd(*args, like=out_like),
                   fake_bwd_py=lambda *args: _fake_bwd(*args, like=out_like))


def attention(q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor] = None,
              causal: bool = False, dropout_p: float = 0.0, scale: Optional[float] = None,
              backend: Optional[str] = None) -> Tensor:
    """Masked scaled dot-product attention.

    q (B, H, Lq, D); k, v (B, H, Lk, D); key_padding_mask (B, Lk) bool, True = padding (never attended).
    causal aligns bottom-right: query i sees key j iff j <= i + (Lk - Lq). scale defaults to 1/sqrt(D).
    dropout_p drops attention probabilities (kept ones scaled by 1/(1-p)); the mask comes from a seed
    drawn by torch's generator of the inputs' device (the default generator on the CPU, the CUDA generator
    on a GPU: graph-safe, see _registry.dropout_seed). A query row with no visible key returns zeros (and zero
    grads). backend: "torch", "cpu", "cuda", "triton", "cuda_sim" or None (the default).
    """
    try:
        fwd = _dispatch.forward("attention", backend, q)
        seed = dropout_seed(dropout_p, "attention", q)
        return fwd(q, k, v, key_padding_mask, bool(causal), dropout_p, scale, seed)[0]
    except (TypeError, ValueError, RuntimeError):
        _registry.check_types("attention", locals())
        raise
