"""The CPU micro-kernel's tile products (csrc/gemm/micro_kernel.h, variants in csrc/gemm/products.h), one
variant at a time through the test hook ``fastformer._C.tile_product``: each variant's result against the float64
product of the same inputs within the summation error bound, and each variant's guarantee: a result that depends
on its own row of A and column of B alone (not on memory offsets, not on the rows and columns computed beside
it), and bf16_dot equal to bf16_emulated bit for bit. CPU attention in bfloat16 runs on these products
(tests/ops/test_attention.py, test_threads.py check it through the op)."""
import pytest
import torch

from fastformer import _C as C
from helpers import at_offset
from tolerances import product_bound

VARIANTS = C.product_variants()
DTYPES = {"fma": (torch.float32, torch.float64), "bf16_dot": (torch.bfloat16,), "bf16_emulated": (torch.bfloat16,)}
CASES = [(variant, dtype) for variant in VARIANTS for dtype in DTYPES[variant]]
# (m, k, n): odd sizes on purpose, k = 1 and odd k (the bf16 variants' last half pair), n below, at and past
# one register of columns and every column-block width (4, 2, 1 registers and the padded rest).
SHAPES = [(1, 1, 1), (7, 33, 97), (113, 64, 7), (97, 7, 113), (6, 128, 64), (13, 63, 48), (64, 64, 32),
          (5, 1, 200), (1, 257, 16)]


def _ids(case):
    return f"{case[0]}-{str(case[1]).removeprefix('torch.')}"


def _operands(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)


def test_the_variants_listed():
    assert VARIANTS[0] == "fma" and "bf16_emulated" in VARIANTS
    assert set(VARIANTS) <= set(DTYPES)


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_product_matches_float64(case, shape):
    variant, dtype = case
    a, b = _operands(*shape, dtype)
    c = C.tile_product(a, b, variant)
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    assert c.dtype == accumulate and c.shape == (shape[0], shape[2])
    ref = a.double() @ b.double()
    bound = product_bound(a.double(), b.double(), accumulate)
    excess = ((c.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"{variant}: the error exceeds the summation bound by {excess:.3g}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_results_do_not_depend_on_offsets_or_neighbours(case):
    """Each element is its own chain of multiply-adds: the same bits at any memory offset and row stride, and
    whichever rows and columns are computed with it (other row blocks, column blocks, the padded rest)."""
    variant, dtype = case
    m, k, n = 29, 67, 83
    a, b = _operands(m, k, n, dtype, seed=1)
    full = C.tile_product(a, b, variant)
    for offset, pad in [(1, 0), (3, 5), (7, 1)]:
        moved = C.tile_product(at_offset(a, offset, pad), at_offset(b, offset + 2, pad + 3), variant)
        assert torch.equal(moved, full), f"{variant}: offset {offset}, row padding {pad}"
    for r0, r1 in [(0, 1), (5, 12), (13, 29)]:
        assert torch.equal(C.tile_product(a[r0:r1], b, variant), full[r0:r1]), f"{variant}: rows {r0}:{r1}"
    for c0, c1 in [(0, 3), (16, 48), (64, 83), (1, 82)]:
        cols = C.tile_product(a, b[:, c0:c1].contiguous(), variant)
        assert torch.equal(cols, full[:, c0:c1]), f"{variant}: columns {c0}:{c1}"


@pytest.mark.skipif("bf16_dot" not in VARIANTS, reason="this CPU has no AVX512_BF16 (bf16_dot does not run here); "
                    "bf16_emulated is checked against float64 above")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_dot_equals_emulated_bit_for_bit(shape):
    a, b = _operands(*shape, torch.bfloat16, seed=2)
    a = a * 2.0 ** torch.randint(-8, 9, a.shape).to(torch.bfloat16)  # magnitudes far apart: roundings matter
    assert torch.equal(C.tile_product(a, b, "bf16_dot"), C.tile_product(a, b, "bf16_emulated"))


def test_bad_input_is_refused():
    a, b = _operands(4, 5, 6, torch.float32)
    with pytest.raises(ValueError, match="does not run here"):
        C.tile_product(a, b, "amx")
    with pytest.raises(ValueError, match="bfloat16"):
        C.tile_product(a, b, "bf16_emulated")
    with pytest.raises(ValueError, match=r"a \(m, k\) and b \(k, n\)"):
        C.tile_product(a, b.t(), "fma")
    with pytest.raises(ValueError, match="unit column strides"):
        C.tile_product(a.t().contiguous().t(), b, "fma")
