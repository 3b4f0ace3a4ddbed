"""fastformer._C.packed_linear, the incremental decoder's small-M projection kernel (csrc/gemm/packed_linear.cpp),
against the float64 reference x W^T + b: row counts around the kernel's row groups (1-17, 97; AVX2 takes 6-row
blocks over half panels from 8 rows), odd widths around the 32-column panels, with and without bias, on one
and two threads; bad arguments raise ValueError.
CI runs this file at every CPU instruction-set level the machine supports."""
import pytest
import torch

from fastformer._ext import C
from fastformer.nn.linear import linear, pack_panels
from helpers import randn
from tolerances import assert_close


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 97])
@pytest.mark.parametrize("K, N", [(1, 1), (7, 31), (97, 32), (256, 33), (64, 1000), (113, 97)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_linear_matches_reference(M, K, N, with_bias):
    x, w = randn(M, K, dtype=torch.float32), randn(N, K, dtype=torch.float32)
    b = randn(N, dtype=torch.float32) if with_bias else None
    panels = pack_panels(w)
    P, S = C.PACKED_LINEAR_PANEL, C.PACKED_LINEAR_STRIP
    assert panels.shape == ((N + P - 1) // P, P // S, K, S)
    y = C.packed_linear(x, panels, b, N)
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert_close(y, ref, torch.float32, "y")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("M", [4, 40])
def test_packed_linear_splits_panels_over_threads(threads, M):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w, b = randn(M, 256, dtype=torch.float32), randn(8000, 256, dtype=torch.float32), randn(8000,
                                                                                                 dtype=torch.float32)
        y = C.packed_linear(x, pack_panels(w), b, 8000)
    finally:
        torch.set_num_threads(before)
    assert_close(y, x.double() @ w.double().t() + b.double(), torch.float32, "y")


def shifted(x, offset):
    """x's values in a view ``offset`` elements into a larger buffer: a data pointer misaligned by offset."""
    view = torch.empty(x.numel() + offset, dtype=x.dtype)[offset:].view(x.shape)
    return view.copy_(x)


@pytest.mark.parametrize("M", [4, 40, 128])
def test_packed_linear_is_bit_identical_on_1_2_and_3_threads(M):
    """The panels split over threads, each panel's arithmetic the same on any thread (128 rows: AVX2's 6-row
    groups and the 4 + 4 split of the last 8), and x read at any memory offset (no BLAS: the result depends
    on the values alone)."""
    x, w, b = randn(M, 256, dtype=torch.float32), randn(8001, 256, dtype=torch.float32), randn(8001,
                                                                                              dtype=torch.float32)
    panels, before = pack_panels(w), torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outputs += [C.packed_linear(shifted(x, offset), panels, b, 8001) for offset in (0, 1, 2, 3, 8)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outputs[0], y) for y in outputs[1:])


def test_linear_takes_the_packed_kernel_at_any_row_count():
    layer = torch.nn.Linear(40, 70)
    with torch.no_grad():
        for rows in (1, 5, 256, 641):
            x = randn(rows, 40, dtype=torch.float32)
            assert_close(linear(x, layer.weight, layer.bias),
                         x.double() @ layer.weight.double().t() + layer.bias.double(), torch.float32)


@pytest.mark.parametrize("args, message", [
    (lambda: (torch.zeros(2, 8, dtype=torch.float64), pack_panels(torch.zeros(5, 8)), None, 5),
     "x must be a 2-D float32"),
    (lambda: (torch.zeros(8), pack_panels(torch.zeros(5, 8)), None, 5), "x must be a 2-D float32"),
    (lambda: (torch.zeros(2, 8), pack_panels(torch.zeros(5, 9)), None, 5), "panels must be a contiguous float32"),
    (lambda: (torch.zeros(2, 8), pack_panels(torch.zeros(5, 8)), None, 40), "panels must be a contiguous float32"),
    (lambda: (torch.zeros(2, 8), pack_panels(torch.zeros(5, 8)), torch.zeros(4), 5), "bias must be a contiguous float32"),
    (lambda: (torch.zeros(2, 8), pack_panels(torch.zeros(5, 8)), None, -1), "n and K must be >= 0"),
])
def test_packed_linear_bad_arguments_raise(args, message):
    with pytest.raises(ValueError, match=message):
        C.packed_linear(*args())
