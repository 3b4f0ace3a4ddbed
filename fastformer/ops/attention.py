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
    """An output of the kernels shaped like x (B, H, L, D) in their layout, one rule for every kernel backend
    and device (cpu, cuda, triton, cuda_sim: rows_like in csrc/cpu/attention.cpp, csrc/cuda/attention.cu and
    fastformer/triton/attention.py): always a view (B, H, L, D) of a contiguous (B, L, H, D) tensor, whatever
    the inputs' layout, as torch's CPU sdpa writes its output and gradients (the model's and transformers'
    projections then take out, dq, dk, dv without a copy). The torch backend (the reference) writes
    contiguous outputs."""
    return x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2)


def grads_like(q: Tensor, k: Tensor, v: Tensor, packed_grads: int) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """attention_bwd's gradients as the kernel backends write them (csrc/attention_grads.h, one rule): the views
    the kernels write (dq, dk, dv, each ``rows_like`` its input, or, by ``packed_grads``, decided by attention's
    autograd from the inputs (3 where q, k, v are the adjacent parts of one packed (B, L, 3, H, D) projection, 2
    where k, v are), the parts of one packed gradient), and the op's outputs: a packed gradient whole, in place
    of its parts, whose outputs are empty (an op's outputs may not share memory)."""
    def packed(x, n):
        return x.new_empty(x.shape[0], x.shape[2], n, x.shape[1], x.shape[3])

    def parts(p):
        return tuple(p.select(2, i).transpose(1, 2) for i in range(p.shape[2]))

    if packed_grads == 3:
        dqkv = packed(q, 3)
        return parts(dqkv), (dqkv, q.new_empty(0), q.new_empty(0))
    if packed_grads == 2:
        dq, dkv = rows_like(q), packed(k, 2)
        return (dq, *parts(dkv)), (dq, dkv, q.new_empty(0))
    grads = rows_like(q), rows_like(k), rows_like(v)
    return grads, grads


def packed_outputs(dq: Tensor, dk: Tensor, dv: Tensor, packed_grads: int) -> tuple[Tensor, Tensor, Tensor]:
    """attention_bwd's outputs from gradients in any layout (the torch reference's contiguous ones): a packed
    gradient stacked, as ``grads_like`` lays the outputs out."""
    if packed_grads == 3:
        return torch.stack([g.transpose(1, 2) for g in (dq, dk, dv)], dim=2), dq.new_empty(0), dq.new_empty(0)
    if packed_grads == 2:
        return dq, torch.stack([g.transpose(1, 2) for g in (dk, dv)], dim=2), dq.new_empty(0)
    return dq, dk, dv


def _layout(backend: str):
    """How a ``_py`` twin on ``backend`` passes the (B, H, L, D) tensors and lays out its outputs: the kernels
    read views in place (csrc/ops.h attention_layout copies only a tensor whose last dim is strided or whose
    rows overlap) and write rows_like; the torch reference takes contiguous copies and writes contiguous."""
    if backend == "torch":
        return Tensor.contiguous, out_like
    return C.attention_layout, rows_like


def _fake_fwd(q, k, v, key_padding_mask, causal, dropout_p, scale, seed, like=rows_like):
    _registry.same_device("attention", "q", q, k=k, v=v, key_padding_mask=key_padding_mask)
    C.check_seed(seed, dropout_p, q, "attention")  # a seed on "meta" beside CPU inputs lands here
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return like(q), q.new_empty(q.shape[:3], dtype=lse_dtype)


def _fake_bwd(dout, q, k, v, out, lse, key_padding_mask, causal, dropout_p, scale, seed, packed_grads,
              like=rows_like):
    C.check_seed(seed, dropout_p, q, "attention")
    if like is rows_like:
        return grads_like(q, k, v, packed_grads)[1]
    return packed_outputs(like(q), like(k), like(v), packed_grads)


def _py_fwd(q, k, v, key_padding_mask, causal, dropout_p, scale, seed, backend):
    scale = C.check_attention(q, k, v, key_padding_mask, dropout_p, scale)
    C.check_seed(seed, dropout_p, q, "attention")
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    impl = _dispatch.implementation("attention", "fwd", backend)
    rows, _ = _layout(backend)
    return impl(rows(q), rows(k), rows(v), mask, causal, dropout_p, scale, seed)


def _py_bwd(dout, q, k, v, out, lse, key_padding_mask, causal, dropout_p, scale, seed, packed_grads, backend):
    C.check_attention_bwd(dout, q, k, v, out, lse, key_padding_mask, dropout_p, packed_grads)
    scale = C.check_attention(q, k, v, key_padding_mask, dropout_p, scale)
    C.check_seed(seed, dropout_p, q, "attention")
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    impl = _dispatch.implementation("attention", "bwd", backend)
    rows, _ = _layout(backend)
    return impl(rows(dout), rows(q), rows(k), rows(v), rows(out), lse.contiguous(), mask, causal, dropout_p, scale,
                seed, packed_grads)


_registry.register("attention", fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, py_fwd=_py_fwd, py_bwd=_py_bwd,
                   fake_fwd_py=lambda *args: _fake_fwd(*args[:-1], like=_layout(args[-1])[1]),
                   fake_bwd_py=lambda *args: _fake_bwd(*args[:-1], like=_layout(args[-1])[1]))


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
