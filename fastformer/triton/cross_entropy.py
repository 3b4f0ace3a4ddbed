"""Label-smoothed cross-entropy over the last dim in Triton, forward and backward.

One program per row of V logits (R rows, int64 targets, e = label smoothing). Forward: one loop over
BLOCK_V chunks keeps per-lane online (max m, sum l of e^(x - m)) and the sum of the logits; then
lse = m + log l, nll = lse - x[t], loss = (1 - e) nll + e (lse - sum x / V) (nll when e = 0), and
loss = nll = 0 where t == ignore_index. Bytes per row: V sizeof(T) read once, three float32 written.
Backward: dx = (dloss + dnll) e^(x - lse) - e dloss / V, minus (1 - e) dloss + dnll in the target's
column, zeros in ignored rows: V sizeof(T) read and written once.
A NaN or +inf logit makes the row's lse NaN (a per-lane flag, as the softmax kernel keeps); a row of only
-inf logits has lse = -inf. Targets out of [0, V) are refused by the caller (csrc/ops.h), but possibly only
after the kernels ran (a deferred check, or none during CUDA graph capture: csrc/value_checks.h), so the
forward reads no logit for one (its nll is NaN) and the backward gives it no one-hot column.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastformer.triton._common import check, online_softmax_step, online_softmax_total, row_blocks


@triton.jit
def _cross_entropy_fwd_kernel(
    logits_ptr,  # (R, V) input, contiguous
    target_ptr,  # (R,) int64 class indices (or ignore_index)
    loss_ptr,  # (R,) float32 label-smoothed loss, written
    nll_ptr,  # (R,) float32 negative log-likelihood, written
    lse_ptr,  # (R,) float32 row logsumexp, written
    V,  # classes per row
    smoothing,  # e in [0, 1]
    ignore_index,  # target value of a row without loss
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * V
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per-lane running max
    l = tl.zeros([BLOCK_V], tl.float32)  # per-lane running sum of e^(x - m)
    sx = tl.zeros([BLOCK_V], tl.float32)  # per-lane sum of the logits
    bad = tl.zeros([BLOCK_V], tl.int32)  # per-lane: saw a NaN or +inf
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < V
        x = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        sx += tl.where(inside, x, 0.0)
        m, l, bad = online_softmax_step(m, l, bad, x)  # NaN / +inf count as -inf; lse is set to NaN below
    row_max_safe, total = online_softmax_total(m, l)
    lse = tl.where(total > 0, row_max_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    lse = tl.where(tl.max(bad, 0) > 0, float("nan"), lse)
    t = tl.load(target_ptr + row)
    valid = (t >= 0) & (t < V)
    x_t = tl.load(x_row + tl.where(valid, t, 0)).to(tl.float32)
    nll = tl.where(valid, lse - x_t, float("nan"))
    smooth = lse - tl.sum(sx, 0) / V
    loss = tl.where(smoothing == 0.0, nll, (1.0 - smoothing) * nll + smoothing * smooth)  # no 0 * inf
    ignored = t == ignore_index
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss))
    tl.store(nll_ptr + row, tl.where(ignored, 0.0, nll))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(
    dloss_ptr,  # (R,) float32 gradient of loss
    dnll_ptr,  # (R,) float32 gradient of nll
    logits_ptr,  # (R, V) forward input
    target_ptr,  # (R,) int64
    lse_ptr,  # (R,) float32 forward logsumexp
    dlogits_ptr,  # (R, V) gradient of logits, written
    V,
    smoothing,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(target_ptr + row)
    dloss = tl.load(dloss_ptr + row)
    dnll = tl.load(dnll_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = dloss + dnll
    c = smoothing * dloss / V
    hot = (1.0 - smoothing) * dloss + dnll
    ignored = t == ignore_index
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < V
        x = tl.load(logits_ptr + row * V + cols, mask=inside, other=0.0).to(tl.float32)
        dx = g * tl.exp(x - lse) - c - tl.where(cols == t, hot, 0.0)
        dx = tl.where(ignored, 0.0, dx)
        tl.store(dlogits_ptr + row * V + cols, dx.to(dlogits_ptr.dtype.element_ty), mask=inside)


def cross_entropy_fwd(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float,
                      ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check("cross_entropy", logits)
    logits, target = logits.contiguous(), target.contiguous()
    V = logits.shape[-1]
    loss = torch.empty(target.shape, dtype=torch.float32, device=logits.device)
    nll, lse = torch.empty_like(loss), torch.empty_like(loss)
    R = target.numel()
    if R:
        cfg = row_blocks(V)
        _cross_entropy_fwd_kernel[(R,)](logits, target, loss, nll, lse, V, float(label_smoothing), ignore_index,
                                        BLOCK_V=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    return loss, nll, lse


def cross_entropy_bwd(dloss: torch.Tensor, dnll: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                      lse: torch.Tensor, label_smoothing: float, ignore_index: int) -> torch.Tensor:
    check("cross_entropy", logits)
    logits = logits.contiguous()
    dlogits = torch.empty_like(logits)
    R, V = target.numel(), logits.shape[-1]
    if R:
        cfg = row_blocks(V)
        _cross_entropy_bwd_kernel[(R,)](dloss.contiguous(), dnll.contiguous(), logits,
                                        target.contiguous(), lse.contiguous(), dlogits, V, float(label_smoothing),
                                        ignore_index, BLOCK_V=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    return dlogits
