"""ops.cross_entropy over the peers' test matrices (tests/matrix.py says how they are run and judged).

The peers' fused cross-entropies are the LLM-head kind: rows of a (B, T) batch over a vocabulary of 32k to
128k classes, with label smoothing and an ignore_index for padding (Liger-Kernel, FlashAttention, apex's
xentropy), and PyTorch's own samples of small (N, C, d1, ...) inputs. Row counts (B T) are cut so the matrix
fits a 2-core CI run; vocabularies, smoothing, ignore indices, logit scales and the share of ignored targets
are the peers' own. PyTorch puts the classes in dim 1; ops.cross_entropy takes them last, so its
(N, C, d1, ...) samples are taken as (N, d1, ..., C).

PyTorch eager is F.cross_entropy(reduction="none") on the rows, once with the case's smoothing (the loss)
and once without (the nll). The losses of ops.cross_entropy are float32 whatever the logits' dtype (float64
for float64), so they are judged at their own dtype against eager run at that dtype on the same (rounded)
logits; the logits' gradient has the logits' dtype and is judged against eager autograd in that dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from fastformer import ops
from helpers import dtype_name, forward_backward, randn, torch_cross_entropy, upcast
from matrix import check, matrix_params, on_cpu, on_device


@dataclass(frozen=True)
class Case:
    family: str
    shape: tuple  # logits (..., V); target has shape[:-1]
    smoothing: float = 0.0
    ignore_index: int = -100
    ignored: str = "none"  # rows whose target is set to ignore_index (targets in [0, V) may also equal it):
    #                        "none"; "liger" (randint(1, R // 2) random rows); "flash" (10 random rows of
    #                        FlashAttention's 1024 to 4096, here at most a quarter of the rows); "apex" (R // 6
    #                        random rows, at least one); "quarter" (about a quarter of the rows and the first);
    #                        "all" (every row)
    scalar: float = 1.0  # logits randn * scalar (Liger's scalar, FlashAttention's logit_scale and x 10)
    uniform: bool = False  # logits uniform in [-9, 9) instead: make_tensor's default (PyTorch's samples)
    dtypes: tuple | None = None

    @property
    def work(self):
        return math.prod(self.shape)

    @property
    def rows(self):
        return math.prod(self.shape[:-1])

    def __str__(self):
        s = f"{self.family}-" + "x".join(map(str, self.shape)) + f"-e{self.smoothing}-ignore{self.ignore_index}"
        s += f"-{self.ignored}" if self.ignored != "none" else ""
        s += "-uniform9" if self.uniform else ""
        return s + (f"-x{self.scalar:g}" if self.scalar != 1.0 else "")


LOW = (torch.float64, torch.float32)  # dtypes whose eager arithmetic holds the large-logit cases
# The files the families come from, and the commit each was read at:
#   LIGER: linkedin/Liger-Kernel test/transformers/test_cross_entropy.py (53d5934c, the last version with
#          its llama3 shape and its scalars 0.1 / 1 / 10; ignore_index 42 from af35a6cf)
#   FA: Dao-AILab/flash-attention tests/losses/test_cross_entropy.py (900b3793) and
#       tests/losses/test_cross_entropy_parallel.py (2d07ad64)
#   APEX: NVIDIA/apex apex/contrib/test/xentropy/test_label_smoothing.py (16fadfe7)
#   PT: PyTorch torch/testing/_internal/common_methods_invocations.py and common_modules.py (as shipped in
#       torch 2.14.1; the no-batch (9,) samples with label_smoothing 0.5 from pytorch/pytorch at 3936fdda)

CASES = [
    # LIGER::test_correctness: (B, T, V) in [(2, 4096, 32000) llama, (1, 4096, 128256) llama3, (3, 423,
    # 32000) "weird shapes"] x scalar [0.1, 1.0, 10.0] multiplying randn logits, bfloat16 and float32.
    *[Case("liger", shape, scalar=s) for shape in ((2, 8, 32000), (1, 8, 128256), (3, 5, 32000))
      for s in (0.1, 1.0, 10.0)],
    *[Case("liger", (1, 2, 32000), scalar=s) for s in (0.1, 10.0)],  # within the slow backends' budget
    # LIGER::test_correctness_functional: (B, T, V) in [(2, 2, 8), (9, 7, 41)], the functional's
    # ignore_index 0 (a valid class), the same scalars.
    *[Case("liger_functional", shape, ignore_index=0, scalar=s) for shape in ((2, 2, 8), (9, 7, 41))
      for s in (0.1, 1.0, 10.0)],
    # LIGER::test_correctness_with_ignore_index: (B, T, V, ignore_index) in [(2, 4096, 32000, -100),
    # (2, 4096, 32000, 2), (1, 4096, 128256, -300), (3, 423, 32000, -123)], randint(1, B T // 2) random
    # rows set to ignore_index.
    *[Case("liger_ignore_index", shape, ignore_index=ii, ignored="liger", scalar=s)
      for shape, ii, s in (((2, 8, 32000), -100, 1.0), ((2, 8, 32000), 2, 10.0), ((1, 8, 128256), -300, 0.1),
                           ((3, 5, 32000), -123, 1.0))],
    Case("liger_ignore_index", (1, 2, 32000), ignore_index=2, ignored="liger", scalar=10.0),
    # LIGER::test_correctness_with_label_smoothing_once: label_smoothing 0.1 on its three shapes;
    # ..._with_ignore_index_once: (ignore_index, label_smoothing) in [(1, 0.1), (-100, 0.2), (2, 0.1) on
    # 128256, (-300, 0.2) on (3, 423)]; af35a6cf's z-loss tests add (42, 0.1).
    *[Case("liger_label_smoothing", shape, 0.1, scalar=s) for shape, s in (((2, 8, 32000), 1.0),
                                                                             ((1, 8, 128256), 10.0),
                                                                             ((3, 5, 32000), 0.1))],
    *[Case("liger_label_smoothing", shape, e, ii, "liger") for shape, ii, e in
      (((2, 8, 32000), 1, 0.1), ((2, 8, 32000), -100, 0.2), ((1, 8, 128256), 2, 0.1), ((3, 5, 32000), -300, 0.2),
       ((3, 5, 32000), 42, 0.1))],
    Case("liger_label_smoothing", (1, 2, 32000), 0.2, 1, "liger", scalar=10.0),
    # FA::test_cross_entropy_loss: vocab_size [50257, 128256] ("larger than 64k for split"; 128 * 1024 at
    # 08124c8f), smoothing [0.0, 0.9], logit_scale [1.0, 0.7], 10 random targets -100 (4096 or 1024 rows there).
    *[Case("flash", (16, 50257), e, ignored="flash", scalar=s) for e in (0.0, 0.9) for s in (1.0, 0.7)],
    *[Case("flash", (12, 128256), e, ignored="flash") for e in (0.0, 0.9)],
    Case("flash", (8, 128 * 1024), 0.9, ignored="flash"),
    Case("flash", (1, 50257), 0.9, scalar=0.7),
    # FA::test_cross_entropy_loss_parallel: vocab 50264 split over world_size [1, 2, 4, 8] (per-rank vocabularies
    # 50264, 25132, 12566, 6283: the odd ones), logits randn x 10, smoothing [0.0, 0.9], 10 targets -100.
    *[Case("flash_parallel", (16, v), e, ignored="flash", scalar=10.0) for v in (50264, 25132, 12566, 6283)
      for e in (0.0, 0.9)],
    Case("flash_parallel", (8, 6283), 0.9, scalar=10.0),
    Case("flash_parallel", (2, 25132), 0.0, scalar=10.0),
    # APEX::LabelSmoothingTest: (N, T, H) = (128, 74, 32320), smoothing 0.1, padding_idx 0 (a valid class) on
    # N T // 6 random rows, half and bfloat16 logits.
    Case("apex_xentropy", (2, 6, 32320), 0.1, 0, "apex"),
    Case("apex_xentropy", (1, 2, 32320), 0.1, 0, "apex"),
    # PT::sample_inputs_cross_entropy: (N, C) = (2, 3) with extra dims [(), (1,), (1, 2), (1, 2, 3)], and
    # ignore_index=1 on (2, 3); make_tensor's uniform [-9, 9) logits.
    *[Case("pytorch_opinfo", (2, *extra, 3), uniform=True) for extra in ((), (1,), (1, 2), (1, 2, 3))],
    Case("pytorch_opinfo", (2, 3), ignore_index=1, uniform=True),
    # PT::module_inputs_torch_nn_CrossEntropyLoss: (2, 3, 5, 5), (2, 3, 5), (2, 3), (2, 3, 5, 5, 2, 2) with
    # {}, ignore_index 1, label_smoothing 0.15, both; the no-batch (3,) (and 3936fdda's (9,), label_smoothing
    # 0.5) with a 0-dim target.
    *[Case("pytorch_module", shape, e, ii, uniform=True)
      for shape, e, ii in (((2, 5, 5, 3), 0.0, -100), ((2, 5, 3), 0.0, 1), ((2, 3), 0.15, -100),
                           ((2, 5, 5, 2, 2, 3), 0.15, 1))],
    *[Case("pytorch_module", (v,), e, uniform=True) for v, e in ((3, 0.0), (3, 0.15), (9, 0.5))],
    # Adversarial (ours, not a peer's): large logits (|x| to 400: a max must be subtracted before the exponent),
    # vocabularies of 1 (loss 0) and 2, every row ignored, ignore_index equal to a valid class (a pad id 0 that
    # a quarter of the targets take).
    Case("large_logits", (16, 97), ignored="quarter", scalar=100.0, dtypes=LOW),
    Case("large_logits", (4, 4099), 0.1, ignored="quarter", scalar=100.0, dtypes=LOW),
    Case("large_logits", (2, 32000), 0.1, scalar=100.0, dtypes=LOW),
    Case("large_logits", (16, 1000), 0.1, ignored="quarter", scalar=30.0),
    *[Case("small_vocab", (7, 1), e) for e in (0.0, 0.1)],
    Case("small_vocab", (1,), 1.0),  # 1-D logits, a 0-dim target
    *[Case("small_vocab", (7, 2), e, ignored="quarter") for e in (0.0, 0.1)],
    Case("small_vocab", (3, 5, 2), 1.0, 0),  # pad id 0: one of the two classes
    Case("all_ignored", (4, 113), 0.1, ignored="all"),
    Case("all_ignored", (2, 3, 1000), 0.0, 0, "all"),
    Case("all_ignored", (3, 1), 0.1, 0),  # the only class is the pad id: every target is ignored
    Case("pad_id", (16, 97), 0.1, 0, "quarter"),
    Case("pad_id", (4, 4099), 0.0, 0, "quarter"),
    Case("pad_id", (8, 32000), 0.1, 0, "quarter", scalar=10.0),
]


def out_dtype(dtype):
    """The dtype of loss and nll for logits of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def make_target(case):
    """int64 target of shape case.shape[:-1] in [0, V), the case's rows set to ignore_index."""
    V, R = case.shape[-1], case.rows
    target = torch.randint(0, V, (R,), dtype=torch.int64)
    count = {"none": 0, "all": R, "flash": min(10, R // 4), "apex": max(1, R // 6),
             "liger": int(torch.randint(1, max(2, R // 2), ())) if R > 1 else 0}.get(case.ignored)
    if case.ignored == "quarter":
        ignored = torch.rand(R) < 0.25
        ignored[0] = True
    else:
        ignored = torch.zeros(R, dtype=torch.bool)
        ignored[torch.randperm(R)[:count]] = True
    return target.masked_fill(ignored, case.ignore_index).reshape(case.shape[:-1])


def make_logits(case, dtype):
    if case.uniform:  # make_tensor(low=None, high=None) for floating dtypes: uniform in [-9, 9)
        return (torch.rand(*case.shape, dtype=torch.float64) * 18 - 9).to(dtype)
    return randn(*case.shape, dtype=dtype, scale=case.scalar)


@pytest.mark.parametrize("backend,dtype,case", matrix_params("cross_entropy", CASES))
def test_cross_entropy_matrix(backend, dtype, case):
    logits, target = make_logits(case, dtype), make_target(case)
    acc = out_dtype(dtype)
    # Upstream gradients of loss and nll drawn in the logits' dtype (eager's loss and nll have that dtype),
    # given to ops.cross_entropy as the float32 (float64) values they are, to the reference in float64.
    upstream = [randn(case.shape[:-1], dtype=dtype) for _ in range(2)]

    def run(b, target):
        return lambda x: ops.cross_entropy(x, target, label_smoothing=case.smoothing, ignore_index=case.ignore_index,
                                           return_nll=True, backend=b)

    outs, (dlogits,) = (on_cpu(t) for t in forward_backward(run(backend, *on_device([target])), on_device([logits]),
                                                            on_device([u.to(acc) for u in upstream])))
    ref_outs, (ref_dlogits,) = forward_backward(run("torch", target), upcast([logits]), upcast(upstream))
    _, (eager_dlogits,) = forward_backward(
        lambda x: torch_cross_entropy(x, target, case.smoothing, case.ignore_index), [logits], upstream)
    # loss and nll are float32 (float64) whatever the logits' dtype, so check() judges them at that dtype:
    # its floor in float32 ulps, and against eager computing the float32 losses PyTorch's way (F.cross_entropy
    # on logits.float(): the composition the peers test against), on the same rounded logits, which float32
    # holds exactly. That is stricter than eager in half (a half loss errs by up to half an ulp of half) and
    # the same as eager in the dtype for float32 and float64 logits. Their ratios are kept apart from the
    # gradients' under "cross_entropy[<logits' dtype>]".
    eager_outs = torch_cross_entropy(logits.to(acc), target, case.smoothing, case.ignore_index)
    # The condition of a cross-entropy at its logits, as of a softmax: max(1, max |x|) over the rows that count
    # (lse and x[t] are known to |x| ulp whatever the order of the arithmetic, and e^(x - lse) carries it).
    counted = (target != case.ignore_index)[..., None]
    condition = float(logits.double().abs().masked_fill(~counted, 0.0).max()) if logits.numel() else 1.0
    for name, a, e, r in zip(("loss", "nll"), outs, eager_outs, ref_outs):
        check(f"cross_entropy[{dtype_name(dtype)}]", backend, acc, name, a, e, r, condition)
    check("cross_entropy", backend, dtype, "dlogits", dlogits, eager_dlogits, ref_dlogits, condition)
    # Ignored rows give exactly 0 and an exactly zero gradient (the criterion alone allows a floor).
    ignored = ~counted[..., 0]
    assert (outs[0][ignored] == 0).all() and (outs[1][ignored] == 0).all(), "an ignored row must give 0"
    assert (dlogits[ignored] == 0).all(), "an ignored row must get a zero gradient"
