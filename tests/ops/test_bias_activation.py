"""ops.bias_activation against the float64 torch reference: every backend and dtype, odd widths.

y = dropout(act(x + bias)) over the last dim, act = relu, gelu (exact) or silu; bias (N,) float32 beside a
float16/bfloat16/float32 x (the float32 master bias), or of x's dtype; gradients dx (x's dtype) and dbias
(bias's dtype). Dropout parity across backends is in test_dropout.py; here dropout_p = 0 except where named.
"""
import math
from dataclasses import dataclass

import pytest
import torch

from fastformer import ops
from helpers import (ALL_BACKENDS, FLOAT64_BACKENDS, SLOW_LIMITS, backend_dtype_cases, forward_backward, randn,
                     upcast)
from tolerances import assert_close

ACTIVATIONS = ("relu", "gelu", "silu")


@dataclass(frozen=True)
class Case:
    shape: tuple  # x: (..., N)
    activation: str = "relu"
    bias_dtype: torch.dtype = torch.float32  # None: x's dtype

    @property
    def rows(self):
        return math.prod(self.shape[:-1])

    def __str__(self):
        bias = "xdtype" if self.bias_dtype is None else str(self.bias_dtype).removeprefix("torch.")
        return "x".join(map(str, self.shape)) + f"-{self.activation}-bias_{bias}"


def small(case):
    """Whether the case fits the limits of the slow (simulated GPU) backends."""
    return case.rows <= SLOW_LIMITS["rows"] and case.shape[-1] <= 128


SHAPES = [(1, 1), (7, 1), (1, 7), (7, 7), (7, 97), (1, 113), (2, 7, 113), (16, 128), (113, 97), (113, 7),
          (97, 113), (3, 37, 512), (113,)]
CASES = ([Case(shape, activation) for shape in SHAPES for activation in ACTIVATIONS]
         + [Case((7, 97), activation, None) for activation in ACTIVATIONS]
         + [Case((16, 64), "gelu", None), Case((113, 64), "silu", torch.float64)])


def make_inputs(case, dtype):
    N = case.shape[-1]
    x = randn(*case.shape, dtype=dtype, scale=2.0)
    bias = randn(N, dtype=dtype if case.bias_dtype is None else case.bias_dtype)
    return [x, bias], [randn(*case.shape, dtype=dtype)]


def coarser(a, b):
    """The less precise of two float dtypes: dbias is summed in float32 (float64 for float64 x), then rounded
    to bias's dtype, so its error is the coarser one's."""
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def bias_act_fn(backend, activation, p=0.0):
    return lambda x, bias: ops.bias_activation(x, bias, activation=activation, dropout_p=p, backend=backend)


def test_activation_names_are_the_models():
    # The op's names, in code order (csrc/activation.h), are config.activation's: the model passes its own.
    from fastformer.nn.config import ACTIVATIONS as MODEL_ACTIVATIONS
    from fastformer.ops.bias_activation import ACTIVATIONS as OP_ACTIVATIONS

    assert OP_ACTIVATIONS == MODEL_ACTIVATIONS == ACTIVATIONS


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_torch_reference_matches_naive_formula(activation):
    # The reference's hand-written backward against autograd through torch's own functions.
    naive_act = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu}[activation]
    inputs, upstream = make_inputs(Case((5, 2, 33), activation, None), torch.float64)
    outs, grads = forward_backward(bias_act_fn("torch", activation), inputs, upstream)
    expected, expected_grads = forward_backward(lambda x, b: naive_act(x + b), inputs, upstream)
    assert_close(outs[0], expected[0], torch.float64, "y")
    for name, g, e in zip(("dx", "dbias"), grads, expected_grads):
        assert_close(g, e, torch.float64, name)


@pytest.mark.parametrize("backend,dtype,case", backend_dtype_cases(ALL_BACKENDS, CASES, small))
def test_bias_activation_matches_reference(backend, dtype, case):
    inputs, upstream = make_inputs(case, dtype)
    (y,), (dx, dbias) = forward_backward(bias_act_fn(backend, case.activation), inputs, upstream)
    (ref,), (ref_dx, ref_dbias) = forward_backward(bias_act_fn("torch", case.activation), upcast(inputs),
                                                   upcast(upstream))
    assert_close(y, ref, dtype, "y")
    assert_close(dx, ref_dx, dtype, "dx")
    assert dbias.dtype == inputs[1].dtype
    judge = coarser(inputs[1].dtype, torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(dbias.to(judge), ref_dbias, judge, "dbias")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_dropout_matches_reference_and_regenerates_the_mask(backend, activation):
    # Same torch seed -> same mask as the reference, forward and backward (the mask of gelu and silu is
    # regenerated in backward; relu's is read off y).
    # 68 columns: rows start at multiples of 4 (one Philox call per 4); 33: rows start anywhere in a group.
    for case in (Case((9, 68), activation), Case((5, 33), activation)):
        inputs, upstream = make_inputs(case, torch.float32)

        def seeded(backend):
            def call(x, bias):
                torch.manual_seed(1234)
                return bias_act_fn(backend, activation, 0.3)(x, bias)
            return call

        (y,), (dx, dbias) = forward_backward(seeded(backend), inputs, upstream)
        (ref,), (ref_dx, ref_dbias) = forward_backward(seeded("torch"), upcast(inputs), upcast(upstream))
        assert_close(y, ref, torch.float32, "y")
        assert_close(dx, ref_dx, torch.float32, "dx")
        assert_close(dbias, ref_dbias, torch.float32, "dbias")
        (plain,), _ = forward_backward(bias_act_fn("torch", activation), upcast(inputs), upcast(upstream))
        assert ((ref == 0) & (plain != 0)).any(), "nothing was dropped"


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_gradcheck(backend, activation, p):
    # Finite differences re-run the forward with the same seed (same mask): the analytic gradient passes
    # only if backward uses exactly the forward's mask.
    x = randn(3, 7, dtype=torch.float64, scale=2.0)
    x = torch.where(x.abs() < 0.05, 0.5, x)  # relu's kink away from the finite differences' steps
    bias = torch.zeros(7, dtype=torch.float64)

    def fn(x, bias):
        torch.manual_seed(7)
        return bias_act_fn(backend, activation, p)(x, bias)

    assert torch.autograd.gradcheck(fn, [x.requires_grad_(), bias.requires_grad_()])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_strided_and_offset_inputs(backend):
    # A transposed view and a view at an odd element offset give the results of contiguous copies, bit for bit.
    base = randn(40 * 33 + 3, dtype=torch.float32)
    x_offset = base[3:].view(40, 33)[:16]
    x_transposed = randn(33, 16, dtype=torch.float32).t()
    bias = randn(33, dtype=torch.float32)
    for x in (x_offset, x_transposed):
        for activation in ACTIVATIONS:
            dy = randn(16, 33, dtype=torch.float32).t().contiguous().t()  # a non-contiguous upstream too
            (y,), (dx, db) = forward_backward(bias_act_fn(backend, activation), [x, bias], [dy])
            (yc,), (dxc, dbc) = forward_backward(bias_act_fn(backend, activation), [x.contiguous(), bias],
                                                 [dy.contiguous()])
            assert torch.equal(y, yc) and torch.equal(dx, dxc) and torch.equal(db, dbc), (activation, x.stride())


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_output_dtypes_and_bias_dtypes(backend):
    # y and dx in x's dtype; dbias in bias's dtype, whatever the pair (a bfloat16 bias beside float16 x too).
    x = randn(5, 12, dtype=torch.float16)
    dy = randn(5, 12, dtype=torch.float16)
    for bias_dtype in (torch.float32, torch.float16, torch.bfloat16):
        bias = randn(12, dtype=bias_dtype)
        (y,), (dx, db) = forward_backward(bias_act_fn(backend, "silu"), [x, bias], [dy])
        (ref,), (ref_dx, ref_db) = forward_backward(bias_act_fn("torch", "silu"), upcast([x, bias]), upcast([dy]))
        assert (y.dtype, dx.dtype, db.dtype) == (torch.float16, torch.float16, bias_dtype)
        assert_close(y, ref, torch.float16, "y")
        assert_close(dx, ref_dx, torch.float16, "dx")
        assert_close(db, ref_db, bias_dtype, "dbias")


def test_relu_saves_its_output_and_gelu_its_input():
    # relu's backward needs y only (fc1's output can be freed), gelu's and silu's need x.
    x = randn(4, 8, dtype=torch.float32).requires_grad_()
    bias = randn(8, dtype=torch.float32).requires_grad_()
    for activation, saved in (("relu", "y"), ("gelu", "x"), ("silu", "x")):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            y = ops.bias_activation(x, bias, activation=activation, backend="cpu")
        expected = y if saved == "y" else x
        assert any(t.data_ptr() == expected.data_ptr() and t.shape == expected.shape for t in packed), activation
        assert not any(t.data_ptr() == (x if saved == "y" else y).data_ptr() for t in packed), activation


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_empty_inputs(backend):
    for shape in ((0, 5), (3, 0)):
        x = torch.randn(shape, requires_grad=True)
        bias = torch.randn(shape[-1], requires_grad=True)
        y = ops.bias_activation(x, bias, activation="gelu", backend=backend)
        y.sum().backward()
        assert y.shape == shape and x.grad.shape == shape
        assert torch.equal(bias.grad, torch.zeros(shape[-1]))
