"""The training step's speed, fastformer beside PyTorch: one batch, one process, one table (issue 44).

Every row trains the same model size on the same batch (random sentence pairs, lengths uniform in
[max/2, max], right-padded: tools/profile_step.py's batch) with a fused Adam (fastformer.train's, and its
compute-dtype weight copies, in fastformer's rows; torch's in the baselines) and the same loss (label-smoothed
cross-entropy over every target position, pad ignored), and reports target tokens/s over ``--steps`` timed
steps after ``--warmup`` untimed ones, its ratio to nn.Transformer eager and the peak device memory:

- ``fastformer <backend> eager``: fastformer.train's own step code (fastformer/training/step.py
  ``micro_batch`` + ``optimizer_update``: no host synchronization);
- ``fastformer <backend> graphs``: the same step replayed as CUDA graphs (fastformer/training/graphs.py,
  ``--cuda-graphs``);
- ``nn.Transformer eager``, ``torch.compile(nn.Transformer)`` and its ``mode="reduce-overhead"`` (CUDA
  graphs of its own): the baseline of benchmarks/test_training_step.py.

A row that cannot run here (graphs on a CPU, a backend not built) says why instead of a figure. Each row is
built, warmed up and timed once before the next is built; then the rows alternate for ``--rounds`` - 1 more
rounds (the machine's load drifts); each row's tokens/s is over all its timed steps. ``--out`` is rewritten
after every row and round, and an interrupt (``timeout --signal=INT``) writes what was measured, marked
incomplete, so a cut-off run keeps its first rows. ``--rows`` picks rows (the baseline always runs), so the
rows that compile for minutes can go in a later call (tools/gpu_check.sh part 2). The peak memory is each
row's own (above what earlier rows hold). Under the table: the triton launch plans' counters.

    python tools/step_table.py --device cuda --out docs/results/gpu-step.md      # base, 390 pairs <= 64, bf16
    python tools/step_table.py --device cuda --rows fastformer                   # fastformer's rows + baseline
    python tools/step_table.py --device cpu --config tiny --vocab 64 --pairs 4 --max-len 8 --steps 2  # smoke
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # the baseline model and its loss
sys.path.insert(0, os.path.join(ROOT, "tools"))

from fastformer.cli import HelpFormatter  # noqa: E402
from fastformer.nn import Transformer, TransformerConfig  # noqa: E402
from fastformer.nn.linear import set_compute_dtype  # noqa: E402
from fastformer.training.optim import Adam  # noqa: E402
from fastformer.training.loop import triton_plans_summary  # noqa: E402
from fastformer.training.step import micro_batch, optimizer_update, to_device, value_checks  # noqa: E402
from profile_step import add_batch_arguments, batch  # noqa: E402
from test_training_step import TorchTransformer, torch_loss_sums  # noqa: E402

BASELINE = "nn.Transformer eager"


def fastformer_step(config, backend, graphs: bool, data, dtype, device, tokens):
    """A step function of fastformer.train's step code on a stand-in for its Run."""
    torch.manual_seed(0)
    model = Transformer(config, backend=backend).to(device).train()
    model.check_token_values = False
    amp = None if dtype == torch.float32 else dtype
    copies = {} if amp is None else set_compute_dtype(model, amp)  # as fastformer.train: weights in the autocast dtype
    run = SimpleNamespace(
        model=model, train_model=model, config=config, amp_dtype=amp, compute_copies=copies,
        optimizer=Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, capturable=graphs,
                       compute_copies=copies),
        scaler=torch.amp.GradScaler(device.type, enabled=False), args=SimpleNamespace(clip_norm=0.0),
        sums=torch.zeros(2, device=device), grad_scale=torch.full((), 1.0 / tokens, device=device),
        procs=SimpleNamespace(device=device, world=1, gradient_sync=lambda *a, **k: contextlib.nullcontext()))
    host = tuple(t.cpu() for t in data)
    if graphs:
        from fastformer.training.graphs import CudaGraphs
        run.step = CudaGraphs(run)

        def step():
            with value_checks(run):
                run.sums.zero_()
                run.step.micro_batch(host)
                run.step.update()
    else:
        def step():
            with value_checks(run):  # as train_step: on a GPU the targets' check is deferred, no sync
                run.optimizer.zero_grad(set_to_none=True)
                run.sums.zero_()
                micro_batch(run, *to_device(host, device), sync=True)
                optimizer_update(run)
    return step


def torch_step(config, mode: str | None, data, dtype, device, tokens):
    """A step function of the nn.Transformer baseline, eager or under torch.compile(mode=...)."""
    torch.manual_seed(0)
    model = TorchTransformer(config).to(device).train()
    forward = model if mode is None else torch.compile(model, mode=None if mode == "default" else mode)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=device.type == "cuda")
    src, tgt_in, tgt_out = data

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss, _ = torch_loss_sums(forward, src, tgt_in, tgt_out, config.pad_id, config.label_smoothing)
            (loss / tokens).backward()
        optimizer.step()
    return step


def rows_wanted(device: torch.device) -> list[tuple[str, callable]]:
    """(name, factory(config, data, dtype, device, tokens) -> step) of every row, in table order."""
    import fastformer
    rows = []
    backends = ["cuda", "triton"] if device.type == "cuda" else ["cpu"]
    for backend in backends:
        rows.append((f"fastformer {backend} eager",
                     lambda c, d, t, dev, n, b=backend: fastformer_step(c, b, False, d, t, dev, n)))
        rows.append((f"fastformer {backend} graphs",
                     lambda c, d, t, dev, n, b=backend: fastformer_step(c, b, True, d, t, dev, n)))
    rows.append((BASELINE, lambda c, d, t, dev, n: torch_step(c, None, d, t, dev, n)))
    rows.append(("torch.compile(nn.Transformer)", lambda c, d, t, dev, n: torch_step(c, "default", d, t, dev, n)))
    rows.append(("torch.compile(nn.Transformer, mode=\"reduce-overhead\")",
                 lambda c, d, t, dev, n: torch_step(c, "reduce-overhead", d, t, dev, n)))
    available = fastformer.backends()
    return [(name, make) for name, make in rows
            if not name.startswith("fastformer") or available.get(name.split()[1], False)]


def select(rows: list, patterns: str | None) -> list:
    """The rows whose name contains one of the comma-separated patterns (all rows for None), the baseline
    always included: every ratio is to nn.Transformer eager measured in the same process."""
    if not patterns:
        return rows
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    return [(name, make) for name, make in rows if name == BASELINE or any(p in name for p in wanted)]


def refusal(name: str, device: torch.device) -> str | None:
    if "graphs" in name and device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if "compile" in name and device.type != "cuda":
        return "left out on the CPU (minutes of compiling; the GPU's row)"
    return None


class Table:
    """The rows measured so far, as markdown, written to ``out`` after every row and every round (a run cut
    off by a time-out keeps what it measured). Each row's tokens/s is over all its timed steps so far; its peak
    memory is the peak allocated while it was built and warmed up, above what was allocated before (the
    earlier rows' models, optimizers and graph pools stay alive for the alternating rounds, and are not
    counted)."""

    def __init__(self, header: str, names: list[str], tokens: int, out: str | None):
        self.header, self.names, self.tokens, self.out = header, names, tokens, out
        self.seconds: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.notes: dict[str, str] = {}
        self.peak: dict[str, float] = {}
        self.footer: list[str] = []
        self.state = "running"

    def add(self, name: str, seconds: float, steps: int) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.steps[name] = self.steps.get(name, 0) + steps

    def markdown(self) -> str:
        speed = {name: self.tokens * self.steps[name] / s for name, s in self.seconds.items() if s > 0}
        base = speed.get(BASELINE)
        lines = [self.header, "",
                 "| model | target tokens/s | vs nn.Transformer eager | timed steps | peak memory (the row's own) |",
                 "|---|---:|---:|---:|---:|"]
        for name in self.names:
            memory = f"{self.peak[name]:.2f} GiB" if name in self.peak else "-"
            if name in speed:
                ratio = f"{speed[name] / base:.2f}x" if base else "-"
                lines.append(f"| {name} | {speed[name]:,.0f} | {ratio} | {self.steps[name]} | {memory} |")
            else:
                lines.append(f"| {name} | {self.notes.get(name, 'not reached (' + self.state + ')')} | | | {memory} |")
        if self.state != "complete":
            lines += ["", f"**Incomplete: {self.state}.** The figures above are over the steps timed before that."]
        return "\n".join(lines + ([""] + self.footer if self.footer else [])) + "\n"

    def write(self) -> None:
        if self.out:
            tmp = self.out + ".tmp"
            with open(tmp, "w") as f:
                f.write(self.markdown())
            os.replace(tmp, self.out)  # a reader (the check's report) never sees half a table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_batch_arguments(parser)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row first (compiling, capture)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of timed steps, the rows alternating")
    parser.add_argument("--rows", default=None,
                        help="comma-separated parts of row names to run (e.g. 'fastformer' or 'graphs,compile'); "
                             "nn.Transformer eager, the baseline of every ratio, always runs. Default: every row")
    parser.add_argument("--out", default=None, help="write the markdown here too, after every row and round")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if min(args.warmup, args.steps - 1, args.rounds - 1, args.pairs - 1, args.max_len - 1) < 0:
        parser.error("--warmup >= 0, --steps, --rounds, --pairs and --max-len >= 1")
    rows = select(rows_wanted(device), args.rows)
    config = getattr(TransformerConfig, args.config)(vocab_size=args.vocab, max_positions=max(args.max_len, 256))
    torch.manual_seed(0)
    data = tuple(t.to(device) for t in batch(config, args.pairs, args.max_len, "cpu"))
    tokens = int(data[2].ne(config.pad_id).sum())
    cuda = device.type == "cuda"
    header = (f"Training step, {args.config} config, vocabulary {args.vocab:,}, {args.pairs} pairs <= {args.max_len} "
              f"tokens ({tokens:,} target tokens), {str(dtype).removeprefix('torch.')}, on "
              f"{torch.cuda.get_device_name(device) if cuda else 'the CPU'}; {args.rounds} rounds of {args.steps} "
              f"steps per row after {args.warmup} warm-up steps, the rows alternating (`python tools/step_table.py "
              f"{' '.join(argv if argv is not None else sys.argv[1:])}`)")
    table = Table(header, [name for name, _ in rows], tokens, args.out)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def timed(name, step):
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        table.add(name, time.perf_counter() - start, args.steps)

    steps = {}
    try:
        # Each row is built, warmed up and timed once before the next is built, so that a run cut off early
        # has figures for its first rows; the later rounds alternate over every row built.
        for name, make in rows:
            why = refusal(name, device)
            if why:
                table.notes[name] = why
                continue
            try:
                if cuda:
                    sync()
                    before = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                step = make(config, data, dtype, device, tokens)
                for _ in range(args.warmup):
                    step()
                sync()
                if cuda:
                    table.peak[name] = (torch.cuda.max_memory_allocated(device) - before) / 2**30
                timed(name, step)
                steps[name] = step
            except Exception as exc:  # a row that fails says why; the others still run
                table.notes[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            table.write()
        for _ in range(args.rounds - 1):
            for name, step in steps.items():
                timed(name, step)
            table.write()
        table.state = "complete"
    except KeyboardInterrupt:  # timeout --signal=INT: keep what was measured
        table.state = "interrupted (SIGINT, e.g. the caller's time-out)"
    line = triton_plans_summary()  # the launch plans' counters over every row, or None where none ran
    if line:
        table.footer.append(f"- {line}")
    table.write()
    print(table.markdown())
    return 0 if table.state == "complete" else 130


if __name__ == "__main__":
    raise SystemExit(main())
