"""One update of the paper's recipe (Vaswani et al., 2017, section 5): the inverse-square-root learning
rate with linear warmup (or a fine-tuning schedule, --schedule), label-smoothed cross-entropy over the target
tokens, batches accumulated until --update-tokens target tokens (over all ranks), the gradient averaged per
target token, Adam.

The step never waits for the device: batches are collated, checked and counted on the host before they
move (pinned memory, non-blocking copies); the loss covers every target position, padding excluded by
``ignore_index`` (no boolean selection, whose size the host would have to read back); the loss sums stay
device tensors until the loop logs them; the gradient's scale and the learning rate reach a graph-captured
optimizer as device tensors; on a GPU the ops' value checks (cross_entropy's targets, attention_varlen's
tables) run deferred, on the device, and the loop reads their flags when it logs (``ops.check_deferred()``).
So on a GPU the host runs ahead of the kernels, and with --cuda-graphs (fastformer/training/graphs.py) the
micro-batch and the update replay as CUDA graphs, the checks captured with them.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from fastformer import ops
from fastformer.data.batching import PackedBatch
from fastformer.nn.linear import mark_compute_copies_current

if TYPE_CHECKING:
    from fastformer.training.run import Run


SCHEDULES = ("paper", "inverse-sqrt", "linear")  # --schedule


def learning_rate(step: int, d_model: int, warmup: int, factor: float) -> float:
    """The paper's schedule: factor * d^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1."""
    step = max(step, 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def fine_tuning_rate(step: int, peak: float, warmup: int, total: int | None = None) -> float:
    """The fine-tuning schedules, step counted from 1: a linear warmup to ``peak`` at update ``warmup``, then
    inverse-sqrt (``total`` None) peak * sqrt(warmup / step), fairseq's inverse_sqrt, which needs no run length;
    or linear, down to 0 at update total + 1: update ``total``, the last, gets peak / (total - warmup + 1)
    (transformers' get_linear_schedule_with_warmup, whose first update has a learning rate of 0, shifted by one)."""
    step = max(step, 1)
    if step <= warmup:
        return peak * step / warmup
    if total is None:
        return peak * (warmup / step) ** 0.5
    return peak * (total - step + 1) / (total - warmup + 1)


def scheduled_rate(args, step: int, d_model: int) -> float:
    """Update ``step``'s learning rate under --schedule (its flags resolved: fastformer.training.finetune)."""
    if args.schedule == "paper":
        return learning_rate(step, d_model, args.warmup, args.lr_factor)
    return fine_tuning_rate(step, args.lr, args.warmup, args.max_steps if args.schedule == "linear" else None)


def loss_sums(model, src, tgt_in, tgt_out, pad_id: int, label_smoothing: float,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Label-smoothed cross-entropy and plain NLL summed over the non-pad target tokens (0-dim float32
    tensors; the token count is the caller's, from its host copy of tgt_out).

    Every position goes through the output projection and one fused pass of ``ops.cross_entropy`` on
    ``backend`` (the model's), pad targets ignored (``ignore_index``: loss and gradient 0): smoothed = (1 - e)
    nll + e mean_c(-log p_c), as torch's cross_entropy(label_smoothing=e) defines it, without
    log-probabilities in memory (the logits stay in the autocast dtype; the kernels accumulate in float32).
    Projecting the pad positions too costs their share of the largest matmul (a few percent with
    length-sorted batches), and keeps the shapes, and so the step, free of host synchronization."""
    logits = model(src, tgt_in)  # (B, T, V)
    loss, nll = ops.cross_entropy(logits, tgt_out, label_smoothing=label_smoothing, ignore_index=pad_id,
                                  return_nll=True, backend=backend)
    return loss.sum(), nll.detach().sum()


def packed_loss_sums(model, batch: PackedBatch, pad_id: int, label_smoothing: float,
                     backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """loss_sums of a padding-free batch: logits of the packed targets (Tt, V), every one a real token except
    a fixed-shape batch's padding tail (pad targets, ignored)."""
    loss, nll = ops.cross_entropy(model(packed=batch), batch.tgt_out, label_smoothing=label_smoothing,
                                  ignore_index=pad_id, return_nll=True, backend=backend)
    return loss.sum(), nll.detach().sum()


def to_device(batch, device: torch.device):
    """Host tensors (a tuple of them, or a PackedBatch) on ``device``; to a GPU from pinned memory without
    blocking the host."""
    if isinstance(batch, PackedBatch):
        return batch.to(device) if device.type != "cuda" else batch.pin_memory().to(device, non_blocking=True)
    if device.type != "cuda":
        return tuple(t.to(device) for t in batch)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in batch)


def check_batch(run: Run, batch) -> int:
    """Checks a host batch's token ids (the model's own check would wait for the device) and returns its
    target tokens."""
    if isinstance(batch, PackedBatch):
        run.model.check_tokens(batch.src[None], batch.tgt_in[None])
        return int(batch.tgt_out.ne(run.config.pad_id).sum())
    run.model.check_tokens(*batch[:2])
    return int(batch[2].ne(run.config.pad_id).sum())


def micro_batch(run: Run, *batch, sync: bool) -> None:
    """Forward and backward of one batch (on the device: src, tgt_in, tgt_out, or one PackedBatch): the
    gradient accumulates into .grad and the loss sums into ``run.sums`` (loss, nll); DDP all-reduces at the
    backward only when ``sync``."""
    config = run.config
    with run.procs.gradient_sync(run.train_model, sync=sync), \
            torch.autocast(run.procs.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype is not None):
        if isinstance(batch[0], PackedBatch):
            loss, nll = packed_loss_sums(run.train_model, batch[0], config.pad_id, config.label_smoothing,
                                         backend=run.model.backend)
        else:
            loss, nll = loss_sums(run.train_model, *batch, config.pad_id, config.label_smoothing,
                                  backend=run.model.backend)
        run.scaler.scale(loss).backward()
    run.sums.add_(torch.stack([loss.detach(), nll]))


def optimizer_update(run: Run) -> None:
    """The gradient scaled by ``run.grad_scale`` (world / target tokens: the mean over every target token
    of the update, DDP having averaged over ranks), clipped to --clip-norm, and the optimizer's step."""
    grads = [p.grad for p in run.model.parameters() if p.grad is not None]
    run.scaler.unscale_(run.optimizer)
    torch._foreach_mul_(grads, run.grad_scale)
    if run.args.clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.args.clip_norm)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    # the optimizer wrote the compute-dtype copies in its pass and moved the parameters' version counters
    mark_compute_copies_current(run.compute_copies)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Each group's learning rate: in place where it is a device tensor (a captured optimizer reads it there)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def value_checks(run: Run):
    """The mode of the ops' value checks during a step: deferred on a GPU (fastformer/ops/deferred.py: no host
    synchronization; the loop calls ``ops.check_deferred()`` where it reads the device anyway), at the call
    elsewhere (free on the CPU). The batches' token ids are checked on the host before they move
    (check_batch), so a deferred check that fires is a bug of the trainer, not of the data."""
    return ops.deferred_checks() if run.procs.device.type == "cuda" else contextlib.nullcontext()


class EagerStep:
    """The step run op by op (fastformer.training.run.Step): each micro-batch moved to the device and trained
    (``micro_batch``), then ``optimizer_update``; the gradients dropped before an update's first micro-batch."""

    def __init__(self, run: Run):
        self.run = run

    def begin(self) -> None:
        self.run.optimizer.zero_grad(set_to_none=True)

    def micro_batch(self, batch, sync: bool = True) -> None:
        device_batch = to_device(batch, self.run.procs.device)
        micro_batch(self.run, *((device_batch,) if isinstance(batch, PackedBatch) else device_batch), sync=sync)

    def update(self) -> None:
        optimizer_update(self.run)


def train_step(run: Run) -> dict:
    """One optimizer update through ``run.step`` (eager, or replayed as CUDA graphs); returns its learning rate,
    its target tokens over all ranks (an int) and its loss sums (``sums``: a device tensor (loss, nll) of this
    rank, read only when the loop logs).

    Each rank takes batches from its stream until its share (1/N) of --update-tokens target tokens; only
    the last micro-batch's backward all-reduces (DDP averages over ranks), and the gradient is rescaled to
    the mean over every target token of the update."""
    with value_checks(run):
        args, procs, config = run.args, run.procs, run.config
        lr = scheduled_rate(args, run.state["step"] + 1, config.d_model)
        set_learning_rate(run.optimizer, lr)
        run.step.begin()
        run.sums.zero_()
        tokens = 0
        while True:
            batch = run.batches.next_tensors()
            n = check_batch(run, batch)  # on the host, before the batch moves
            last = tokens + n >= args.update_tokens / procs.world
            run.step.micro_batch(batch, sync=last)
            tokens += n
            if last:
                break
        tokens = int(procs.sum(tokens)[0]) if procs.world > 1 else tokens
        run.grad_scale.fill_(procs.world / tokens)
        run.step.update()
        return {"lr": lr, "tokens": tokens, "sums": run.sums}
