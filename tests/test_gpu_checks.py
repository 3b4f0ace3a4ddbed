"""The checks of tests/gpu (tests/gpu_checks.py), each failing on a deliberately broken case, on the CPU, so
that CI, which has no GPU, shows that they can fail (issue 51). The replay count of the captured step is shown
failing in tests/train/test_sync_free_step.py, beside the CPU stand-in of the CUDA graphs it needs.
"""
import os
import threading

import pytest
import torch

import fastformer
from gpu_checks import ENTRY_POINTS, assert_recorded_and_replayed, fastformer_calls, op_calls


def test_the_frame_check_passes_the_cpu_backend():
    """The cpu backend's path is the cuda backend's: the public function, the dispatcher's lookup, the
    registered op, C++ kernels and C++ autograd; the profiler sees the backward (its gradient hooks) and no
    fastformer Python beyond the entry points, once the first call has filled the dispatcher's cache."""
    forward = op_calls("cpu", "cpu", torch.float32)
    fastformer_calls(forward)
    calls = fastformer_calls(forward)
    assert set(calls) <= ENTRY_POINTS, sorted(set(calls) - ENTRY_POINTS)
    assert "ops/attention.py:attention" in calls


def test_the_frame_check_flags_a_python_backward():
    """A backend whose kernels are Python (the torch reference, run by the registered ops' Python
    implementations): the frames of its backward, which the autograd engine calls from the C++ autograd
    node, are reported, and the GPU test's assertion would fail on them."""
    calls = fastformer_calls(op_calls("torch", "cpu", torch.float32))
    assert {"ops/attention.py:_py_bwd", "ops/layer_norm_residual.py:_py_bwd"} <= set(calls), sorted(set(calls))
    assert not set(calls) <= ENTRY_POINTS


def test_the_frame_check_fails_when_it_cannot_see_the_backward():
    """A backward run on a thread the profiler does not watch (on a GPU the autograd engine's device thread,
    here a thread of our own) goes unseen: instead of reporting no Python frame, the check fails on its
    gradient hooks, which were never seen called (tests/gpu/test_cuda_graph_step.py shows the device
    thread's case on a GPU)."""
    def backward_elsewhere(loss):
        thread = threading.Thread(target=loss.backward)
        thread.start()
        thread.join()

    with pytest.raises(AssertionError, match="saw 0 of the 2 gradient hooks"):
        fastformer_calls(op_calls("torch", "cpu", torch.float32), backward_elsewhere)


def counters(recorded, replays, refused=0, python=3):
    return {"recorded": recorded, "replays": replays, "refused": refused, "python": python}


@pytest.mark.parametrize("stats", [
    {"attention_fwd": counters(recorded=0, replays=0)},  # only retried: the autotuner disturbed each recording
    {"attention_fwd": counters(recorded=1, replays=0)},  # recorded at the last call, never replayed
    {"attention_fwd": counters(recorded=2, replays=4, refused=1)},
    {"attention_fwd": counters(recorded=1, replays=2)},  # one of the two configurations never recorded
], ids=["retried", "not-replayed", "refused", "one-configuration"])
def test_the_plans_check_fails_without_recordings_and_replays(stats):
    with pytest.raises(AssertionError, match="attention_fwd"):
        assert_recorded_and_replayed(stats, ["attention_fwd"], configurations=2)
    assert_recorded_and_replayed({"attention_fwd": counters(recorded=2, replays=2)}, ["attention_fwd"], 2)


@pytest.mark.skipif(not fastformer.backends().get("triton") or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs the triton backend in the interpreter (TRITON_INTERPRET=1)")
def test_the_plans_check_on_the_interpreters_plans():
    """The launch plans' real counters (csrc/triton/plans.cpp, replaying the interpreter's kernels on the
    CPU): one call of an attention configuration, forward and backward, fails the check (its recording, if
    any, is not replayed yet), three calls pass it."""
    from fastformer.triton import plans

    forward = op_calls("triton", "cpu", torch.float32)
    names = ["attention_fwd", "attention_bwd", "layer_norm_residual_fwd", "layer_norm_residual_bwd"]
    plans.on_cpu(True)
    plans.clear()
    try:
        sum(out.sum() for out in forward()).backward()
        with pytest.raises(AssertionError):
            assert_recorded_and_replayed(plans.stats(), names, configurations=1)
        for _ in range(2):
            sum(out.sum() for out in forward()).backward()
        assert_recorded_and_replayed(plans.stats(), names, configurations=1)
    finally:
        plans.on_cpu(False)
        plans.clear()
