"""Fine-tuning a transformers Marian model (issue 54, item 4): one training step (forward, backward, optimizer
step) of the converted model as ``python -m fastformer.train`` runs it, beside the same model's step in
transformers as its Trainer runs it, on the same sentence pairs of spread lengths, in target tokens per second.
Targets (issue 54, on the CPU): >= 1.5x transformers in bfloat16 autocast, >= 1.2x in float32.

The model: opus-mt-de-en's shape (d_model 512, 6+6 layers, 8 heads, d_ff 2048, swish, scaled embeddings,
one 58,101-token vocabulary tied to the output projection, final_logits_bias; ``</s>`` 0, ``<pad>`` 58,100 =
the decoder's start token; dropout 0.1 as opus-mt's config.json; about 74M parameters) with random weights,
written by ``save_pretrained`` into a temporary folder once per module, then loaded by each side from it:
``MarianMTModel.from_pretrained(folder, attn_implementation="sdpa")`` and fastformer's converter
(fastformer/hf_convert.py ``from_transformers``, the function behind ``fastformer.from_transformers``; no
tokenizer: the folder holds weights only). Smoke sizes (``--bench-sizes smoke``): 2+2 layers, d_model 64,
2 heads, d_ff 128, a 1,000-token vocabulary, 4 pairs of 4-16 tokens: it checks the benchmark in seconds.

The batch: 32 sentence pairs, source and target lengths drawn uniformly from 8-64 tokens (seeded), ids
2 .. 58,099, one batch as a data loader that does not sort by length deals them (transformers' Trainer by
default): fastformer's ``collate`` for the converted model (src + eos; tgt_in = start + y, tgt_out = y + eos;
right-padded with pad: about 1.7 positions per real token) and ``collate_packed`` (the same pairs without
padding, fastformer.train --batching packed). transformers gets the padded src with its attention mask and
``labels`` = tgt_out with pad as -100 (its decoder inputs, ``shift_tokens_right(labels)``, equal tgt_in at every
real target: tests/hf/test_training_parity.py checks the loss and gradients of both of fastformer's batchings
against transformers'). A Marian model in transformers has no padding-free path (its positions count from 0
per row; cross-attention takes no packed sequences).

The steps (each takes the gradient of the mean over the target tokens):
  fastformer    ``micro_batch`` and ``optimizer_update`` of fastformer/training/step.py, the code of
                fastformer.train's ``train_step``, on a one-process run: the loss (``loss_sums``, or
                ``packed_loss_sums`` on the packed batch: label smoothing 0.1, the fused ``ops.cross_entropy``)
                under autocast to the precision, backward, the gradient scaled by 1 / target tokens, Adam
                (betas 0.9, 0.98, eps 1e-9, as fastformer.train builds it on the CPU), no clipping
                (fastformer.train's default --clip-norm 0); "fastformer --batching packed" (timed) and
                "fastformer --batching padded" (fastformer.train's default);
  transformers  as its Trainer (label_smoothing_factor 0.1, bf16 where the precision is bfloat16, its
                default optimizer on torch >= 2.8, AdamW fused; max_grad_norm 0: no clipping on either side):
                ``model(input_ids, attention_mask, decoder_input_ids)`` and ``LabelSmoother(0.1)`` on its
                logits under autocast, backward, AdamW's step ("transformers LabelSmoother 0.1"); and with
                the model's own loss, ``model(..., labels=labels).loss``, plain cross-entropy without
                smoothing, a cheaper loss than fastformer's ("transformers model loss, no smoothing").
Precisions (harness ``train_precisions``): float32 always, and bfloat16 autocast where the CPU has bfloat16
dot products (as fastformer.train --precision auto picks), both sides alike.

Timing: the packed fastformer step is timed with the other three in each of its rounds (Bench's
``turns_with``, in a rotating order), one untimed call of each first, at least the size profile's minimum of
rounds (3 by default; a full-size step takes seconds on a 2-core CPU). From the medians of those same rounds,
so that the machine's drift cancels: "speedup" {contender: its median / the packed step's}, "padded speedup"
{transformers step: its median / the padded fastformer step's}, "tokens/s" the packed step's and "tokens/s
of" each other's. A CPU comparison: on a GPU session the test skips. Without transformers the module skips,
the reason naming the extra that brings it (harness.need).

    pytest benchmarks/test_hf_finetune_step.py --benchmark-only -q -p no:cacheprovider
    pytest benchmarks/test_hf_finetune_step.py --benchmark-only --bench-sizes smoke -q     # seconds
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from fastformer import hf_convert
from fastformer.data.batching import PackedBatch, collate, collate_packed
from fastformer.nn.linear import set_compute_dtype
from fastformer.training.optim import Adam
from fastformer.training.processes import Processes
from fastformer.training.step import check_batch, micro_batch, optimizer_update
from harness import MarianShape, need  # benchmarks/ is on sys.path (pytest inserts a conftest's folder)

transformers = need("transformers")  # without it the module skips, the reason naming the extra
from transformers.trainer_pt_utils import LabelSmoother  # noqa: E402

LABEL_SMOOTHING = 0.1
SMOOTHED = "transformers LabelSmoother 0.1"
TRANSFORMERS = (SMOOTHED, "transformers model loss, no smoothing")
PADDED = "fastformer --batching padded"
EOS = 0  # opus-mt's ids; <pad> (the decoder's start token) is the last id


@dataclasses.dataclass(frozen=True)
class Shape(MarianShape):
    pairs: int
    lengths: tuple[int, int]  # shortest and longest sentence of each side (tokens, without eos)


FULL = Shape("opus-mt-de-en shape", 512, 6, 8, 2048, 58101, 32, (8, 64))
SMOKE = Shape("tiny Marian", 64, 2, 2, 128, 1000, 4, (4, 16))


@pytest.fixture(scope="module")
def shape(ctx) -> Shape:
    if ctx.cuda:
        pytest.skip("a CPU comparison (issue 54's targets are the CPU's): run with --bench-device cpu")
    return SMOKE if ctx.sizes.name == "smoke" else FULL


@pytest.fixture(scope="module")
def folder(shape, tmp_path_factory) -> str:
    """The random Marian model's folder (config.json and model.safetensors)."""
    config = shape.marian_config(transformers, decoder_vocab_size=shape.vocab_size, dropout=0.1,
                                 attention_dropout=0.0, activation_dropout=0.0, eos_token_id=EOS,
                                 forced_eos_token_id=EOS)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("marian")
    transformers.MarianMTModel(config).save_pretrained(path)
    return str(path)


def sentence_pairs(shape: Shape) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(1)
    lo, hi = shape.lengths

    def side():
        return [torch.randint(2, shape.vocab_size - 1, (int(torch.randint(lo, hi + 1, (), generator=g)),),
                              generator=g).tolist() for _ in range(shape.pairs)]

    return side(), side()


def fastformer_run(folder: str, precision: torch.dtype) -> SimpleNamespace:
    """What fastformer.train's micro_batch and optimizer_update read of its Run (fastformer/training/setup.py),
    for one process on the CPU: the converted model in train mode, Adam as setup builds it (fastformer's fused one,
    writing the weights' autocast-dtype copies), autocast to
    ``precision`` (None for float32), no gradient scaler (float16 only), no clipping."""
    model, _ = hf_convert.from_transformers(folder, tokenizer=False)
    model.train()
    model.check_token_values = False  # check_batch checks each batch on the host, as train_step does
    amp = None if precision == torch.float32 else precision
    copies = {} if amp is None else set_compute_dtype(model, amp)  # the weights' autocast-dtype copies
    return SimpleNamespace(
        args=SimpleNamespace(clip_norm=0.0), procs=Processes(), config=model.config, model=model, train_model=model,
        optimizer=Adam(model.parameters(), lr=5e-5, betas=(0.9, 0.98), eps=1e-9, compute_copies=copies),
        compute_copies=copies, scaler=torch.amp.GradScaler("cuda", enabled=False), amp_dtype=amp,
        sums=torch.zeros(2), grad_scale=torch.ones(()))


def test_hf_finetune_step(bench, ctx, shape, folder, precision):
    run = fastformer_run(folder, precision)
    config = run.config
    pairs = sentence_pairs(shape)
    src, tgt_in, tgt_out = collate(*pairs, pad_id=config.pad_id, bos_id=config.start_id, eos_id=config.eos_id)
    packed = collate_packed(*pairs, bos_id=config.start_id, eos_id=config.eos_id, pad_id=config.pad_id)
    tokens = int(tgt_out.ne(config.pad_id).sum())

    def fastformer_step(batch):
        def step():  # fastformer.train's train_step for an update of one batch (a tuple or a PackedBatch)
            run.optimizer.zero_grad(set_to_none=True)
            run.sums.zero_()
            n = check_batch(run, batch)
            micro_batch(run, *((batch,) if isinstance(batch, PackedBatch) else batch), sync=True)
            run.grad_scale.fill_(1.0 / n)
            optimizer_update(run)
        return step

    hf = transformers.MarianMTModel.from_pretrained(folder, attn_implementation="sdpa").train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=5e-5, weight_decay=0.0, fused=True)
    mask = src.ne(config.pad_id)
    labels = tgt_out.masked_fill(tgt_out.eq(config.pad_id), -100)
    decoder_inputs = hf.prepare_decoder_input_ids_from_labels(labels)  # the Trainer's collator makes them
    smoother = LabelSmoother(epsilon=LABEL_SMOOTHING)

    def transformers_step(smoothed: bool):
        def step():
            optimizer.zero_grad(set_to_none=True)
            with ctx.autocast(precision):  # the Trainer autocasts the forward and the loss, not the backward
                if smoothed:  # the Trainer with label_smoothing_factor: labels popped, its LabelSmoother
                    out = hf(input_ids=src, attention_mask=mask, decoder_input_ids=decoder_inputs, use_cache=False)
                    loss = smoother(out, labels)
                else:
                    loss = hf(input_ids=src, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
        return step

    others = {**{name: transformers_step(name == SMOOTHED) for name in TRANSFORMERS},
              PADDED: fastformer_step((src, tgt_in, tgt_out))}
    dtype = str(precision).removeprefix("torch.")
    bench(fastformer_step(packed), op="hf_finetune_step",
          shape=f"{shape.name}, {shape.pairs} pairs of {shape.lengths[0]}-{shape.lengths[1]} tokens ({tokens} target)",
          pass_=f"fwd+bwd+adam, {dtype}", impl="fastformer --batching packed", baseline=False,
          per_second={"tokens/s": tokens}, turns_with=others)
    info = bench.benchmark.extra_info
    if "alternated" in info:  # (not with --benchmark-disable: one call, untimed)
        median = {name: info["alternated"][name + " median s"] for name in others}
        info["tokens/s of"] = {name: tokens / seconds for name, seconds in median.items()}
        info["padded speedup"] = {name: median[name] / median[PADDED] for name in TRANSFORMERS}
