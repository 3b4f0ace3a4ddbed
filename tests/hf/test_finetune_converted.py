"""python -m fastformer.train --init CHECKPOINT on converted transformers models (tiny random Marian, with one
and with separate vocabularies, M2M-100 and NLLB, built as tests/hf/test_converted.py builds them:
save_pretrained into a temporary folder, no network), then ``python -m fastformer.convert``:

- the batches hold transformers' ids: the source as its tokenizer's input_ids, the target as its labels
  (``text_target``: Marian's target vocabulary; M2M-100's target-language token first) and the decoder input
  as its shift_tokens_right of the labels (the decoder's start token first); NLLB's, which transformers cannot
  read from the hub-less folder the test writes, by fairseq's rule (its language codes first);
- the run keeps the checkpoint's config and tokenizer (an M2M-100's languages added), the loss falls, dev and
  test BLEU before and after reach the summary, Marian's final_logits_bias stays as it is (a buffer in
  transformers), --resume continues exactly;
- the fine-tuned M2M-100 and NLLB translate into their target language by default (translate, evaluate);
- an M2M-100 without a target language, or with an unknown one, is refused.
"""
import json
import os

import pytest
import sentencepiece
import torch
import transformers
from transformers.models.m2m_100.modeling_m2m_100 import shift_tokens_right

from fastformer import checkpoint as ckpt
from fastformer.convert import main as convert
from fastformer.data.batching import collate
from fastformer.train import build_parser, main
from fastformer.training.batches import special_ids
from fastformer.training.processes import Processes
from fastformer.training.setup import setup
from fastformer.translation import translate
from test_converted import TEXT, write_m2m, write_marian, write_nllb

# A task a tiny model learns in a few updates: each sentence's words in reverse order.
TARGETS = [" ".join(reversed(text.split())) for text in TEXT]
FAMILIES = ("marian", "marian-separate", "m2m", "nllb")
TARGET_LANG = {"m2m": "de", "nllb": "deu_Latn"}  # the multilingual families' --target-lang


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (converted checkpoint, transformers folder): weights of std 0.05, as a trained model's are
    small, so that a few updates of fine-tuning move the loss."""
    root = tmp_path_factory.mktemp("finetune")
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter((TEXT + TARGETS) * 20),
                                             model_prefix=str(root / "sp"), vocab_size=60, model_type="bpe",
                                             minloglevel=2)
    spm = str(root / "sp.model")
    out = {}
    for family in FAMILIES:
        (folder := root / family).mkdir()
        if family == "m2m":
            write_m2m(folder, spm, 0.05)
        elif family == "nllb":
            write_nllb(folder, spm, 0.05)
        else:
            write_marian(folder, spm, 0.05, separate=family == "marian-separate")
        convert([str(folder), "--out", str(root / f"{family}.pt")])
        out[family] = (str(root / f"{family}.pt"), str(folder))
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Training, dev and test files: the six sentences and their reversals."""
    folder = tmp_path_factory.mktemp("data")
    for name, lines in (("train.src", TEXT * 4), ("train.tgt", TARGETS * 4), ("dev.src", TEXT[:3]),
                        ("dev.tgt", TARGETS[:3]), ("test.src", TEXT[3:]), ("test.tgt", TARGETS[3:])):
        (folder / name).write_text("\n".join(lines) + "\n")
    return folder


def init_args(init, data, out, family, *extra):
    languages = ("--target-lang", TARGET_LANG[family]) if family in TARGET_LANG else ()
    return ["--init", init, "--out", str(out), *languages,
            *[arg for split in ("train", "valid", "test") for side in ("src", "tgt")
              for arg in (f"--{split}-{side}", str(data / f"{'dev' if split == 'valid' else split}.{side}"))],
            "--max-tokens", "400", "--update-tokens", "150", "--lr", "3e-3", "--warmup", "3", "--eval-sentences", "3",
            "--log-every", "1", "--checkpoint-minutes", "100", "--beam", "2", *extra]


def hf_tokenizer(family, folder):
    if family == "m2m":
        return transformers.M2M100Tokenizer.from_pretrained(folder, src_lang="en", tgt_lang="de")
    return transformers.MarianTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "nllb"])
def test_batches_hold_transformers_ids(family, checkpoints, data, tmp_path):
    init, folder = checkpoints[family]
    args = build_parser().parse_args(init_args(init, data, tmp_path / "run", family))
    run = setup(args, Processes.start("cpu"))
    hf, hf_config = hf_tokenizer(family, folder), transformers.AutoConfig.from_pretrained(folder)
    expected = hf(TEXT, text_target=TARGETS)
    src_ids, tgt_ids = run.ids["test"][0] + run.ids["dev"][0], run.ids["test"][1] + run.ids["dev"][1]
    order = [TEXT.index(s) for s in run.corpus.src["test"] + run.corpus.src["dev"]]
    assert src_ids == [expected.input_ids[i][:-1] for i in order]  # transformers appends eos; collate does
    assert tgt_ids == [expected.labels[i][:-1] for i in order]
    _, tgt_in, tgt_out = collate(src_ids, tgt_ids, **special_ids(run.config))
    real = tgt_out.ne(run.config.pad_id)
    assert torch.equal(tgt_out[real], torch.tensor([t for i in order for t in expected.labels[i]]))
    labels = torch.where(real, tgt_out, -100)  # transformers' padded labels
    shifted = shift_tokens_right(labels, hf_config.pad_token_id, hf_config.decoder_start_token_id)
    # transformers' decoder_input_ids of these labels, at every position that has a label (a shorter row's eos
    # moves into its first padding position there, whose output no label reads)
    assert torch.equal(tgt_in[real], shifted[real])
    # the training batches themselves: the decoder's start token, then (M2M-100) the target language
    src, tgt_in, tgt_out = run.batches.next_tensors()
    assert bool(tgt_in[:, 0].eq(hf_config.decoder_start_token_id).all())
    if family == "m2m":
        lang = hf.get_lang_id("de")
        assert bool(tgt_in[:, 1].eq(lang).all()) and bool(tgt_out[:, 0].eq(lang).all())
        assert bool(src[:, 0].eq(hf.get_lang_id("en")).all())
    # padding-free batches (--batching packed) too: each target sentence starts with the start token
    args = build_parser().parse_args(init_args(init, data, tmp_path / "packed", family, "--batching", "packed"))
    packed = setup(args, Processes.start("cpu")).batches.next_tensors()
    starts = packed.tgt_seqs.cu_seqlens[:-1].long()
    assert bool(packed.tgt_in[starts].eq(hf_config.decoder_start_token_id).all())
    assert bool(packed.src[packed.src_seqs.cu_seqlens[1:].long() - 1].eq(hf_config.eos_token_id).all())


def test_nllb_batches_follow_fairseqs_ids(checkpoints, data, tmp_path):
    """NLLB (non-legacy, as transformers' NllbTokenizer): the source is its language code, the pieces (sentencepiece
    id + 1) and eos; the labels the target language's code, the pieces and eos; the decoder input eos (the
    decoder's start token) then the labels without their eos."""
    init, folder = checkpoints["nllb"]
    run = setup(build_parser().parse_args(init_args(init, data, tmp_path / "run", "nllb")), Processes.start("cpu"))
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(folder, "sentencepiece.bpe.model"))
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    size = sp.get_piece_size()
    deu, eng = size + 1, size + 2  # tests/hf/test_converted.py write_nllb's codes

    def pieces(text):
        return [p + 1 if p != sp.unk_id() else 3 for p in sp.encode(text)]

    src_ids, tgt_ids = run.ids["test"][0] + run.ids["dev"][0], run.ids["test"][1] + run.ids["dev"][1]
    for src, tgt, text in zip(src_ids, tgt_ids, run.corpus.src["test"] + run.corpus.src["dev"]):
        assert src == [eng] + pieces(text)
        assert tgt == [deu] + pieces(TARGETS[TEXT.index(text)])
    src, tgt_in, tgt_out = run.batches.next_tensors()
    assert bool(tgt_in[:, 0].eq(hf_config.decoder_start_token_id).all()) and hf_config.decoder_start_token_id == 2
    assert bool(tgt_in[:, 1].eq(deu).all()) and bool(tgt_out[:, 0].eq(deu).all())
    assert bool(src[:, 0].eq(eng).all())


@pytest.mark.parametrize("family", FAMILIES)
def test_init_run_fine_tunes_the_converted_model(family, checkpoints, data, tmp_path):
    init, _ = checkpoints[family]
    out = tmp_path / "run"
    result = main(init_args(init, data, out, family, "--max-steps", "30", "--eval-every", "0"))
    source, tuned = ckpt.load(init), ckpt.load(str(out))
    assert tuned["config"] == source["config"]  # the converted config as it is (its dropout, vocabulary, ...)
    expected_tokenizer = dict(source["tokenizer"], target_lang=TARGET_LANG.get(family))
    assert tuned["tokenizer"].keys() == expected_tokenizer.keys()
    for key, value in expected_tokenizer.items():
        same = torch.equal(value, tuned["tokenizer"][key]) if isinstance(value, torch.Tensor) else \
            value == tuned["tokenizer"][key]
        assert same, key
    with open(out / "log.jsonl") as f:
        log = [json.loads(line) for line in f]
    losses = [r["loss"] for r in log if r["kind"] == "train"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert set(result["before_and_after"]) == {"test_bleu"} and len(result["before_and_after"]["test_bleu"]) == 2
    if family.startswith("marian"):  # final_logits_bias: trained by nobody, as in transformers
        assert torch.equal(tuned["model"]["output_bias"], source["model"]["output_bias"])
    assert not torch.equal(tuned["model"]["embed.weight"], source["model"]["embed.weight"])


@pytest.mark.parametrize("family", sorted(TARGET_LANG))
def test_fine_tuned_multilingual_model_translates_into_its_target_language(family, checkpoints, data, tmp_path):
    init, _ = checkpoints[family]
    out = tmp_path / "run"
    main(init_args(init, data, out, family, "--max-steps", "3", "--eval-every", "0", "--no-test"))
    int8 = tmp_path / "int8.pt"
    convert([str(out), "--out", str(int8), "--quantize", "int8"])
    for path in (str(out), str(int8)):
        model, tokenizer, _ = ckpt.load_model(path)
        source_lang = {"m2m": "en", "nllb": "eng_Latn"}[family]
        assert (tokenizer.source_lang, tokenizer.target_lang) == (source_lang, TARGET_LANG[family])
        forced = []
        generate = model.generate
        model.generate = lambda *a, **k: forced.append(k["forced_tokens"]) or generate(*a, **k)
        translate(model, tokenizer, TEXT[:2], beam=1)
        assert forced == [[tokenizer.language_id(TARGET_LANG[family])]]


def test_resume_of_a_converted_init_run_is_exact(checkpoints, data, tmp_path):
    init, _ = checkpoints["marian-separate"]
    flags = ("--dropout", "0.1", "--eval-every", "0", "--no-test", "--keep", "10")
    main(init_args(init, data, tmp_path / "straight", "marian-separate", "--max-steps", "8", *flags))
    main(init_args(init, data, tmp_path / "stopped", "marian-separate", "--max-steps", "4", *flags))
    main(init_args(init, data, tmp_path / "stopped", "marian-separate", "--max-steps", "8", "--resume", *flags))
    a, b = (ckpt.load(str(tmp_path / name / "checkpoint_8.pt")) for name in ("straight", "stopped"))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs after resuming"
    for key, value in a["optimizer"]["state"].items():
        assert torch.equal(value["exp_avg_sq"], b["optimizer"]["state"][key]["exp_avg_sq"])


def test_m2m_languages_are_checked(checkpoints, data, tmp_path, capsys):
    init, _ = checkpoints["m2m"]
    no_target = [a for a in init_args(init, data, tmp_path / "a", "m2m") if a not in ("--target-lang", "de")]
    for argv, message in ((no_target, "is a multilingual model (M2M-100 or NLLB): give --target-lang CODE"),
                          (init_args(init, data, tmp_path / "b", "m2m", "--target-lang", "xx"),
                           "unknown target language 'xx'")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "a" / "log.jsonl")
