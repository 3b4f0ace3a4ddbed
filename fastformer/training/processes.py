"""One training process, or N under ``torchrun --nproc_per_node=N``: every collective operation of the
trainer is a method of ``Processes``, so the rest of the trainer reads as single-process code.

Under torchrun each rank trains on its own shard of every epoch's batches (gloo on CPU, nccl on GPUs);
DistributedDataParallel averages the gradients at the last micro-batch of each update. Decisions that must
agree across ranks (stop, checkpoint now) are the main process's, broadcast to the others.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm


@dataclass
class Processes:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        """True in the process that writes files and prints (rank 0)."""
        return self.rank == 0

    @classmethod
    def start(cls, device_arg: str | None) -> "Processes":
        """This process's rank and device (from torchrun's RANK/WORLD_SIZE/LOCAL_RANK when set); joins the
        process group when there are several."""
        env = os.environ
        procs = cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))) \
            if "RANK" in env and "WORLD_SIZE" in env else cls()
        if device_arg is None:
            procs.device = torch.device(f"cuda:{procs.local_rank}" if torch.cuda.is_available() else "cpu")
        else:
            procs.device = torch.device(device_arg)
            if procs.device.type == "cuda" and not torch.cuda.is_available():
                raise SystemExit("--device cuda was asked for but no CUDA device is visible")
        if procs.world > 1:
            if procs.device.type == "cuda":
                torch.cuda.set_device(procs.device)
            dist.init_process_group("nccl" if procs.device.type == "cuda" else "gloo")
        return procs

    def say(self, message: str) -> None:
        """Print once (main process), without breaking a progress bar."""
        if self.main:
            tqdm.write(message)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum(self, *values: float) -> list[float]:
        """Each value summed over all ranks (float64); a single process's own values, not via the device."""
        if self.world == 1:
            return [float(v) for v in values]
        totals = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return totals.tolist()

    def main_decides(self, *flags: bool) -> list[bool]:
        """The main process's flags, on every rank (a rank's own clock or budget must not decide alone); a
        single process's own, without a round trip through the device (the host must not wait for it)."""
        if self.world == 1:
            return [bool(f) for f in flags]
        values = torch.tensor([float(f) for f in flags], device=self.device)
        dist.broadcast(values, 0)
        return [bool(v) for v in values.tolist()]

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def shard(self, batches: list) -> list:
        """This rank's share of one epoch's batches: dealt round-robin; the last round, if incomplete, is
        dropped so that every rank takes the same number of batches."""
        per_rank = len(batches) // self.world
        return batches[self.rank: per_rank * self.world: self.world]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module that training calls: DistributedDataParallel around ``model`` with several processes."""
        if self.world == 1:
            return model
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def gradient_sync(self, train_model: torch.nn.Module, sync: bool):
        """Context of one micro-batch's backward: DDP's all-reduce runs only when ``sync``."""
        if self.world > 1 and not sync:
            return train_model.no_sync()
        return contextlib.nullcontext()

    def close(self) -> None:
        """Wait for every rank, then leave the process group."""
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()
