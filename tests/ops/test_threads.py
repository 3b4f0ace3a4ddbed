"""A result must not depend on the number of threads: every op of the cpu backend, forward and backward,
gives bit-identical results with 1, 2 and 3 threads (a training run or a translation must not change with
the machine's core count). Nor on where its inputs lie: attention's tile products are fastformer's own
(csrc/gemm/micro_kernel.h), because a BLAS may take alignment- and thread-dependent paths (MKL's default mode
on Intel CPUs does), so the same call on views shifted by 1, 2, 3 and 8 elements, at 1, 2 and 3 threads,
gives bit-identical results too.

Shapes are odd on purpose, so that work splits unevenly over the threads: attention (4, 3, 113, 59) x
(4, 3, 203, 59) has 24 query tiles of 64 rows, the last one short, and 12 (batch, head) items in the
backward; 97 and 113 rows for the row-wise ops. Each call runs with dropout where the op has it, and
with masks, so every branch of the kernels is timed across threads.
"""
import pytest
import torch

from fastformer import ops
from helpers import BACKENDS, dtype_name, randn

THREADS = (1, 2, 3)
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend is not among the tested backends")


def attention_call(dtype):
    q = randn(4, 3, 113, 59, dtype=dtype).requires_grad_()
    k = randn(4, 3, 203, 59, dtype=dtype).requires_grad_()
    v = randn(4, 3, 203, 59, dtype=dtype).requires_grad_()
    mask = torch.rand(4, 203) < 0.2
    mask[1] = True  # a batch row with no visible key
    dout = randn(4, 3, 113, 59, dtype=dtype)

    def run():
        torch.manual_seed(7)  # the same dropout seed in every run
        out = ops.attention(q, k, v, key_padding_mask=mask, causal=True, dropout_p=0.1, backend="cpu")
        grads = torch.autograd.grad(out, (q, k, v), dout)
        return (out, *grads)

    return run


def attention_nomask_call(dtype):
    # The case: no mask, no dropout, no causal limit.
    q = randn(4, 3, 113, 59, dtype=dtype).requires_grad_()
    k = randn(4, 3, 203, 59, dtype=dtype).requires_grad_()
    v = randn(4, 3, 203, 59, dtype=dtype).requires_grad_()
    dout = randn(4, 3, 113, 59, dtype=dtype)

    def run():
        out = ops.attention(q, k, v, backend="cpu")
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    return run


def attention_varlen_call(dtype):
    # Packed sequences of spread lengths (an empty one, one longer than the rest: its items are split over the
    # threads by cost in the backward), 6 query heads over 2 key/value heads, causal, dropout.
    lens_q, lens_k = [113, 0, 7, 250, 1], [203, 5, 0, 251, 9]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    q = randn(sum(lens_q), 6, 59, dtype=dtype).requires_grad_()
    k = randn(sum(lens_k), 2, 59, dtype=dtype).requires_grad_()
    v = randn(sum(lens_k), 2, 59, dtype=dtype).requires_grad_()
    dout = randn(sum(lens_q), 6, 59, dtype=dtype)

    def run():
        torch.manual_seed(7)
        out = ops.attention_varlen(q, k, v, cu_q, cu_k, 250, 251, causal=True, dropout_p=0.1, backend="cpu")
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    return run


def softmax_call(dtype):
    x = randn(97, 3, 113, dtype=dtype).requires_grad_()
    mask = torch.rand(97, 1, 113) < 0.3
    dy = randn(97, 3, 113, dtype=dtype)

    def run():
        y = ops.softmax(x, mask=mask, scale=0.7, backend="cpu")
        return (y, *torch.autograd.grad(y, (x,), dy))

    return run


def layer_norm_residual_call(dtype):
    x = randn(1031, 97, dtype=dtype).requires_grad_()  # more rows than the backward's fixed chunk count
    residual = randn(1031, 97, dtype=dtype).requires_grad_()
    weight = randn(97, dtype=dtype, shift=1.0).requires_grad_()
    bias = randn(97, dtype=dtype).requires_grad_()
    dy, ds = randn(1031, 97, dtype=dtype), randn(1031, 97, dtype=dtype)

    def run():
        torch.manual_seed(7)
        y, s = ops.layer_norm_residual(x, residual, weight, bias, dropout_p=0.1, prenorm=True, backend="cpu")
        return (y, s, *torch.autograd.grad((y, s), (x, residual, weight, bias), (dy, ds)))

    return run


def layer_norm_residual_fused_call(dtype):
    # The fused epilogue: a float32 x_bias (its gradient dx_bias, a third reduction over the rows) and the
    # output also in a compute dtype (bfloat16, or float16 beside a bfloat16 stream), whose gradient adds.
    compute = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    x = randn(1031, 97, dtype=dtype).requires_grad_()
    residual = randn(1031, 97, dtype=dtype).requires_grad_()
    weight = randn(97, dtype=dtype, shift=1.0).requires_grad_()
    bias = randn(97, dtype=dtype).requires_grad_()
    x_bias = randn(97, dtype=torch.float32).requires_grad_()
    dy, dy_c = randn(1031, 97, dtype=dtype), randn(1031, 97, dtype=compute)

    def run():
        torch.manual_seed(7)
        y, y_c = ops.layer_norm_residual(x, residual, weight, bias, dropout_p=0.1, x_bias=x_bias,
                                         compute_dtype=compute, backend="cpu")
        return (y, y_c, *torch.autograd.grad((y, y_c), (x, residual, weight, bias, x_bias), (dy, dy_c)))

    return run


def cross_entropy_call(dtype):
    logits = randn(113, 7, 1001, dtype=dtype).requires_grad_()
    target = torch.randint(0, 1001, (113, 7))
    target[::5, 3] = -100
    dloss, dnll = torch.rand(113, 7, dtype=torch.float32), torch.rand(113, 7, dtype=torch.float32)
    if dtype == torch.float64:
        dloss, dnll = dloss.double(), dnll.double()

    def run():
        loss, nll = ops.cross_entropy(logits, target, label_smoothing=0.1, return_nll=True, backend="cpu")
        return (loss, nll, *torch.autograd.grad((loss, nll), (logits,), (dloss, dnll)))

    return run


def bias_activation_call(activation):
    def call(dtype):
        x = randn(1031, 97, dtype=dtype).requires_grad_()  # more rows than the backward's fixed chunk count
        bias = randn(97, dtype=torch.float32).requires_grad_()  # the float32 master bias
        dy = randn(1031, 97, dtype=dtype)

        def run():
            torch.manual_seed(7)
            y = ops.bias_activation(x, bias, activation=activation, dropout_p=0.1, backend="cpu")
            return (y, *torch.autograd.grad(y, (x, bias), dy))

        return run

    return call


# One call per op of csrc/ops.h's list (tests/test_op_lists.py fails while an op has none).
CALLS = {"attention": attention_call, "attention_nomask": attention_nomask_call,
         "attention_varlen": attention_varlen_call, "softmax": softmax_call,
         "layer_norm_residual": layer_norm_residual_call, "layer_norm_residual+fused": layer_norm_residual_fused_call,
         "cross_entropy": cross_entropy_call, "bias_activation-relu": bias_activation_call("relu"),
         "bias_activation-gelu": bias_activation_call("gelu"), "bias_activation-silu": bias_activation_call("silu")}


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("op", list(CALLS))
def test_results_do_not_depend_on_the_thread_count(op, dtype, restore_threads):
    run = CALLS[op](dtype)
    results = {}
    for n in THREADS:
        torch.set_num_threads(n)
        results[n] = run()
    for n in THREADS[1:]:
        for i, (a, b) in enumerate(zip(results[1], results[n])):
            assert torch.isfinite(a).all(), f"{op} output {i} holds non-finite values"
            assert torch.equal(a, b), (f"{op} {dtype_name(dtype)}: output {i} with {n} threads differs from 1 "
                                       f"thread by up to {(a.double() - b.double()).abs().max().item():.3g}")


OFFSETS = (0, 1, 2, 3, 8)


def shifted(x, offset, transposed=False):
    """x's values in a view that starts ``offset`` elements into a larger buffer (so its data pointer is
    misaligned by offset elements); ``transposed``: a (B, H, L, D) view of (B, L, H, D) memory, the layout
    the model's projections give."""
    B, H, L, D = x.shape
    buffer = torch.empty(x.numel() + offset, dtype=x.dtype)[offset:]
    view = buffer.view(B, L, H, D).transpose(1, 2) if transposed else buffer.view(B, H, L, D)
    view.copy_(x)
    return view


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_bias_activation_does_not_depend_on_memory_offsets(dtype, activation, restore_threads):
    # 113 rows of 97 (no whole vector at any level), views 1, 2, 3 and 8 elements off, at 1, 2 and 3 threads.
    x, dy, bias = randn(113, 97, dtype=dtype), randn(113, 97, dtype=dtype), randn(97, dtype=torch.float32)

    def at_offset(t, offset):
        view = torch.empty(t.numel() + offset, dtype=t.dtype)[offset:].view(t.shape)
        return view.copy_(t)

    def run(offset):
        xs, bs = at_offset(x, offset).requires_grad_(), at_offset(bias, offset).requires_grad_()
        torch.manual_seed(7)
        y = ops.bias_activation(xs, bs, activation=activation, dropout_p=0.1, backend="cpu")
        return (y, *torch.autograd.grad(y, (xs, bs), at_offset(dy, offset)))

    torch.set_num_threads(1)
    expected = run(0)
    for threads in THREADS:
        torch.set_num_threads(threads)
        for offset in OFFSETS:
            for i, (a, b) in enumerate(zip(expected, run(offset))):
                assert torch.equal(a, b), (f"bias_activation {activation} {dtype_name(dtype)}: output {i} at offset "
                                           f"{offset} with {threads} threads differs")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_attention_does_not_depend_on_memory_offsets(dtype, layout, restore_threads):
    # Odd shapes: 113 queries (two tiles, the last short), 203 keys (a short last key block), D 59 (not a
    # whole vector at any level); a mask with a fully padded batch row, causal, dropout.
    q, k, v = randn(3, 2, 113, 59, dtype=dtype), randn(3, 2, 203, 59, dtype=dtype), randn(3, 2, 203, 59, dtype=dtype)
    dout = randn(3, 2, 113, 59, dtype=dtype)
    mask = torch.rand(3, 203) < 0.2
    mask[1] = True

    def run(offset):
        inputs = [shifted(t, offset, layout == "blhd").requires_grad_() for t in (q, k, v)]
        torch.manual_seed(7)
        out = ops.attention(*inputs, key_padding_mask=mask, causal=True, dropout_p=0.1, backend="cpu")
        return (out, *torch.autograd.grad(out, inputs, shifted(dout, offset)))

    torch.set_num_threads(1)
    expected = run(0)
    for a in expected:
        assert torch.isfinite(a).all()
    for threads in THREADS:
        torch.set_num_threads(threads)
        for offset in OFFSETS:
            for i, (a, b) in enumerate(zip(expected, run(offset))):
                assert torch.equal(a, b), (
                    f"attention {dtype_name(dtype)} {layout}: output {i} with inputs {offset} elements off and "
                    f"{threads} threads differs from aligned, 1 thread, by up to "
                    f"{(a.double() - b.double()).abs().max().item():.3g}")


def shifted_rows(x, offset):
    """x's values (any shape) in a contiguous view ``offset`` elements into a larger buffer."""
    buffer = torch.empty(x.numel() + offset, dtype=x.dtype)[offset:]
    view = buffer.view(x.shape)
    view.copy_(x)
    return view


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_layer_norm_residual_fused_does_not_depend_on_memory_offsets(dtype, restore_threads):
    # The fused epilogue (x_bias, compute_dtype, dropout) on rows of 97 (no whole vector) with every input and
    # upstream gradient misaligned by the offset: y, y_c and every gradient, dx_bias included, bit for bit.
    compute = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    x, residual = randn(203, 97, dtype=dtype), randn(203, 97, dtype=dtype)
    weight, bias = randn(97, dtype=dtype, shift=1.0), randn(97, dtype=dtype)
    x_bias = randn(97, dtype=torch.float32)
    dy, dy_c = randn(203, 97, dtype=dtype), randn(203, 97, dtype=compute)

    def run(offset):
        inputs = [shifted_rows(t, offset).requires_grad_() for t in (x, residual, weight, bias, x_bias)]
        torch.manual_seed(7)
        y, y_c = ops.layer_norm_residual(*inputs[:4], dropout_p=0.1, x_bias=inputs[4], compute_dtype=compute,
                                         backend="cpu")
        grads = (shifted_rows(dy, offset), shifted_rows(dy_c, offset))
        return (y, y_c, *torch.autograd.grad((y, y_c), inputs, grads))

    torch.set_num_threads(1)
    expected = run(0)
    for threads in THREADS:
        torch.set_num_threads(threads)
        for offset in OFFSETS:
            for i, (a, b) in enumerate(zip(expected, run(offset))):
                assert torch.isfinite(a).all()
                assert torch.equal(a, b), (f"layer_norm_residual {dtype_name(dtype)}: output {i} with inputs {offset} "
                                           f"elements off and {threads} threads differs from aligned, 1 thread")
