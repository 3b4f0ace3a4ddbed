"""ops.attention over the peers' test matrices (tests/matrix.py says how they are run and judged).

Batch and head counts are cut to 1-2 (the peers run 4-8 x 9-16 on GPUs) so the matrix fits a 2-core CI
run; lengths, head dims, masks, scales, dropout rates and layouts are the peers' own values. The only
causal alignment of ops.attention is bottom-right (FlashAttention >= 2.1, xformers'
LowerTriangularFromBottomRightMask); a top-left mask (xformers' LowerTriangularMask, SDPA's is_causal)
is the same mask when Lq == Lk, so those peers' cases are taken with square shapes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from fastformer import ops
from fastformer.ops import reference
from helpers import ALL_BACKENDS, forward_backward, randn, upcast, visible_keys
from matrix import check, matrix_params

MAX_HEAD_DIM = {"cuda": 128, "cuda_sim": 128, "triton": 128}  # backends that refuse larger head dims


@dataclass(frozen=True)
class Case:
    family: str
    B: int
    H: int
    Lq: int
    Lk: int
    D: int
    causal: bool = False
    padding: str = "none"  # key padding: "none", "random", "third" (FlashAttention's modes), "all" (every key)
    scale: float | None = None
    dropout: float = 0.0
    layout: str = "contiguous"  # "packed": q, k, v views of one (B, L, 3, H, D) tensor; "gqa": K/V heads expanded
    kv_heads: int = 0  # "gqa": K/V heads (H must be a multiple)
    magnitude: float = 1.0  # q and k drawn with this standard deviation
    dtypes: tuple | None = None  # None: every dtype of the backend

    @property
    def work(self):
        return self.B * self.H * self.Lq * self.Lk * max(self.D, 1)

    def refused(self, backend):
        return self.D > MAX_HEAD_DIM.get(backend, math.inf)

    def __str__(self):
        s = f"{self.family}-B{self.B}H{self.H}q{self.Lq}k{self.Lk}d{self.D}"
        s += "-causal" if self.causal else ""
        s += f"-pad{self.padding}" if self.padding != "none" else ""
        s += f"-scale{self.scale}" if self.scale is not None else ""
        s += f"-drop{self.dropout}" if self.dropout else ""
        s += f"-{self.layout}{self.kv_heads or ''}" if self.layout != "contiguous" else ""
        s += f"-mag{self.magnitude}" if self.magnitude != 1.0 else ""
        return s


LOW = (torch.float64, torch.float32)  # dtypes whose eager arithmetic holds the large-logit cases

CASES = [
    # FlashAttention, tests/test_flash_attn.py::test_flash_attn_output: d in [32, 40, 59, 64, 80, 96, 111,
    # 128, 160, 192, 224, 256] x causal, (seqlen_q, seqlen_k) = (113, 203) among its pairs.
    *[Case("flash_output_d", 1, 2, 113, 203, d, causal) for d in (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
      for causal in (False, True)],
    *[Case("flash_output_d", 2, 1, 17, 33, d, True) for d in (59, 111, 160)],  # within the slow backends' budget
    # ... and its seqlen pairs at d = 64, both causal settings; a small pair for the slow backends.
    *[Case("flash_output_len", 1, 2 if lq * lk < 2**20 else 1, lq, lk, 64, causal)
      for lq, lk in ((113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
                     (1023, 1024), (1024, 1023), (2048, 2048)) for causal in (False, True)],
    Case("flash_output_len", 2, 2, 17, 33, 64, True),
    # FlashAttention, tests/test_flash_attn.py::test_flash_attn_varlen_output: generate_random_padding_mask
    # modes "random" / "third" / "full" on the keys, (seqlen_q, seqlen_k) from its list incl. (1, 147).
    *[Case("flash_varlen", 2, 2, lq, lk, d, causal, mode)
      for lq, lk in ((1, 147), (113, 203), (128, 217), (108, 256), (256, 512))
      for d in (32, 59, 128) for causal in (False, True) for mode in ("random", "third")],
    Case("flash_varlen", 2, 2, 7, 33, 40, True, "random"),
    Case("flash_varlen", 2, 2, 33, 17, 59, False, "third"),
    # FlashAttention, test_flash_attn_output with mha_type "mqa" / "gqa" (nheads 9, nheads_k 1 / 3): here
    # K/V of kv_heads heads expanded to H (stride 0), as a caller without native GQA passes them.
    Case("flash_gqa", 1, 6, 113, 203, 64, True, layout="gqa", kv_heads=3),
    Case("flash_gqa", 1, 6, 113, 203, 128, False, layout="gqa", kv_heads=1),
    Case("flash_gqa", 2, 2, 33, 33, 64, True, layout="gqa", kv_heads=1),
    # FlashAttention, test_flash_attn_output with dropout_p = 0.17 (the reference applies the same mask).
    Case("flash_dropout", 1, 2, 113, 203, 64, False, dropout=0.17),
    Case("flash_dropout", 2, 2, 33, 17, 40, True, "random", dropout=0.17),
    # PyTorch, test/test_transformers.py::test_mem_efficient_attention_vs_math_ref_grads: batch [1, 8],
    # seq_len_q [4, 8, 64, 143, 256, 512, 1024, 2048], seq_len_k [4, 8, 64, 128, 256, 587, 1024, 2048],
    # head_dim [8, 16, 32, 64, 72, 96, 128], is_causal, dropout_p [0.0, 0.22]; a cross-section of it.
    *[Case("sdpa_grads", b, 2, lq, lk, d, causal, dropout=p)
      for b, lq, lk, d, causal, p in ((1, 4, 4, 8, False, 0.0), (1, 8, 587, 16, False, 0.0), (2, 64, 128, 72, True, 0.0),
                                      (1, 143, 587, 96, False, 0.22), (1, 143, 8, 32, True, 0.0),
                                      (2, 256, 64, 128, True, 0.22), (1, 2048, 4, 8, False, 0.0),
                                      (2, 8, 8, 72, True, 0.22), (2, 4, 64, 16, True, 0.0))],
    # PyTorch, test/test_transformers.py::test_scaled_dot_product_attention_fused_kernels_packed: q, k, v
    # sliced from one packed (B, L, 3 H D) projection and transposed to (B, H, L, D): non-contiguous.
    *[Case("sdpa_packed", 2, 2, L, L, d, causal, layout="packed")
      for L, d, causal in ((64, 16, False), (64, 64, True), (127, 32, False), (33, 64, True))],
    # xformers, tests/test_mem_eff_attention.py: K in {32, 64, 128} and odd Mq/Mkv with
    # LowerTriangularFromBottomRightMask (bottom-right causal, Mq < Mkv and Mq > Mkv), LowerTriangularMask
    # (top-left: square here) and BlockDiagonal (padded batch) biases.
    *[Case("xformers", 2, 2, mq, mkv, k, causal, mode)
      for mq, mkv, k, causal, mode in ((1, 97, 32, True, "none"), (97, 1, 64, True, "none"), (97, 113, 128, True, "none"),
                                       (113, 97, 64, True, "random"), (33, 33, 32, True, "none"),
                                       (7, 33, 64, False, "random"), (33, 7, 32, True, "third"))],
    # Adversarial (issue 18): non-positive and huge scales, head dims 1 and 2, rows of length 1, large
    # logits, every key padded.
    *[Case("scale", 2, 2, 33, 33, 64, causal, "random", scale=s, dtypes=None if abs(s) < 50 else LOW)
      for s in (0.0, -0.7, -3.0, 100.0, 1e4) for causal in (False, True)],
    *[Case("head_dim", 2, 2, 33, 17, d, True, "random") for d in (1, 2, 3)],
    *[Case("length_one", 2, 2, lq, lk, 16, causal) for lq, lk in ((1, 1), (1, 33), (33, 1)) for causal in (False, True)],
    Case("large_logits", 2, 2, 33, 33, 64, True, magnitude=8.0, dtypes=LOW),
    Case("large_logits", 1, 2, 113, 203, 64, False, "random", magnitude=8.0, dtypes=LOW),
    Case("all_padded", 2, 2, 17, 33, 40, False, "all"),
]


def key_padding(case):
    """(B, Lk) bool padding mask of FlashAttention's generate_random_padding_mask modes, or None."""
    if case.padding == "none":
        return None
    if case.padding == "all":
        return torch.ones(case.B, case.Lk, dtype=torch.bool)
    if case.padding == "third":  # every sequence keeps its first third .. all of its keys
        lengths = torch.randint(max(1, case.Lk // 3), case.Lk + 1, (case.B, 1))
    else:  # "random": a random length in [max(1, Lk - 20), Lk]
        lengths = torch.randint(max(1, case.Lk - 20), case.Lk + 1, (case.B, 1))
    return torch.arange(case.Lk)[None, :] >= lengths


def make_inputs(case, dtype):
    """q, k, v in the case's layout and dtype; the upstream gradient in the dtype."""
    B, H, Lq, Lk, D = case.B, case.H, case.Lq, case.Lk, case.D
    if case.layout == "packed":
        qkv = randn(B, Lq, 3 * H * D, dtype=dtype).view(B, Lq, 3, H, D)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, L, D), strided views
    elif case.layout == "gqa":  # each K/V head serves H / kv_heads query heads
        q = randn(B, H, Lq, D, dtype=dtype, scale=case.magnitude)
        k, v = (randn(B, case.kv_heads, 1, Lk, D, dtype=dtype).expand(-1, -1, H // case.kv_heads, -1, -1)
                .reshape(B, H, Lk, D) for _ in range(2))  # a stride-0 view for one K/V head, else a copy
    else:
        q = randn(B, H, Lq, D, dtype=dtype, scale=case.magnitude)
        k = randn(B, H, Lk, D, dtype=dtype, scale=case.magnitude)
        v = randn(B, H, Lk, D, dtype=dtype)
    return q, k, v, key_padding(case), randn(B, H, Lq, D, dtype=dtype)


def eager_attention(q, k, v, mask, case, seed):
    """PyTorch eager in the inputs' dtype: scores, masked_fill, softmax, dropout, matmul (rows with no
    visible key give zeros, the rule of every backend)."""
    scale = 1.0 / math.sqrt(case.D) if case.scale is None else case.scale
    scale = 1.0 if case.D == 0 and case.scale is None else scale
    visible = visible_keys(case.B, case.Lq, case.Lk, mask, case.causal)
    s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))
    empty = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if case.dropout:
        keep = reference.dropout_keep(seed, p.numel(), case.dropout).reshape(p.shape)
        p = p * keep.to(p.dtype) / (1 - case.dropout)
    return p @ v


def largest_logit(q, k, mask, case):
    """max |scale q . k| over the visible (query, key) pairs, in float64 (0 if none)."""
    scale = 1.0 / math.sqrt(case.D) if case.scale is None else case.scale
    visible = visible_keys(case.B, case.Lq, case.Lk, mask, case.causal)
    s = ((q @ k.transpose(-1, -2)) * (scale if case.D else 0.0)).abs().masked_fill(~visible, 0.0)
    return float(s.max()) if s.numel() else 0.0


def attention_fn(backend, case, mask):
    return lambda q, k, v: ops.attention(q, k, v, key_padding_mask=mask, causal=case.causal, scale=case.scale,
                                         dropout_p=case.dropout, backend=backend)


def seeded(seed, fn):
    """fn under torch.manual_seed(seed): the op draws its dropout seed from torch's generator."""
    def run(*args):
        torch.manual_seed(seed)
        return fn(*args)
    return run


@pytest.mark.parametrize("backend,dtype,case", matrix_params("attention", ALL_BACKENDS, CASES))
def test_attention_matrix(backend, dtype, case):
    q, k, v, mask, dout = make_inputs(case, dtype)
    run_seed = int(torch.randint(0, 2**31, ()))
    if case.refused(backend):
        with pytest.raises((ValueError, RuntimeError), match=f"head dim (D = )?{case.D} is not supported"):
            ops.attention(q, k, v, key_padding_mask=mask, causal=case.causal, backend=backend)
        return
    torch.manual_seed(run_seed)
    dropout_seed = int(torch.randint(0, 2**62, ()))  # the seed the op draws after the same manual_seed
    (out,), grads = forward_backward(seeded(run_seed, attention_fn(backend, case, mask)), [q, k, v], [dout])
    (ref,), ref_grads = forward_backward(seeded(run_seed, attention_fn("torch", case, mask)), upcast([q, k, v]),
                                         upcast([dout]))
    (eager,), eager_grads = forward_backward(lambda q, k, v: eager_attention(q, k, v, mask, case, dropout_seed),
                                             [q, k, v], [dout])
    condition = largest_logit(*upcast([q, k]), mask, case)
    check("attention", backend, dtype, "out", out, eager, ref, condition)
    for name, g, eg, rg in zip(("dq", "dk", "dv"), grads, eager_grads, ref_grads):
        check("attention", backend, dtype, name, g, eg, rg, condition)
