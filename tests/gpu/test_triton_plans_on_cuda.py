"""The triton backend's launch plans on a GPU (csrc/triton/plans.cpp, fastformer/triton/plans.py): a
configuration's first call runs Python and records, every later call is replayed from C++ (cuLaunchKernel on
the current stream), bit for bit the Python run's results; a replay can be captured in a CUDA graph and does
not synchronize. tests/gpu/test_cuda_graph_step.py checks that no Python frame runs inside the op's call.
Skipped without a CUDA device (CI has none: tests/ops/test_triton_plans.py runs the same machinery on the CPU,
the interpreter's kernels standing in for cuLaunchKernel).
"""
import pytest
import torch

import fastformer
from fastformer import ops

from gpu_checks import assert_recorded_and_replayed, cuda_sync_errors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not fastformer.backends().get("triton"),
                                reason="needs a CUDA device and the triton backend")


@pytest.fixture(autouse=True)
def fresh_plans():
    from fastformer.triton import plans

    plans.set_enabled(True)
    plans.clear()
    yield plans
    plans.set_enabled(True)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda").to(dtype)


# (inputs, upstream gradients, function) per op, on CUDA tensors: masks, dropout, odd sizes, strided views.
def attention_case(dtype):
    B, H, Lq, Lk, D = 2, 3, 97, 113, 64
    qkv = randn(B, Lk, 3, H, D, dtype=dtype)  # one fused projection: q, k, v are strided (B, H, L, D) views
    q, k, v = (qkv[:, :Lq, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2))
    mask = torch.rand(B, Lk, device="cuda") < 0.25

    def fn(q, k, v):
        return ops.attention(q, k, v, key_padding_mask=mask, causal=True, dropout_p=0.1, backend="triton")

    return [q, k, v], [randn(B, H, Lq, D, dtype=dtype)], fn


def softmax_case(dtype):
    def fn(x):
        return ops.softmax(x, scale=0.7, backend="triton")

    return [randn(3, 5, 7, 113, dtype=dtype)], [randn(3, 5, 7, 113, dtype=dtype)], fn


def layer_norm_residual_case(dtype):
    def fn(x, r, w, b):
        return ops.layer_norm_residual(x, r, w, b, dropout_p=0.1, backend="triton")

    return ([randn(4, 33, 512, dtype=dtype), randn(4, 33, 512, dtype=dtype), randn(512, dtype=dtype),
             randn(512, dtype=dtype)], [randn(4, 33, 512, dtype=dtype)], fn)


def cross_entropy_case(dtype):
    target = torch.randint(0, 1001, (97,), device="cuda")
    target[::7] = -100

    def fn(logits):
        return ops.cross_entropy(logits, target, label_smoothing=0.1, backend="triton")

    return [randn(97, 1001, dtype=dtype)], [randn(97)], fn


CASES = {"attention": attention_case, "softmax": softmax_case, "layer_norm_residual": layer_norm_residual_case,
         "cross_entropy": cross_entropy_case}


def run(fn, inputs, upstream, seed=7):
    if seed is not None:
        torch.manual_seed(seed)  # the dropout seeds are drawn from the CUDA generator
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(upstream[0])
    return [out.detach()] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("op", list(CASES))
def test_later_calls_are_replayed_bit_for_bit(fresh_plans, op, dtype):
    """Forward and backward: the calls after the recording are replays (with the autotuner on, a first
    recording it disturbs is retried once), and every call gives the Python run's bits and layouts."""
    inputs, upstream, fn = CASES[op](dtype)
    fresh_plans.set_enabled(False)
    expected = run(fn, inputs, upstream)
    fresh_plans.set_enabled(True)
    for call in range(4):
        got = run(fn, inputs, upstream)
        for g, e in zip(got, expected):
            assert g.stride() == e.stride() and torch.equal(g, e), f"call {call} differs from the Python run"
    stats = fresh_plans.stats()
    for phase in ("fwd", "bwd"):
        s = stats[f"{op}_{phase}"]
        assert s["recorded"] == 1 and s["refused"] == 0 and s["replays"] >= 2, (phase, stats)


def test_replays_are_captured_by_a_cuda_graph(fresh_plans):
    """attention forward and backward and layer_norm_residual forward, replayed inside torch.cuda.graph: the
    captured calls are replays (no Python, nothing the capture refuses), and replaying the graph on new
    inputs and a new dropout seed gives what the Python implementation gives for them."""
    B, H, L, D = 2, 4, 64, 64
    q, k, v, dout = (randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(4))
    x, r = randn(B, L, 256), randn(B, L, 256)
    w, b = randn(256), randn(256)
    seed = torch.randint(0, 2**62, (), device="cuda")
    fwd, bwd = torch.ops.fastformer.attention_fwd_py, torch.ops.fastformer.attention_bwd_py
    lnr = torch.ops.fastformer.layer_norm_residual_fwd_py

    def step():
        out, lse = fwd(q, k, v, None, True, 0.2, None, seed, "triton")
        grads = bwd(dout, q, k, v, out, lse, None, True, 0.2, None, seed, 0, "triton")
        return (out, *grads, lnr(x, r, w, b, 1e-5, 0.0, None, None, None, "triton")[0])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # record, then replay (a disturbed recording is retried)
            step()
    torch.cuda.current_stream().wait_stream(side)
    before = {name: s["replays"] for name, s in fresh_plans.stats().items() if isinstance(s, dict) and "replays" in s}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    after = fresh_plans.stats()
    for name in ("attention_fwd", "attention_bwd", "layer_norm_residual_fwd"):
        assert after[name]["replays"] == before[name] + 1, (name, after)
    for t in (q, k, v, dout, x, r):
        t.copy_(torch.randn_like(t))
    seed.fill_(12345)
    graph.replay()
    torch.cuda.synchronize()
    fresh_plans.set_enabled(False)
    expected = step()
    for c, e in zip(captured, expected):
        assert torch.equal(c, e)


def test_replays_do_not_synchronize(fresh_plans):
    """Two calls (the configuration is then recorded, whether its first or its second call records), then a
    third under set_sync_debug_mode("error"): a replay, and nothing in it synchronizes."""
    inputs, upstream, fn = CASES["layer_norm_residual"](torch.bfloat16)
    for _ in range(2):
        run(fn, inputs, upstream)
    before = fresh_plans.stats()["layer_norm_residual_fwd"]["replays"]
    with cuda_sync_errors():
        run(fn, inputs, upstream, seed=None)
    assert fresh_plans.stats()["layer_norm_residual_fwd"]["replays"] == before + 1


def test_every_op_of_the_training_step_is_recordable(fresh_plans):
    """Every configuration of the ops a training step calls is recorded and replayed, none refused (a refused
    one would keep its Python cost on every call: its reason would be listed here). Each is called 3 times:
    a configuration called once may not be recorded yet (with the autotuner on, its benchmark discards a
    recording; a first call may stay in Python), so no refusal could show, and this test, calling each once,
    passed with attention never recorded. gpu_checks.assert_recorded_and_replayed asserts the recordings and
    the replays, with FASTFORMER_TRITON_AUTOTUNE=0 (tools/gpu_check.sh) or without."""
    ops_ = ("attention", "layer_norm_residual", "cross_entropy")
    dtypes = (torch.float32, torch.bfloat16)
    for op in ops_:
        for dtype in dtypes:
            inputs, upstream, fn = CASES[op](dtype)
            for _ in range(3):
                run(fn, inputs, upstream)
    stats = fresh_plans.stats()
    assert stats["refused_reasons"] == {}
    assert_recorded_and_replayed(stats, [f"{op}_{phase}" for op in ops_ for phase in ("fwd", "bwd")],
                                 configurations=len(dtypes))
