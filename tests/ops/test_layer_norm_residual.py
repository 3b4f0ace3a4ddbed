"""ops.layer_norm_residual against the float64 torch reference: every backend and dtype, odd widths.

y = LayerNorm(residual + dropout(x)) over the last dim, with weight and bias of shape (N,);
prenorm=True also returns s = residual + dropout(x), and the gradient then flows through both outputs.
The fused epilogue (issue 52): x_bias, the branch's bias added before dropout, and compute_dtype, the
normalized output also written in float16/bfloat16 for the next GEMM (post-norm: (y, y_c); pre-norm: (y_c, s)).
(Dropout is tested in test_dropout.py; here dropout_p = 0, except with the vector paths and the mixed
dtypes: a float16 or bfloat16 x beside a float32 residual, weight and bias, autocast's case.)
"""
import math
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastformer import ops
from helpers import (ALL_BACKENDS, FLOAT64_BACKENDS, SLOW_LIMITS, backend_dtype_cases, forward_backward, kernel_op,
                     randn, upcast)
from tolerances import assert_close


@dataclass(frozen=True)
class Case:
    shape: tuple  # x and residual: (..., N)
    prenorm: bool = False
    eps: float = 1e-5

    @property
    def rows(self):
        return math.prod(self.shape[:-1])

    def __str__(self):
        return "x".join(map(str, self.shape)) + f"-prenorm{self.prenorm}-eps{self.eps}"


def small(case):
    """Whether the case fits the limits of the slow (simulated GPU) backends."""
    return case.rows <= SLOW_LIMITS["rows"] and case.shape[-1] <= SLOW_LIMITS["N"]


CASES = [
    # Within the slow backends' limits.
    Case((1, 1)),  # N = 1: variance 0, y = bias, finite gradients
    Case((7, 1), True),
    Case((7, 7)),
    Case((7, 97), True),
    Case((1, 113), False, 1e-6),
    Case((2, 7, 113), True),  # leading dims beyond rows
    Case((7, 512), False, 0.1),
    Case((1, 1000), True),
    Case((16, 1000), False),
    # Bigger.
    Case((113, 97), True),
    Case((113, 113), False, 1e-6),
    Case((3, 37, 512), True, 1e-5),
    Case((113, 1000), False),
    Case((7, 1000), True, 0.1),
    Case((113, 7), True),
]


def make_inputs(case, dtype):
    N = case.shape[-1]
    x = randn(*case.shape, dtype=dtype)
    residual = randn(*case.shape, dtype=dtype, scale=2.0, shift=0.5)
    weight = randn(N, dtype=dtype, shift=1.0)
    bias = randn(N, dtype=dtype)
    upstream = [randn(*case.shape, dtype=dtype) for _ in range(2 if case.prenorm else 1)]
    return [x, residual, weight, bias], upstream


def lnr_fn(backend, case):
    return lambda x, residual, weight, bias: ops.layer_norm_residual(
        x, residual, weight, bias, eps=case.eps, prenorm=case.prenorm, backend=backend
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_reference_matches_naive_formula(case):
    inputs, upstream = make_inputs(case, torch.float64)

    def naive(x, residual, weight, bias):
        s = residual + x
        y = torch.nn.functional.layer_norm(s, (case.shape[-1],), weight, bias, case.eps)
        return (y, s) if case.prenorm else y

    outs, grads = forward_backward(lnr_fn("torch", case), inputs, upstream)
    expected, expected_grads = forward_backward(naive, inputs, upstream)
    for name, o, e in zip(("y", "s"), outs, expected):
        assert_close(o, e, torch.float64, name)
    for name, g, e in zip(("dx", "dresidual", "dweight", "dbias"), grads, expected_grads):
        assert_close(g, e, torch.float64, name)


@pytest.mark.parametrize("backend,dtype,case", backend_dtype_cases(ALL_BACKENDS, CASES, small))
def test_layer_norm_residual_matches_reference(backend, dtype, case):
    inputs, upstream = make_inputs(case, dtype)
    outs, grads = forward_backward(lnr_fn(backend, case), inputs, upstream)
    refs, ref_grads = forward_backward(lnr_fn("torch", case), upcast(inputs), upcast(upstream))
    assert len(outs) == (2 if case.prenorm else 1)
    for name, o, r in zip(("y", "s"), outs, refs):
        assert_close(o, r, dtype, name)
    for name, g, r in zip(("dx", "dresidual", "dweight", "dbias"), grads, ref_grads):
        assert_close(g, r, dtype, name)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_single_feature_is_finite(backend, dtype):
    # N = 1: the variance is 0 and rstd = 1/sqrt(eps), so x - mean = 0, y = bias and dweight = 0;
    # nothing may turn into NaN.
    case = Case((7, 1), True)
    inputs, upstream = make_inputs(case, dtype)
    (y, s), (dx, dres, dw, db) = forward_backward(lnr_fn(backend, case), inputs, upstream)
    x, residual, _, bias = inputs
    zeros = torch.zeros(case.shape, dtype=torch.float64)
    assert_close(y, bias.double().expand(case.shape), dtype, "y")
    assert_close(s, (residual.double() + x.double()), dtype, "s")
    # ds flows straight back into x and residual; dy contributes nothing (y does not depend on s).
    assert_close(dx, upstream[1].double(), dtype, "dx")
    assert_close(dres, upstream[1].double(), dtype, "dresidual")
    assert_close(dw, zeros[0], dtype, "dweight")
    assert_close(db, upstream[0].double().sum(0), dtype, "dbias")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_large_mean_is_stable(backend):
    # Rows with mean 1000 and standard deviation 1: E[s^2] - E[s]^2 in float32 loses all precision,
    # a two-pass or Welford variance does not.
    case = Case((7, 512))
    inputs, upstream = make_inputs(case, torch.float32)
    inputs[1] = randn(*case.shape, dtype=torch.float32, shift=1000.0)
    outs, grads = forward_backward(lnr_fn(backend, case), inputs, upstream)
    refs, ref_grads = forward_backward(lnr_fn("torch", case), upcast(inputs), upcast(upstream))
    assert_close(outs[0], refs[0], torch.float32, "y")
    for name, g, r in zip(("dx", "dresidual", "dweight", "dbias"), grads, ref_grads):
        assert_close(g, r, torch.float32, name)


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
@pytest.mark.parametrize("prenorm", [False, True])
def test_gradcheck_float64(backend, prenorm):
    # Analytic gradients of all four inputs against finite differences.
    case = Case((3, 7), prenorm, 1e-5)
    inputs, _ = make_inputs(case, torch.float64)
    inputs = [t.requires_grad_() for t in inputs]
    assert torch.autograd.gradcheck(lnr_fn(backend, case), inputs)


def shifted(t, elements):
    """A contiguous copy of t whose data starts ``elements`` elements past a 16-byte boundary."""
    buffer = torch.empty(t.numel() + elements, dtype=t.dtype)
    view = buffer[elements:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 == elements * t.element_size() % 16
    return view


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N", [97, 98, 100, 104, 264, 1030])
@pytest.mark.parametrize("offset", [0, 2], ids=["aligned", "offset2"])
def test_vector_paths_chunks_and_dropout(backend, dtype, N, offset):
    # The CUDA kernels move a row in 16-byte packs (N a multiple of 4 floats or 8 halves, every tensor
    # 16-byte aligned), else in pairs (N even, 2-element aligned), else element by element, and draw the
    # dropout mask per pack, pair or element; each way must draw the mask every backend draws. N = 97:
    # elements; 98: pairs; 100 and 104: packs of floats, pairs of halves (a lane holds 4 values, half a
    # pack of halves); 264: packs of both; 1030: the block-per-row layout (pairs). offset2: every input and upstream gradient starts 2 elements past a
    # 16-byte boundary, so the packs give way to pairs. 70 rows: the backward's dweight/dbias partials come
    # from several chunks of rows (32 rows each in the warp layout), the last one short.
    case = Case((70, N), True)
    torch.manual_seed(0)
    inputs, upstream = make_inputs(case, dtype)
    inputs, upstream = [shifted(t, offset) for t in inputs], [shifted(t, offset) for t in upstream]

    def fn(backend):
        def run(x, residual, weight, bias):
            torch.manual_seed(7)  # the same dropout seed for every backend
            return ops.layer_norm_residual(x, residual, weight, bias, eps=case.eps, dropout_p=0.2, prenorm=True,
                                           backend=backend)
        return run

    outs, grads = forward_backward(fn(backend), inputs, upstream)
    refs, ref_grads = forward_backward(fn("torch"), upcast(inputs), upcast(upstream))
    for name, o, r in zip(("y", "s", "dx", "dresidual", "dweight", "dbias"), outs + grads, refs + ref_grads):
        assert_close(o, r, dtype, name)
    dropped = (grads[0] == 0).double().mean().item()  # dx is 0 exactly where x was dropped
    assert 0.1 < dropped < 0.3, f"dropout 0.2 dropped {dropped:.3f} of x"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_many_rows_grow_the_backward_chunks(backend):
    # 16,385 rows: more than the GPU kernels' 512 chunks of their minimum 32 rows, so each chunk grows to
    # 33 rows (497 partial rows of dweight/dbias for the second stage); dbias sums 16,385 values a column.
    case = Case((16385, 3))
    inputs, upstream = make_inputs(case, torch.float32)
    outs, grads = forward_backward(lnr_fn(backend, case), inputs, upstream)
    refs, ref_grads = forward_backward(lnr_fn("torch", case), upcast(inputs), upcast(upstream))
    assert_close(outs[0], refs[0], torch.float32, "y")
    for name, g, r in zip(("dx", "dresidual", "dweight", "dbias"), grads, ref_grads):
        assert_close(g, r, torch.float32, name)


# A float16 or bfloat16 branch beside a float32 residual stream (autocast's sublayer output beside the
# float32 stream and LayerNorm parameters): s = residual + dropout(x) in float32 from the upcast x; y, s,
# dresidual, dweight and dbias in float32, dx in x's dtype, each written by the kernels (no cast).
MIXED_CASES = [
    Case((1, 1)),  # N = 1
    Case((7, 40), True),  # N even: the CUDA kernels move pairs
    Case((1, 113), True),  # N odd: single elements
    Case((2, 7, 97)),
    Case((7, 1030), True, 0.1),  # the CUDA block-per-row layout
    Case((97, 113), True),  # bigger: not on the slow backends
    Case((97, 40)),
]


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("backend,dtype,case",
                         backend_dtype_cases(ALL_BACKENDS, MIXED_CASES, small, dtypes=(torch.float16, torch.bfloat16)))
def test_half_branch_beside_float32_residual_matches_reference(backend, dtype, case, dropout_p):
    inputs, upstream = make_inputs(case, torch.float32)
    inputs[0] = randn(*case.shape, dtype=dtype)

    def fn(backend):
        def run(x, residual, weight, bias):
            torch.manual_seed(7)  # the same dropout seed for every backend
            return ops.layer_norm_residual(x, residual, weight, bias, eps=case.eps, dropout_p=dropout_p,
                                           prenorm=case.prenorm, backend=backend)
        return run

    outs, grads = forward_backward(fn(backend), inputs, upstream)
    refs, ref_grads = forward_backward(fn("torch"), upcast(inputs), upcast(upstream))
    for name, o, r in zip(("y", "s"), outs, refs):
        assert_close(o, r, torch.float32, name)
    assert_close(grads[0], ref_grads[0], dtype, "dx")
    for name, g, r in zip(("dresidual", "dweight", "dbias"), grads[1:], ref_grads[1:]):
        assert_close(g, r, torch.float32, name)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("N", [97, 98, 264, 1030])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
def test_half_branch_vector_paths(backend, N, offset):
    # A float16 branch beside float32 rows: the CUDA kernels move pairs (N even, every row 2-element
    # aligned) or elements, never the 16-byte packs of one dtype, and draw the mask each way as every
    # backend does; offset1 starts every tensor one element past an aligned address. 70 rows: several
    # backward chunks of dweight/dbias partials, the last one short.
    case = Case((70, N), True)
    inputs, upstream = make_inputs(case, torch.float32)
    inputs[0] = randn(*case.shape, dtype=torch.float16)
    inputs, upstream = [shifted(t, offset) for t in inputs], [shifted(t, offset) for t in upstream]

    def fn(backend):
        def run(x, residual, weight, bias):
            torch.manual_seed(7)
            return ops.layer_norm_residual(x, residual, weight, bias, dropout_p=0.2, prenorm=True, backend=backend)
        return run

    outs, grads = forward_backward(fn(backend), inputs, upstream)
    refs, ref_grads = forward_backward(fn("torch"), upcast(inputs), upcast(upstream))
    dtypes = (torch.float32, torch.float32, torch.float16) + (torch.float32,) * 3
    for name, o, r, dtype in zip(("y", "s", "dx", "dresidual", "dweight", "dbias"), outs + grads, refs + ref_grads,
                                 dtypes):
        assert_close(o, r, dtype, name)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_backward_op_writes_each_gradient_in_its_dtype(backend):
    # The registered backward op itself (what autograd calls): dx_dtype = x's dtype gives dx in it;
    # None gives s's dtype, as before the argument existed.
    x, residual = randn(7, 40, dtype=torch.bfloat16), randn(7, 40, dtype=torch.float32)
    weight, bias = randn(40, dtype=torch.float32, shift=1.0), randn(40, dtype=torch.float32)
    fwd, tail = kernel_op("layer_norm_residual", "fwd", backend)
    bwd, _ = kernel_op("layer_norm_residual", "bwd", backend)
    y, s, mean, rstd, y_c = fwd(x, residual, weight, bias, 1e-5, 0.0, None, None, None, *tail)
    assert (y.dtype, s.dtype, mean.dtype, rstd.dtype) == (torch.float32,) * 4
    assert y_c.shape == (0,)  # no compute dtype asked for: an empty output
    dy = randn(7, 40, dtype=torch.float32)
    for dx_dtype, want in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (None, torch.float32)):
        dx, dres, dw, db, dxb = bwd(dy, None, s, weight, mean, rstd, 0.0, None, dx_dtype, None, None, *tail)
        assert dxb.shape == (0,)  # no x_bias: an empty gradient
        assert (dx.dtype, dres.dtype, dw.dtype, db.dtype) == (want,) + (torch.float32,) * 3
        # No dropout: dx is dresidual in dx's dtype, to one ulp (the Triton interpreter truncates float32 to
        # bfloat16 where a GPU rounds to nearest).
        torch.testing.assert_close(dx.double(), dres.double(), rtol=torch.finfo(want).eps, atol=0)


class AtenCalls(TorchDispatchMode):
    """The names of the ATen ops called while active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif("triton" not in ALL_BACKENDS, reason="the triton backend is not available")
def test_triton_backward_reduces_dweight_dbias_inside_the_op():
    # Stage two of the dweight/dbias/dx_bias reduction is a Triton kernel writing weight's and x_bias's dtype:
    # the backward calls no reduction or cast op of torch (only allocations; the interpreter adds its own host
    # copies), with the gradient of the bfloat16 output y_c read as it is.
    from fastformer.triton.layer_norm_residual import layer_norm_residual_bwd, layer_norm_residual_fwd

    x, residual = randn(70, 40, dtype=torch.bfloat16), randn(70, 40, dtype=torch.float32)
    weight, bias = randn(40, dtype=torch.float32, shift=1.0), randn(40, dtype=torch.float32)
    x_bias = randn(40, dtype=torch.float32)
    _, s, mean, rstd, _ = layer_norm_residual_fwd(x, residual, weight, bias, 1e-5, 0.0, None, x_bias, torch.bfloat16)
    dy, dy_c = randn(70, 40, dtype=torch.float32), randn(70, 40, dtype=torch.bfloat16)
    with AtenCalls() as calls:
        layer_norm_residual_bwd(dy, None, s, weight, mean, rstd, 0.0, None, torch.bfloat16, dy_c, x_bias)
    assert not [n for n in calls.names if "sum" in n or "_to_copy" in n or n == "aten::to"], calls.names


# The fused epilogue (issue 52): the branch's bias x_bias (a float32 master bias) and the normalized output in
# a compute dtype. The training case: a bfloat16 branch beside the float32 residual stream and parameters.
FUSED_CASES = [
    Case((1, 1)),
    Case((7, 1), True),
    Case((7, 40), True),  # N even: the CUDA kernels move pairs
    Case((1, 113)),  # N odd: single elements
    Case((2, 7, 97), True),
    Case((3, 64)),  # packs for a float32 stream (float32 branch, float32 y_c: none)
    Case((7, 1030), True, 0.1),  # the CUDA block-per-row layout
    Case((97, 113)),  # bigger: not on the slow backends
    Case((113, 512), True),
]


def fused_fn(backend, case, compute_dtype, dropout_p, with_bias=True):
    def run(x, residual, weight, bias, x_bias):
        torch.manual_seed(7)  # the same dropout seed for every backend
        return ops.layer_norm_residual(x, residual, weight, bias, eps=case.eps, dropout_p=dropout_p,
                                       prenorm=case.prenorm, x_bias=x_bias if with_bias else None,
                                       compute_dtype=compute_dtype, backend=backend)
    return run


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16, torch.float16], ids=["no_c", "c_bf16", "c_f16"])
@pytest.mark.parametrize("backend,dtype,case", backend_dtype_cases(ALL_BACKENDS, FUSED_CASES, small,
                                                                   dtypes=(torch.float32, torch.float16,
                                                                           torch.bfloat16)))
def test_x_bias_and_compute_dtype_match_reference(backend, dtype, case, compute_dtype, dropout_p):
    # x in dtype beside a float32 residual, weight, bias and x_bias; y_c (compute_dtype) against the float64
    # y in compute_dtype's tolerance; the gradients of y (or s) and y_c add; dx_bias = sum over rows of dx.
    inputs, upstream = make_inputs(case, torch.float32)
    inputs[0] = randn(*case.shape, dtype=dtype)
    inputs.append(randn(case.shape[-1], dtype=torch.float32, shift=0.5))
    if compute_dtype is not None:  # post-norm: (y, y_c); pre-norm: (y_c, s)
        upstream.append(randn(*case.shape, dtype=compute_dtype))
        if case.prenorm:
            upstream = [upstream[2], upstream[1]]
    outs, grads = forward_backward(fused_fn(backend, case, compute_dtype, dropout_p), inputs, upstream)
    # The reference in float64; with a compute dtype it returns y for y_c (its stream's dtype: the same tensor).
    refs, ref_grads = forward_backward(fused_fn("torch", case, None if compute_dtype is None else torch.float64,
                                                dropout_p), upcast(inputs), upcast(upstream))
    names = {(False, False): ("y",), (True, False): ("y", "s"), (False, True): ("y", "y_c"),
             (True, True): ("y_c", "s")}[case.prenorm, compute_dtype is not None]
    assert len(outs) == len(names)
    for name, o, r in zip(names, outs, refs):
        assert_close(o, r, compute_dtype if name == "y_c" else torch.float32, name)
    assert_close(grads[0], ref_grads[0], dtype, "dx")
    for name, g, r in zip(("dresidual", "dweight", "dbias", "dx_bias"), grads[1:], ref_grads[1:]):
        assert_close(g, r, torch.float32, name)


@pytest.mark.parametrize("backend,dtype,case",
                         backend_dtype_cases(ALL_BACKENDS, [Case((7, 97), True), Case((2, 3, 40)), Case((5, 1030))],
                                             small, dtypes=(torch.float16, torch.bfloat16)))
def test_fused_epilogue_in_the_stream_dtype(backend, dtype, case):
    # A float16 or bfloat16 stream (x, residual, weight, bias in dtype), a float32 x_bias (returned dx_bias in
    # float32) and the other half dtype as compute dtype: y_c = y rounded to dtype, then to the other.
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    inputs, upstream = make_inputs(case, dtype)
    inputs.append(randn(case.shape[-1], dtype=torch.float32))
    upstream.append(randn(*case.shape, dtype=other))
    if case.prenorm:
        upstream = [upstream[2], upstream[1]]
    outs, grads = forward_backward(fused_fn(backend, case, other, 0.0), inputs, upstream)
    refs, ref_grads = forward_backward(fused_fn("torch", case, torch.float64, 0.0), upcast(inputs),
                                       upcast(upstream))
    names = ("y_c", "s") if case.prenorm else ("y", "y_c")
    for name, o, r in zip(names, outs, refs):
        assert_close(o, r, other if name == "y_c" else dtype, name)
    for name, g, r in zip(("dx", "dresidual", "dweight", "dbias"), grads, ref_grads):
        assert_close(g, r, dtype, name)
    # dx_bias comes in x_bias's float32, with the accuracy of the stream (s is rounded to dtype).
    assert grads[4].dtype == torch.float32
    assert_close(grads[4].to(dtype), ref_grads[4], dtype, "dx_bias")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("N", [40, 97, 264, 1030])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
def test_compute_output_is_y_rounded(backend, compute_dtype, N, offset):
    # y_c is y.to(compute_dtype) bit for bit (the same pass rounds the stored y), on every vector path (N 40:
    # pairs, 97: elements, 264: packs of the float32 rows without y_c, 1030: block per row; offset1: unaligned).
    # The Triton interpreter rounds float32 to bfloat16 by truncation where torch rounds to nearest: one ulp.
    case = Case((70, N))
    inputs, _ = make_inputs(case, torch.float32)
    inputs = [shifted(t, offset) for t in inputs]
    x_bias = shifted(randn(N, dtype=torch.float32), offset)
    y, y_c = ops.layer_norm_residual(*inputs, x_bias=x_bias, compute_dtype=compute_dtype, backend=backend)
    plain = ops.layer_norm_residual(*inputs, x_bias=x_bias, backend=backend)
    assert y_c.dtype == compute_dtype and y.dtype == torch.float32
    if backend in ("cuda", "cuda_sim"):
        # A 2-byte y_c beside float32 rows turns the CUDA warp layout's 16-byte packs into pairs (N 264): the
        # row sums then add in another order, within float32 rounding.
        torch.testing.assert_close(y, plain)
    else:
        assert torch.equal(y, plain)  # asking for y_c changes nothing else
    if backend == "triton" and compute_dtype == torch.bfloat16:
        torch.testing.assert_close(y_c.double(), y.to(compute_dtype).double(), rtol=torch.finfo(compute_dtype).eps,
                                   atol=0)
    else:
        assert torch.equal(y_c, y.to(compute_dtype))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_x_bias_is_the_branch_plus_bias(backend):
    # x_bias adds to x before dropout: the same result as the branch x + x_bias (float32) without it, with the
    # same dropout mask (the element index rule is unchanged); dx_bias is the row sum of dx.
    case = Case((70, 98), True)
    inputs, upstream = make_inputs(case, torch.float32)
    inputs.append(randn(98, dtype=torch.float32))
    fused = fused_fn(backend, case, None, 0.3)
    outs, grads = forward_backward(fused, inputs, upstream)
    summed = fused_fn(backend, case, None, 0.3, with_bias=False)
    plain_outs, plain_grads = forward_backward(summed, [inputs[0] + inputs[4]] + inputs[1:], upstream)
    for name, o, r in zip(("y", "s", "dx", "dresidual", "dweight", "dbias"), outs + grads[:4],
                          plain_outs + plain_grads[:4]):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(grads[4], grads[0].sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
@pytest.mark.parametrize("prenorm", [False, True])
def test_gradcheck_float64_with_x_bias(backend, prenorm):
    # Analytic gradients of all five inputs (x_bias included) against finite differences; with compute_dtype
    # float64 (the stream's own) y_c is y, and both outputs' gradients add.
    case = Case((3, 7), prenorm, 1e-5)
    inputs, _ = make_inputs(case, torch.float64)
    inputs = [t.requires_grad_() for t in inputs + [randn(7, dtype=torch.float64)]]
    assert torch.autograd.gradcheck(fused_fn(backend, case, torch.float64, 0.0), inputs)
