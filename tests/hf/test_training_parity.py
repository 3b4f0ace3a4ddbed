"""Fine-tuning a converted model does transformers' training maths (issue 54, item 2): on tiny random Marian
(one vocabulary, and separate vocabularies) and M2M-100 models built here (``save_pretrained`` into a
temporary folder, every dropout rate and M2M-100's layer drop set to 0 in config.json, then
``fastformer.from_transformers``), a padded batch's loss and every parameter's gradient equal transformers'
``model(..., labels=...)`` in train mode, with and without label smoothing (transformers' Trainer's
``label_smoothing_factor``: its ``LabelSmoother``, trainer_pt_utils.py), both models in float64, within the
tolerance table's float64 row.

fastformer's side is its training path: ``loss_sums`` (fastformer/training/step.py: the model's forward and
the fused ``ops.cross_entropy``, pad targets ignored) on the batch ``collate`` makes for a converted model
(tgt_in = the config's start token + y, tgt_out = y + eos), and ``packed_loss_sums`` on the same pairs
without padding (``collate_packed``, fastformer.train --batching packed); backward of the sum, the gradient
scaled by 1 / target tokens (``optimizer_update``'s ``grad_scale``). transformers' side: ``labels`` = the target
tokenizer's ids (y + eos; M2M-100's open with the target-language token), pad -> -100; the model derives
its decoder inputs (``shift_tokens_right``). Gradients are compared by the converter's own mapping
(fastformer/hf_convert.py ``state_dict``, run on each tensor's element numbers, so q, k and v land in
``qkv_proj`` as the weights do), and every trainable element of transformers' model maps to exactly one of
fastformer's. A weight used in several places (the shared embedding: source and target lookups and the
output projection, tied to ``lm_head``) is one parameter on both sides, its gradient the sum of its uses.

Where the two differ by design (docs/transformers.md, "Fine-tuning: the same maths as transformers"), asserted
as found:

- ``final_logits_bias`` (Marian) is a buffer in transformers: never trained. fastformer's ``output_bias`` is
  a parameter that fastformer trains; its gradient is what transformers' bias would get as a parameter, the
  sum over every position of d loss / d logits.
- Marian's sinusoid tables: transformers builds them frozen, but ``from_pretrained`` (5.24) leaves
  ``embed_positions.weight`` trainable, so its training moves them (their gradient is not 0); fastformer's
  are constants.
- Loss normalization: fastformer sums over the target tokens and divides the gradient by the update's token
  count (all micro-batches, all ranks); transformers' loss is the mean over the call's labels that are not
  -100 (``LabelSmoother``: over ``num_items_in_batch`` when the Trainer passes it). One batch: the same.
- Decoder inputs after a sentence's end: ``shift_tokens_right`` feeds the sentence's eos, then pad;
  ``collate`` feeds pad. Those positions' targets are ignored and the causal mask keeps them from every real
  position, so loss and gradients do not see them; the inputs agree wherever a target is real.
- Label smoothing: both are (1 - e) nll + e mean over all V classes (pad's included) of -log p, averaged
  over the non-pad targets. ``LabelSmoother`` sums -log p over the classes in float32 whatever the logits'
  dtype: checked against its formula summed in float64 on the same logits at the float32 row, and fastformer
  against that formula at the float64 row.
- Precision, not design: transformers keeps its sinusoid tables in float32 (Marian's a parameter,
  M2M-100's a buffer) even in a float64 model; they are checked against fastformer's (float64) at the
  float32 row, then given fastformer's so that the rest compares at float64.
- Layer drop (M2M-100's ``encoder_layerdrop``/``decoder_layerdrop``, 0.05 by default) skips layers at random
  in transformers' training; fastformer has none. Dropout draws random masks: both run without here.
"""
import json
import os

import pytest
import sentencepiece
import torch
import transformers

import fastformer
from fastformer import hf_convert
from fastformer.data.batching import collate, collate_packed
from fastformer.nn.transformer import position_table
from fastformer.training.step import loss_sums, packed_loss_sums
from test_converted import TEXT, write_m2m, write_marian
from tolerances import assert_close

FAMILIES = ("marian", "marian-separate", "m2m")
NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                  decoder_layerdrop=0.0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's folder (weights of std 0.3, Marian's final_logits_bias random), its config.json without
    dropout or layer drop."""
    spm = tmp_path_factory.mktemp("spm")
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(TEXT * 20), model_prefix=str(spm / "sp"),
                                             vocab_size=60, model_type="bpe", minloglevel=2)
    spm_file = str(spm / "sp.model")
    out = {"marian": write_marian(tmp_path_factory.mktemp("marian"), spm_file, 0.3),
           "marian-separate": write_marian(tmp_path_factory.mktemp("separate"), spm_file, 0.3, separate=True),
           "m2m": write_m2m(tmp_path_factory.mktemp("m2m"), spm_file, 0.3)}
    for folder in out.values():
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        with open(path, "w") as f:
            json.dump({**config, **NO_DROPOUT}, f)
    return out


def models(family: str, folder: str, backend: str):
    """transformers' model and fastformer's conversion of the folder, both float64 in train mode, with
    transformers' sinusoid tables (float32 values) replaced by fastformer's float64 ones once they agree."""
    cls = transformers.MarianMTModel if family.startswith("marian") else transformers.M2M100ForConditionalGeneration
    hf = cls.from_pretrained(folder).double().train()
    model, _ = fastformer.from_transformers(folder, backend=backend)
    model = model.double().train()
    config = model.config
    with torch.no_grad():
        for stack in (hf.model.encoder, hf.model.decoder):
            positions = stack.embed_positions
            table = positions.weight if family.startswith("marian") else positions.weights
            first = 0 if family.startswith("marian") else positions.offset  # M2M-100: rows from pad + 1
            ours = position_table(table.shape[0] - first, config)
            assert_close(table[first:].float(), ours, torch.float32, "transformers' position table")
            table[first:] = ours
    return hf, model


def batch(family: str, folder: str, config):
    """src (B, S), tgt_in, tgt_out (B, T) as fastformer's training collates them for the converted model, the
    same pairs packed (``collate_packed``: --batching packed), and transformers' labels: its tokenizer's ids
    (y + eos; M2M-100's from the target-language token), pad -> -100."""
    if family.startswith("marian"):
        tokenizer = transformers.MarianTokenizer.from_pretrained(folder)
    else:
        tokenizer = transformers.M2M100Tokenizer.from_pretrained(folder, src_lang="en", tgt_lang="de")
    pairs = tokenizer(TEXT[:4], text_target=TEXT[2:6])
    src, tgt = ([ids[:-1] for ids in pairs[side]] for side in ("input_ids", "labels"))  # without eos: collate's
    packed = collate_packed(src, tgt, bos_id=config.start_id, eos_id=config.eos_id, pad_id=config.pad_id)
    src, tgt_in, tgt_out = collate(src, tgt, pad_id=config.pad_id, bos_id=config.start_id, eos_id=config.eos_id)
    labels = torch.full(tgt_out.shape, -100)
    for row, ids in enumerate(pairs["labels"]):
        labels[row, :len(ids)] = torch.tensor(ids)
    if family == "m2m":
        assert labels[:, 0].eq(tokenizer.lang_code_to_id["de"]).all()  # a target, trained as any other
    return src, tgt_in, tgt_out, packed, labels


def shift_tokens_right(family: str):
    """The family's shift_tokens_right (labels -> decoder inputs), as its model calls it."""
    if family.startswith("marian"):
        return transformers.models.marian.modeling_marian.shift_tokens_right
    return transformers.models.m2m_100.modeling_m2m_100.shift_tokens_right


def label_smoothed(logits, labels, epsilon):
    """transformers' LabelSmoother (trainer_pt_utils.py), its sum over the classes in float64: (1 - e) times
    the mean NLL over the labels that are not -100, plus e times the mean over those positions and every class
    (pad's included) of -log p."""
    log_p = logits.log_softmax(-1)
    keep = labels.ne(-100)
    nll = -log_p.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    count = keep.sum()
    return (1 - epsilon) * nll[keep].sum() / count + epsilon * -log_p.sum(-1)[keep].sum() / (count * log_p.shape[-1])


def mapped_gradients(hf, config) -> tuple[dict[str, torch.Tensor], list[str]]:
    """transformers' gradients under fastformer's names, by the converter's mapping (``hf_convert.state_dict``
    run on element numbers: the number of every element of every trainable parameter, float32, exact below
    2^24), and the names it read. Asserts that each trainable element of transformers' model lands in exactly
    one place. Left out: the output bias (transformers' is no parameter) and the sinusoid tables (fastformer's
    are constants; transformers' Marian tables are trainable: the test asserts it)."""
    params = {name: p for name, p in hf.named_parameters() if p.requires_grad and "embed_positions" not in name}
    numbers, start = {}, 0
    for name, p in params.items():
        numbers[name] = torch.arange(start, start + p.numel(), dtype=torch.float32).view(p.shape)
        start += p.numel()
    assert start < 2 ** 24
    mapped = {k: v.long() for k, v in hf_convert.state_dict(numbers, config).items() if k != "output_bias"}
    used = torch.cat([v.reshape(-1) for v in mapped.values()])
    assert torch.equal(used.sort().values, torch.arange(start)), "an element of transformers' model is mapped " \
        "twice or not at all"
    flat = torch.cat([p.grad.reshape(-1) for p in params.values()])
    return {k: flat[v] for k, v in mapped.items()}, list(params)


@pytest.mark.parametrize("batching", ["padded", "packed"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_match_transformers(family, backend, smoothing, batching, folders):
    hf, model = models(family, folders[family], backend)
    config = model.config
    src, tgt_in, tgt_out, packed, labels = batch(family, folders[family], config)
    assert torch.equal(labels, tgt_out.masked_fill(tgt_out.eq(config.pad_id), -100))
    real = labels.ne(-100)
    assert not bool(real.all()) and not bool(src.ne(config.pad_id).all()), "the batch must hold padding"
    tokens = int(real.sum())

    out = hf(input_ids=src, attention_mask=src.ne(config.pad_id), labels=labels)
    decoder_inputs = shift_tokens_right(family)(labels, config.pad_id, config.start_id)
    assert torch.equal(decoder_inputs[real], tgt_in[real])  # the same inputs wherever a target is real
    if smoothing:
        smoother = transformers.trainer_pt_utils.LabelSmoother(epsilon=smoothing)
        logits = out.logits.detach().requires_grad_()
        theirs, ours = smoother({"logits": logits}, labels), label_smoothed(logits, labels, smoothing)
        d_theirs, d_ours = (torch.autograd.grad(loss, logits)[0] for loss in (theirs, ours))
        assert_close(theirs.float(), ours.detach(), torch.float32, "LabelSmoother's loss")
        assert_close(d_theirs.float(), d_ours, torch.float32, "LabelSmoother's d loss / d logits")
        hf_loss = label_smoothed(out.logits, labels, smoothing)
    else:
        hf_loss = out.loss  # the model's own: CrossEntropyLoss, the mean over the labels that are not -100
    d_logits = torch.autograd.grad(hf_loss, out.logits, retain_graph=True)[0]
    hf_loss.backward()

    if batching == "packed":  # the same pairs without padding: every target real
        assert torch.equal(packed.tgt_in, tgt_in[real]) and torch.equal(packed.tgt_out, tgt_out[real])
        loss, nll = packed_loss_sums(model, packed, config.pad_id, smoothing, backend=model.backend)
    else:
        loss, nll = loss_sums(model, src, tgt_in, tgt_out, config.pad_id, smoothing, backend=model.backend)
    loss.backward()
    assert_close((loss / tokens).detach(), hf_loss.detach(), torch.float64, "loss")
    assert_close(nll / tokens, out.loss.detach(), torch.float64, "nll")

    expected, read = mapped_gradients(hf, config)
    names = {name for name, _ in model.named_parameters()}
    assert names == set(expected) | ({"output_bias"} if config.output_bias else set())
    for name, p in model.named_parameters():
        grad = p.grad / tokens  # optimizer_update's grad_scale: 1 / the update's target tokens
        if name == "output_bias":  # transformers' final_logits_bias is a buffer: what it would get
            assert "final_logits_bias" in dict(hf.named_buffers()) and not any("final_logits" in n for n in read)
            assert_close(grad, d_logits.sum((0, 1)), torch.float64, name)
        else:
            assert_close(grad, expected[name], torch.float64, name)
    if family.startswith("marian"):  # from_pretrained leaves Marian's sinusoid tables trainable: they learn
        for stack in (hf.model.encoder, hf.model.decoder):
            table = stack.embed_positions.weight
            assert table.requires_grad and table.grad.abs().max() > 0, "transformers no longer trains Marian's " \
                "position tables: update docs/transformers.md's differences and this test"

