"""The training step on a GPU: captured as CUDA graphs it gives the eager step's losses, it never
synchronizes with the host, and an op call on CUDA tensors reaches its kernel launch without a Python frame
(issue 44). Skipped without a CUDA device (CI has none: tests/train/test_sync_free_step.py checks the step's
ATen calls and the graphs' control flow on the CPU there, and tests/test_gpu_checks.py shows the checks of
tests/gpu_checks.py failing on broken cases).
"""
import sys

import pytest
import torch

import fastformer
from fastformer.train import build_parser
from fastformer.training.processes import Processes
from fastformer.training.setup import setup

from gpu_checks import ENTRY_POINTS, assert_every_update_replayed, cuda_sync_errors, fastformer_calls, op_calls

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "train"))
from train_helpers import GRAPH_CASES, set_attention_dropout, tiny_run_args, train_updates  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_BACKENDS = [b for b in ("cuda", "triton") if fastformer.backends().get(b)]


def make_run(out, backend, *extra, attention_dropout=0.0):
    args = build_parser().parse_args(tiny_run_args(out, "--device", "cuda", "--backend", backend,
                                                   "--precision", "bf16", *extra))
    run = setup(args, Processes.start("cuda"))
    set_attention_dropout(run.model, attention_dropout)
    return run


@pytest.mark.parametrize("case", list(GRAPH_CASES))
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_captured_step_gives_the_eager_losses(tmp_path, backend, case):
    """Same seed, same fixed-shape batches (--cuda-graphs' buckets for both), no residual or embedding
    dropout, each run's training started from the same generator state: the same losses, update after
    update, and the same weights, the first batch of each shape and the first update running eagerly and
    the later ones replayed.

    Accumulated micro-batches: the replayed backward passes add into the persistent .grad tensors, which
    only the update graph zeroes; a captured backward that overwrote them would keep only the last
    micro-batch's gradient, which one micro-batch per update cannot show (the CPU stand-in of this test
    breaks it so: tests/train/test_sync_free_step.py). Every update here holds >= 2 micro-batches.

    Attention dropout: the masks come from seeds drawn on the device from the CUDA generator, and under
    capture torch hands a graph's random ops the generator's offset at each replay, advancing it by what the
    captured ops consume, as the same ops advance it run eagerly (the capture itself draws nothing): so the
    replays draw the eager step's masks, and the losses still agree. (The residual and embedding dropout
    stay off: 0 here, as in the other cases, keeps this case about attention.) That dropout was on is
    checked too: two forward passes of one batch differ. A replay that froze its capture's masks would
    differ from the eager losses (the CPU stand-in shows it)."""
    extra, attention_dropout = GRAPH_CASES[case]
    eager = make_run(tmp_path / "eager", backend, "--dropout", "0", *extra, attention_dropout=attention_dropout)
    eager.batches.fixed_shapes = True
    eager.batches.seek(0)
    graphed = make_run(tmp_path / "graphed", backend, "--dropout", "0", "--cuda-graphs", *extra,
                       attention_dropout=attention_dropout)
    torch.manual_seed(0)  # each run's training starts from the same generators (the CUDA one at offset 0)
    expected, eager_micro, drawn = train_updates(eager, 12)
    torch.manual_seed(0)
    got, micro, _ = train_updates(graphed, 12)
    assert micro == eager_micro
    assert len(graphed.step.shapes) >= 2, graphed.step.shapes  # replays of more than one shape
    if extra:
        assert min(micro) >= 2, micro
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=2e-3, atol=2e-3)
    for p, q in zip(eager.model.parameters(), graphed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-3)
    if attention_dropout:
        src, tgt_in = (t.cuda() for t in drawn[0][:2])
        eager.model.train()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            assert not torch.equal(eager.model(src, tgt_in), eager.model(src, tgt_in)), "attention dropout is off"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_captured_step_never_synchronizes(tmp_path, backend):
    """With residual and attention dropout: after 6 updates, whose batches captured a graph per shape, the
    same batches again under set_sync_debug_mode("error"), which raises on any synchronizing CUDA call, the
    ones inside C++ kernels included; every micro-batch and update among them counted as a replay
    (gpu_checks.assert_every_update_replayed: a batch run eagerly or captured afresh fails the count rather
    than escaping the check). The loss is finite, and two replays of one batch draw different dropout
    masks (the seeds advance on the device)."""
    run = make_run(tmp_path / "run", backend, "--dropout", "0.3", "--cuda-graphs", attention_dropout=0.1)
    first, _, drawn = train_updates(run, 6)
    assert_every_update_replayed(run, drawn, cuda_sync_errors())
    assert all(torch.isfinite(torch.tensor(first)))
    graph, _ = next(iter(run.step.micro.values()))
    sums = []
    for _ in range(2):
        run.sums.zero_()
        graph.replay()
        sums.append(run.sums.clone())
    assert not torch.equal(sums[0], sums[1]), "two replays drew the same dropout masks"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_no_python_frame_between_the_op_and_its_kernel(backend):
    """After the public function hands over to the registered op, nothing in fastformer's Python runs until
    the op returns, forward and backward: the cuda backend's kernels are C++, the triton backend's are
    launched from C++ by each configuration's plan (csrc/triton/plans.cpp), which its first calls recorded.
    gpu_checks.fastformer_calls runs the backward on this thread, where sys.setprofile sees it, and fails
    unless a gradient hook of each output was seen (tests/test_gpu_checks.py shows it flagging the torch
    backend's Python backward, and failing when the backward runs on another thread)."""
    forward = op_calls(backend, "cuda")
    for _ in range(3):  # first calls: imports, caches, Triton's compiles and autotuning, the plans' recordings
        fastformer_calls(forward)
    torch.cuda.synchronize()
    calls = fastformer_calls(forward)
    assert set(calls) <= ENTRY_POINTS, sorted(set(calls) - ENTRY_POINTS)


def test_the_frame_check_fails_on_a_device_thread_backward():
    """Why fastformer_calls runs the backward with the engine's multithreading off: with it on, the backward
    of CUDA tensors runs on the engine's device thread, which sys.setprofile does not watch, so the gradient
    hooks go unseen and the check fails rather than report a backward it never saw. (If this test fails, the
    engine ran that backward on the calling thread after all: the frame check above still holds, but this
    account of the engine is wrong.)"""
    def backward_on_device_threads(loss):
        with torch.autograd.set_multithreading_enabled(True):
            loss.backward()

    with pytest.raises(AssertionError, match="gradient hooks"):
        fastformer_calls(op_calls(None, "cuda"), backward_on_device_threads)
