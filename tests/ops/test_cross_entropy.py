"""ops.cross_entropy against the float64 torch reference: every backend and dtype, odd vocabularies.

Per row of logits (..., V) and int64 target (...): loss = (1 - e) nll + e (lse - mean x) with
nll = lse - x[target] and e = label_smoothing; loss = nll = 0 (and no gradient) where target ==
ignore_index. The losses are float32 (float64 for float64 logits) whatever the logits' dtype, so they
are compared at the float32 (float64) tolerance: the kernels accumulate in float32 from the rounded
logits, which the reference reads exactly. The logits' gradient has the logits' dtype. Forward (loss and
nll) and backward (random upstream gradients for both) against the torch backend run in float64 on
float64 copies of the same inputs; the reference itself against torch.nn.functional.cross_entropy.
"""
import math
from dataclasses import dataclass

import pytest
import torch

from fastformer import ops
from helpers import (ALL_BACKENDS, FLOAT64_BACKENDS, SLOW_LIMITS, backend_dtype_cases, backend_dtypes, forward_backward,
                     randn, torch_cross_entropy, upcast)
from tolerances import assert_close


@dataclass(frozen=True)
class Case:
    shape: tuple  # logits (..., V); target has shape[:-1]
    smoothing: float = 0.0
    ignore_index: int = -100
    all_ignored: bool = False  # every row's target is ignore_index

    @property
    def rows(self):
        return math.prod(self.shape[:-1])

    def __str__(self):
        shape = "x".join(map(str, self.shape))
        ignored = "-allignored" if self.all_ignored else ""
        return f"{shape}-e{self.smoothing}-ignore{self.ignore_index}{ignored}"


def small(case):
    """Whether the case fits the limits of the slow (simulated GPU) backends."""
    return case.rows <= SLOW_LIMITS["rows"] and case.shape[-1] <= SLOW_LIMITS["N"]


# V multiples of 8 (512, 1000, 4096, 32000) take the CUDA kernels' 16-byte packs (4 floats, 8 halves);
# the others (1, 7, 97, 113, 4099) their element-by-element loops.
CASES = [
    # Within the slow backends' limits.
    Case((1,)),  # 1-D logits, 0-dim target: one class, nll 0
    Case((97,), 0.1),
    Case((113,), 1.0, 5),  # ignore_index inside [0, V) but not the target (unless drawn)
    Case((7, 1), 0.1),  # one class per row: loss 0 (e = 0.1 too: lse = x = mean x)
    Case((7, 1), 0.0, 0),  # ignore_index 0 = the only class: every row ignored
    Case((7, 7), 0.0, 0),  # pad id 0
    Case((7, 97), 0.1),
    Case((2, 7, 113), 1.0),  # (B, T, V); e = 1: the loss is lse - mean x alone
    Case((2, 3, 113), 0.1, 0),
    Case((5, 8), 0.1),  # one pack of halves, two of floats
    Case((16, 512)),
    Case((2, 5, 1000), 0.1),
    Case((5, 1000), 1.0, 0),
    Case((3, 4099), 0.1, 0),  # long rows: the kernels loop over blocks of a row
    Case((2, 4096)),
    Case((4, 113), 0.1, -100, True),  # every row ignored: zeros, zero gradient
    Case((2, 3, 1000), 0.0, 0, True),
    # Bigger.
    Case((113, 97), 0.1),
    Case((4, 33, 1000), 0.0, 0),
    Case((64, 4099), 0.1),
    Case((1000, 7), 1.0),
    Case((3, 37, 512), 0.1, 0),
    Case((37, 32000), 0.1),  # a translation vocabulary
    Case((50, 113), 0.0, -100, True),
]


def out_dtype(dtype):
    """The dtype of loss and nll for logits of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def make_target(case):
    """int64 target of shape case.shape[:-1] in [0, V), about a quarter of the rows (always the first, when
    there are several) set to ignore_index; every row when the case says so."""
    V = case.shape[-1]
    target = torch.randint(0, V, case.shape[:-1], dtype=torch.int64)
    ignored = torch.rand(case.shape[:-1]) < 0.25
    if case.rows > 1:
        ignored.view(-1)[0] = True
    if case.all_ignored:
        ignored[...] = True
    return target.masked_fill(ignored, case.ignore_index)


def make_inputs(case, dtype):
    logits = randn(*case.shape, dtype=dtype, scale=2.0)
    target = make_target(case)
    upstream = [randn(case.shape[:-1], dtype=out_dtype(dtype)) for _ in range(2)]  # dloss, dnll
    return logits, target, upstream


def ce_fn(backend, case, target):
    return lambda logits: ops.cross_entropy(logits, target, label_smoothing=case.smoothing,
                                            ignore_index=case.ignore_index, return_nll=True, backend=backend)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_reference_matches_torch_functional(case):
    logits, target, upstream = make_inputs(case, torch.float64)
    outs, (dlogits,) = forward_backward(ce_fn("torch", case, target), [logits], upstream)
    expected, (expected_dlogits,) = forward_backward(
        lambda x: torch_cross_entropy(x, target, case.smoothing, case.ignore_index), [logits], upstream)
    for name, o, e in zip(("loss", "nll"), outs, expected):
        assert_close(o, e, torch.float64, name)
    assert_close(dlogits, expected_dlogits, torch.float64, "dlogits")


@pytest.mark.parametrize("backend,dtype,case", backend_dtype_cases(ALL_BACKENDS, CASES, small))
def test_cross_entropy_matches_reference(backend, dtype, case):
    logits, target, upstream = make_inputs(case, dtype)
    (loss, nll), (dlogits,) = forward_backward(ce_fn(backend, case, target), [logits], upstream)
    (ref_loss, ref_nll), (ref_dlogits,) = forward_backward(ce_fn("torch", case, target), upcast([logits]),
                                                           upcast(upstream))
    assert_close(loss, ref_loss, out_dtype(dtype), "loss")
    assert_close(nll, ref_nll, out_dtype(dtype), "nll")
    assert_close(dlogits, ref_dlogits, dtype, "dlogits")
    # Ignored rows are exactly zero, with an exactly zero gradient.
    ignored = target == case.ignore_index
    assert ignored.any() or (case.rows == 1 and not case.all_ignored), "make_target should have ignored a row"
    assert ignored.all() or not case.all_ignored
    assert (loss[ignored] == 0).all() and (nll[ignored] == 0).all(), "an ignored row must give 0"
    assert (dlogits[ignored] == 0).all(), "an ignored row must get a zero gradient"


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_gradcheck_float64(backend, smoothing):
    # Analytic gradient of both outputs against finite differences, with ignored rows.
    case = Case((3, 4, 9), smoothing, 2)
    logits, target, _ = make_inputs(case, torch.float64)
    assert torch.autograd.gradcheck(ce_fn(backend, case, target), [logits.requires_grad_()])


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
def test_output_dtypes_and_return_nll(backend, dtype):
    # float32 losses for half and float32 logits (float64 for float64), of target's shape; return_nll=False
    # gives the loss alone, the same as the first of return_nll=True's pair.
    case = Case((2, 3, 97), 0.1)
    logits, target, _ = make_inputs(case, dtype)
    loss = ops.cross_entropy(logits, target, label_smoothing=0.1, backend=backend)
    assert isinstance(loss, torch.Tensor)
    pair = ops.cross_entropy(logits, target, label_smoothing=0.1, return_nll=True, backend=backend)
    assert isinstance(pair, tuple) and len(pair) == 2
    for t in (loss, *pair):
        assert t.dtype == out_dtype(dtype) and t.shape == target.shape
    torch.testing.assert_close(loss, pair[0], rtol=0, atol=0)
    # A 0-dim target gives 0-dim losses.
    one = ops.cross_entropy(logits[0, 0], target[0, 0], return_nll=True, backend=backend)
    assert all(t.shape == () and t.dtype == out_dtype(dtype) for t in one)


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
@pytest.mark.parametrize("which", ["nll", "loss"])
def test_gradient_through_one_output(backend, dtype, which):
    # Only one output used (the other's gradient is undefined: zeros); e.g. perplexity's nll alone.
    case = Case((5, 97), 0.1)
    logits, target, upstream = make_inputs(case, dtype)
    used = 1 if which == "nll" else 0

    def fn(backend):
        return lambda x: ce_fn(backend, case, target)(x)[used]

    (out,), (dlogits,) = forward_backward(fn(backend), [logits], upstream[used:used + 1])
    (ref,), (ref_dlogits,) = forward_backward(fn("torch"), upcast([logits]), upcast(upstream[used:used + 1]))
    assert_close(out, ref, out_dtype(dtype), which)
    assert_close(dlogits, ref_dlogits, dtype, "dlogits")


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
@pytest.mark.parametrize("view", ["transposed", "sliced", "offset"])
def test_noncontiguous_and_misaligned_logits(backend, dtype, view):
    # transposed: (R, V) view of a (V, R) tensor; sliced: rows strided by 2V; offset: contiguous but one
    # element past a 16-byte boundary, V a multiple of 8 (the CUDA kernels must leave their packs then).
    R, V = 6, 40
    if view == "transposed":
        logits = randn(V, R, dtype=dtype, scale=2.0).t()
    elif view == "sliced":
        logits = randn(R, 2 * V, dtype=dtype, scale=2.0)[:, V:]
    else:
        logits = randn(R * V + 1, dtype=dtype, scale=2.0)[1:].view(R, V)
        assert logits.is_contiguous() and logits.data_ptr() % 16 != 0
    target = torch.randint(0, V, (2 * R,))[::2]  # strided too
    target[1] = -100
    case = Case((R, V), 0.1)
    upstream = [randn(R, dtype=out_dtype(dtype)) for _ in range(2)]
    outs, grads = forward_backward(ce_fn(backend, case, target), [logits], upstream)
    c_outs, c_grads = forward_backward(ce_fn(backend, case, target.contiguous()), [logits.contiguous()], upstream)
    refs, ref_grads = forward_backward(ce_fn("torch", case, target), upcast([logits]), upcast(upstream))
    for name, o, c, r, d in zip(("loss", "nll", "dlogits"), outs + grads, c_outs + c_grads, refs + ref_grads,
                                (out_dtype(dtype), out_dtype(dtype), dtype)):
        assert_close(o, r, d, name)
        torch.testing.assert_close(o, c, msg=lambda m: f"{name}: non-contiguous vs contiguous: {m}")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_large_logits_are_stable(backend):
    # Logits around 1e3 (a max subtraction is needed: e^x overflows float32 at 89) and a shift of the
    # whole row leave nll unchanged.
    case = Case((6, 1000), 0.1)
    logits, target, upstream = make_inputs(case, torch.float32)
    shifted = logits + 1e3
    (loss, nll), (dlogits,) = forward_backward(ce_fn(backend, case, target), [shifted], upstream)
    (ref_loss, ref_nll), (ref_dlogits,) = forward_backward(ce_fn("torch", case, target), upcast([shifted]),
                                                           upcast(upstream))
    assert_close(nll, ref_nll, torch.float32, "nll")
    assert_close(loss, ref_loss, torch.float32, "loss")
    assert_close(dlogits, ref_dlogits, torch.float32, "dlogits")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_empty_batch(backend):
    # No rows: empty losses and an empty gradient (V > 0).
    logits = torch.empty(0, 7, dtype=torch.float32, requires_grad=True)
    target = torch.empty(0, dtype=torch.int64)
    loss, nll = ops.cross_entropy(logits, target, return_nll=True, backend=backend)
    assert loss.shape == (0,) and nll.shape == (0,) and loss.dtype == torch.float32
    (loss.sum() + nll.sum()).backward()
    assert logits.grad.shape == (0, 7)



def unchecked_kernels(backend):
    """(forward, backward) of a backend's cross_entropy kernels without the checks in front of them: what runs
    while a GPU call's target check is deferred (csrc/value_checks.h)."""
    if backend == "torch":
        from fastformer.ops import reference
        return reference.cross_entropy_fwd, reference.cross_entropy_bwd
    if backend == "triton":
        from fastformer.triton import cross_entropy
        return cross_entropy.cross_entropy_fwd, cross_entropy.cross_entropy_bwd
    from fastformer import cuda_sim
    return cuda_sim.entry("cross_entropy", "fwd"), cuda_sim.entry("cross_entropy", "bwd")


@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b != "cpu"])  # cpu: always checked at the call
def test_an_unchecked_out_of_range_target_reads_no_logit(backend):
    # Far outside [0, V) (a read there would leave the tensor): the row's nll and loss are NaN and its gradient
    # has no one-hot column, without a logit read for the target; the other rows are those of good targets.
    V, e = 97, 0.1
    logits = randn(4, V, dtype=torch.float32)
    good, bad = torch.tensor([3, 5, -100, 7]), torch.tensor([3, 1 << 40, -100, -(1 << 40)])
    fwd, bwd = unchecked_kernels(backend)
    loss, nll, lse = fwd(logits, bad, e, -100)
    good_loss, good_nll, good_lse = fwd(logits, good, e, -100)
    assert loss[[1, 3]].isnan().all() and nll[[1, 3]].isnan().all()
    torch.testing.assert_close(loss[[0, 2]], good_loss[[0, 2]])
    torch.testing.assert_close(nll[[0, 2]], good_nll[[0, 2]])
    torch.testing.assert_close(lse, good_lse)
    dloss, dnll = torch.rand(4), torch.rand(4)
    dlogits = bwd(dloss, dnll, logits, bad, lse, e, -100)
    good_dlogits = bwd(dloss, dnll, logits, good, lse, e, -100)
    torch.testing.assert_close(dlogits[[0, 2]], good_dlogits[[0, 2]])
    no_hot = (dloss + dnll)[:, None] * torch.softmax(logits, -1) - (e * dloss / V)[:, None]
    torch.testing.assert_close(dlogits[[1, 3]], no_hot[[1, 3]], rtol=1e-5, atol=1e-6)
