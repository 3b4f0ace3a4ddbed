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
from helpers import forward_backward, randn, upcast, visible_keys
from matrix import DEVICE, check, matrix_params, on_cpu, on_device

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
    magnitudes: tuple = (1.0, 1.0, 1.0)  # standard deviations of q, k, v
    dtypes: tuple | None = None  # None: every dtype of the backend

    @property
    def work(self):
        return self.B * self.H * self.Lq * self.Lk * max(self.D, 1)

    @property
    def softmax_scale(self):
        """The scale ops.attention applies: the case's, else 1/sqrt(D) (the matrix has no D = 0 case)."""
        return 1.0 / math.sqrt(self.D) if self.scale is None else self.scale

    def refused(self, backend):
        return self.D > MAX_HEAD_DIM.get(backend, math.inf)

    def __str__(self):
        s = f"{self.family}-B{self.B}H{self.H}q{self.Lq}k{self.Lk}d{self.D}"
        s += "-causal" if self.causal else ""
        s += f"-pad{self.padding}" if self.padding != "none" else ""
        s += f"-scale{self.scale}" if self.scale is not None else ""
        s += f"-drop{self.dropout}" if self.dropout else ""
        s += f"-{self.layout}{self.kv_heads or ''}" if self.layout != "contiguous" else ""
        s += "-mag" + "x".join(f"{m:g}" for m in self.magnitudes) if self.magnitudes != (1.0, 1.0, 1.0) else ""
        return s


LOW = (torch.float64, torch.float32)  # dtypes whose eager arithmetic holds the large-logit cases
# The files the families come from, and the commit each was read at:
#   FA: Dao-AILab/flash-attention tests/test_flash_attn.py (0251105a)
#   PT: pytorch/pytorch test/test_transformers.py (read in the mirror cyyever/pytorch at 0cecc5c1)
#   XF: facebookresearch/xformers tests/test_mem_eff_attention.py (bed3978b)

CASES = [
    # FA::test_flash_attn_output: d in [32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256] x causal at its
    # first (seqlen_q, seqlen_k) = (113, 203); batch 4 x 6 heads there.
    *[Case("flash_output_d", 1, 2, 113, 203, d, causal) for d in (32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256)
      for causal in (False, True)],
    *[Case("flash_output_d", 2, 1, 17, 33, d, True) for d in (59, 111, 160)],  # within the slow backends' budget
    # ... its (seqlen_q, seqlen_k) list at d = 64, both causal settings.
    *[Case("flash_output_len", 1, 2 if lq * lk < 2**20 else 1, lq, lk, 64, causal)
      for lq, lk in ((113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
                     (1023, 1024), (1024, 1023), (2048, 2048)) for causal in (False, True)],
    Case("flash_output_len", 2, 2, 17, 33, 64, True),
    # FA::test_flash_attn_causal: its pairs with swap_sq_sk (Lq < Lk and Lq > Lk), bottom-right causal.
    *[Case("flash_causal", 1, 2, lq, lk, d, True) for a, b in ((1, 239), (3, 799), (127, 513))
      for lq, lk in ((a, b), (b, a)) for d in (59, 128)],
    Case("flash_causal", 2, 2, 3, 31, 40, True),
    Case("flash_causal", 2, 2, 31, 3, 40, True),
    # FA::test_flash_attn_varlen_output: keys padded by generate_random_padding_mask ("random"; also its
    # "third" mode), its pairs incl. (1, 147), d from [32, 59, 64, 80, 96, 111, 128, ...].
    *[Case("flash_varlen", 2, 2, lq, lk, d, causal, mode)
      for lq, lk in ((1, 147), (113, 203), (128, 217), (108, 256), (256, 512))
      for d in (32, 59, 80, 128) for causal in (False, True) for mode in ("random", "third")],
    Case("flash_varlen", 2, 2, 7, 33, 40, True, "random"),
    Case("flash_varlen", 2, 2, 33, 17, 59, False, "third"),
    # FA::test_flash_attn_output, mha_type "mqa" / "gqa" (6 heads, nheads_k 1 / 2); PT's
    # test_mqa_singleton_head_broadcast likewise: K/V of kv_heads heads expanded to H.
    Case("flash_gqa", 1, 6, 113, 203, 64, True, layout="gqa", kv_heads=2),
    Case("flash_gqa", 1, 6, 113, 203, 128, False, layout="gqa", kv_heads=1),
    Case("flash_gqa", 2, 2, 33, 33, 64, True, layout="gqa", kv_heads=1),
    # FA::test_flash_attn_output with dropout_p = 0.17 (the reference applies the same mask).
    Case("flash_dropout", 1, 2, 113, 203, 64, False, dropout=0.17),
    Case("flash_dropout", 2, 2, 33, 17, 40, True, "random", dropout=0.17),
    # FA::test_flash_attn_bwd_overflow: q x 5, k and v x 3, seqlen [1, 2, 5, 17, 128], d [16, 32, 64], causal.
    *[Case("flash_bwd_overflow", 2, 2, L, L, d, True, magnitudes=(5.0, 3.0, 3.0))
      for L, d in ((1, 16), (5, 32), (17, 64), (128, 64))],
    # PT::test_mem_efficient_attention_vs_math_ref_grads: batch [1, 8], seq_len_q/k [8, 103, 1024, 2048],
    # head_dim [8, 16, 96, 128], is_causal, dropout_p [0.0, 0.22], scale [None, "l1" = 1 / head_dim];
    # and test_flash_attention_vs_math_ref_grads: seq_len_q [4, 143, 2048], seq_len_k [4, 127, 579, 2048].
    *[Case("sdpa_grads", b, 2, lq, lk, d, causal, scale=sc, dropout=p)
      for b, lq, lk, d, causal, sc, p in ((1, 8, 8, 8, False, None, 0.0), (1, 8, 1024, 16, False, 1 / 16, 0.0),
                                          (2, 103, 103, 96, True, None, 0.22), (1, 103, 2048, 128, False, 1 / 128, 0.0),
                                          (1, 1024, 8, 16, True, None, 0.0), (1, 143, 579, 8, False, None, 0.22),
                                          (2, 4, 127, 16, True, 1 / 16, 0.0), (2, 8, 8, 8, True, 1 / 8, 0.22))],
    # PT::test_scaled_dot_product_attention (math): (N', L, S, E) = (2, 4, 3, 6), dropout [0.0, 0.2, 0.5].
    *[Case("sdpa_math", 2, 2, 4, 3, 6, causal, dropout=p) for causal in (False, True) for p in (0.0, 0.2, 0.5)],
    # PT::test_causal_variants: (B, H, Lq, Lkv, d) in [(16, 16, 128, 128, 16), (16, 16, 128, 256, 32),
    # (16, 16, 256, 128, 32), (1, 1, 23, 56, 15)], lower-right causal.
    *[Case("sdpa_causal", b, h, lq, lk, d, True) for b, h, lq, lk, d in ((1, 2, 128, 128, 16), (1, 2, 128, 256, 32),
                                                                         (1, 2, 256, 128, 32), (1, 1, 23, 56, 15))],
    # PT::test_scaled_dot_product_attention_fused_kernels_packed: one (B, L, 3 H d) projection, chunked,
    # viewed and transposed to (B, H, L, d): non-contiguous q, k, v ((32, 64, 16, 64) there).
    *[Case("sdpa_packed", 2, 2, L, L, d, causal, layout="packed")
      for L, d, causal in ((64, 64, False), (64, 64, True), (127, 32, False), (33, 16, True))],
    # XF::generate_test_shapes_B_Mq_Mkv_H_K_Kv: inputs randn * 3; "weird" Mq [2, 3, 15, 31, 32, 34, 68, 72,
    # 90, 132, 136] against Mkv 128 (and as Mkv against Mq 256); K [1, 2, 3, 31, 34, 36, 38, 40, 64, 80,
    # 160, 258, ...]; LowerTriangularFromBottomRightMask (bottom-right), LowerTriangularMask (top-left: the
    # same mask for Mq == Mkv); test_custom_scale: scale 0.1.
    *[Case("xformers", 1, 2, mq, 128, k, causal, magnitudes=(3.0, 3.0, 3.0))
      for mq, k, causal in ((2, 31, True), (15, 34, False), (31, 38, True), (68, 80, False), (136, 160, True),
                            (90, 258, False))],
    *[Case("xformers", 1, 2, 256, mkv, 40, True, magnitudes=(3.0, 3.0, 3.0)) for mkv in (3, 72, 132)],
    Case("xformers", 2, 2, 32, 32, 64, True, magnitudes=(3.0, 3.0, 3.0)),
    Case("xformers", 2, 2, 15, 31, 64, False, "random", scale=0.1),
    # Adversarial (ours, not a peer's): non-positive and huge scales (PT's test_scaled_dot_product_attention_math_
    # with_negative_scale: -1 / 1e-4), head dims 1 to 3, rows of length 1, large logits, every key padded.
    *[Case("scale", 2, 2, 33, 33, 64, causal, "random", scale=s, dtypes=None if abs(s) < 50 else LOW)
      for s in (0.0, -0.7, -3.0, 100.0, 1e4, -1e4) for causal in (False, True)],
    *[Case("head_dim", 2, 2, 33, 17, d, True, "random") for d in (1, 2, 3)],
    *[Case("length_one", 2, 2, lq, lk, 16, causal)
      for lq, lk in ((1, 1), (1, 33), (33, 1)) for causal in (False, True)],
    Case("large_logits", 2, 2, 33, 33, 64, True, magnitudes=(8.0, 8.0, 1.0), dtypes=LOW),
    Case("large_logits", 1, 2, 113, 203, 64, False, "random", magnitudes=(8.0, 8.0, 1.0), dtypes=LOW),
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
    mq, mk, mv = case.magnitudes
    if case.layout == "packed":
        qkv = randn(B, Lq, 3 * H * D, dtype=dtype).chunk(3, -1)
        q, k, v = (t.view(B, Lq, H, D).transpose(1, 2) for t in qkv)  # (B, H, L, D), strided views
    elif case.layout == "gqa":  # each K/V head serves H / kv_heads query heads
        q = randn(B, H, Lq, D, dtype=dtype, scale=mq)
        k, v = (randn(B, case.kv_heads, 1, Lk, D, dtype=dtype, scale=m).expand(-1, -1, H // case.kv_heads, -1, -1)
                .reshape(B, H, Lk, D) for m in (mk, mv))  # a stride-0 view for one K/V head, else a copy
    else:
        q = randn(B, H, Lq, D, dtype=dtype, scale=mq)
        k = randn(B, H, Lk, D, dtype=dtype, scale=mk)
        v = randn(B, H, Lk, D, dtype=dtype, scale=mv)
    return q, k, v, key_padding(case), randn(B, H, Lq, D, dtype=dtype)


def eager_attention(q, k, v, mask, case, seed):
    """PyTorch eager in the inputs' dtype: scores, masked_fill, softmax, dropout, matmul (rows with no
    visible key give zeros, the rule of every backend)."""
    visible = visible_keys(case.B, case.Lq, case.Lk, mask, case.causal)
    s = ((q @ k.transpose(-1, -2)) * case.softmax_scale).masked_fill(~visible, float("-inf"))
    empty = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if case.dropout:
        keep = reference.dropout_keep(seed, p.numel(), case.dropout).reshape(p.shape)
        p = p * keep.to(p.dtype) / (1 - case.dropout)
    return p @ v


def largest_logit(q, k, mask, case):
    """max |scale q . k| over the visible (query, key) pairs, in float64 (0 if none)."""
    visible = visible_keys(case.B, case.Lq, case.Lk, mask, case.causal)
    s = ((q @ k.transpose(-1, -2)) * case.softmax_scale).abs().masked_fill(~visible, 0.0)
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


def reference_fn(case, mask, dropout_seed):
    """The torch backend's attention on CPU tensors with the dropout seed ``dropout_seed`` (the registered op
    takes it as a tensor): the seed a run on another device drew there."""
    seed = torch.tensor(dropout_seed, dtype=torch.int64) if case.dropout else None
    return lambda q, k, v: torch.ops.fastformer.attention_fwd_py(q, k, v, mask, case.causal, case.dropout, case.scale,
                                                                 seed, "torch")[0]


@pytest.mark.parametrize("backend,dtype,case", matrix_params("attention", CASES))
def test_attention_matrix(backend, dtype, case):
    q, k, v, mask, dout = make_inputs(case, dtype)
    run_seed = int(torch.randint(0, 2**31, ()))
    q_dev, k_dev, v_dev, mask_dev, dout_dev = on_device([q, k, v, mask, dout])  # the backend's inputs
    if case.refused(backend):
        with pytest.raises((ValueError, RuntimeError), match=f"head dim (D = )?{case.D} is not supported"):
            ops.attention(q_dev, k_dev, v_dev, key_padding_mask=mask_dev, causal=case.causal, backend=backend)
        return
    torch.manual_seed(run_seed)
    # The seed the op draws after the same manual_seed, from the generator of the inputs' device.
    dropout_seed = int(torch.randint(0, 2**62, (), device=DEVICE))
    (out,), grads = forward_backward(seeded(run_seed, attention_fn(backend, case, mask_dev)), [q_dev, k_dev, v_dev],
                                     [dout_dev])
    out, grads = out.cpu(), on_cpu(grads)
    (ref,), ref_grads = forward_backward(reference_fn(case, mask, dropout_seed), upcast([q, k, v]), upcast([dout]))
    (eager,), eager_grads = forward_backward(lambda q, k, v: eager_attention(q, k, v, mask, case, dropout_seed),
                                             [q, k, v], [dout])
    condition = largest_logit(*upcast([q, k]), mask, case)
    check("attention", backend, dtype, "out", out, eager, ref, condition)
    for name, g, eg, rg in zip(("dq", "dk", "dv"), grads, eager_grads, ref_grads):
        check("attention", backend, dtype, name, g, eg, rg, condition)
