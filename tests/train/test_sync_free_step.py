"""The training step issues no host synchronization, so a GPU can run it as a CUDA graph (issue 44).

On the CPU a dispatch mode sees every ATen call of the device part of the step: the micro-batch (forward,
backward, loss sums) and the optimizer update, exactly what fastformer/training/graphs.py captures. It
fails on the calls that make a GPU's host wait: reading a scalar back (``_local_scalar_dense``, ``item``,
``is_nonzero``), ops whose output shape depends on the data (``nonzero``, ``masked_select``, boolean
indexing: the host must learn the size), and copies from a device to the CPU. (Syncs inside C++ kernels,
such as a range check's ``.item()`` on CUDA tensors, are invisible here: tests/gpu runs the captured step
under ``torch.cuda.set_sync_debug_mode("error")``, which sees those.) The batch is prepared, checked and
counted on the host before it moves, outside the part observed.
"""
import torch
import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from fastformer.data.batching import PackedBatch
from fastformer.train import build_parser
from fastformer.training.processes import Processes
from fastformer.training.setup import setup
from fastformer.training.step import micro_batch, optimizer_update, to_device, train_step

from gpu_checks import assert_every_update_replayed
from train_helpers import GRAPH_CASES, set_attention_dropout, tiny_run_args, train_updates

aten = torch.ops.aten
SCALAR_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default}
DATA_DEPENDENT_SHAPES = {aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default,
                         aten._unique2.default}


class SyncDetector(TorchDispatchMode):
    """Records every ATen call that would make the host wait for a GPU."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SCALAR_READS or func in DATA_DEPENDENT_SHAPES:
            self.syncs.append(str(func))
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.syncs.append("aten.index.Tensor with a boolean index")
        elif func in (aten._to_copy.default, aten.copy_.default):
            source = args[1] if func is aten.copy_.default else args[0]
            target_device = kwargs.get("device") if func is aten._to_copy.default else args[0].device
            if source.device.type != "cpu" and target_device is not None and torch.device(target_device).type == "cpu":
                self.syncs.append(f"{func}: device to host")
        return func(*args, **kwargs)


def make_run(tmp_path, *extra):
    """A tiny run on the CPU with the optimizer fastformer.train uses on CUDA: Adam, fused (on the CPU the
    trainer keeps torch's default Adam, whose step count is a host tensor read back with .item())."""
    args = build_parser().parse_args(tiny_run_args(tmp_path / "run", "--dropout", "0.1", "--clip-norm", "1.0",
                                                   "--precision", "fp32", *extra))
    run = setup(args, Processes.start("cpu"))
    run.optimizer = torch.optim.Adam(run.model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
    return run


def device_part(run, batch):
    """What a captured step holds: the micro-batch on the device and the update (the token count, and so
    the gradient's scale, come from the host batch)."""
    micro_batch(run, *to_device(batch, run.procs.device), sync=True)
    optimizer_update(run)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_step_has_no_host_sync(tmp_path, precision):
    run = make_run(tmp_path, "--precision", precision)
    run.model.train()
    for _ in range(2):  # the first update creates Adam's state: both it and a later one are checked
        batch = run.batches.next_tensors()
        run.optimizer.zero_grad(set_to_none=True)
        run.grad_scale.fill_(1.0 / int(batch[2].ne(run.config.pad_id).sum()))
        with SyncDetector() as detector:
            device_part(run, batch)
        assert detector.syncs == [], detector.syncs
    assert torch.isfinite(run.sums).all() and run.sums[0] > 0


def test_fixed_shape_packed_step_has_no_host_sync(tmp_path):
    """The packed step of --batching packed --cuda-graphs (one fixed shape): attention_varlen's tables and
    max_len come from the host batch, the loss ignores the padding tail by ignore_index."""
    run = make_run(tmp_path, "--batching", "packed")
    run.batches.fixed_shapes = True
    run.batches.seek(0)
    run.model.train()
    for _ in range(2):
        batch = run.batches.next_tensors()
        run.optimizer.zero_grad(set_to_none=True)
        run.grad_scale.fill_(1.0 / int(batch.tgt_out.ne(run.config.pad_id).sum()))
        with SyncDetector() as detector:
            micro_batch(run, to_device(batch, run.procs.device), sync=True)
            optimizer_update(run)
        assert detector.syncs == [], detector.syncs
    assert torch.isfinite(run.sums).all() and run.sums[0] > 0


def test_the_detector_sees_what_the_step_avoids(tmp_path):
    """The model's own token check (kept for users; the trainer checks on the host instead) and the boolean
    selection of pad positions (the old loss) are host syncs on a GPU: the detector reports both."""
    run = make_run(tmp_path)
    src, tgt_in, tgt_out = run.batches.next_tensors()
    run.model.check_token_values = True
    with SyncDetector() as detector:
        run.model(src, tgt_in)
    assert any("_local_scalar_dense" in s for s in detector.syncs), detector.syncs
    run.model.check_token_values = False
    with SyncDetector() as detector:
        hidden = run.model.hidden(src, tgt_in)
        hidden[tgt_out != run.config.pad_id]
    assert detector.syncs == ["aten.index.Tensor with a boolean index"], detector.syncs


def test_train_step_reports_device_sums_and_host_token_counts(tmp_path):
    """train_step: the tokens of the update counted on the host (an int), the loss sums left on the device
    until the loop logs them, and a loss over every position equal to one over the non-pad positions only."""
    run = make_run(tmp_path, "--dropout", "0")
    update = train_step(run)
    assert isinstance(update["tokens"], int) and update["tokens"] >= run.args.update_tokens
    assert update["sums"].device.type == "cpu" and update["sums"].shape == (2,)
    src, tgt_in, tgt_out = run.batches.next_tensors()
    run.model.eval()
    with torch.no_grad():
        logits = run.model(src, tgt_in)
        keep = tgt_out != run.config.pad_id
        expected = torch.nn.functional.cross_entropy(logits[keep].double(), tgt_out[keep], reduction="sum",
                                                     label_smoothing=run.config.label_smoothing)
        from fastformer.training.step import loss_sums
        loss, _ = loss_sums(run.model, src, tgt_in, tgt_out, run.config.pad_id, run.config.label_smoothing)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-4)


def test_bad_token_ids_are_refused_on_the_host(tmp_path):
    run = make_run(tmp_path)
    src, tgt_in, _ = run.batches.next_tensors()
    with pytest.raises(ValueError, match="outside"):
        run.model.check_tokens(src, tgt_in.masked_fill(tgt_in == tgt_in[0, 0], run.config.vocab_size))


class ReplayedBody:
    """A stand-in for a captured CUDA graph on the CPU: replay() runs the captured body again on the same
    (static) input tensors, which is what a graph's replay does on a GPU."""
    captures = replays = 0

    def __init__(self, body, inputs):
        self.body, self.inputs = body, inputs
        ReplayedBody.captures += 1

    def replay(self):
        ReplayedBody.replays += 1
        self.body(*self.inputs)


class FrozenMasks(ReplayedBody):
    """A broken stand-in: every replay draws the random numbers of its capture (the generator's state then),
    as a graph would whose dropout seeds did not advance between replays."""

    def __init__(self, body, inputs):
        super().__init__(body, inputs)
        self.state = torch.get_rng_state()

    def replay(self):
        torch.set_rng_state(self.state)
        super().replay()


@pytest.fixture
def graphs(monkeypatch):
    """fastformer/training/graphs.py with CUDA's stream and capture calls replaced by stand-ins: a capture
    is a ReplayedBody (counted from 0 in each test)."""
    from fastformer.training import graphs

    class Stream:
        def __init__(self, *args):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(graphs, "capture", lambda body, inputs, pool: ReplayedBody(body, inputs))
    ReplayedBody.captures = ReplayedBody.replays = 0
    return graphs


def fixed_shape_run(out, graphs, *extra, attention_dropout=0.0):
    """A tiny run with no residual or embedding dropout on batches of --cuda-graphs' fixed shapes, through
    ``graphs.CudaGraphs`` (the stand-ins) unless ``graphs`` is None."""
    run = make_run(out, "--dropout", "0", "--clip-norm", "0.5", *extra)
    set_attention_dropout(run.model, attention_dropout)
    run.batches.fixed_shapes = True
    run.batches.seek(0)
    if graphs is not None:
        run.step = graphs.CudaGraphs(run)
    return run


def eager_and_graphed(tmp_path, graphs, extra=(), attention_dropout=0.0, steps=8):
    """The same updates run eagerly and through the graphs' control flow, each run's training from the same
    generator state: for each, (run, train_updates' losses, micro-batches and host batches)."""
    results = []
    for name, stand_ins in (("eager", None), ("graphed", graphs)):
        run = fixed_shape_run(tmp_path / name, stand_ins, *extra, attention_dropout=attention_dropout)
        torch.manual_seed(0)
        results.append((run, *train_updates(run, steps)))
    return results


def dropout_draws_differ(run, batch) -> bool:
    """Whether two forward passes of one host batch differ (in training mode, dropout on)."""
    run.model.train()
    with torch.no_grad():
        forward = (lambda: run.model(packed=batch)) if isinstance(batch, PackedBatch) else (lambda: run.model(*batch[:2]))
        return not torch.equal(forward(), forward())


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_graph_logic_gives_the_eager_losses(tmp_path, graphs, case):
    """fastformer/training/graphs.py's control flow on the CPU, CUDA's stream and capture calls replaced by
    stand-ins: one capture per batch shape and one of the update, the first batch of a shape trained eagerly,
    later ones copied into the static buffers and replayed, gradients kept (and accumulated over an update's
    micro-batches) and zeroed by the update, the learning rate and gradient scale read from tensors. Same
    fixed-shape batches, no residual or embedding dropout: the same losses and weights as the eager step, in
    the cases of tests/gpu/test_cuda_graph_step.py, which runs the real capture (with attention dropout, a
    replay here draws from the CPU generator where the eager step does; there, from the CUDA generator's
    offsets, which a capture hands its replays)."""
    extra, attention_dropout = GRAPH_CASES[case]
    steps = 8
    (eager, expected, eager_micro, drawn), (graphed, got, micro, _) = eager_and_graphed(
        tmp_path, graphs, extra, attention_dropout, steps)
    shapes = len(graphed.step.shapes)
    assert ReplayedBody.captures == shapes + 1  # one per shape met, one of the update
    assert shapes == 1 if "packed" in extra else shapes >= 2, graphed.step.shapes
    # every micro-batch but the first of each shape, every update but the first
    assert ReplayedBody.replays == sum(micro) - shapes + steps - 1, (ReplayedBody.replays, micro, shapes)
    assert micro == eager_micro and ("--update-tokens" not in extra or min(micro) >= 2), micro
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    for p, q in zip(eager.model.parameters(), graphed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(q.grad is not None and not q.grad.any() for q in graphed.model.parameters())  # zeroed, kept
    assert dropout_draws_differ(eager, drawn[0]) == bool(attention_dropout)


def test_the_comparison_fails_when_replays_overwrite_the_gradients(tmp_path, graphs, monkeypatch):
    """A broken capture whose backward writes the gradients instead of adding to them (each micro-batch
    zeroes them first): an update keeps only its last micro-batch's gradient. With accumulated
    micro-batches the losses part from the eager ones, as the comparison of the test above would report."""
    micro_body = graphs.CudaGraphs._micro_body

    def overwriting(self, *batch):
        torch._foreach_zero_([p.grad for p in self.params])
        micro_body(self, *batch)

    monkeypatch.setattr(graphs.CudaGraphs, "_micro_body", overwriting)
    (_, expected, _, _), (_, got, _, _) = eager_and_graphed(tmp_path, graphs, *GRAPH_CASES["accumulated micro-batches"])
    assert got[0] == pytest.approx(expected[0], rel=1e-5)  # the first update's loss, before any update
    assert not torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_the_comparison_fails_when_replays_freeze_the_dropout_masks(tmp_path, graphs, monkeypatch):
    """A broken capture whose replays draw their capture's masks again: with attention dropout the losses
    part from the eager ones; without dropout (the only case before issue 51) they agree, blind to it."""
    monkeypatch.setattr(graphs, "capture", lambda body, inputs, pool: FrozenMasks(body, inputs))
    for case, blind in (("update of one micro-batch", True), ("attention dropout", False)):
        (_, expected, _, _), (_, got, _, _) = eager_and_graphed(tmp_path / case, graphs, *GRAPH_CASES[case])
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5) == blind, case


def test_every_update_counted_as_a_replay(tmp_path, graphs, monkeypatch):
    """gpu_checks.assert_every_update_replayed, which tests/gpu/test_cuda_graph_step.py runs under
    set_sync_debug_mode("error"): here under the SyncDetector. After 6 updates, their batches again are all
    replays and pass; it fails on a batch of a shape never captured (captured now, as the old GPU test's
    loop skipped it, checking nothing) and on a runner that trains the batches eagerly."""
    run = fixed_shape_run(tmp_path / "run", graphs, attention_dropout=0.1)
    _, _, drawn = train_updates(run, 6)
    detector = SyncDetector()
    assert_every_update_replayed(run, drawn, detector)
    assert detector.syncs == []
    later = (run.batches.next_tensors() for _ in range(100))
    new_shape = next(b for b in later if (*b[0].shape, b[1].shape[1]) not in run.step.micro)
    with pytest.raises(AssertionError, match="micro-batch graphs 1, of the update graph 2"):
        assert_every_update_replayed(run, [drawn[0], new_shape], SyncDetector())
    monkeypatch.setattr(run.step, "micro_batch", lambda batch, sync=True: run.step._micro_body(*batch))
    with pytest.raises(AssertionError, match="micro-batch graphs 0"):
        assert_every_update_replayed(run, drawn, SyncDetector())


def test_the_step_defers_the_value_checks_on_a_gpu(tmp_path, monkeypatch):
    """On a GPU train_step runs in the deferred mode of the ops' value checks (cross_entropy's targets,
    attention_varlen's tables: no host read per call, fastformer/ops/deferred.py); elsewhere they stay at the
    call (free on the CPU). The batches are checked on the host before they move either way (check_batch)."""
    from fastformer._ext import C
    from fastformer.training import step

    run = make_run(tmp_path)
    seen = []
    monkeypatch.setattr(step, "check_batch", lambda run, batch: seen.append(C.deferred_checks_enabled()) or 400)
    monkeypatch.setattr(step, "micro_batch", lambda run, *batch, sync: seen.append(C.deferred_checks_enabled()))
    monkeypatch.setattr(step, "optimizer_update", lambda run: seen.append(C.deferred_checks_enabled()))
    train_step(run)
    assert seen == [False] * 3
    monkeypatch.setattr(run.procs, "device", torch.device("cuda"))
    monkeypatch.setattr(step, "to_device", lambda batch, device: batch)
    seen.clear()
    train_step(run)
    assert seen == [True] * 3 and not C.deferred_checks_enabled()


def test_the_loop_reads_the_deferred_checks_where_it_reads_the_device(tmp_path, monkeypatch):
    """fastformer/training/loop.py calls ops.check_deferred() right after each log's read-back of the loss sums
    (so a bad batch fails loudly within one log interval, at no extra wait), and before a dev evaluation and
    before a checkpoint (none of weights a bad batch touched)."""
    from fastformer import ops
    from fastformer.training import loop

    run = make_run(tmp_path, "--max-steps", "4", "--log-every", "2", "--checkpoint-every", "3", "--eval-every", "3")
    events = []
    sum_ = run.procs.sum
    monkeypatch.setattr(run.procs, "sum", lambda *values: events.append("read") or sum_(*values))
    monkeypatch.setattr(ops, "check_deferred", lambda: events.append("check"))
    monkeypatch.setattr(loop, "save_checkpoint", lambda run: events.append("save"))
    monkeypatch.setattr(loop, "evaluate_dev", lambda run: events.append("evaluate"))
    monkeypatch.setattr(loop, "train_step", lambda run: events.append("step") or
                        {"tokens": 1, "lr": 0.0, "sums": torch.ones(2)})
    loop.train(run)
    assert events == ["step", "step", "read", "check",  # update 2: logged
                      "step", "check", "evaluate", "check", "save",  # update 3: dev evaluation, checkpoint
                      "step", "read", "check"], events  # update 4, the last: logged (finish() saves)
