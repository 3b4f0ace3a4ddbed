"""ops.attention_varlen over the peers' test matrix (tests/matrix.py says how it is run and judged).

The families come from FlashAttention's test of its varlen entry point: B sequences whose query and key
lengths are drawn by its generate_random_padding_mask modes up to the pair (seqlen_q, seqlen_k) ("random":
[max(1, L - 20), L], "third": [L // 3, L]), packed along the first dim with int32 cu_seqlens, multi-head,
multi-query and grouped-query heads, bottom-right causal per sequence, dropout 0.17. Batches are cut to 2-3
sequences and heads to 2-6 (FlashAttention runs 4-8 x 6-9 on GPUs) so that the matrix fits a 2-core CI run;
lengths and head dims are its own. Adversarial families of ours pack what a padded batch never holds: empty
sequences (first, last, next to each other, none with queries at all), a sequence with queries but no keys
(its rows are zeros), keys without queries, one-token sequences, a batch of length-one sequences.

PyTorch eager is the computation sequence by sequence in the inputs' dtype (matmul, masked_fill, softmax,
dropout by the shared rule's mask, matmul; K and V repeated per group); the reference is the torch backend's
attention_varlen in float64 with the same dropout seed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from fastformer import ops
from fastformer.ops import reference
from helpers import forward_backward, randn, upcast
from matrix import DEVICE, check, matrix_params, on_cpu, on_device


@dataclass(frozen=True)
class Case:
    family: str
    B: int  # sequences
    H: int
    H_kv: int
    Lq: int  # the longest query / key length a drawn sequence may have (flash's seqlen_q, seqlen_k)
    Lk: int
    D: int
    causal: bool = False
    mode: str = "random"  # how lengths are drawn: "random", "third" (FlashAttention's modes), or "fixed"
    lens_q: tuple | None = None  # mode "fixed": the lengths themselves
    lens_k: tuple | None = None
    scale: float | None = None
    dropout: float = 0.0
    dtypes: tuple | None = None  # None: every dtype of the backend

    @property
    def work(self):
        """Multiply-adds of one head dim's scores over the sequences (an upper bound for drawn lengths)."""
        if self.mode == "fixed":
            return self.H * sum(lq * lk for lq, lk in zip(self.lens_q, self.lens_k)) * max(self.D, 1)
        return self.B * self.H * self.Lq * self.Lk * max(self.D, 1)

    @property
    def softmax_scale(self):
        return 1.0 / math.sqrt(self.D) if self.scale is None else self.scale

    def __str__(self):
        if self.mode == "fixed":
            s = f"{self.family}-q{'-'.join(map(str, self.lens_q))}k{'-'.join(map(str, self.lens_k))}"
        else:
            s = f"{self.family}-B{self.B}q{self.Lq}k{self.Lk}-{self.mode}"
        s += f"-H{self.H}kv{self.H_kv}d{self.D}"
        s += "-causal" if self.causal else ""
        s += f"-scale{self.scale}" if self.scale is not None else ""
        s += f"-drop{self.dropout}" if self.dropout else ""
        return s


def fixed(family, lens_q, lens_k, H=2, H_kv=2, D=32, causal=False, **kw):
    return Case(family, len(lens_q), H, H_kv, max(lens_q), max(lens_k), D, causal, "fixed", tuple(lens_q),
                tuple(lens_k), **kw)


# FA: Dao-AILab/flash-attention tests/test_flash_attn.py::test_flash_attn_varlen_output (the file
# tests/ops/test_attention_matrix.py cites): its (seqlen_q, seqlen_k) pairs incl. (1, 147), (113, 203), (128, 217),
# (108, 256), (256, 512); d from [32, 59, 64, 80, 96, 111, 128, ...]; causal; mha_type "mha", "mqa", "gqa" (one or a
# few key/value heads; 6 query heads over 1 or 2 in hopper/test_flash_attn.py's version); dropout_p [0.0, 0.17];
# query and key lengths drawn by generate_random_padding_mask ("random", and its "third" mode).
PAIRS = ((1, 147), (113, 203), (128, 217), (108, 256), (256, 512))
CASES = [
    # its seqlen pairs, both modes, both causal settings (d 59: an odd head dim, no vector width divides it)
    *[Case("flash_varlen_len", 3 if lq * lk < 2**16 else 2, 2, 2, lq, lk, 59, causal, mode)
      for lq, lk in PAIRS for causal, mode in ((False, "random"), (True, "third"))],
    Case("flash_varlen_len", 2, 2, 2, 17, 33, 59, True, "third"),  # within the slow backends' budget
    # its head dims at (113, 203)
    *[Case("flash_varlen_d", 2, 2, 2, 113, 203, d, causal, "third" if causal else "random")
      for d in (32, 59, 80, 128) for causal in (False, True)],
    *[Case("flash_varlen_d", 2, 2, 2, 17, 33, d, True, "random") for d in (80, 128)],
    # mha / mqa / gqa: 6 query heads over 6, 1 or 2 key/value heads
    Case("flash_varlen_heads", 2, 6, 6, 128, 217, 32, True, "random"),
    Case("flash_varlen_heads", 2, 6, 1, 113, 203, 80, False, "third"),
    Case("flash_varlen_heads", 3, 6, 2, 108, 256, 59, True, "random"),
    Case("flash_varlen_heads", 2, 4, 1, 17, 17, 32, True, "random"),
    Case("flash_varlen_heads", 2, 4, 2, 9, 33, 40, False, "third"),
    # dropout 0.17 (the reference and eager drop by the same rule: reference.dropout_keep_at)
    Case("flash_varlen_dropout", 2, 2, 2, 113, 203, 32, False, "random", dropout=0.17),
    Case("flash_varlen_dropout", 3, 6, 2, 108, 256, 80, True, "third", dropout=0.17),
    Case("flash_varlen_dropout", 2, 2, 1, 17, 33, 40, True, "random", dropout=0.17),
    # Adversarial (ours): empty sequences first, last, side by side, and every query sequence empty
    fixed("empty_sequences", (0, 37, 0, 0, 21, 0), (0, 40, 0, 5, 21, 0), causal=True),
    fixed("empty_sequences", (19, 0, 0, 30), (0, 0, 12, 30), H=4, H_kv=2, D=59),  # keys and queries apart
    fixed("empty_sequences", (0, 0, 0), (7, 0, 9), D=16),  # no query at all: empty out, zero dk and dv
    # a one-token sequence among long ones, and a single one-token sequence
    fixed("single_token", (1, 61, 1), (1, 70, 45), causal=True, D=64),
    fixed("single_token", (40, 1, 33), (40, 1, 1), H=2, H_kv=1, D=80),
    fixed("single_token", (1,), (1,), D=128),
    # every sequence of length one (a decoding step of a batch, packed)
    *[fixed("length_one", (1,) * 12, (1,) * 12, H=4, H_kv=1, D=64, causal=c) for c in (False, True)],
    fixed("length_one", (1,) * 5, (17, 1, 33, 2, 9), D=40, causal=True),  # one query against caches
    # a sequence with queries but no keys (zeros), and causal Lq > Lk rows that see nothing
    *[fixed("keyless_queries", (23, 9, 40), (31, 0, 17), H=2, H_kv=1, D=59, causal=c) for c in (False, True)],
    fixed("keyless_queries", (6, 11), (0, 4), D=16, causal=True),
]


def lengths(case):
    """The sequences' query and key lengths: the case's own, or drawn as generate_random_padding_mask does."""
    if case.mode == "fixed":
        return case.lens_q, case.lens_k

    def draw(L):
        low = max(1, L - 20) if case.mode == "random" else L // 3
        return tuple(torch.randint(low, L + 1, (case.B,)).tolist())

    return draw(case.Lq), draw(case.Lk)


def pack(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def make_inputs(case, dtype):
    """(lens_q, lens_k), q (Tq, H, D), k and v (Tk, H_kv, D) and the upstream gradient, in ``dtype``."""
    lens_q, lens_k = lengths(case)
    Tq, Tk = sum(lens_q), sum(lens_k)
    q = randn(Tq, case.H, case.D, dtype=dtype)
    k = randn(Tk, case.H_kv, case.D, dtype=dtype)
    v = randn(Tk, case.H_kv, case.D, dtype=dtype)
    return (lens_q, lens_k), q, k, v, randn(Tq, case.H, case.D, dtype=dtype)


def sequences(lens_q, lens_k):
    cq, ck = pack(lens_q).tolist(), pack(lens_k).tolist()
    return [(cq[b], slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(lens_q))]


def visible(Lq, Lk, causal):
    """(Lq, Lk) bool: query i sees key j (causal bottom-right: j <= i + Lk - Lq)."""
    if not causal:
        return torch.ones(Lq, Lk, dtype=torch.bool)
    return torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + (Lk - Lq)


def eager_varlen(q, k, v, lens, case, seed):
    """PyTorch eager in the inputs' dtype, sequence by sequence: scores, masked_fill, softmax (rows with no
    visible key give zeros), dropout by the shared rule (element (h Tq + cu_q[b] + i) Tk + j), matmul."""
    group = case.H // case.H_kv
    Tq, Tk = q.shape[0], k.shape[0]
    outs = []
    for start, rq, rk in sequences(*lens):
        qb = q[rq].transpose(0, 1)  # (H, Lq, D)
        kb, vb = (t[rk].transpose(0, 1).repeat_interleave(group, dim=0) for t in (k, v))
        Lq, Lk = qb.shape[1], kb.shape[1]
        s = ((qb @ kb.transpose(-1, -2)) * case.softmax_scale).masked_fill(~visible(Lq, Lk, case.causal),
                                                                          float("-inf"))
        empty = torch.isneginf(s).all(-1, keepdim=True)
        p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        if case.dropout:
            h = torch.arange(case.H)[:, None, None]
            i = torch.arange(Lq)[None, :, None]
            j = torch.arange(Lk)[None, None, :]
            keep = reference.dropout_keep_at(seed, (h * Tq + start + i) * Tk + j, case.dropout)
            p = p * keep.to(p.dtype) / (1 - case.dropout)
        outs.append((p @ vb).transpose(0, 1))
    return torch.cat(outs)


def largest_logit(q, k, lens, case):
    """max |scale q . k| over the visible (query, key) pairs of every sequence and head, in float64."""
    group = case.H // case.H_kv
    largest = 0.0
    for _, rq, rk in sequences(*lens):
        qb, kb = q[rq].transpose(0, 1), k[rk].transpose(0, 1).repeat_interleave(group, dim=0)
        if qb.shape[1] and kb.shape[1]:
            s = ((qb @ kb.transpose(-1, -2)) * case.softmax_scale).abs()
            largest = max(largest, float(s.masked_fill(~visible(qb.shape[1], kb.shape[1], case.causal), 0).max()))
    return largest


def varlen_fn(backend, case, lens, cu_q, cu_k):
    max_q, max_k = max(lens[0]), max(lens[1])
    return lambda q, k, v: ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=case.causal,
                                                scale=case.scale, dropout_p=case.dropout, backend=backend)


def seeded(seed, fn):
    """fn under torch.manual_seed(seed): the op draws its dropout seed from torch's generator."""
    def run(*args):
        torch.manual_seed(seed)
        return fn(*args)
    return run


def reference_fn(case, lens, dropout_seed):
    """The torch backend's attention_varlen on CPU tensors with the dropout seed ``dropout_seed`` (the registered
    op takes it as a tensor): the seed a run on another device drew there."""
    seed = torch.tensor(dropout_seed, dtype=torch.int64) if case.dropout else None
    cu_q, cu_k = pack(lens[0]), pack(lens[1])
    return lambda q, k, v: torch.ops.fastformer.attention_varlen_fwd_py(
        q, k, v, cu_q, cu_k, max(lens[0]), max(lens[1]), case.causal, case.dropout, case.scale, seed, "torch")[0]


def test_families_keep_their_promises():
    # The drawn families stay within their pairs, and the adversarial ones hold what their names say.
    for case in CASES:
        if case.mode == "fixed":
            assert len(case.lens_q) == len(case.lens_k) == case.B, case
        assert case.H % case.H_kv == 0, case
    fam = {f: [c for c in CASES if c.family == f] for f in {c.family for c in CASES}}
    assert any(0 in c.lens_q for c in fam["empty_sequences"]) and any(sum(c.lens_q) == 0 for c in fam["empty_sequences"])
    assert all(1 in c.lens_q for c in fam["single_token"])
    assert all(set(c.lens_q) == {1} for c in fam["length_one"])
    assert all(any(lq > 0 and lk == 0 for lq, lk in zip(c.lens_q, c.lens_k)) for c in fam["keyless_queries"])
    assert {(c.H, c.H_kv) for c in fam["flash_varlen_heads"]} >= {(6, 6), (6, 1), (6, 2)}
    assert {c.mode for c in fam["flash_varlen_len"]} == {"random", "third"}


@pytest.mark.parametrize("backend,dtype,case", matrix_params("attention_varlen", CASES))
def test_attention_varlen_matrix(backend, dtype, case):
    lens, q, k, v, dout = make_inputs(case, dtype)
    run_seed = int(torch.randint(0, 2**31, ()))
    cu_q, cu_k = pack(lens[0]), pack(lens[1])
    q_dev, k_dev, v_dev, dout_dev, cu_q_dev, cu_k_dev = on_device([q, k, v, dout, cu_q, cu_k])  # the backend's
    torch.manual_seed(run_seed)
    # The seed the op draws after the same manual_seed, from the generator of the inputs' device.
    dropout_seed = int(torch.randint(0, 2**62, (), device=DEVICE))
    (out,), grads = forward_backward(seeded(run_seed, varlen_fn(backend, case, lens, cu_q_dev, cu_k_dev)),
                                     [q_dev, k_dev, v_dev], [dout_dev])
    out, grads = out.cpu(), on_cpu(grads)
    (ref,), ref_grads = forward_backward(reference_fn(case, lens, dropout_seed), upcast([q, k, v]), upcast([dout]))
    (eager,), eager_grads = forward_backward(lambda q, k, v: eager_varlen(q, k, v, lens, case, dropout_seed),
                                             [q, k, v], [dout])
    condition = largest_logit(*upcast([q, k]), lens, case)
    check("attention_varlen", backend, dtype, "out", out, eager, ref, condition)
    for name, g, eg, rg in zip(("dq", "dk", "dv"), grads, eager_grads, ref_grads):
        check("attention_varlen", backend, dtype, name, g, eg, rg, condition)
    # Rows of a sequence without keys, or causal queries before the first key, are zeros (and zero grads).
    blind = torch.cat([~visible(rq.stop - rq.start, rk.stop - rk.start, case.causal).any(-1)
                       for _, rq, rk in sequences(*lens)])
    assert (out[blind] == 0).all() and (grads[0][blind] == 0).all(), "a query with no visible key must give zeros"
