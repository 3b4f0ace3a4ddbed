"""ops.attention: masked scaled dot-product attention with optional attention dropout.

    out = dropout(softmax(scale q k^T, masked)) v    per (batch, head)

The custom ops ``fastformer::attention_fwd`` (returns out and the row logsumexp) and
``fastformer::attention_bwd`` (recomputes probabilities from the logsumexp) call the backend the
dispatcher chose; autograd connects them, a fake implementation serves torch.compile.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from fastformer import _dispatch
from fastformer.ops import _checks


@torch.library.custom_op("fastformer::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], causal: bool,
                  dropout_p: float, scale: float, seed: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    impl = _dispatch.implementation("attention", "fwd", backend)
    return impl(q, k, v, key_padding_mask, causal, dropout_p, scale, int(seed))


@attention_fwd.register_fake
def _(q, k, v, key_padding_mask, causal, dropout_p, scale, seed, backend):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=lse_dtype)


@torch.library.custom_op("fastformer::attention_bwd", mutates_args=())
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  key_padding_mask: Optional[Tensor], causal: bool, dropout_p: float, scale: float,
                  seed: Tensor, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    impl = _dispatch.implementation("attention", "bwd", backend)
    return impl(dout, q, k, v, out, lse, key_padding_mask, causal, dropout_p, scale, int(seed))


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, key_padding_mask, causal, dropout_p, scale, seed, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, causal, dropout_p, scale, seed, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, seed)
    ctx.args = (causal, dropout_p, scale, backend)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, key_padding_mask, seed = ctx.saved_tensors
    causal, dropout_p, scale, backend = ctx.args
    dq, dk, dv = attention_bwd(dout.contiguous(), q, k, v, out, lse, key_padding_mask, causal, dropout_p,
                               scale, seed, backend)
    return dq, dk, dv, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor] = None,
              causal: bool = False, dropout_p: float = 0.0, scale: Optional[float] = None,
              backend: Optional[str] = None) -> Tensor:
    """Masked scaled dot-product attention.

    q (B, H, Lq, D); k, v (B, H, Lk, D); key_padding_mask (B, Lk) bool, True = padding (never attended).
    causal aligns bottom-right: query i sees key j iff j <= i + (Lk - Lq). scale defaults to 1/sqrt(D).
    dropout_p drops attention probabilities (kept ones scaled by 1/(1-p)); the mask comes from a seed
    drawn from torch's default generator. A query row with no visible key returns zeros (and zero
    grads). backend: "torch", "cpu", "cuda", "triton", "cuda_sim" or None (the default).
    """
    op = "attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.tensor(t, name, op)
        if t.dim() != 4:
            raise ValueError(f"fastformer attention: {name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
    _checks.floating(q, "q", op)
    _checks.same_dtype_device(op, "q", q, k=k, v=v)
    B, H, Lq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"fastformer attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != B or k.shape[1] != H or k.shape[3] != D:
        raise ValueError(f"fastformer attention: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in "
                         f"batch, heads and head dim")
    Lk = k.shape[2]
    if key_padding_mask is not None:
        _checks.bool_mask(key_padding_mask, "key_padding_mask", op, q.device)
        if tuple(key_padding_mask.shape) != (B, Lk):
            raise ValueError(f"fastformer attention: key_padding_mask must have shape (B, Lk) = {(B, Lk)}, "
                             f"got {tuple(key_padding_mask.shape)}")
        key_padding_mask = key_padding_mask.contiguous()
    dropout_p = _checks.dropout_p(dropout_p, op)
    scale = 1.0 / math.sqrt(D) if scale is None else _checks.finite(scale, "scale", op)
    name = _dispatch.resolve(op, backend, q.device, q.dtype)
    seed = _checks.dropout_seed(dropout_p)
    out, _ = attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), key_padding_mask, bool(causal),
                           dropout_p, scale, seed, name)
    return out
