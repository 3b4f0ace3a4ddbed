"""Fine-tuning, ``--init CHECKPOINT``: a trained or converted model (``python -m fastformer.convert DIR --out
CHECKPOINT``) trained further on the run's data.

The checkpoint's config, weights and tokenizer are used as they are: no new vocabulary (Marian's source and
target sentencepiece models and vocabularies, M2M-100's and NLLB's language codes), the config's dropout and
label smoothing (--dropout and --label-smoothing override them), a fresh optimizer. The flags whose defaults
depend on --init are resolved here (``resolve_flags``): the learning-rate schedule (fastformer/training/step.py
``scheduled_rate``) is a fine-tuning one, a short warmup to --lr and a decay, instead of the paper's
from-scratch schedule, and the gradient norm is clipped to 1.0, as transformers' Trainer does.
"""
from __future__ import annotations

import argparse
import os
from typing import NamedTuple

import torch

from fastformer import checkpoint as ckpt
from fastformer.cli import usage_error
from fastformer.nn import Transformer

PROG = "python -m fastformer.train"

# The defaults that --init changes (the parser's are None, so that a flag given can be told from a default).
FROM_SCRATCH = {"config": "small", "vocab_size": 8000, "warmup": 300, "lr_factor": 0.5, "clip_norm": 0.0}
FINE_TUNING_LR = 5e-5  # the peak; transformers' Seq2SeqTrainer's default learning rate
WARMUP_SHARE, WARMUP_UPDATES = 0.04, 100  # of --max-steps when given, else updates
FINE_TUNING_CLIP = 1.0  # transformers' Trainer's max_grad_norm


class Init(NamedTuple):
    model: Transformer
    tokenizer: object  # fastformer.data.Tokenizer, or a converted model's VocabTokenizer


def resolve_flags(args: argparse.Namespace) -> None:
    """Refuses what contradicts --init or --schedule and fills in the defaults that depend on them, in place
    (a second call changes nothing)."""
    if args.init:
        given = [flag for flag, name in (("--config", "config"), ("--vocab-size", "vocab_size"))
                 if getattr(args, name) is not None]
        if given:
            usage_error(PROG, "--init fine-tunes the checkpoint's own model and vocabulary: drop "
                              + " and ".join(given))
    else:
        if args.source_lang or args.target_lang:
            usage_error(PROG, "--source-lang and --target-lang choose the languages of an M2M-100 or NLLB model "
                              "fine-tuned with --init")
        args.config = args.config or FROM_SCRATCH["config"]
        args.vocab_size = args.vocab_size or FROM_SCRATCH["vocab_size"]
    args.schedule = args.schedule or ("inverse-sqrt" if args.init else "paper")
    if args.schedule == "paper":
        if args.lr is not None:
            usage_error(PROG, "--lr is the peak of --schedule inverse-sqrt and linear; the paper schedule is scaled "
                              "by --lr-factor")
        args.lr_factor = FROM_SCRATCH["lr_factor"] if args.lr_factor is None else args.lr_factor
        args.warmup = args.warmup or FROM_SCRATCH["warmup"]
    else:
        if args.lr_factor is not None:
            usage_error(PROG, f"--lr-factor scales the paper schedule; --schedule {args.schedule} peaks at --lr")
        if args.schedule == "linear" and args.max_steps is None:
            usage_error(PROG, "--schedule linear decays to 0 at --max-steps: give --max-steps (--schedule "
                              "inverse-sqrt needs no run length)")
        args.lr = FINE_TUNING_LR if args.lr is None else args.lr
        default_warmup = max(1, round(WARMUP_SHARE * args.max_steps)) if args.max_steps else WARMUP_UPDATES
        args.warmup = args.warmup or default_warmup
    if args.clip_norm is None:
        args.clip_norm = FINE_TUNING_CLIP if args.init else FROM_SCRATCH["clip_norm"]


def load_init(args: argparse.Namespace, device: torch.device) -> Init:
    """The --init checkpoint's model (its config with --dropout and --label-smoothing applied, on ``device``) and
    tokenizer, with the languages of an M2M-100 or NLLB model set (--source-lang, --target-lang); what cannot be
    fine-tuned is a usage error naming the checkpoint."""
    try:
        # a run folder's latest checkpoint, named as a file: the run's saved flags say which one it started from
        args.init = os.path.abspath(ckpt.resolve(args.init))
        state = ckpt.load(args.init)
    except ckpt.CheckpointError as exc:
        usage_error(PROG, f"--init: {exc}")
    quantized = ckpt.quantization(state)
    if quantized is not None:
        usage_error(PROG, f"--init: {args.init} holds an {quantized} model, which is for inference: its "
                          f"projections are {quantized} weights with scales, which cannot be trained. Fine-tune the "
                          "float checkpoint (python -m fastformer.convert DIR --out CHECKPOINT, without --quantize), "
                          "then quantize the result (python -m fastformer.convert RUN_DIR --out F --quantize int8)")
    overrides = {name: value for name in ("dropout", "label_smoothing") if (value := getattr(args, name)) is not None}
    try:  # from_state checks the weights against the config, their finiteness and the tokenizer
        model, tokenizer, _ = ckpt.from_state({**state, "config": {**state["config"], **overrides}}, args.init,
                                              backend=args.backend, device=str(device))
    except ckpt.CheckpointError as exc:
        usage_error(PROG, f"--init: {exc}")
    _set_languages(args, tokenizer)
    if model.output_bias is not None:
        # Marian's final_logits_bias: a buffer in transformers, which its fine-tuning leaves as it is; so here.
        model.output_bias.requires_grad_(False)
    return Init(model, tokenizer)


def _set_languages(args: argparse.Namespace, tokenizer) -> None:
    """An M2M-100 or NLLB tokenizer's source and target languages: each source sentence starts with the
    source's token and each target sentence with the target's, as transformers' tokenizers make input_ids and
    labels (the decoder's start token, eos, then the target language); the target's is also forced first when
    the run translates. Both are needed: the flag, or the tokenizer's own (a converted tokenizer's src_lang, a
    fine-tuned model's languages)."""
    languages = getattr(tokenizer, "languages", None)
    if not languages:
        if args.source_lang or args.target_lang:
            usage_error(PROG, f"--source-lang and --target-lang: {args.init}'s tokenizer has no language codes "
                              "(they choose the languages of M2M-100 and NLLB models)")
        return
    try:
        tokenizer.set_source_lang(args.source_lang or tokenizer.source_lang)
        tokenizer.set_target_lang(args.target_lang or tokenizer.target_lang)
    except ValueError as exc:
        usage_error(PROG, f"--source-lang/--target-lang: {exc}")
    for flag, lang in (("--source-lang", tokenizer.source_lang), ("--target-lang", tokenizer.target_lang)):
        if lang is None:
            usage_error(PROG, f"{args.init} is a multilingual model (M2M-100 or NLLB): give {flag} CODE (it knows "
                              f"{tokenizer.language_list()})")
