"""Batches by token count: sentence pairs sorted by length into buckets, cut so a batch's padded size
(sentences x longest sentence, source or target) stays within ``max_tokens``; packed batches (``packed``,
``collate_packed``: padding-free training) are cut so each side's real tokens stay within it.

With ``fixed_shapes`` (CUDA graph replay, fastformer/training/graphs.py) every batch has one of a small set of
shapes: a pair's length (the longer side, + bos/eos) is rounded up to a length bucket (``bucket_length``),
and a batch of bucket L holds at most ``max_tokens // L`` pairs and is padded to exactly that many rows
(all-pad rows are never attended to and carry no loss) and to L columns on both sides (``collate(shape=)``).
Packed batches with ``fixed_shapes`` have one shape for the whole run (``packed_shape``): each side's tokens
padded to --max-tokens, the padding tail cut into sentences of pad tokens that carry no loss, and the
sentence tables padded with empty sentences to a count no batch of the data can exceed.
"""
from __future__ import annotations

import random
from typing import NamedTuple

import torch

from fastformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


# Rounding step of the length buckets: lengths up to 64 go up to a multiple of 8, up to 128 to a multiple of
# 16, up to 256 of 32, beyond that of 64. On the default corpus (Bible de-en, 8,000 pieces, --max-tokens
# 4096): 11 shapes, and 1.20 target positions computed per real target token, against 1.056 for the
# length-sorted batches of variable shape (and 1.34 with buckets of 16 and 32: 6 shapes).
_BUCKET_STEPS = ((64, 8), (128, 16), (256, 32))
_LAST_STEP = 64


def bucket_length(n: int) -> int:
    """The length bucket of a pair whose longer side (with bos/eos) has n tokens: n rounded up."""
    step = next((s for limit, s in _BUCKET_STEPS if n <= limit), _LAST_STEP)
    return -(-n // step) * step


def batch_shape(n: int, max_tokens: int) -> tuple[int, int]:
    """(rows, columns) of a fixed-shape batch whose longest pair has n tokens (with bos/eos)."""
    length = bucket_length(n)
    return max(1, max_tokens // length), length


def token_batches(src: list[list[int]], tgt: list[list[int]], max_tokens: int, *, shuffle: bool,
                  seed: int = 0, fixed_shapes: bool = False, packed: bool = False) -> list[list[int]]:
    """Lists of example indices. Sorting by length (ties broken randomly when shuffling) keeps padding
    low; the batch order is shuffled with ``seed`` when ``shuffle``. ``fixed_shapes``: lengths are
    counted as their bucket's (``bucket_length``), so each batch fits ``batch_shape`` of its longest pair.
    ``packed``: a batch holds pairs while neither side's real tokens (with eos, or bos) exceed ``max_tokens``
    (no padding is computed, so none is counted)."""
    rng = random.Random(seed)
    lengths = [max(len(s), len(t)) + 2 for s, t in zip(src, tgt)]  # + bos / eos
    if fixed_shapes:
        lengths = [bucket_length(n) for n in lengths]
    order = sorted(range(len(src)), key=lambda i: (lengths[i], rng.random() if shuffle else i))
    batches, current, longest, sums = [], [], 0, [0, 0]
    for i in order:
        if lengths[i] > max_tokens:
            raise ValueError(f"example {i} has {lengths[i]} tokens, more than max_tokens={max_tokens}")
        sides = (len(src[i]) + 1, len(tgt[i]) + 1)
        full = (max(sums[0] + sides[0], sums[1] + sides[1]) > max_tokens if packed
                else max(longest, lengths[i]) * (len(current) + 1) > max_tokens)
        if current and full:
            batches.append(current)
            current, longest, sums = [], 0, [0, 0]
        current.append(i)
        longest = max(longest, lengths[i])
        sums = [sums[0] + sides[0], sums[1] + sides[1]]
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches


def collate(src: list[list[int]], tgt: list[list[int]] | None = None, *, pad_id: int = PAD_ID, bos_id: int = BOS_ID,
            eos_id: int = EOS_ID, shape: tuple[int, int] | None = None):
    """src (B, S) with eos, right-padded; with targets also tgt_in (B, T) = bos + y and tgt_out (B, T) =
    y + eos, right-padded with pad (the ids: fastformer's tokenizer's by default, a model config's
    pad_id, start_id and eos_id for a converted model). ``shape`` (rows, columns): every tensor padded to
    exactly that shape (rows beyond the batch are all pad), as fixed-shape batches are."""
    if shape is not None:
        longest = max(len(r) for r in src + (tgt or [])) + 1  # + eos (source, target out) or bos (target in)
        if len(src) > shape[0] or longest > shape[1]:
            raise ValueError(f"a batch of {len(src)} sentences of up to {longest} tokens does not fit the shape "
                             f"{shape}")

    def pad(rows):
        rows_out, columns = shape if shape is not None else (len(rows), max(len(r) for r in rows))
        out = torch.full((rows_out, columns), pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        return out

    src_t = pad([s + [eos_id] for s in src])
    if tgt is None:
        return src_t
    return src_t, pad([[bos_id] + t for t in tgt]), pad([t + [eos_id] for t in tgt])


class Sequences(NamedTuple):
    """Sequences packed along one dim (padding-free), as the model's packed path takes them: sequence b is
    tokens cu_seqlens[b] .. cu_seqlens[b + 1] (int32, B + 1); ``positions`` (int64, one per token) each token's
    position in its sequence; ``max_len`` the longest sequence."""
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    max_len: int

    def to(self, device: torch.device, non_blocking: bool = False) -> "Sequences":
        return Sequences(self.cu_seqlens.to(device, non_blocking=non_blocking),
                         self.positions.to(device, non_blocking=non_blocking), self.max_len)

    def pin_memory(self) -> "Sequences":
        return Sequences(self.cu_seqlens.pin_memory(), self.positions.pin_memory(), self.max_len)


class PackedBatch(NamedTuple):
    """A padding-free batch: src (Ts,) with each sentence's eos, tgt_in (Tt,) = bos + y and tgt_out (Tt,) = y + eos
    per sentence, all int64, sentence after sentence; ``src_seqs`` and ``tgt_seqs`` where each sentence is."""
    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    src_seqs: Sequences
    tgt_seqs: Sequences

    def to(self, device: torch.device, non_blocking: bool = False) -> "PackedBatch":
        return PackedBatch(*(t.to(device, non_blocking=non_blocking) for t in self))

    def pin_memory(self) -> "PackedBatch":
        return PackedBatch(*(t.pin_memory() for t in self))


def sequences(lengths: list[int]) -> Sequences:
    """Sequences of these lengths, packed in order."""
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    starts = torch.repeat_interleave(cu[:-1], torch.tensor(lengths, dtype=torch.int64))
    return Sequences(cu.to(torch.int32), torch.arange(int(cu[-1])) - starts, max(lengths, default=0))


class PackedShape(NamedTuple):
    """The one shape of a run's fixed-shape packed batches (CUDA graph replay): ``tokens`` per side,
    ``sentences`` entries in each sentence table (real sentences, padding sentences, empty ones), every
    sentence at most ``max_len`` tokens (the max_seqlen the attention kernels are launched for)."""
    tokens: int
    sentences: int
    max_len: int


def packed_shape(src: list[list[int]], tgt: list[list[int]], max_tokens: int) -> PackedShape:
    """The fixed shape that every packed batch of these pairs fits (token_batches(packed=True) with
    ``max_tokens``, whatever the shuffle): a batch's real tokens per side are at most ``max_tokens`` and each
    sentence has at least the shortest sentence's tokens (+ eos or bos), so a batch holds at most
    max_tokens // shortest sentences of a side; the padding tail of up to ``max_tokens`` tokens needs at most
    ceil(max_tokens / max_len) sentences of ``max_len``. The sentence count is rounded up to a multiple of 8."""
    if not src:
        raise ValueError("packed_shape needs at least one sentence pair")
    sides = ([len(s) + 1 for s in src], [len(t) + 1 for t in tgt])
    max_len = max(max(side) for side in sides)
    if max_len > max_tokens:
        raise ValueError(f"a sentence of {max_len} tokens is more than max_tokens={max_tokens}")
    real = min(max_tokens // min(side) for side in sides)
    sentences = real + -(-max_tokens // max_len)
    return PackedShape(max_tokens, -(-sentences // 8) * 8, max_len)


def collate_packed(src: list[list[int]], tgt: list[list[int]], *, bos_id: int = BOS_ID, eos_id: int = EOS_ID,
                   pad_id: int = PAD_ID, shape: PackedShape | None = None) -> PackedBatch:
    """The pairs as one PackedBatch: no padding anywhere (fastformer.nn.Transformer's packed path). With
    ``shape`` (fixed-shape batches, ``packed_shape``): each side padded to ``shape.tokens`` tokens of pad_id,
    the padding cut into sentences of at most ``shape.max_len`` (they attend only among themselves, and their
    targets are pad: ignored by the loss), the tables padded with empty sentences to ``shape.sentences``,
    ``max_len`` = ``shape.max_len``. The real sentences' rows are those of the batch without ``shape``."""
    src_rows = [s + [eos_id] for s in src]
    tgt_in = [[bos_id] + t for t in tgt]
    tgt_out = [t + [eos_id] for t in tgt]
    if shape is None:
        flat = lambda rows: torch.tensor([x for r in rows for x in r], dtype=torch.long)  # noqa: E731
        return PackedBatch(flat(src_rows), flat(tgt_in), flat(tgt_out), sequences([len(r) for r in src_rows]),
                           sequences([len(r) for r in tgt_in]))

    def side(*rows_of):
        lengths = [len(r) for r in rows_of[0]]
        tail = shape.tokens - sum(lengths)
        if tail < 0 or max(lengths, default=0) > shape.max_len:
            raise ValueError(f"a packed batch of {len(lengths)} sentences, {sum(lengths)} tokens, the longest "
                             f"{max(lengths, default=0)}, does not fit the shape {tuple(shape)}")
        lengths += [shape.max_len] * (tail // shape.max_len) + ([tail % shape.max_len] if tail % shape.max_len else [])
        if len(lengths) > shape.sentences:
            raise ValueError(f"a packed batch of {len(rows_of[0])} sentences and {tail} padding tokens needs "
                             f"{len(lengths)} sentences, more than the shape's {shape.sentences}")
        seqs = sequences(lengths + [0] * (shape.sentences - len(lengths)))
        padded = [torch.tensor([x for r in rows for x in r] + [pad_id] * tail, dtype=torch.long) for rows in rows_of]
        return padded, Sequences(seqs.cu_seqlens, seqs.positions, shape.max_len)

    (src_t,), src_seqs = side(src_rows)
    (tgt_in_t, tgt_out_t), tgt_seqs = side(tgt_in, tgt_out)
    return PackedBatch(src_t, tgt_in_t, tgt_out_t, src_seqs, tgt_seqs)
