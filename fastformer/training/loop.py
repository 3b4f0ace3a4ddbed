"""The training loop and the end of a run."""
from __future__ import annotations

import json
import os
import resource
import time

import torch

from fastformer import _dispatch
from fastformer import ops
from fastformer.cli import progress
from fastformer.runtime import provenance, resident_bytes, trim_freed_memory
from fastformer.training.evaluation import evaluate_dev, final_test, fine_tuning_gain
from fastformer.training.resume import save_checkpoint
from fastformer.training.run import Run
from fastformer.training.step import train_step


def _progress_bar(run: Run):
    """Progress against --max-steps when given, else against the --max-minutes training budget."""
    args, step = run.args, run.state["step"]
    if args.max_steps is not None:
        return progress(total=args.max_steps, initial=step, unit="upd", disable=not run.procs.main,
                        dynamic_ncols=True, desc="train")
    return progress(total=round(args.max_minutes, 2), initial=round(run.state["train_seconds"] / 60, 2), unit="min",
                    disable=not run.procs.main, dynamic_ncols=True, desc="train",
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} min "
                               "[{elapsed}<{remaining}{postfix}]")


def train(run: Run) -> None:
    """Updates until --max-steps, or until --max-minutes of training time (counted across resumes).
    A train record every --log-every updates and at the last one (tokens/s over whole updates: forward,
    backward, optimizer), dev evaluation every --eval-every, a checkpoint every --checkpoint-every updates
    and every --checkpoint-minutes. The main process decides when to stop and when to save."""
    args, procs, state = run.args, run.procs, run.state

    def out_of_budget() -> bool:
        return (args.max_steps is not None and state["step"] >= args.max_steps) or \
            state["train_seconds"] >= args.max_minutes * 60

    bar = _progress_bar(run)
    window_tokens, window_seconds, last_save = 0, 0.0, time.monotonic()
    run.model.train()
    stop = procs.main_decides(out_of_budget())[0]
    while not stop:
        start = time.monotonic()
        update = train_step(run)
        if args.malloc == "keep" and trim_freed_memory(int(args.max_rss_gib * 2**30)):
            run.malloc_trims += 1
        elapsed = time.monotonic() - start
        state["step"] += 1
        state["tokens"] += update["tokens"]
        state["train_seconds"] += elapsed
        window_tokens, window_seconds = window_tokens + update["tokens"], window_seconds + elapsed
        bar.update(1 if args.max_steps is not None else min(elapsed / 60, bar.total - bar.n))
        save_due = (args.checkpoint_every > 0 and state["step"] % args.checkpoint_every == 0) or \
            time.monotonic() - last_save >= args.checkpoint_minutes * 60
        stop, save = procs.main_decides(out_of_budget(), save_due)
        if state["step"] % args.log_every == 0 or stop:
            # The one read-back of the device: it waits for the queued steps, so its wait counts as training
            # time (on a GPU the steps only queue kernels, the host running ahead). The deferred value checks
            # of those steps (train_step's value_checks) are read right after it, at no further wait.
            waited = time.monotonic()
            loss_sum, nll_sum = procs.sum(*update["sums"].tolist())
            ops.check_deferred()
            waited = time.monotonic() - waited
            state["train_seconds"] += waited
            tok_s = window_tokens / max(window_seconds + waited, 1e-9)
            window_tokens, window_seconds = 0, 0.0
            record = {"kind": "train", "step": state["step"], "epoch": run.batches.epoch,
                      "loss": round(loss_sum / update["tokens"], 4),
                      "nll": round(nll_sum / update["tokens"], 4), "lr": update["lr"],
                      "tokens_per_s": round(tok_s, 1), "train_minutes": round(state["train_seconds"] / 60, 2),
                      "rss_gib": round(resident_bytes() / 2**30, 3)}  # resident memory now (the peak: summary)
            run.log.write(record)
            bar.set_postfix(upd=state["step"], loss=f"{record['loss']:.3f}", tok_s=f"{tok_s:.0f}",
                            lr=f"{update['lr']:.2e}", refresh=False)  # a refresh here would defeat mininterval
        if args.eval_every and state["step"] % args.eval_every == 0 and procs.main:
            ops.check_deferred()  # no evaluation of weights that a bad batch has touched
            evaluate_dev(run)
        if save and not stop:  # the last checkpoint is finish()'s
            ops.check_deferred()  # nor a checkpoint of them
            save_checkpoint(run)
            last_save = time.monotonic()
    bar.close()


def triton_plans_summary() -> str | None:
    """The triton backend's launch plans over this process's calls in one line (fastformer.triton.plans.summary:
    configurations recorded and refused with the reasons, replays, Python calls), or None when none was
    counted: the backend was not triton on CUDA tensors, or triton is not available here."""
    if not _dispatch.status("triton")[0]:
        return None
    from fastformer.triton import plans

    return plans.summary()


def finish(run: Run) -> dict:
    """The final checkpoint; then on the main process a last dev evaluation, loss.png and the test. The summary
    (logged, printed, returned) holds the triton plans' line when that backend ran on CUDA tensors: the
    calls of the whole run (training, dev evaluations, the test translation)."""
    args, procs, state = run.args, run.procs, run.state
    save_checkpoint(run)  # train() checked the last steps' deferred value checks when it logged its last update
    result = {"run_dir": run.run_dir, "steps": state["step"], "train_minutes": round(state["train_seconds"] / 60, 2),
              "tokens_per_s": round(state["tokens"] / max(state["train_seconds"], 1e-9), 1),
              "precision": str(run.amp_dtype or torch.float32).removeprefix("torch."),
              "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
              "malloc_trims": run.malloc_trims}
    if procs.main:
        if args.eval_every and run.last_dev_step != state["step"]:
            evaluate_dev(run)
        run.log.plot(os.path.join(run.run_dir, "loss.png"))
        if not args.no_test:
            result.update(final_test(run))
        result.update(fine_tuning_gain(run))  # --init: dev and test BLEU before the first update and now
        result["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # test included
        plans = triton_plans_summary()
        if plans is not None:
            result["triton_plans"] = plans
        run.log.write({"kind": "summary", "step": state["step"], **result, **provenance()})
        procs.say(json.dumps(result))
    return result
