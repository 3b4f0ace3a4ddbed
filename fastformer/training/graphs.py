"""--cuda-graphs: the training step replayed as CUDA graphs, one per batch shape plus one for the update.

On a GPU a Transformer step at the paper's sizes is host-bound: launching its ~1,000 kernels from Python
takes longer than running them (docs/gpu-report.md). A CUDA graph records the launches once and replays them
with one call. What makes the step capturable (fastformer/training/step.py): no host synchronization in
forward, backward or the update; batches in a small fixed set of shapes (fastformer/data/batching.py's
length buckets: rows x columns fixed per bucket, all-pad rows added; or, with --batching packed, one shape:
--max-tokens tokens per side, the sentence tables of a fixed length); dropout seeds drawn on the device from
torch's CUDA generator, whose Philox offset advances on every replay (fastformer/ops/_registry.py); the
learning rate and the gradient's scale in device tensors; a fused, capturable Adam.

Per batch shape ((B, S, T), or the packed tensors' shapes): the first batch of that shape is copied into static input buffers and run eagerly on
a side stream (real work: it trains, and it warms up lazy initialisation, Triton's compilation and
autotuning, the allocator), then the micro-batch (forward, backward into the persistent .grad tensors, loss
sums into ``run.sums``) is captured; later batches of that shape are copied into the buffers and replayed.
The update (gradient scale, clipping, Adam, gradient zeroing) is run eagerly once, then captured and
replayed. All graphs share one memory pool: they replay one at a time on one stream, and what outlives a
replay (gradients, sums, optimizer state, parameters) lives outside the pool.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fastformer.data.batching import PackedBatch, Sequences
from fastformer.training.step import loss_sums, optimizer_update, packed_loss_sums

if TYPE_CHECKING:
    from fastformer.training.run import Run


def refusal(args, device: torch.device, world: int) -> str | None:
    """Why --cuda-graphs cannot run with these settings, or None."""
    if device.type != "cuda":
        return f"--cuda-graphs needs a CUDA device (the device is {device})"
    if world > 1:
        return "--cuda-graphs runs in a single process (DistributedDataParallel's hooks are not captured here)"
    if args.precision == "fp16" or (args.precision == "auto" and not torch.cuda.is_bf16_supported()):
        return ("--cuda-graphs needs --precision bf16 or fp32: fp16's loss scaling reads the overflow flag on "
                "the host every update")
    if args.compile:
        return "--cuda-graphs and --compile are two ways of removing the host from the step; choose one"
    return None


def capture(body, inputs: tuple, pool) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``body(*inputs)`` (captured, not run), its memory from ``pool``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body(*inputs)
    return graph


class CudaGraphs:
    """The step replayed as CUDA graphs (fastformer.training.run.Step): the captured micro-batches (one graph per
    batch shape) and the captured update of one run."""

    def __init__(self, run: Run):
        self.run = run
        self.device = run.procs.device
        self.pool = torch.cuda.graph_pool_handle()
        self.micro: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.update_graph: torch.cuda.CUDAGraph | None = None
        # Persistent gradients, zeroed by the update: captured backward passes accumulate into them.
        self.params = [p for p in run.model.parameters() if p.requires_grad]
        for p in self.params:
            p.grad = torch.zeros_like(p)
        for group in run.optimizer.param_groups:  # a captured Adam reads the learning rate from the device
            group["capturable"] = True  # (a resumed optimizer's may be a CPU tensor: always a new one here)
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device)

    @property
    def shapes(self) -> list[tuple]:
        """The batch shapes captured so far: (B, S, T) of padded batches, (Ts, Tt, sentences + 1, max_len) of
        packed ones."""
        return sorted(self.micro)

    def _micro_body(self, *batch: torch.Tensor) -> None:
        """Forward, backward and loss sums of one batch: (src, tgt_in, tgt_out), or a packed batch's tensors
        (``_tensors``), whose max_len is the graph's (``self.max_len``)."""
        run = self.run
        # autocast's weight cache would hold casts made during capture past it: off under graphs
        with torch.autocast("cuda", dtype=run.amp_dtype, enabled=run.amp_dtype is not None, cache_enabled=False):
            if len(batch) == 3:
                loss, nll = loss_sums(run.model, *batch, run.config.pad_id, run.config.label_smoothing,
                                      backend=run.model.backend)
            else:
                src, tgt_in, tgt_out, src_cu, src_pos, tgt_cu, tgt_pos, max_len = batch
                packed = PackedBatch(src, tgt_in, tgt_out, Sequences(src_cu, src_pos, max_len),
                                     Sequences(tgt_cu, tgt_pos, max_len))
                loss, nll = packed_loss_sums(run.model, packed, run.config.pad_id, run.config.label_smoothing,
                                             backend=run.model.backend)
        loss.backward()
        run.sums.add_(torch.stack([loss.detach(), nll]))

    @staticmethod
    def _tensors(batch) -> tuple[list[torch.Tensor], tuple]:
        """A host batch's tensors (what is copied into a graph's static buffers) and its key: (src, tgt_in,
        tgt_out) and (B, S, T); of a PackedBatch also its sentence tables and positions, and the key holds the
        sentence count and max_len (a launch parameter of the captured attention kernels)."""
        if isinstance(batch, PackedBatch):
            if batch.src_seqs.max_len != batch.tgt_seqs.max_len:
                raise ValueError("a fixed-shape packed batch has one max_len on both sides (collate_packed(shape=))")
            tensors = [batch.src, batch.tgt_in, batch.tgt_out, *batch.src_seqs[:2], *batch.tgt_seqs[:2]]
            return tensors, (batch.src.shape[0], batch.tgt_in.shape[0], batch.src_seqs.cu_seqlens.shape[0],
                             batch.src_seqs.max_len)
        src, tgt_in, tgt_out = batch
        return [src, tgt_in, tgt_out], (*src.shape, tgt_in.shape[1])

    def _update_body(self) -> None:
        optimizer_update(self.run)
        torch._foreach_zero_([p.grad for p in self.params])

    def _warm_and_capture(self, body, *inputs) -> torch.cuda.CUDAGraph:
        """Runs ``body(*inputs)`` once eagerly on a side stream (its real work), then captures it."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            body(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return capture(body, inputs, self.pool)

    def begin(self) -> None:
        """Nothing: the gradients are persistent, zeroed by the captured update."""

    def micro_batch(self, batch, sync: bool = True) -> None:
        """Forward and backward of one host batch (src, tgt_in, tgt_out: int64 (B, S), (B, T), (B, T); or a
        fixed-shape PackedBatch): replayed when its shape has a graph, else run and captured. ``sync`` is
        always true in effect: graphs run in a single process (``refusal``)."""
        tensors, key = self._tensors(batch)
        entry = self.micro.get(key)
        if entry is None:
            static = tuple(t.to(self.device) for t in tensors)
            inputs = static + ((key[3],) if isinstance(batch, PackedBatch) else ())
            self.micro[key] = (self._warm_and_capture(self._micro_body, *inputs), static)
            return
        graph, static = entry
        for buffer, t in zip(static, tensors):
            buffer.copy_(t.pin_memory() if buffer.is_cuda else t, non_blocking=True)
        graph.replay()

    def update(self) -> None:
        """The optimizer update of the accumulated gradient (run.grad_scale and the learning rate already set)."""
        if self.update_graph is None:
            self.update_graph = self._warm_and_capture(self._update_body)
        else:
            self.update_graph.replay()
