"""A projection's gradients in bf16 training on the CPU (csrc/gemm/weight_grad.cpp): the op
``fastformer::weight_grad(dy, x) -> (dW, db)``, dW = dy^T x and db = dy's column sums, both float32, summed in
float32 on the micro-kernel (csrc/gemm/products.h) with dy read as a transposed A operand of row pairs. Checked:
against the float64 product of the same bfloat16 inputs within the summation error bound (odd shapes, more than
one block of tokens, an odd last pair); bf16_dot equal to bf16_emulated bit for bit; the same bits at any memory
offset, row stride and thread count; bad input refused; the fake's shapes (opcheck); and the model's bf16
projections taking it (fastformer/nn/linear.py)."""
import pytest
import torch

from fastformer import _C as C
from fastformer.nn.linear import Linear, set_compute_dtype
from helpers import at_offset
from tolerances import product_bound

BF16_VARIANTS = [v for v in C.product_variants() if v != "fma"]
# (M tokens, N outputs, K inputs): odd sizes; M past one block of 512 tokens with an odd last block; N past one
# chunk of 192 rows of dW and one task of 48; K at and past every column-block width.
SHAPES = [(1, 1, 1), (7, 97, 113), (113, 7, 97), (513, 33, 70), (300, 200, 5), (1031, 1, 64), (2, 385, 16)]


def _operands(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, n, generator=g).to(torch.bfloat16),
            torch.randn(m, k, generator=g).to(torch.bfloat16))


def _within_bound(actual, a, b):
    ref = a @ b
    excess = ((actual.double() - ref).abs() - product_bound(a, b, torch.float32)).max().item()
    return excess <= 0, excess


@pytest.mark.parametrize("variant", BF16_VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gradients_match_float64(variant, shape):
    dy, x = _operands(*shape)
    dw, db = C.weight_grad(dy, x, variant)
    assert dw.dtype == db.dtype == torch.float32 and dw.shape == (shape[1], shape[2]) and db.shape == (shape[1],)
    ok, excess = _within_bound(dw, dy.double().t(), x.double())
    assert ok, f"dW: the error exceeds the summation bound by {excess:.3g}"
    ok, excess = _within_bound(db[:, None], dy.double().t(), torch.ones(shape[0], 1, dtype=torch.float64))
    assert ok, f"db: the error exceeds the summation bound by {excess:.3g}"


def test_the_op_is_closer_to_float64_than_bf16_products():
    """What it replaces: ATen's bf16 product rounds dW to bfloat16 (then cast to float32)."""
    dy, x = _operands(1024, 64, 96, seed=3)
    ref = dy.double().t() @ x.double()
    dw, _ = torch.ops.fastformer.weight_grad(dy, x)
    ours = (dw.double() - ref).abs().max().item()
    aten = ((dy.t() @ x).double() - ref).abs().max().item()
    assert ours * 20 < aten, (ours, aten)


def test_no_tokens_gives_zeros():
    dy, x = _operands(0, 5, 7)
    dw, db = C.weight_grad(dy, x)
    assert torch.equal(dw, torch.zeros(5, 7)) and torch.equal(db, torch.zeros(5))
    dy, x = _operands(9, 5, 0)
    dw, db = C.weight_grad(dy, x)
    assert dw.shape == (5, 0) and torch.allclose(db, dy.float().sum(0))


@pytest.mark.skipif("bf16_dot" not in BF16_VARIANTS, reason="this CPU has no AVX512_BF16 (bf16_dot does not run "
                    "here); bf16_emulated is checked against float64 above")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_dot_equals_emulated_bit_for_bit(shape):
    dy, x = _operands(*shape, seed=2)
    dy = dy * 2.0 ** torch.randint(-8, 9, dy.shape).to(torch.bfloat16)  # magnitudes far apart: roundings matter
    for a, b in zip(C.weight_grad(dy, x, "bf16_dot"), C.weight_grad(dy, x, "bf16_emulated")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", BF16_VARIANTS)
def test_results_do_not_depend_on_offsets_strides_or_threads(variant):
    """Each element is its own chain: the same bits at any memory offset and row stride, from a transposed view
    (copied first), and at 1, 2 and 3 threads (threads take rows of dW)."""
    dy, x = _operands(531, 389, 83, seed=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = C.weight_grad(dy, x, variant)
        for offset, pad in [(1, 0), (3, 5), (7, 1)]:
            moved = C.weight_grad(at_offset(dy, offset, pad), at_offset(x, offset + 2, pad + 3), variant)
            assert all(torch.equal(m, f) for m, f in zip(moved, full)), f"offset {offset}, row padding {pad}"
        transposed = C.weight_grad(dy.t().contiguous().t(), x.t().contiguous().t(), variant)
        assert all(torch.equal(t, f) for t, f in zip(transposed, full))
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert all(torch.equal(t, f) for t, f in zip(C.weight_grad(dy, x, variant), full)), f"{threads} threads"
    finally:
        torch.set_num_threads(before)


def test_bad_input_is_refused():
    dy, x = _operands(4, 5, 6)
    with pytest.raises(ValueError, match="bfloat16 CPU tensors"):
        C.weight_grad(dy.float(), x)
    with pytest.raises(ValueError, match="same rows"):
        C.weight_grad(dy, x[:3])
    with pytest.raises(ValueError, match=r"dy \(M, N\)"):
        C.weight_grad(dy[0], x)
    with pytest.raises(ValueError, match="not a bfloat16 product"):
        C.weight_grad(dy, x, "fma")
    with pytest.raises(ValueError, match="not a bfloat16 product"):
        C.weight_grad(dy, x, "amx")
    with pytest.raises(ValueError, match="bfloat16 CPU tensors"):
        torch.ops.fastformer.weight_grad(dy, x.half())


def test_opcheck():
    dy, x = _operands(37, 11, 13)
    torch.library.opcheck(torch.ops.fastformer.weight_grad.default, (dy, x))


def test_a_bf16_projection_takes_its_gradients_in_float32():
    """Under autocast with compute copies (fastformer.train's bf16), a Linear's weight and bias gradients are the
    float32 sums of the bfloat16 inputs: the op's, not a bf16 product cast."""
    torch.manual_seed(0)
    layer = Linear(40, 24)
    set_compute_dtype(layer, torch.bfloat16)
    x = torch.randn(3, 50, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    dy2, x2 = dy.reshape(-1, 24), x.reshape(-1, 40).to(torch.bfloat16)
    dw, db = torch.ops.fastformer.weight_grad(dy2, x2)
    assert layer.weight.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, dw) and torch.equal(layer.bias.grad, db)
