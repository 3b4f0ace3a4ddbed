"""What a checkpoint holds so that ``--resume`` continues a run bit-identically, for 1 or N processes.

Besides the weights, the optimizer and the (global) ``train_state`` (updates, target tokens, training
seconds), a checkpoint holds ``ranks``: for every process, in rank order, its batch position (epoch,
index into its shard) and its RNG states (torch's CPU generator, the CUDA generator of its device when it
trains on one, Python's ``random``: dropout and anything else drawn during training). They are gathered to
the main process, which writes the file atomically (fastformer.checkpoint.save).

Resumed under the same number of processes, each rank takes back its own position and RNG states, and
the run continues as if never stopped. Under another number, exact continuation is impossible (the
batches were dealt to another number of shards): every rank starts the epoch after the furthest one
reached, dealt to the new number of ranks, with RNG streams seeded from --seed, the update count and
the rank; the run says so.
"""
from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING

import torch

from fastformer import checkpoint as ckpt

if TYPE_CHECKING:
    from fastformer.training.run import Run


def rng_state(device: torch.device) -> dict:
    """This process's RNG states."""
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": list(internal), "python_version": version,
             "python_gauss": gauss}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(run: Run) -> None:
    """checkpoint_<step>.pt in the run folder (collective: every rank calls it), then the oldest pruned
    down to --keep."""
    procs = run.procs
    ranks = procs.gather({**run.batches.position(), "rng": rng_state(procs.device)})
    if not procs.main:
        return
    payload = ckpt.model_state(run.model, run.tokenizer, optimizer=run.optimizer.state_dict(), data=run.data_info,
                               args=vars(run.args), step=run.state["step"], train_state=dict(run.state), ranks=ranks,
                               world_size=procs.world)
    if run.scaler.is_enabled():
        payload["scaler"] = run.scaler.state_dict()
    ckpt.save(payload, os.path.join(run.run_dir, f"checkpoint_{run.state['step']}.pt"))
    ckpt.prune(run.run_dir, run.args.keep)


def restore(run: Run) -> None:
    """Continue ``run`` from its folder's latest checkpoint: weights, optimizer, loss scaler, train state,
    this rank's batch position and RNG states; the log is cut back to the checkpoint's update."""
    procs = run.procs
    found = ckpt.list_checkpoints(run.run_dir)
    if not found:
        raise SystemExit(f"--resume: {run.run_dir} holds no checkpoint")
    try:
        saved = ckpt.load(found[-1])
    except ckpt.CheckpointError as exc:
        raise SystemExit(f"--resume: {exc}") from exc
    init = (saved.get("args") or {}).get("init")
    if bool(init) != bool(run.args.init):  # the tokenizer is the --init checkpoint's, or the run folder's spm.model
        raise SystemExit(f"--resume: {found[-1]} fine-tunes {init}: resume with --init {init}" if init else
                         f"--resume: {found[-1]} was trained from scratch: resume without --init")
    if saved["config"] != run.config.to_dict():
        raise SystemExit(f"--resume: {found[-1]} was trained with another config; use another --out")
    # padded and packed batching cut the data into different batches: a batch position means nothing in the
    # other (checkpoints from before --batching were padded)
    batching = (saved.get("args") or {}).get("batching", "padded")
    if batching != run.args.batching:
        raise SystemExit(f"--resume: {found[-1]} was trained with --batching {batching}: resume with --batching "
                         f"{batching}")
    if "ranks" not in saved:
        raise SystemExit(f"--resume: {found[-1]} was written by an older fastformer without the per-process "
                         "training state; it translates and evaluates, but cannot be resumed")
    run.model.load_state_dict(saved["model"])
    run.optimizer.load_state_dict(saved["optimizer"])
    if "scaler" in saved:
        run.scaler.load_state_dict(saved["scaler"])
    run.state.update(saved["train_state"])
    ranks, step = saved["ranks"], run.state["step"]
    if len(ranks) == procs.world:
        mine = ranks[procs.rank]
        run.batches.seek(mine["epoch"], mine["batch_in_epoch"])
        set_rng_state(mine["rng"], procs.device)
        procs.say(f"resumed {found[-1]} at update {step}, epoch {ranks[0]['epoch']}")
    else:
        epoch = max(r["epoch"] for r in ranks) + 1
        run.batches.seek(epoch)
        seed = run.args.seed * 1_000_003 + step * 1_009 + procs.rank
        torch.manual_seed(seed)
        random.seed(seed)
        procs.say(f"resumed {found[-1]} at update {step}, written by {len(ranks)} process(es), with "
                  f"{procs.world}: not an exact continuation. The data continues at the start of epoch {epoch}, "
                  f"dealt to {procs.world} shard(s), and the RNG streams are seeded anew from --seed, the update "
                  "count and the rank")
    run.log.start(resumed_step=step)
