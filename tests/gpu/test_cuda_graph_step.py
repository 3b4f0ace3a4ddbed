"""The training step on a GPU: captured as CUDA graphs it gives the eager step's losses, it never
synchronizes with the host, and an op call on CUDA tensors reaches its kernel launch without a Python frame
(issue 44). Skipped without a CUDA device (CI has none: tests/train/test_sync_free_step.py checks the step's
ATen calls on the CPU there).
"""
import sys

import pytest
import torch

import fastformer
from fastformer import ops
from fastformer.train import build_parser
from fastformer.training.processes import Processes
from fastformer.training.setup import setup
from fastformer.training.step import train_step

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "train"))
from train_helpers import tiny_run_args  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_BACKENDS = [b for b in ("cuda", "triton") if fastformer.backends().get(b)]


def make_run(tmp_path, backend, *extra):
    args = build_parser().parse_args(tiny_run_args(tmp_path / f"run-{backend}-{len(extra)}", "--device", "cuda",
                                                   "--backend", backend, "--precision", "bf16", *extra))
    return setup(args, Processes.start("cuda"))


def losses(run, steps):
    out = []
    for _ in range(steps):
        update = train_step(run)
        out.append(update["sums"][0].item() / update["tokens"])
    return out


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_captured_step_gives_the_eager_losses(tmp_path, backend):
    """Same seed, same fixed-shape batches (--cuda-graphs' buckets for both), no dropout (the eager and the
    captured steps draw their masks from different RNG offsets): the same losses, step after step, the first
    steps of each shape running eagerly and the later ones replayed."""
    torch.manual_seed(0)
    eager = make_run(tmp_path, backend, "--dropout", "0")
    eager.batches.fixed_shapes = True
    eager.batches.seek(0)
    torch.manual_seed(0)
    graphed = make_run(tmp_path, backend, "--dropout", "0", "--cuda-graphs")
    expected, got = losses(eager, 12), losses(graphed, 12)
    assert len(graphed.graphs.shapes) >= 2, graphed.graphs.shapes  # replays of more than one shape
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=2e-3, atol=2e-3)
    for p, q in zip(eager.model.parameters(), graphed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_captured_step_never_synchronizes(tmp_path, backend):
    """With dropout: every replay after the captures runs under set_sync_debug_mode("error"), which raises on
    any synchronizing CUDA call, the ones inside C++ kernels included; the loss keeps falling, and two
    replays of one batch draw different dropout masks (the seeds advance on the device)."""
    run = make_run(tmp_path, backend, "--dropout", "0.3", "--cuda-graphs")
    first = losses(run, 6)  # captures every shape met so far
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            run.sums.zero_()
            batch = run.batches.next_tensors()
            if (*batch[0].shape, batch[1].shape[1]) not in run.graphs.micro:
                continue  # a new shape is captured after an eager warm-up run, which may synchronize
            run.graphs.micro_batch(*batch)
            run.grad_scale.fill_(1.0 / 400)
            run.graphs.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(torch.tensor(first)))
    shape, (graph, static) = next(iter(run.graphs.micro.items()))
    sums = []
    for _ in range(2):
        run.sums.zero_()
        graph.replay()
        sums.append(run.sums.clone())
    assert not torch.equal(sums[0], sums[1]), "two replays drew the same dropout masks"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_no_python_frame_between_the_op_and_its_kernel(backend):
    """sys.setprofile sees every Python call: after the public function hands over to the registered op,
    nothing in Python runs until the op returns (forward and backward): the cuda backend's kernels are C++,
    the triton backend's are launched from C++ by each configuration's plan (csrc/triton/plans.cpp), which its
    first calls recorded."""
    q, k, v = (torch.randn(2, 4, 33, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    x, r = (torch.randn(2, 33, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    w, b = torch.ones(256, device="cuda", dtype=torch.bfloat16), torch.zeros(256, device="cuda", dtype=torch.bfloat16)
    calls = []

    def run():
        out = ops.attention(q, k, v, causal=True, backend=backend)
        y = ops.layer_norm_residual(x, r, w, b, backend=backend)
        (out.float().sum() + y.float().sum()).backward()

    for _ in range(3):  # first calls: imports, caches, Triton's compiles and autotuning, the plans' recordings
        run()
    torch.cuda.synchronize()

    def profiler(frame, event, arg):
        if event == "call":
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profiler)
    try:
        run()
    finally:
        sys.setprofile(None)
    ours = [c for c in calls if "fastformer" in c and "/tests/" not in c]
    allowed = ("ops/attention.py:attention", "ops/layer_norm_residual.py:layer_norm_residual",
               "_dispatch.py:forward", "_registry.py:dropout_seed")
    assert all(c.endswith(allowed) for c in ours), [c for c in ours if not c.endswith(allowed)]
