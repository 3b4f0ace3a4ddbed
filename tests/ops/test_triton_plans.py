"""The triton backend's launch plans (csrc/triton/plans.cpp, fastformer/triton/plans.py) on the CPU.

A configuration's first call runs its Triton implementation in Python unrecorded (a first sight), its second
runs it again and records it, later calls replay the plan in C++; the table keeps at most its capacity of
configurations, the least recently used evicted. On a GPU a replay launches the compiled kernels with cuLaunchKernel (tests/gpu/test_triton_plans_on_cuda.py);
here, under TRITON_INTERPRET=1, plans.on_cpu(True) registers the same C++ kernel for CPU tensors and a replay
runs each recorded kernel in the interpreter through one Python call, so everything but cuLaunchKernel runs:
the key, the recorder's classification, the allocations, the parameters (pointers at their offsets, scalars'
bits), the outputs' layout, the counters, the bound, the fallback to Python for refused configurations and for
the other backends, and the autotuner's benchmark kept out of a recording. The compiled-kernel half of the recorder (signature, PTX parameters) is checked on a
kernel that Triton compiles here for sm_80 without a GPU.
"""
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from fastformer import ops

from helpers import BACKENDS, forward_backward, padding_mask, randn

pytestmark = pytest.mark.skipif("triton" not in BACKENDS or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs the triton backend in the interpreter (TRITON_INTERPRET=1)")

F32 = torch.float32


@pytest.fixture(scope="module", autouse=True)
def plans_on_cpu():
    from fastformer.triton import plans

    plans.on_cpu(True)
    yield plans
    plans.on_cpu(False)
    plans.clear()


@pytest.fixture(autouse=True)
def fresh(plans_on_cpu):
    plans_on_cpu.clear()
    plans_on_cpu.set_enabled(True)
    capacity = plans_on_cpu.stats()["capacity"]
    yield
    plans_on_cpu.set_enabled(True)
    plans_on_cpu.set_capacity(capacity)


def stats(op):
    from fastformer.triton import plans

    s = plans.stats()
    return s[f"{op}_fwd"], s[f"{op}_bwd"]


def counts(replays=0, python=0, first_sight=0, recorded=0, refused=0, evicted=0):
    return {"replays": replays, "python": python, "first_sight": first_sight, "recorded": recorded,
            "refused": refused, "evicted": evicted}


# One call per op, forward and backward through autograd: (op, inputs, upstream gradients, function).
def attention_case(dtype=F32):
    qkv = randn(2, 9, 3, 2, 16, dtype=dtype)  # one fused projection: q, k, v are strided (B, H, L, D) views
    q, k, v = qkv[:, :7, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
    mask = padding_mask(2, 9)
    fn = lambda q, k, v: ops.attention(q, k, v, key_padding_mask=mask, causal=True, dropout_p=0.25,  # noqa: E731
                                       backend="triton")
    return [t.detach() for t in (q, k, v)], [randn(2, 2, 7, 16, dtype=dtype)], fn


def attention_varlen_case(dtype=F32):
    # Packed sequences (an empty one among them), grouped-query (4 query heads on 2 kv heads), k and v strided
    # heads of one (Tk, 2, H_kv, D) projection, causal, dropout: the tables are read by the kernels, so every
    # call with these shapes replays the one plan.
    q = randn(12, 4, 16, dtype=dtype)
    kv = randn(14, 2, 2, 16, dtype=dtype)
    cu_q, cu_k = torch.tensor([0, 5, 5, 12], dtype=torch.int32), torch.tensor([0, 3, 9, 14], dtype=torch.int32)
    fn = lambda q, k, v: ops.attention_varlen(q, k, v, cu_q, cu_k, 7, 6, causal=True, dropout_p=0.25,  # noqa: E731
                                              backend="triton")
    return [q, kv[:, 0], kv[:, 1]], [randn(12, 4, 16, dtype=dtype)], fn


def softmax_case(dtype=F32):
    fn = lambda x: ops.softmax(x, scale=0.5, backend="triton")  # noqa: E731
    return [randn(5, 37, dtype=dtype)], [randn(5, 37, dtype=dtype)], fn


def layer_norm_residual_case(dtype=F32):
    fn = lambda x, r, w, b: ops.layer_norm_residual(x, r, w, b, dropout_p=0.1, backend="triton")  # noqa: E731
    return ([randn(3, 5, 40, dtype=dtype), randn(3, 5, 40, dtype=dtype), randn(40, dtype=dtype),
             randn(40, dtype=dtype)], [randn(3, 5, 40, dtype=dtype)], fn)


def cross_entropy_case(dtype=F32):
    target = torch.randint(0, 50, (6,))
    target[2] = -100
    fn = lambda logits: ops.cross_entropy(logits, target, label_smoothing=0.1, backend="triton")  # noqa: E731
    return [randn(6, 50, dtype=dtype)], [randn(6, dtype=F32)], fn


CASES = {"attention": attention_case, "attention_varlen": attention_varlen_case, "softmax": softmax_case,
         "layer_norm_residual": layer_norm_residual_case, "cross_entropy": cross_entropy_case}


def run(fn, inputs, upstream, seed):
    torch.manual_seed(seed)  # the dropout seed's draw
    outputs, grads = forward_backward(fn, inputs, upstream)
    return outputs + grads


@pytest.mark.parametrize("op", list(CASES))
def test_repeated_configuration_is_recorded_then_replayed_bit_for_bit(op):
    """The first call of a configuration runs in Python unrecorded, the second records, the later ones replay:
    every call gives the Python run's bits and layouts."""
    from fastformer.triton import plans

    inputs, upstream, fn = CASES[op]()
    plans.set_enabled(False)
    expected = run(fn, inputs, upstream, seed=5)
    assert stats(op) == (counts(),) * 2
    plans.set_enabled(True)
    interpreted = len(plans._interpreted)
    progress = [counts(python=1, first_sight=1), counts(python=2, first_sight=1, recorded=1),
                counts(replays=1, python=2, first_sight=1, recorded=1),
                counts(replays=2, python=2, first_sight=1, recorded=1)]
    for call, want in enumerate(progress):
        got = run(fn, inputs, upstream, seed=5)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape and g.stride() == e.stride()
            assert torch.equal(g, e), f"call {call} differs from the Python run"
        fwd, bwd = stats(op)
        assert fwd == bwd == want, (call, fwd, bwd, plans.stats())
        if call == 0:
            assert len(plans._interpreted) == interpreted, "a first sight recorded launches"


def test_replays_allocate_fresh_outputs():
    x = randn(4, 24, dtype=F32)
    first, second, third, fourth = (ops.softmax(x, backend="triton") for _ in range(4))
    assert stats("softmax")[0]["replays"] == 2
    assert len({t.data_ptr() for t in (first, second, third, fourth)}) == 4
    assert all(torch.equal(first, t) for t in (second, third, fourth))


def configurations():
    from fastformer.triton import plans

    return plans.stats()["configurations"]


def test_key_tells_configurations_apart():
    """A new configuration for what Triton's code or specialization can depend on; the same one otherwise."""
    x = randn(6, 40, dtype=F32)
    ops.softmax(x, backend="triton")
    ops.softmax(randn(6, 40, dtype=F32), backend="triton")  # other values, same configuration
    assert configurations() == 1
    ops.softmax(x, scale=0.25, backend="triton")  # a scalar's value
    assert configurations() == 2
    ops.softmax(x.half(), backend="triton")  # the dtype
    assert configurations() == 3
    ops.softmax(randn(7, 40, dtype=F32), backend="triton")  # a size
    assert configurations() == 4
    flat = randn(6 * 40 + 1, dtype=F32)
    unaligned = flat[1:].view(6, 40)  # 4 bytes past a 16-byte boundary: Triton specializes on alignment
    assert unaligned.data_ptr() % 16 != 0
    y = ops.softmax(unaligned, backend="triton")
    assert configurations() == 5
    torch.testing.assert_close(y, torch.softmax(unaligned, -1))

    q, k, v = (randn(2, 2, 5, 16, dtype=F32) for _ in range(3))
    ops.attention(q, k, v, backend="triton")
    ops.attention(q, k, v, key_padding_mask=padding_mask(2, 5), backend="triton")  # None-ness of the mask
    ops.attention(q, k, v, causal=True, backend="triton")  # a bool
    ops.attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, backend="triton")  # strides
    assert configurations() == 5 + 4
    before = configurations()
    same = ops.attention(q, q, q, backend="triton")  # one tensor three times: its own configuration
    assert configurations() == before + 1
    distinct = ops.attention(q, q.clone(), q.clone(), backend="triton")  # the first call's configuration
    again = ops.attention(q, q, q, backend="triton")
    assert configurations() == before + 1
    assert torch.equal(same, distinct) and torch.equal(same, again)


def test_varlen_replay_reads_this_calls_tables():
    """attention_varlen's plan is keyed by the tables' sizes, not their values (the kernels read them from
    device memory): a replay with other sequence lengths computes those, as the Python run does, and its
    tables' values were checked by csrc/ops.h before the replay."""
    q, k, v = (randn(10, 2, 16, dtype=F32) for _ in range(3))
    tables = [torch.tensor(t, dtype=torch.int32) for t in ([0, 4, 10], [0, 0, 10], [0, 7, 10])]
    ops.attention_varlen(q, k, v, tables[1], tables[1], 10, 10, causal=True, backend="triton")  # first sight
    replayed = [ops.attention_varlen(q, k, v, t, t, 10, 10, causal=True, backend="triton") for t in tables]
    assert stats("attention_varlen")[0] == counts(replays=2, python=2, first_sight=1, recorded=1)
    for t, out in zip(tables, replayed):
        torch.testing.assert_close(out, ops.attention_varlen(q, k, v, t, t, 10, 10, causal=True, backend="torch"))
    with pytest.raises(ValueError, match="must be non-decreasing"):
        ops.attention_varlen(q, k, v, *[torch.tensor([0, 7, 6, 10], dtype=torch.int32)] * 2, 10, 10, backend="triton")


def test_refused_configuration_runs_in_python():
    """softmax with a mask computes its mask's row offsets with torch ops (arange, mul, add): that
    configuration is refused and keeps running in Python, counted, with the reason."""
    from fastformer.triton import plans

    x = randn(2, 3, 4, 24, dtype=F32)
    mask = torch.rand(2, 1, 1, 24) < 0.3
    expected = ops.softmax(x, mask=mask, backend="torch")
    for _ in range(3):
        torch.testing.assert_close(ops.softmax(x, mask=mask, backend="triton"), expected)
    fwd, _ = stats("softmax")
    assert fwd == counts(python=3, first_sight=1, refused=1)
    (reason,) = plans.stats()["refused_reasons"]
    assert reason.startswith("runs aten.") and reason.endswith(" in torch"), reason


def test_an_unknown_triton_version_runs_in_python_with_one_warning(monkeypatch):
    """Under a Triton the recorder does not list (RECORDER_TRITON_VERSIONS), a configuration's second call is
    refused with that reason instead of recorded: every call runs in Python (the same results), one warning."""
    import warnings

    import triton
    from fastformer.triton import plans

    assert plans.recorder_supports(triton.__version__), triton.__version__  # the Triton CI installs is listed
    assert plans.recorder_supports("3.6.0") and not plans.recorder_supports("3.5.1")
    monkeypatch.setattr(plans, "RECORDER_TRITON_VERSIONS", ("0.1",))
    monkeypatch.setattr(plans, "_warned_version", False)
    x = randn(3, 8, dtype=F32)
    expected = ops.softmax(x, backend="torch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            torch.testing.assert_close(ops.softmax(x, backend="triton"), expected)
        ops.softmax(randn(5, 8, dtype=F32), backend="triton")
        ops.softmax(randn(5, 8, dtype=F32), backend="triton")  # a second configuration's recording: no warning
    assert [str(w.message) for w in caught if "launch-plan recorder" in str(w.message)] == [
        f"fastformer: Triton {triton.__version__} is not a version the launch-plan recorder knows (0.1): triton "
        "calls run in Python, correct but with Python's cost per call"]
    fwd, _ = stats("softmax")
    assert fwd == counts(python=6, first_sight=2, refused=2)
    assert plans.stats()["refused_reasons"] == {
        f"Triton {triton.__version__} is not a version the launch-plan recorder knows (0.1)": 2}


def test_the_protocol_codes_are_cpps():
    """The status codes and parameter kinds plans.py uses are the ones C++ exports (defined once there), and
    the description handed to C++ is named tuples in the order C++ reads them."""
    from fastformer._ext import C
    from fastformer.triton import plans

    assert (plans.PLAN, plans.REFUSED, plans.NOT_RECORDED) == (
        C.TRITON_PLAN_STATUS["plan"], C.TRITON_PLAN_STATUS["refused"], C.TRITON_PLAN_STATUS["not_recorded"])
    assert len({plans.PLAN, plans.REFUSED, plans.NOT_RECORDED}) == 3
    assert (plans.INPUT, plans.ALLOC, plans.VALUE, plans.NULL) == tuple(
        C.TRITON_PLAN_PARAM_KINDS[k] for k in ("input", "alloc", "value", "null"))
    assert plans.PlanDescription._fields == ("allocs", "launches", "outputs")
    assert plans.Launch._fields == ("kernel", "grid", "params")
    assert plans.Param._fields == ("kind", "index", "value", "size")
    x = randn(3, 8, dtype=F32)
    out, status, description = plans._run("softmax", "fwd", True, (x, None, 1.0))
    assert status == plans.PLAN and isinstance(description, plans.PlanDescription), (status, description)
    (launch,) = description.launches
    assert launch.kernel.interpreted >= 0 and all(isinstance(p, plans.Param) for p in launch.params)
    assert description.outputs[0].alloc == 0
    torch.testing.assert_close(out, ops.softmax(x, backend="torch"))


def test_errors_come_through_as_before():
    q, k, v = (randn(1, 1, 4, 130, dtype=F32) for _ in range(3))
    with pytest.raises(ValueError, match="head dim 130"):  # the Triton code's own limit, raised in Python
        ops.attention(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="must agree in batch"):  # csrc/ops.h's checks, before any plan
        ops.attention(q, *(randn(2, 1, 4, 130, dtype=F32) for _ in range(2)), backend="triton")
    x = randn(3, 8, dtype=F32)
    ops.softmax(x, backend="triton")
    ops.softmax(x, backend="triton")  # recorded
    with pytest.raises(ValueError, match="scale must be a finite number"):  # a replayable configuration's checks
        ops.softmax(x, scale=float("inf"), backend="triton")


def test_other_backends_take_the_python_implementation():
    x = randn(4, 24, dtype=F32)
    for _ in range(2):
        torch.testing.assert_close(ops.softmax(x, scale=0.5, backend="torch"), torch.softmax(0.5 * x, -1))
    assert configurations() == 0


def test_disabled_plans_run_python():
    from fastformer.triton import plans

    plans.set_enabled(False)
    assert not plans.enabled()
    x = randn(4, 24, dtype=F32)
    for _ in range(2):
        ops.softmax(x, backend="triton")
    assert configurations() == 0 and stats("softmax")[0]["python"] == 0


def test_configurations_seen_once_are_not_recorded():
    """A run whose shapes vary: every call a new configuration, each run in Python once and never recorded."""
    from fastformer.triton import plans

    interpreted = len(plans._interpreted)
    for n in range(20, 26):
        x = randn(3, n, dtype=F32)
        torch.testing.assert_close(ops.softmax(x, backend="triton"), torch.softmax(x, -1))
    assert stats("softmax")[0] == counts(python=6, first_sight=6)
    assert configurations() == 6 and len(plans._interpreted) == interpreted


def softmax_call(n: int, replay: bool = False) -> None:
    """One softmax call of the configuration of width n, checked against torch; ``replay``: it must be replayed."""
    before = stats("softmax")[0]["replays"]
    x = randn(2, n, dtype=F32)
    torch.testing.assert_close(ops.softmax(x, backend="triton"), torch.softmax(x, -1))
    assert (stats("softmax")[0]["replays"] == before + 1) == replay, (n, stats("softmax"))


def test_the_table_is_bounded_least_recently_used_evicted():
    from fastformer.triton import plans

    assert plans.stats()["capacity"] == 4096
    plans.set_capacity(4)
    for n in (10, 11, 12, 13):  # four configurations, each recorded
        softmax_call(n)
        softmax_call(n)
    softmax_call(10, replay=True)  # 10 is now the most recently used, 11 the least
    softmax_call(14)  # a fifth configuration: the table is full, 11 goes
    assert configurations() == 4 and stats("softmax")[0]["evicted"] == 1
    softmax_call(10, replay=True)
    softmax_call(13, replay=True)
    before = stats("softmax")[0]
    softmax_call(11)  # evicted: a first sight again (12 goes now)
    after = stats("softmax")[0]
    assert after["first_sight"] == before["first_sight"] + 1 and after["evicted"] == 2
    for n in range(30, 60):  # shapes that never repeat: the bound holds, the plans in use stay
        softmax_call(n)
        softmax_call(10, replay=True)
        assert configurations() <= 4
    assert stats("softmax")[0]["evicted"] == 2 + 30
    plans.set_capacity(2)  # a smaller bound evicts down to it
    assert configurations() == 2 and stats("softmax")[0]["evicted"] == 2 + 30 + 2
    softmax_call(10, replay=True)


def test_summary_line():
    from fastformer.triton import plans

    assert plans.summary() is None  # nothing counted: fastformer.train leaves the line out
    softmax = {"replays": 12345, "python": 100, "first_sight": 40, "recorded": 38, "refused": 3, "evicted": 5}
    zero = {k: 0 for k in softmax}
    attention = {**zero, "python": 20, "first_sight": 5}
    made = {"softmax_fwd": softmax, "softmax_bwd": zero, "attention_fwd": attention, "capacity": 4096,
            "configurations": 41, "refused_reasons": {"needs scratch memory": 1, "runs aten.copy_.default in torch": 2}}
    assert plans.summary(made) == (
        "triton plans: 41 configurations, 38 recorded, 3 refused (2: runs aten.copy_.default in torch; 1: needs "
        "scratch memory), 5 evicted; 12,345 replays (99.0% of calls), 120 python calls (45 first sights)")
    x = randn(2, 8, dtype=F32)
    for _ in range(3):
        ops.softmax(x, backend="triton")
    assert plans.summary() == ("triton plans: 1 configurations, 1 recorded, 0 refused, 0 evicted; 1 replays "
                               "(33.3% of calls), 2 python calls (1 first sights)")


def test_training_summary_holds_the_plans_line():
    """fastformer.train's summary record takes its triton line from here (None: left out)."""
    from fastformer.training.loop import triton_plans_summary
    from fastformer.triton import plans

    assert triton_plans_summary() is None
    ops.softmax(randn(2, 8, dtype=F32), backend="triton")
    assert triton_plans_summary() == plans.summary() is not None


# ---- Triton's autotuner benchmarks outside the recording ----

def autotuned_double():
    """A toy autotuned kernel (y = 2 x) with two candidate tiles and a benchmark that does what Triton's
    do_bench does around a candidate (ATen ops: a cache flush), noting what it sees."""
    import triton
    import triton.language as tl

    seen = []

    def bench(kernel_call, quantiles):
        flush = torch.empty(64)
        flush.zero_()
        kernel_call()
        seen.append(torch._C._len_torch_dispatch_stack())  # dispatch modes on while it benchmarks
        return [float(len(seen))] * len(quantiles)  # the first candidate (BLOCK 16) wins

    @triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"],
                     do_bench=bench)
    @triton.jit
    def double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    def softmax_fwd(x, mask, scale):  # stands in for the triton backend's softmax forward
        y = torch.empty_like(x)
        double[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, x.numel())
        return y

    return double, softmax_fwd, seen


def test_autotuner_benchmarks_outside_the_recording(monkeypatch):
    """A call that records while the autotuner tunes a new key: the candidates' launches and the benchmark's
    ATen ops are neither recorded nor seen by a dispatch mode, no candidate's kernel is kept, and the plan
    holds the tuned launch alone, which replays bit for bit."""
    from fastformer import _dispatch
    from fastformer.triton import plans

    double, softmax_fwd, seen = autotuned_double()
    implementation = _dispatch.implementation
    monkeypatch.setattr(_dispatch, "implementation", lambda op, phase, backend: softmax_fwd if (
        op, phase, backend) == ("softmax", "fwd", "triton") else implementation(op, phase, backend))
    x = randn(3, 15, dtype=F32)
    expected = 2 * x
    torch.testing.assert_close(ops.softmax(x, backend="triton"), expected)  # first sight: tunes, unrecorded
    assert len(seen) == 2 and stats("softmax")[0] == counts(python=1, first_sight=1)
    double.cache.clear()  # the autotuner forgets: the recording call tunes again
    interpreted = len(plans._interpreted)
    torch.testing.assert_close(ops.softmax(x, backend="triton"), expected)
    assert seen == [0] * 4, "the benchmark ran under a dispatch mode"
    assert stats("softmax")[0] == counts(python=2, first_sight=1, recorded=1), plans.stats()
    assert len(plans._interpreted) == interpreted + 1, "a candidate's launch was recorded"
    assert plans._interpreted[interpreted][2] == {"BLOCK": 16}  # the tuned candidate's launch
    for _ in range(2):
        assert torch.equal(ops.softmax(x, backend="triton"), expected)
    assert stats("softmax")[0]["replays"] == 2 and len(seen) == 4


# ---- the recorder's half for compiled kernels ----

def test_scalar_bits_round_trip():
    from fastformer.triton.plans import _bits, _decode

    for ty, value in (("i32", -7), ("i32", 2**31 - 1), ("i64", -(2**40)), ("u32", 2**32 - 1), ("u64", 2**64 - 1),
                      ("i1", True), ("fp32", 0.125), ("fp64", 1 / 3)):
        assert _decode(_bits(ty, value), ty) == value, (ty, value)
    assert _bits("fp32", 1.0) == 0x3F800000
    assert _bits("i32", -1) & 0xFFFFFFFF == 0xFFFFFFFF


def test_ptx_parameter_sizes():
    from fastformer.triton.plans import _ptx_param_sizes

    ptx = textwrap.dedent("""
        .visible .entry other(
        \t.param .u32 other_param_0
        )
        .visible .entry k(
        \t.param .u64 .ptr .global .align 1 k_param_0,
        \t.param .u32 k_param_1,
        \t.param .f32 k_param_2,
        \t.param .align 64 .b8 k_param_3[128],
        \t.param .u64 k_param_4
        )
        .reqntid 128
    """)
    assert _ptx_param_sizes(ptx, "k") == [8, 4, 4, 128, 8]
    assert _ptx_param_sizes(ptx, "other") == [4]
    assert _ptx_param_sizes(ptx, "missing") is None


COMPILE = textwrap.dedent('''
    import json, sys, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def scale_rows(x_ptr, y_ptr, seed_ptr, n, row_stride, scale, p, BLOCK: tl.constexpr, HAS_SEED: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i * row_stride, mask=i < n)
        if HAS_SEED:
            x = x + tl.load(seed_ptr).to(tl.float32) * p
        tl.store(y_ptr + i, x * scale, mask=i < n)

    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "seed_ptr": "*i64", "n": "i32", "row_stride": "i64",
                 "scale": "fp32", "p": "fp32", "BLOCK": "constexpr", "HAS_SEED": "constexpr"}
    kernel = triton.compile(ASTSource(fn=scale_rows, signature=signature, constexprs={"BLOCK": 64, "HAS_SEED": True}),
                            target=GPUTarget("cuda", 80, 32))
    meta = kernel.metadata
    json.dump({"name": kernel.name, "ptx": kernel.asm["ptx"], "signature": kernel.src.signature,
               "num_warps": meta.num_warps, "shared": meta.shared, "num_ctas": meta.num_ctas,
               "global_scratch_size": meta.global_scratch_size,
               "profile_scratch_size": getattr(meta, "profile_scratch_size", 0)}, sys.stdout)
''')


@pytest.fixture(scope="module")
def compiled_kernel(tmp_path_factory):
    """A kernel shaped like fastformer's (pointers, i32 and i64 sizes and strides, float scalars, constexprs)
    compiled by Triton for sm_80 here, without a GPU (the interpreter is off in that process)."""
    path = tmp_path_factory.mktemp("triton") / "compile_kernel.py"
    path.write_text(COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        pytest.skip(f"Triton cannot compile for sm_80 here: {done.stderr[-500:]}")
    info = json.loads(done.stdout)
    meta = SimpleNamespace(num_warps=info["num_warps"], shared=info["shared"], num_ctas=info["num_ctas"],
                           global_scratch_size=info["global_scratch_size"],
                           profile_scratch_size=info["profile_scratch_size"], target=SimpleNamespace(warp_size=32))
    return SimpleNamespace(name=info["name"], asm={"ptx": info["ptx"]},
                           src=SimpleNamespace(signature=info["signature"]), metadata=meta, function=0x1234)


def test_compiled_launch_description(compiled_kernel):
    """What the recorder makes of a launch of a compiled kernel: each non-constexpr argument in signature
    order (pointers resolved to an input or allocation and a byte offset, scalars as bits of their type and
    size from the PTX), then Triton's hidden scratch pointers as nulls."""
    from fastformer.triton.plans import ALLOC, INPUT, NULL, VALUE, _bits, _ptx_param_sizes, _Recording

    x = randn(10, 4, dtype=F32)
    seed = torch.tensor(1234)
    recording = _Recording((x, seed), x.device)
    y = torch.empty(10)
    recording.on_aten(torch.ops.aten.empty.memory_format, ([10],), y)
    view = x[:, 1]
    recording.on_aten(torch.ops.aten.select.int, (x, 1, 1), view)
    args = (view, y, seed, 10, 4, 0.5, 0.25, 64, True)
    recording.on_compiled(compiled_kernel, (1, 1, 1), args)
    assert recording.refusal is None, recording.refusal
    ((function, interpreted, threads, shared, name), grid, params), = recording.launches
    assert (function, interpreted, threads, name) == (0x1234, -1, 32 * compiled_kernel.metadata.num_warps, "scale_rows")
    sizes = _ptx_param_sizes(compiled_kernel.asm["ptx"], "scale_rows")
    assert params[:7] == [(INPUT, 0, 4, 8), (ALLOC, 0, 0, 8), (INPUT, 1, 0, 8), (VALUE, 0, 10, 4), (VALUE, 0, 4, 8),
                          (VALUE, 0, _bits("fp32", 0.5), 4), (VALUE, 0, _bits("fp32", 0.25), 4)]
    assert params[7:] == [(NULL, 0, 0, 8)] * (len(sizes) - 7)  # Triton 3.6+: global and profile scratch
    assert [p[3] for p in params] == sizes


def test_compiled_launch_refusals(compiled_kernel):
    from fastformer.triton.plans import _Recording

    x = randn(10, 4, dtype=F32)
    seed = torch.tensor(1234)
    stranger = torch.empty(10)  # not an argument, not allocated by the call
    recording = _Recording((x, seed), x.device)
    recording.on_compiled(compiled_kernel, (1, 1, 1), (x, stranger, seed, 10, 4, 0.5, 0.25, 64, True))
    assert "neither an argument nor allocated" in recording.refusal
    scratch = SimpleNamespace(**{**vars(compiled_kernel), "metadata": SimpleNamespace(
        **{**vars(compiled_kernel.metadata), "global_scratch_size": 128})})
    recording = _Recording((x, seed), x.device)
    recording.on_compiled(scratch, (1, 1, 1), (x, x, seed, 10, 4, 0.5, 0.25, 64, True))
    assert "scratch" in recording.refusal
