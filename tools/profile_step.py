"""The training step explained: a torch.profiler table of fastformer's step beside torch.nn.Transformer's.

Both models take the same batch (random sentence pairs, lengths uniform in [max/2, max], right-padded),
compute the loss as the training benchmark does (benchmarks/test_training_step.py: fastformer's
``loss_sums`` with the fused ``ops.cross_entropy``, the baseline's ``F.cross_entropy``), back-propagate its
mean over the target tokens and take an Adam step (fastformer's with fastformer.train's fused Adam, the baseline
with torch's, ``fused=True`` on CUDA).
After ``--warmup`` steps, ``--steps`` steps per model are profiled; the report gives each model's step time
and target tokens/s over the profiled steps, its ops by self time on the device (CUDA) or the CPU, and
one more step seen by fastformer/training/copies.py: its copies and casts of >= 4,096 elements per GEMM (issue
52's count) and its time by kernel class (GEMM, fastformer's ops, copies, other), as markdown. Under bf16/fp16
fastformer's projections multiply compute-dtype copies of their weights, as fastformer.train's do:

    python tools/profile_step.py --device cuda                      # paper sizes: base, 390 pairs <= 64
    python tools/profile_step.py --device cpu --config tiny --vocab 64 --pairs 4 --max-len 8   # a smoke run
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # the baseline model and its loss live there

from fastformer.cli import HelpFormatter  # noqa: E402
from fastformer.nn import Transformer, TransformerConfig  # noqa: E402
from fastformer.nn.linear import mark_compute_copies_current, set_compute_dtype  # noqa: E402
from fastformer.training.copies import profile_step  # noqa: E402
from fastformer.training.optim import Adam  # noqa: E402
from fastformer.training.step import loss_sums  # noqa: E402
from test_training_step import TorchTransformer, torch_loss_sums  # noqa: E402


def batch(config: TransformerConfig, pairs: int, max_len: int, device) -> tuple[torch.Tensor, ...]:
    """src, tgt_in, tgt_out (pairs, max_len) int64: lengths uniform in [max_len / 2, max_len], padded."""
    def tokens():
        lengths = torch.randint(max(1, max_len // 2), max_len + 1, (pairs,))
        t = torch.randint(4, config.vocab_size, (pairs, max_len))
        return t.masked_fill(torch.arange(max_len)[None] >= lengths[:, None], config.pad_id)

    src, tgt_in = tokens(), tokens()
    tgt_out = torch.where(tgt_in.eq(config.pad_id), config.pad_id, torch.randint_like(tgt_in, 4, config.vocab_size))
    return src.to(device), tgt_in.to(device), tgt_out.to(device)


def profile(name: str, model, data, config, args, device) -> str:
    """Markdown: the model's step time, tokens/s and its profiler table."""
    model.to(device).train()
    src, tgt_in, tgt_out = data
    baseline = isinstance(model, TorchTransformer)
    dtype = getattr(torch, args.dtype)
    if baseline:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                     fused=device.type == "cuda")
        copies = {}
    else:  # as fastformer.train: compute-dtype copies of the weights, written by its fused Adam's pass
        copies = {} if dtype == torch.float32 else set_compute_dtype(model, dtype)
        optimizer = Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, compute_copies=copies)

    target_tokens = int(tgt_out.ne(config.pad_id).sum())

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            if baseline:
                loss, _ = torch_loss_sums(model, src, tgt_in, tgt_out, config.pad_id, config.label_smoothing)
            else:
                loss, _ = loss_sums(model, src, tgt_in, tgt_out, config.pad_id, config.label_smoothing,
                                    backend=args.backend)
            (loss / target_tokens).backward()
        optimizer.step()
        mark_compute_copies_current(copies)
        return target_tokens

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        tokens = sum(step() for _ in range(args.steps))
        sync()
        seconds = time.perf_counter() - start
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=60)
    traffic = profile_step(step, device).markdown(f"Copies and casts of one step of {name}, time by kernel class")
    return (f"### {name}\n\n{args.steps} profiled steps: {seconds / args.steps * 1e3:.1f} ms a step, "
            f"{tokens / seconds:,.0f} target tokens/s (under the profiler)\n\n```\n{table}\n```\n\n{traffic}")


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The device, model size, batch and dtype of a training-step measurement (this tool's and
    tools/step_table.py's)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the models run (default: cuda when a GPU is visible, else cpu)")
    parser.add_argument("--config", default="base", choices=("tiny", "small", "base", "big"),
                        help="TransformerConfig of the models")
    parser.add_argument("--vocab", type=int, default=37000, help="vocabulary size (the paper's: 37,000)")
    parser.add_argument("--pairs", type=int, default=390, help="sentence pairs per batch")
    parser.add_argument("--max-len", type=int, default=64, help="longest source / target sentence (tokens)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="autocast dtype (default: bfloat16 on CUDA, float32 on CPU)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    add_batch_arguments(parser)
    parser.add_argument("--backend", default=None, help="fastformer backend (default: the automatic choice)")
    parser.add_argument("--warmup", type=int, default=3, help="unprofiled steps first (allocator, autotuning)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per model")
    parser.add_argument("--rows", type=int, default=20, help="ops listed per model")
    parser.add_argument("--out", default=None, help="write the markdown here too")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.dtype is None:
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    if args.warmup < 0 or args.steps < 1 or args.pairs < 1 or args.max_len < 1:
        parser.error("--warmup >= 0, --steps >= 1, --pairs >= 1 and --max-len >= 1")
    config = getattr(TransformerConfig, args.config)(vocab_size=args.vocab)
    torch.manual_seed(0)
    data = batch(config, args.pairs, args.max_len, device)
    target_tokens = int(data[2].ne(config.pad_id).sum())
    parts = [f"## The training step profiled ({args.config}, vocab {args.vocab:,}, {args.pairs} pairs <= "
             f"{args.max_len} tokens, {target_tokens:,} target tokens, {args.dtype}, {device})\n\n"
             f"`python tools/profile_step.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n"]
    for name, model in (("fastformer", Transformer(config, backend=args.backend)),
                        ("torch.nn.Transformer", TorchTransformer(config))):
        torch.manual_seed(0)
        parts.append(profile(name, model, data, config, args, device))
        del model
    report = "\n".join(parts)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
