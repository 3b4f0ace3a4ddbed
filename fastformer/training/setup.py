"""A training run from its command-line arguments: the corpus, the joint sentencepiece vocabulary (trained
once per run folder), the model, Adam with the paper's betas, the precision, and the training state (fresh,
or resumed from the run folder's latest checkpoint), and the step that trains it (eager, or replayed as CUDA
graphs): a ``Run`` (fastformer/training/run.py) holds all of it for the loop."""
from __future__ import annotations

import argparse
import os

import torch

from fastformer import checkpoint as ckpt
from fastformer.cli import usage_error
from fastformer.data import Tokenizer, load_bible, load_text_files
from fastformer.data.corpus import ParallelCorpus
from fastformer.nn import Transformer, TransformerConfig
from fastformer.nn.linear import set_compute_dtype
from fastformer.runtime import bound_onednn_cache, keep_freed_memory, native_bf16_cpu
from fastformer.training import finetune, resume
from fastformer.training.batches import BatchStream, special_ids
from fastformer.training.optim import Adam
from fastformer.training.processes import Processes
from fastformer.training.run import Run
from fastformer.training.runlog import RunLog
from fastformer.training.step import EagerStep

PROG = "python -m fastformer.train"


def configure_process(args: argparse.Namespace) -> None:
    """Process-wide settings: torch's thread count, glibc malloc's policy, oneDNN's primitive cache
    (fastformer/runtime.py: the bounds on the process's memory)."""
    bound_onednn_cache()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.malloc == "keep":
        keep_freed_memory()


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


def load_corpus(args: argparse.Namespace) -> tuple[ParallelCorpus, dict, str]:
    """The corpus (user files or a built-in Bible pair), how it was chosen, and its name. Missing,
    unreadable, mismatched or empty files are usage errors (exit 2)."""
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
        files = [os.path.abspath(f) for f in files + list(test or files[2:])]  # evaluate may run elsewhere
        data = {"kind": "files", "train": files[0:2], "dev": files[2:4], "test": files[4:6]}
        return corpus, data, "custom"
    try:
        corpus = load_bible(args.data)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from exc
    return corpus, {"kind": "bible", "name": args.data}, args.data


def prepare_tokenizer(args: argparse.Namespace, corpus: ParallelCorpus, run_dir: str, procs: Processes) -> Tokenizer:
    """The run folder's spm.model, trained by the main process on the training text when absent."""
    spm_path = os.path.join(run_dir, "spm.model")
    if procs.main and not os.path.exists(spm_path):
        procs.say(f"training a {args.vocab_size}-piece sentencepiece BPE model on {len(corpus.src['train'])} "
                  "sentence pairs")
        Tokenizer.train(corpus.src["train"] + corpus.tgt["train"], args.vocab_size, spm_path)
    procs.barrier()
    return Tokenizer.load(spm_path)


def model_config(args: argparse.Namespace, vocab_size: int, ids: dict) -> TransformerConfig:
    """The --config preset with the flags' overrides; positions enough for the longest sentence."""
    overrides = {name: getattr(args, name) for name in ("dropout", "label_smoothing") if getattr(args, name) is not None}
    config = getattr(TransformerConfig, args.config)(vocab_size=vocab_size, **overrides)
    longest = max(len(s) for split in ids.values() for side in split for s in side) + 2  # + bos/eos
    return config.replace(max_positions=longest) if longest > config.max_positions else config


def setup(args: argparse.Namespace, procs: Processes) -> Run:
    """Everything the loop needs, fresh or (--resume) continued from the latest checkpoint."""
    finetune.resolve_flags(args)
    corpus, data_info, data_name = load_corpus(args)
    run_dir = args.out or os.path.join("runs", f"{args.config or 'finetune'}-{data_name}")
    if procs.main:
        os.makedirs(run_dir, exist_ok=True)
        ckpt.remove_partial(run_dir)
        if not args.resume and ckpt.list_checkpoints(run_dir):
            usage_error(PROG, f"{run_dir} holds checkpoints of an earlier run: add --resume to continue it, or "
                              "give another --out")
    procs.barrier()
    init = finetune.load_init(args, procs.device) if args.init else None  # --init: its model and tokenizer
    tokenizer = init.tokenizer if init else prepare_tokenizer(args, corpus, run_dir, procs)
    ids = {split: (tokenizer.encode(corpus.src[split]), tokenizer.encode_target(corpus.tgt[split]))
           for split in corpus.src}
    config = init.model.config if init else model_config(args, tokenizer.vocab_size, ids)
    torch.manual_seed(args.seed)
    model = init.model if init else Transformer(config, backend=args.backend).to(procs.device)
    model.check_token_values = False  # train_step checks each batch on the host before it moves
    amp_dtype = autocast_dtype(args.precision, procs.device)
    if args.cuda_graphs:
        from fastformer.training.graphs import refusal
        reason = refusal(args, procs.device, procs.world)
        if reason:
            usage_error(PROG, reason)
    run = Run(args=args, procs=procs, run_dir=run_dir, corpus=corpus, data_info=data_info, data_name=data_name,
              tokenizer=tokenizer, ids=ids, config=config, model=model, train_model=model,
              # fastformer's fused Adam (training/optim.py) on every device: one pass per element, its step
              # counts on the device; capturable: --cuda-graphs. compute_copies: the weights' bf16/fp16 copies
              # that the optimizer writes with its update (issue 52; none yet: the model does not read them)
              optimizer=Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9,
                             capturable=bool(args.cuda_graphs), compute_copies=None),
              scaler=torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16), amp_dtype=amp_dtype,
              batches=BatchStream(*ids["train"], args.max_tokens, args.seed, procs.shard,
                                  fixed_shapes=bool(args.cuda_graphs), packed=args.batching == "packed",
                                  special_ids=special_ids(config)),
              log=RunLog(os.path.join(run_dir, "log.jsonl"), enabled=procs.main),
              sums=torch.zeros(2, dtype=torch.float32, device=procs.device),
              grad_scale=torch.ones((), dtype=torch.float32, device=procs.device))
    if args.resume:
        resume.restore(run)
    else:
        run.log.start(resumed_step=None)
    procs.barrier()
    if amp_dtype is not None and not args.compile:  # from the weights as trained so far (after a resume)
        run.compute_copies = set_compute_dtype(model, amp_dtype)
        run.optimizer.set_compute_copies(run.compute_copies)  # written by each step, in its pass
    if args.compile:  # in place: parameter names (and so checkpoints) stay those of the eager model
        model.encoder.compile(dynamic=True)
        model.decoder.compile(dynamic=True)
    run.train_model = procs.wrap(model)
    if args.cuda_graphs:
        from fastformer.training.graphs import CudaGraphs
        run.step = CudaGraphs(run)
    else:
        run.step = EagerStep(run)
    procs.say(f"{args.config or 'fine-tuned'} model, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
              f"parameters, vocab {config.vocab_size}, device {procs.device}, backend {args.backend or 'default'}, "
              f"precision {str(amp_dtype or torch.float32).removeprefix('torch.')}, {procs.world} process(es); data "
              f"{data_name}: " + ", ".join(f"{k} {v}" for k, v in corpus.sizes().items()))
    return run
