"""The checks of tests/gpu, written so that they run on CPU tensors too: tests/test_gpu_checks.py and
tests/train/test_sync_free_step.py show each one failing on a deliberately broken case in CI, which has no
GPU (issue 51: a GPU test that cannot fail checks nothing, and a lent GPU is rare).

- ``fastformer_calls``: the fastformer Python functions that run during op calls' forward and backward
  (``op_calls``), with proof that the profiler saw the backward (tests/gpu/test_cuda_graph_step.py).
- ``assert_every_update_replayed``: updates through --cuda-graphs' runner, each one counted as a replay of
  its micro-batch graph and of the update graph (tests/gpu/test_cuda_graph_step.py).
- ``assert_recorded_and_replayed``: the triton launch plans' counters of the ops and phases a test ran
  (tests/gpu/test_triton_plans_on_cuda.py).
"""
import collections
import contextlib
import pathlib
import sys

import torch

import fastformer
from fastformer import ops

PACKAGE = pathlib.Path(fastformer.__file__).parent


def op_calls(backend, device, dtype=torch.bfloat16):
    """A function that calls attention (causal, with dropout) and layer_norm_residual on ``backend`` and
    returns their outputs, on fresh inputs on ``device``, the same every call."""
    q, k, v = (torch.randn(2, 4, 33, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    x, r = (torch.randn(2, 33, 256, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    w, b = torch.ones(256, device=device, dtype=dtype), torch.zeros(256, device=device, dtype=dtype)
    return lambda: [ops.attention(q, k, v, causal=True, dropout_p=0.1, backend=backend),
                    ops.layer_norm_residual(x, r, w, b, backend=backend)]


# What op_calls may run of fastformer's Python: the public functions, the dispatcher's cached lookup, and the
# dropout seed's draw (on a GPU a device kernel).
ENTRY_POINTS = {"ops/attention.py:attention", "ops/layer_norm_residual.py:layer_norm_residual",
                "_dispatch.py:forward", "ops/_registry.py:dropout_seed"}


def fastformer_calls(forward, backward=torch.Tensor.backward) -> list[str]:
    """The calls of Python functions of the fastformer package ("ops/attention.py:attention", relative to the
    package, in order) while ``forward()`` returns a list of op outputs and ``backward`` runs on the sum
    of the outputs, as sys.setprofile sees them.

    sys.setprofile sees only the thread that set it, and on a GPU the autograd engine runs the backward of
    CUDA tensors on a device thread of its own: a Python backward would run unseen. So the whole call runs
    under torch.autograd.set_multithreading_enabled(False), which makes the engine run every node on the
    calling thread (a thread-local setting). And a gradient hook on each output, a Python function that
    the engine calls just before that op's backward node, is a sentinel: unless the profiler saw every one
    of them, the backward ran where it does not look, and this raises AssertionError instead of reporting
    a backward free of Python that it never saw. (sys.monitoring would see every thread, but needs Python
    3.12; this works on every Python the project supports, so the CPU tests exercise what the GPU runs.)"""
    calls = []

    def sentinel(grad):
        return None

    def profiler(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code)

    sys.setprofile(profiler)
    try:
        with torch.autograd.set_multithreading_enabled(False):
            outputs = forward()
            for out in outputs:
                out.register_hook(sentinel)
            backward(sum(out.float().sum() for out in outputs))
    finally:
        sys.setprofile(None)
    seen = sum(code is sentinel.__code__ for code in calls)
    assert seen == len(outputs), (f"the profiler saw {seen} of the {len(outputs)} gradient hooks: the backward "
                                  "ran on a thread it does not watch")
    return [f"{pathlib.Path(code.co_filename).relative_to(PACKAGE)}:{code.co_name}" for code in calls
            if pathlib.Path(code.co_filename).is_relative_to(PACKAGE)]


def assert_every_update_replayed(run, batches: list, guard) -> None:
    """Trains each host batch ((src, tgt_in, tgt_out) or a PackedBatch) as one update through ``run.step``
    (fastformer/training/graphs.py: the micro-batch, then the update) inside the context manager ``guard``
    (on a GPU, torch.cuda.set_sync_debug_mode("error")), and asserts that every micro-batch and every update
    was a replay of a graph captured before: counted on the captured graphs' own ``replay``, so that a
    batch run any other way (eagerly, captured afresh, skipped) leaves a replay uncounted and fails here
    rather than escaping the guard's check."""
    assert batches, "no batch to replay"
    scales = [1.0 / int(batch[2].ne(run.config.pad_id).sum()) for batch in batches]  # tgt_out, counted on the host
    graphs, counts = run.step, collections.Counter()
    held = [(graph, "micro") for graph, _ in graphs.micro.values()]
    held += [(graphs.update_graph, "update")] if graphs.update_graph is not None else []

    def counted(graph, name):
        replay = graph.replay

        def count():
            counts[name] += 1
            replay()
        return count

    for graph, name in held:
        graph.replay = counted(graph, name)  # an instance attribute: the class's replay, shadowed
    try:
        with guard:
            for batch, scale in zip(batches, scales):
                run.sums.zero_()
                graphs.micro_batch(batch)
                run.grad_scale.fill_(scale)
                graphs.update()
    finally:
        for graph, _ in held:
            del graph.replay
    assert counts == collections.Counter(micro=len(batches), update=len(batches)), (
        f"{len(batches)} updates, but replays of the micro-batch graphs {counts['micro']}, of the update "
        f"graph {counts['update']}")


@contextlib.contextmanager
def cuda_sync_errors():
    """Inside: any CUDA call that synchronizes the host with the device raises (the ones inside C++ kernels
    included), after what was queued before has finished."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def assert_recorded_and_replayed(stats: dict, names, configurations: int) -> None:
    """fastformer.triton.plans.stats() after a test called each of ``configurations`` configurations of the
    ops and phases ``names`` ("attention_fwd", ...) at least 3 times: each recorded a plan (none refused),
    and the plans were replayed, at least once per configuration.

    Three calls, because a configuration's first call may stay in Python unrecorded (a rule that records
    only configurations seen twice) or record while Triton's autotuner benchmarks, which discards that
    recording and records again at the next call: the third call is a replay under either rule. A test that
    called fewer times, or whose calls were only retried, fails here instead of asserting nothing."""
    for name in names:
        s = stats[name]
        assert s["recorded"] >= configurations and s["refused"] == 0 and s["replays"] >= configurations, (
            f"{name}: {configurations} configurations called 3 times, but {s}")
