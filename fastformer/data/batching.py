"""Batches by token count: sentence pairs sorted by length into buckets, cut so a batch's padded size
(sentences x longest sentence, source or target) stays within ``max_tokens``."""
from __future__ import annotations

import random

import torch

from fastformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


def token_batches(src: list[list[int]], tgt: list[list[int]], max_tokens: int, *, shuffle: bool,
                  seed: int = 0) -> list[list[int]]:
    """Lists of example indices. Sorting by length (ties broken randomly when shuffling) keeps padding
    low; the batch order is shuffled with ``seed`` when ``shuffle``."""
    rng = random.Random(seed)
    lengths = [max(len(s), len(t)) + 2 for s, t in zip(src, tgt)]  # + bos / eos
    order = sorted(range(len(src)), key=lambda i: (lengths[i], rng.random() if shuffle else i))
    batches, current, longest = [], [], 0
    for i in order:
        if lengths[i] > max_tokens:
            raise ValueError(f"example {i} has {lengths[i]} tokens, more than max_tokens={max_tokens}")
        if current and max(longest, lengths[i]) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, lengths[i])
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches


def collate(src: list[list[int]], tgt: list[list[int]] | None = None, *, pad_id: int = PAD_ID, bos_id: int = BOS_ID,
            eos_id: int = EOS_ID):
    """src (B, S) with eos, right-padded; with targets also tgt_in (B, T) = bos + y and tgt_out (B, T) =
    y + eos, right-padded with pad (the ids: fastformer's tokenizer's by default, a model config's
    pad_id, start_id and eos_id for a converted model)."""
    def pad(rows):
        out = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        return out

    src_t = pad([s + [eos_id] for s in src])
    if tgt is None:
        return src_t
    return src_t, pad([[bos_id] + t for t in tgt]), pad([t + [eos_id] for t in tgt])
