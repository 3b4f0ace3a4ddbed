"""Each rank's training batches, epoch after epoch, from a position a checkpoint can hold.

Epoch e's batches are ``token_batches(..., shuffle=True, seed=seed * 100_003 + e)`` (sentence pairs
sorted by length into batches of at most --max-tokens padded tokens, in a shuffled order), dealt
round-robin to the ranks (``Processes.shard``). A rank's position is (epoch, index into its share): with
the RNG states, all that a rank needs to continue exactly where it stopped. With ``fixed_shapes`` (CUDA
graphs) the batches come in the few shapes of fastformer/data/batching.py's length buckets; with ``packed``
(--batching packed) they are padding-free (collate_packed), each side's real tokens within --max-tokens, and
with both, padded to the one shape of the run (packed_shape: --max-tokens tokens per side). The batches take
the model's special ids (``special_ids``): a converted model's pad, decoder start and eos are its own.
"""
from __future__ import annotations

from typing import Callable

import torch

from fastformer.data import collate, collate_packed, token_batches
from fastformer.data.batching import PackedBatch, PackedShape, batch_shape, packed_shape


def special_ids(config) -> dict:
    """collate's and collate_packed's ids for a model of this TransformerConfig: its pad, its decoder start
    token as the targets' first input (bos; Marian's pad, M2M-100's eos) and its eos."""
    return {"pad_id": config.pad_id, "bos_id": config.start_id, "eos_id": config.eos_id}


class BatchStream:
    def __init__(self, src_ids: list[list[int]], tgt_ids: list[list[int]], max_tokens: int, seed: int,
                 shard: Callable[[list], list], epoch: int = 0, batch_in_epoch: int = 0, fixed_shapes: bool = False,
                 packed: bool = False, special_ids: dict | None = None):
        self.src_ids, self.tgt_ids, self.max_tokens, self.seed, self.shard = src_ids, tgt_ids, max_tokens, seed, shard
        self.fixed_shapes, self.packed = fixed_shapes, packed
        self.ids = special_ids or {}  # collate's pad_id, bos_id, eos_id (default: fastformer's tokenizer's)
        self._packed_shape: PackedShape | None = None
        self.seek(epoch, batch_in_epoch)

    def seek(self, epoch: int, batch_in_epoch: int = 0) -> None:
        """Continue from this position (a checkpoint's)."""
        self.epoch, self.batch_in_epoch = epoch, batch_in_epoch
        self._batches = self._epoch_batches(epoch)

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        every = token_batches(self.src_ids, self.tgt_ids, self.max_tokens, shuffle=True,
                              seed=self.seed * 100_003 + epoch, fixed_shapes=self.fixed_shapes, packed=self.packed)
        batches = self.shard(every)
        if not batches:
            raise SystemExit(f"the training data makes {len(every)} batches of --max-tokens {self.max_tokens}, "
                             "fewer than one per process; use fewer processes or a smaller --max-tokens")
        return batches

    def next(self) -> tuple[list[list[int]], list[list[int]]]:
        """The next batch's (source ids, target ids), moving on to the next epoch at the end of one."""
        if self.batch_in_epoch >= len(self._batches):
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            self._batches = self._epoch_batches(self.epoch)
        batch = self._batches[self.batch_in_epoch]
        self.batch_in_epoch += 1
        return [self.src_ids[i] for i in batch], [self.tgt_ids[i] for i in batch]

    def position(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def next_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | PackedBatch:
        """The next batch collated on the host: src (B, S), tgt_in and tgt_out (B, T), int64; with
        ``fixed_shapes`` padded to its bucket's shape; with ``packed`` a PackedBatch (with ``fixed_shapes``, of
        the run's one packed shape)."""
        src, tgt = self.next()
        if self.packed:
            if not self.fixed_shapes:
                return collate_packed(src, tgt, **self.ids)
            if self._packed_shape is None:  # of all the data, so every batch of every epoch and rank fits it
                self._packed_shape = packed_shape(self.src_ids, self.tgt_ids, self.max_tokens)
            return collate_packed(src, tgt, shape=self._packed_shape, **self.ids)
        shape = None
        if self.fixed_shapes:
            shape = batch_shape(max(len(s) for s in src + tgt) + 2, self.max_tokens)
        return collate(src, tgt, shape=shape, **self.ids)
