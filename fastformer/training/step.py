"""One update of the paper's recipe (Vaswani et al., 2017, section 5): the inverse-square-root learning
rate with linear warmup, label-smoothed cross-entropy over the target tokens, batches accumulated until
--update-tokens target tokens (over all ranks), the gradient averaged per target token, Adam."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fastformer import ops
from fastformer.data import collate

if TYPE_CHECKING:
    from fastformer.training.setup import Run


def learning_rate(step: int, d_model: int, warmup: int, factor: float) -> float:
    """The paper's schedule: factor * d^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1."""
    step = max(step, 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def loss_sums(model, src, tgt_in, tgt_out, pad_id: int, label_smoothing: float,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Label-smoothed cross-entropy and plain NLL summed over the non-pad target tokens, and their count.

    Only non-pad positions go through the output projection (the largest matmul); both losses come from one
    fused pass over their logits, ``ops.cross_entropy`` on ``backend`` (the model's): smoothed = (1 - e) nll
    + e mean_c(-log p_c), as torch's cross_entropy(label_smoothing=e) defines it, without log-probabilities
    in memory (the logits stay in the autocast dtype; the kernels accumulate in float32)."""
    keep = tgt_out != pad_id
    logits = model(src, tgt_in, positions=keep)  # (n, V)
    loss, nll = ops.cross_entropy(logits, tgt_out[keep], label_smoothing=label_smoothing, return_nll=True,
                                  backend=backend)
    return loss.sum(), nll.detach().sum(), int(keep.sum())


def train_step(run: Run) -> dict:
    """One optimizer update; returns its learning rate, target tokens and loss sums over all ranks.

    Each rank takes batches from its stream until its share (1/N) of --update-tokens target tokens; only
    the last micro-batch's backward all-reduces (DDP averages over ranks), and the gradient is rescaled to
    the mean over every target token of the update."""
    args, procs, config = run.args, run.procs, run.config
    lr = learning_rate(run.state["step"] + 1, config.d_model, args.warmup, args.lr_factor)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    tokens = loss_sum = nll_sum = 0.0
    while True:
        src, tgt_in, tgt_out = (t.to(procs.device) for t in collate(*run.batches.next()))
        last = tokens + int((tgt_out != config.pad_id).sum()) >= args.update_tokens / procs.world
        with procs.gradient_sync(run.train_model, sync=last), \
                torch.autocast(procs.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype is not None):
            loss, nll, n = loss_sums(run.train_model, src, tgt_in, tgt_out, config.pad_id, config.label_smoothing,
                                     backend=run.model.backend)
            run.scaler.scale(loss).backward()
        tokens, loss_sum, nll_sum = tokens + n, loss_sum + float(loss.detach()), nll_sum + float(nll)
        if last:
            break
    tokens, loss_sum, nll_sum = procs.sum(tokens, loss_sum, nll_sum)
    run.scaler.unscale_(run.optimizer)
    for p in run.model.parameters():  # DDP averaged over ranks; make it the mean over all target tokens
        if p.grad is not None:
            p.grad.mul_(procs.world / tokens)
    if args.clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), args.clip_norm)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    return {"lr": lr, "tokens": int(tokens), "loss_sum": loss_sum, "nll_sum": nll_sum}
