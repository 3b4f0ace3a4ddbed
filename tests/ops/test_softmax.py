"""ops.softmax against the float64 torch reference: every backend and dtype, masks and broadcasting.

softmax(scale * x, with mask=True positions set to -inf) over the last dim; the mask is bool and
broadcastable to x; a fully masked row returns zeros. Forward and backward (random upstream gradient) are
compared with the torch backend run in float64 on float64 copies of the same inputs.
"""
import math
from dataclasses import dataclass

import pytest
import torch

from fastformer import ops
from helpers import ALL_BACKENDS, FLOAT64_BACKENDS, SLOW_LIMITS, backend_dtype_cases, forward_backward, randn, upcast
from tolerances import assert_close


@dataclass(frozen=True)
class Case:
    shape: tuple
    mask_shape: tuple | None = None  # None: no mask
    scale: float = 1.0

    @property
    def rows(self):
        return math.prod(self.shape[:-1])

    def __str__(self):
        shape = "x".join(map(str, self.shape))
        mask = "nomask" if self.mask_shape is None else "mask" + "x".join(map(str, self.mask_shape))
        return f"{shape}-{mask}-scale{self.scale}"


def small(case):
    """Whether the case fits the limits of the slow (simulated GPU) backends."""
    return case.rows <= SLOW_LIMITS["rows"] and case.shape[-1] <= SLOW_LIMITS["N"]


CASES = [
    # Within the slow backends' limits.
    Case((97,)),
    Case((1, 1)),
    Case((7, 1), (7, 1)),  # one element per row: 1, or 0 when masked
    Case((7, 113), (7, 113)),
    Case((2, 1, 7, 40), (2, 1, 7, 1), 0.5),  # whole rows masked through a broadcast last dim
    Case((2, 2, 3, 33), (2, 1, 1, 33), 2.0),  # per-batch key mask broadcast over heads and rows
    Case((3, 4099), None, 0.5),  # long rows: the kernels loop over blocks of a row
    Case((2, 4099), (2, 4099)),
    Case((2, 7, 128), (128,), 0.125),
    # Bigger.
    Case((2, 3, 7, 113), (2, 1, 1, 113), 0.125),
    Case((2, 3, 97, 16), (97, 16), 2.0),  # mask broadcast over leading dims
    Case((2, 3, 7, 40), (2, 3, 7, 1)),
    Case((113, 97), (113, 97), 1.5),
    Case((5, 4099), (1, 4099)),  # one mask row for every row
    Case((4, 64, 512)),
    Case((1000, 7), (1000, 7)),
]


def make_mask(case, shape):
    """Random bool mask of ``shape`` (True = masked); forces a fully masked row of x where it can."""
    mask = torch.rand(shape) < 0.3
    if shape[-1] == 1:  # one flag per row of x
        mask.view(-1)[0] = True
    elif mask[..., 0].numel() > 1:  # several mask rows: mask the first completely
        mask.view(-1, shape[-1])[0] = True
    return mask


def has_forced_empty_row(case):
    shape = case.mask_shape
    return shape is not None and (shape[-1] == 1 or torch.Size(shape[:-1]).numel() > 1)


def make_inputs(case, dtype):
    x = randn(*case.shape, dtype=dtype, scale=2.0)
    mask = None if case.mask_shape is None else make_mask(case, case.mask_shape)
    dy = randn(*case.shape, dtype=dtype)
    return x, mask, dy


def softmax_fn(backend, case, mask):
    return lambda x: ops.softmax(x, mask=mask, scale=case.scale, backend=backend)


def naive_softmax(x, mask, scale):
    """softmax over the last dim with masked positions excluded; fully masked rows give zeros."""
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else ~mask.expand(x.shape)
    empty = ~keep.any(-1, keepdim=True)
    z = (x * scale).masked_fill(~keep, float("-inf")).masked_fill(empty, 0.0)
    return torch.softmax(z, dim=-1) * keep


@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_reference_matches_naive_formula(case):
    x, mask, dy = make_inputs(case, torch.float64)
    (y,), (dx,) = forward_backward(softmax_fn("torch", case, mask), [x], [dy])
    (expected,), (expected_dx,) = forward_backward(lambda x: naive_softmax(x, mask, case.scale), [x], [dy])
    assert_close(y, expected, torch.float64, "y")
    assert_close(dx, expected_dx, torch.float64, "dx")


@pytest.mark.parametrize("backend,dtype,case", backend_dtype_cases(ALL_BACKENDS, CASES, small))
def test_softmax_matches_reference(backend, dtype, case):
    x, mask, dy = make_inputs(case, dtype)
    (y,), (dx,) = forward_backward(softmax_fn(backend, case, mask), [x], [dy])
    (ref,), (ref_dx,) = forward_backward(softmax_fn("torch", case, mask), upcast([x]), upcast([dy]))
    assert_close(y, ref, dtype, "y")
    assert_close(dx, ref_dx, dtype, "dx")
    if mask is not None:
        # Masked positions are exactly zero (exp(-inf)); fully masked rows are zero with zero gradient.
        full_mask = mask.expand(case.shape)
        assert (y[full_mask] == 0).all(), "masked positions must be exactly zero"
        empty = full_mask.all(-1)
        assert empty.any() or not has_forced_empty_row(case), "make_mask should have masked a whole row"
        assert (y[empty] == 0).all() and (dx[empty] == 0).all(), "a fully masked row must return zeros"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_rows_sum_to_one(backend):
    # Each row with at least one unmasked position is a probability distribution.
    case = Case((4, 3, 33), (4, 1, 33), 0.7)
    x, mask, _ = make_inputs(case, torch.float32)
    y = ops.softmax(x, mask=mask, scale=case.scale, backend=backend)
    full_mask = mask.expand(case.shape)
    live = ~full_mask.all(-1)
    torch.testing.assert_close(y.sum(-1)[live], torch.ones(int(live.sum())), atol=1e-5, rtol=0)
    assert (y >= 0).all()


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
def test_gradcheck_float64(backend):
    # Analytic gradient against finite differences, with a broadcast mask and scale != 1.
    x = randn(3, 4, 9, dtype=torch.float64).requires_grad_()
    mask = torch.rand(3, 1, 9) < 0.3
    mask[0, 0, :] = True
    assert torch.autograd.gradcheck(lambda x: ops.softmax(x, mask=mask, scale=0.7, backend=backend), [x])
