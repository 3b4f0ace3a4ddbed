"""The CPU SIMT execution model (csrc/cuda_sim/simt.h) itself: CUDA semantics it must reproduce, races
it must expose and deadlocks it must raise instead of hanging. Runs small kernels of its own
(tests/cuda_sim/model_kernels.cpp)."""
from pathlib import Path

import pytest
import torch

import fastformer

pytestmark = pytest.mark.skipif(not fastformer.backends()["cuda_sim"], reason="cuda_sim needs a C++ compiler")

SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def kernels():
    from fastformer import cuda_sim

    module = cuda_sim.build("fastformer_cuda_sim_model_kernels", [Path(__file__).with_name("model_kernels.cpp")])
    yield module
    module.set_schedule_seed(cuda_sim.schedule_seed())


def test_thread_and_block_coordinates(kernels):
    grid, block = (3, 2, 2), (8, 4, 2)
    out = kernels.coords(list(grid), list(block))
    expected = [
        (tx, ty, tz, bx, by, bz)
        for bz in range(grid[2]) for by in range(grid[1]) for bx in range(grid[0])
        for tz in range(block[2]) for ty in range(block[1]) for tx in range(block[0])
    ]
    assert out.tolist() == [list(e) for e in expected]


@pytest.mark.parametrize("seed", (0,) + SEEDS)
@pytest.mark.parametrize("width", (32, 16, 8))
@pytest.mark.parametrize("arg", (1, 3, 16))
def test_warp_shuffles_match_cuda_semantics(kernels, seed, width, arg):
    kernels.set_schedule_seed(seed)
    x = torch.randn(32)
    src = torch.randint(-40, 40, (32,), dtype=torch.int32)
    out = kernels.shuffles(x, src, arg, width)
    lane = torch.arange(32)
    segment = lane // width * width
    idx = segment + src.long() % width
    xor = lane ^ arg
    xor = torch.where(xor < segment + width, xor, lane)
    down = torch.where(lane % width + arg < width, lane + arg, lane)
    up = torch.where(lane % width - arg >= 0, lane - arg, lane)
    for row, source in enumerate((idx, xor, down, up)):
        assert torch.equal(out[row], x[source]), f"shuffle kind {row}"


def test_half_and_bfloat16_rounding_matches_torch(kernels):
    special = torch.tensor([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6.1e-5, 5.96e-8,
                            2.98e-8, 2.99e-8, 1e-10, float("inf"), float("-inf"), 3.0e38, 1.0 + 2**-11, 1.0 + 3 * 2**-11])
    x = torch.cat([special, torch.randn(4096) * torch.logspace(-9, 6, 4096)])
    as_half, as_bf16 = kernels.convert(x)
    assert torch.equal(as_half, x.half().float())
    assert torch.equal(as_bf16, x.bfloat16().float())
    nan_half, nan_bf16 = kernels.convert(torch.tensor([float("nan")]))
    assert nan_half.isnan().all() and nan_bf16.isnan().all()


@pytest.mark.parametrize("seed", (0,) + SEEDS)
def test_barrier_orders_shared_memory(kernels, seed):
    kernels.set_schedule_seed(seed)
    x = torch.randn(6, 256)
    assert torch.equal(kernels.reverse(x, True), x.flip(1))


@pytest.mark.parametrize("seed", SEEDS)
def test_missing_barrier_is_a_visible_race(kernels, seed):
    """The same kernel with its one __syncthreads deleted gives wrong results under a shuffled schedule."""
    kernels.set_schedule_seed(seed)
    x = torch.randn(6, 256)
    out = kernels.reverse(x, False)
    wrong = (out != x.flip(1)).float().mean().item()
    assert wrong > 0.1, f"only {wrong:.1%} of the outputs differ: the model hides the race"


@pytest.mark.parametrize("kernel, message", [
    ("divergent_barrier", r"deadlock in block \([01], 0, 0\).*threads 16, .* exited; threads 0, 1, .* wait at __syncthreads "
                          r"\(model_kernels\.cpp:\d+\)"),
    ("two_barriers", r"divergent __syncthreads.*model_kernels\.cpp:\d+.*model_kernels\.cpp:\d+"),
    ("divergent_shuffle", r"divergent warp collective in block \(0, 0, 0\), warp 0"),
    ("bad_block", r"multiple of 32 threads"),
])
def test_broken_barriers_raise_instead_of_hanging(kernels, kernel, message):
    with pytest.raises(RuntimeError, match=message):
        kernels.run_broken(kernel)


# ---- the sm_80 instructions of csrc/cuda/mma.cuh -------------------------------------------------------


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_mma_sync_computes_a_times_b_plus_c(kernels, dtype):
    torch.manual_seed(0)
    a, b = torch.randn(16, 16).to(dtype), torch.randn(16, 8).to(dtype)
    c = torch.randn(16, 8)
    d = kernels.mma(a, b, c)
    expected = a.double() @ b.double() + c.double()
    # 16-bit products are exact in float32; only the float32 sums round.
    torch.testing.assert_close(d.double(), expected, atol=1e-5, rtol=1e-6)


def _ldmatrix_expected(x, trans):
    """The PTX ISA's ldmatrix.x4: lane l receives, from each 8 x 8 matrix i (rows by the lanes 8i..8i+7),
    the elements (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1), or with .trans (2 (l % 4), l / 4) and
    (2 (l % 4) + 1, l / 4); the first in the low 16 bits."""
    bits = x.to(torch.int64) & 0xFFFF
    mats = [bits[(i // 2) * 8:(i // 2) * 8 + 8, (i % 2) * 8:(i % 2) * 8 + 8] for i in range(4)]
    out = torch.empty(32, 4, dtype=torch.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i, m in enumerate(mats):
            lo, hi = (m[2 * t, g], m[2 * t + 1, g]) if trans else (m[g, 2 * t], m[g, 2 * t + 1])
            out[lane, i] = lo | (hi << 16)
    return out


@pytest.mark.parametrize("trans", (False, True))
def test_ldmatrix_distributes_rows_as_the_ptx_isa_says(kernels, trans):
    x = torch.arange(256, dtype=torch.int16).reshape(16, 16) * 7 + 3
    assert torch.equal(kernels.ldmatrix(x, trans), _ldmatrix_expected(x, trans))


@pytest.mark.parametrize("src_bytes", (16, 8, 0))
def test_cp_async_lands_by_the_wait_and_zero_fills(kernels, src_bytes):
    x = torch.arange(128, dtype=torch.float32) + 1
    expected = x.reshape(32, 4).clone()
    expected[:, src_bytes // 4:] = 0.0
    for seed in (0,) + SEEDS:
        kernels.set_schedule_seed(seed)
        before, after = kernels.cp_async(x, src_bytes, True)
        assert torch.equal(after.reshape(32, 4), expected)
        landed = (before.reshape(32, 4) == expected).all(1)
        pending = (before.reshape(32, 4) == -1).all(1)
        assert bool((landed | pending).all())
        if seed == 0:
            assert bool(pending.all()), "seed 0: every copy lands at its wait"
        elif src_bytes:
            assert bool(landed.any()) and bool(pending.any()), "a seed lands some copies early, some at the wait"


def test_cp_async_never_waited_for_raises(kernels):
    kernels.set_schedule_seed(0)
    with pytest.raises(RuntimeError, match="never waited for"):
        kernels.cp_async(torch.zeros(128), 16, False)
