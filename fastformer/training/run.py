"""A training run as the loop sees it: ``Run``, everything fastformer/training/setup.py builds from the
command line (the corpus, the tokenizer, the model, the optimizer, the batches, the log, the training state),
and ``Step``, how one update trains: the eager step (fastformer/training/step.py ``EagerStep``) or the step
replayed as CUDA graphs (fastformer/training/graphs.py ``CudaGraphs``, --cuda-graphs), chosen once in setup, so
that ``train_step`` is one loop for both.

This module imports nothing from fastformer.training at run time (the types it names are for type checkers
only), so each part of the trainer can import it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol

import torch

if TYPE_CHECKING:
    from fastformer.data import Tokenizer
    from fastformer.data.corpus import ParallelCorpus
    from fastformer.nn import Transformer, TransformerConfig
    from fastformer.training.batches import BatchStream
    from fastformer.training.processes import Processes
    from fastformer.training.runlog import RunLog


class Step(Protocol):
    """How one update trains, micro-batch by micro-batch; ``train_step`` (fastformer/training/step.py) sets the
    learning rate, zeroes ``run.sums``, counts the tokens and sets ``run.grad_scale`` around these calls."""

    def begin(self) -> None:
        """Before an update's first micro-batch (the eager step drops the last update's gradients)."""

    def micro_batch(self, batch, sync: bool = True) -> None:
        """Forward and backward of one host batch ((src, tgt_in, tgt_out) or a PackedBatch, checked): the
        gradient accumulates, the loss sums go into ``run.sums``; ``sync``: the update's last micro-batch
        (DistributedDataParallel all-reduces its backward)."""

    def update(self) -> None:
        """The optimizer's update of the accumulated gradient (``run.grad_scale`` and the learning rate set)."""


@dataclass
class Run:
    args: argparse.Namespace
    procs: Processes
    run_dir: str
    corpus: ParallelCorpus
    data_info: dict             # how the corpus was chosen (stored in checkpoints, for evaluate)
    data_name: str
    tokenizer: Tokenizer
    ids: dict                   # split -> (source ids, target ids)
    config: TransformerConfig
    model: Transformer
    train_model: torch.nn.Module  # model, or DDP around it
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    amp_dtype: Optional[torch.dtype]
    batches: BatchStream
    log: RunLog
    sums: torch.Tensor          # (loss, nll) summed over the current update's micro-batches, on the device
    grad_scale: torch.Tensor    # world / target tokens of the current update, on the device
    step: Optional[Step] = None  # EagerStep or CudaGraphs (--cuda-graphs), set by setup once the model is wrapped
    # parameter -> its copy in the autocast dtype (fastformer/nn/linear.py set_compute_dtype), written by the
    # optimizer's step; empty in float32 and under --compile (which traces plain autocast)
    compute_copies: dict = field(default_factory=dict)
    state: dict = field(default_factory=lambda: {"step": 0, "tokens": 0, "train_seconds": 0.0})
    last_dev_step: int = -1
    malloc_trims: int = 0  # updates after which --max-rss-gib handed free heap pages back (this process)
