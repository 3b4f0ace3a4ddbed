"""python -m fastformer.export --transformers CHECKPOINT OUT (fastformer/hf_export.py): OUT loads offline with
AutoModelForSeq2SeqLM and AutoTokenizer and computes the checkpoint's function.

- Converted models, each family: tiny random Marian (one vocabulary, and separate ones), M2M-100 and NLLB folders
  (test_converted.py's builders; NLLB: the M2M-100 model with NLLB's tokenizer), converted with
  ``python -m fastformer.convert``, then exported: transformers' tokenizer gives fastformer's ids, the logits agree
  within the tolerance table, greedy tokens are identical, and beam 4 in the matching mode (docs/transformers.md:
  length penalty 0 in both, whose GNMT and len ** alpha penalties then both rank by the sum of log-probabilities,
  early_stopping=True) gives identical tokens to every sentence whose hypotheses all end before the length limit;
  the exported weights are the original folder's bit for bit and converting OUT gives the checkpoint's weights
  bit for bit.
- A model of fastformer.train (tests/data/tiny-bible-de-en.pt) becomes Marian with its residual dimensions
  reordered: the same checks on the 40 sentences of tests/data/test.de, and the round trip through
  ``fastformer.from_transformers`` gives the same logits.
- What a family cannot express is refused by name, nothing written; OUT existing needs --force.
A random decoder tends to repeat one token: the token tests use weights of std 1.0, the logit tests std 0.3.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers export's optional dependency "
                                   "(pip install '.[hf]')")
import sentencepiece  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import fastformer  # noqa: E402
from fastformer import checkpoint as ckpt  # noqa: E402
from fastformer.convert import main as convert_main  # noqa: E402
from fastformer.data import collate  # noqa: E402
from fastformer.export import build_parser, main as export_main  # noqa: E402
from fastformer.hf_export import marian_order, permute_residual  # noqa: E402
from fastformer.nn import Transformer, TransformerConfig  # noqa: E402
from fastformer.nn.decoding import length_limit  # noqa: E402
from fastformer.nn.transformer import position_table  # noqa: E402
from test_converted import TEXT, spm_file, write_m2m, write_marian  # noqa: E402,F401 (spm_file: the fixture)
from tolerances import assert_close  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
BIBLE = os.path.join(DATA, "tiny-bible-de-en.pt")
FAMILIES = ["marian", "marian-separate", "m2m", "nllb"]
MODEL_CLASS = {"marian": "MarianMTModel", "marian-separate": "MarianMTModel",
               "m2m": "M2M100ForConditionalGeneration", "nllb": "M2M100ForConditionalGeneration"}
TOKENIZER_CLASS = {"marian": "MarianTokenizer", "marian-separate": "MarianTokenizer", "m2m": "M2M100Tokenizer",
                   "nllb": "NllbTokenizer"}


def write_nllb(folder, m2m_folder, spm_file):
    """An NLLB folder: test_converted's M2M-100 model (its ids: <s> 0, <pad> 1, </s> 2, as NLLB's) with NLLB's
    tokenizer files: the sentencepiece model (ids: sentencepiece's + 1) and its language codes right after it."""
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(m2m_folder, name), folder / name)
    shutil.copy(spm_file, folder / "sentencepiece.bpe.model")
    size = sentencepiece.SentencePieceProcessor(model_file=spm_file).get_piece_size()
    added = [{"id": i, "content": c} for i, c in enumerate(["<s>", "<pad>", "</s>", "<unk>"])]
    added += [{"id": size + 1 + i, "content": c} for i, c in enumerate(["deu_Latn", "eng_Latn"])]
    with open(folder / "tokenizer.json", "w") as f:
        json.dump({"added_tokens": added}, f)
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump({"src_lang": "eng_Latn", "tokenizer_class": "NllbTokenizer"}, f)
    return str(folder)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, spm_file):
    """(family, std) -> (original transformers folder, converted checkpoint, exported folder), made on first use."""
    made = {}

    def get(family, std):
        if (family, std) not in made:
            root = tmp_path_factory.mktemp(f"{family}-{std}")
            (root / "hf").mkdir()
            if family.startswith("marian"):
                original = write_marian(root / "hf", spm_file, std, separate=family == "marian-separate")
            else:
                original = write_m2m(root / "hf", spm_file, std)
                if family == "nllb":
                    original = write_nllb(root / "nllb", original, spm_file)
            checkpoint, out = str(root / "model.pt"), str(root / "out")
            convert_main([original, "--out", checkpoint])
            export_main(["--transformers", checkpoint, out])
            made[family, std] = original, checkpoint, out
        return made[family, std]

    return get


def load_exported(out):
    model, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(out, local_files_only=True,
                                                                      output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    return model.eval(), transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)


def target_language(family, tokenizer):
    """The forced target-language token of M2M-100 (de) and NLLB (deu_Latn); None for Marian."""
    code = {"m2m": "de", "nllb": "deu_Latn"}.get(family)
    return None if code is None else [tokenizer.language_id(code)]


def hf_best(hf, src, cfg, limit, beams, forced=None):
    """transformers' best tokens per sentence (no start token, up to its eos) with the folder's own generation
    config (bad_words_ids, forced_eos_token_id), beam in the matching mode, ``limit`` tokens before the eos."""
    extra = {} if forced is None else {"forced_bos_token_id": forced[0]}
    if beams > 1:
        extra.update(length_penalty=0.0, early_stopping=True)
    out = hf.generate(input_ids=src, attention_mask=src.ne(cfg.pad_id), num_beams=beams, do_sample=False,
                      max_new_tokens=limit + 1 + len(forced or []), **extra)
    rows = out[:, 1:].tolist()
    return [row[: row.index(cfg.eos_id)] if cfg.eos_id in row else row for row in rows]


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_loads_with_auto_classes_and_tokenizes_alike(family, exported):
    _, checkpoint, out = exported(family, 1.0)
    hf, hf_tokenizer = load_exported(out)
    assert type(hf).__name__ == MODEL_CLASS[family] and type(hf_tokenizer).__name__ == TOKENIZER_CLASS[family]
    _, tokenizer, _ = ckpt.load_model(checkpoint)
    texts = TEXT + ["zebra quokka"]  # pieces outside the vocabulary: unk
    assert tokenizer.encode(texts) == [ids[:-1] for ids in hf_tokenizer(texts).input_ids]  # transformers adds eos
    forced = target_language(family, tokenizer)
    if forced is None:  # Marian: the target's ids (its own vocabulary where the two are separate)
        ids = [row[:-1] for row in hf_tokenizer(text_target=TEXT).input_ids]
    else:  # the target language's token first
        ids = [forced + row[1:] for row in tokenizer.encode(TEXT)]
    assert hf_tokenizer.batch_decode(ids, skip_special_tokens=True) == tokenizer.decode(ids) == TEXT


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_logits_match(family, exported):
    _, checkpoint, out = exported(family, 0.3)
    hf, _ = load_exported(out)
    model, tokenizer, _ = ckpt.load_model(checkpoint)
    cfg = model.config
    src = collate(tokenizer.encode(TEXT[:4]), pad_id=cfg.pad_id, eos_id=cfg.eos_id)
    assert bool(src.eq(cfg.pad_id).any()), "the batch must hold padding"
    tgt = torch.randint(4, 40, (src.shape[0], 9))
    tgt[:, 0] = cfg.start_id
    with torch.no_grad():  # fastformer in float32 against transformers in float64
        expected = hf.double()(input_ids=src, attention_mask=src.ne(cfg.pad_id), decoder_input_ids=tgt).logits
        got = model(src, tgt)
    assert_close(got, expected, torch.float32, f"{family} logits")


def sentences(model, tokenizer):
    """20 sentences of 3 to 7 words from TEXT, collated (src (20, S))."""
    words = " ".join(TEXT).split()
    return collate(tokenizer.encode([" ".join(words[i:i + 3 + i % 5]) for i in range(0, 60, 3)]),
                   pad_id=model.config.pad_id, eos_id=model.config.eos_id)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_greedy_tokens_match(family, exported):
    """Every sentence identical: both stop at eos or force it after the same number of tokens."""
    _, checkpoint, out = exported(family, 1.0)
    hf, _ = load_exported(out)
    model, tokenizer, _ = ckpt.load_model(checkpoint)
    forced, limit = target_language(family, tokenizer), 12
    src = sentences(model, tokenizer)
    greedy = model.generate(src, beam_size=1, max_len_a=0, max_len_b=limit, forced_tokens=forced)
    assert greedy == hf_best(hf, src, model.config, limit, 1, forced)
    assert len({t for row in greedy for t in row}) > 3, "the random model repeats one token: nothing is compared"


@pytest.mark.parametrize("family", ["m2m", "nllb"])
def test_converted_model_beam_tokens_match_before_the_limit(family, exported):
    """Beam 4 in the matching mode, target language forced: identical for every sentence whose 4 hypotheses all end
    before the limit (at the limit transformers scores the forced eos 0, fastformer its log-probability). The eos
    embedding row is scaled in both models alike so that sentences of 1 to 10 tokens occur. (A random Marian ends
    at once or runs to the limit: Marian's beams are compared on the trained model below, exported as it is and
    converted then exported.)"""
    _, checkpoint, out = exported(family, 1.0)
    hf, _ = load_exported(out)
    model, tokenizer, _ = ckpt.load_model(checkpoint)
    cfg, forced, limit = model.config, target_language(family, tokenizer), 12
    with torch.no_grad():
        hf.model.shared.weight[cfg.eos_id] *= 2.5
        model.embed.weight[cfg.eos_id] *= 2.5
    src = sentences(model, tokenizer)
    hyps = model.beam_search(src, beam_size=4, length_penalty=0.0, max_len_a=0, max_len_b=limit,
                             forced_tokens=forced)
    expected = hf_best(hf, src, cfg, limit, 4, forced)
    early = [i for i, h in enumerate(hyps) if all(len(tokens) <= limit for tokens, _ in h)]  # limit: 1 + 12
    assert 5 <= len(early) < len(hyps) and len({len(hyps[i][0][0]) for i in early}) > 3, early
    assert [hyps[i][0][0] for i in early] == [expected[i] for i in early]


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_round_trip_is_bit_exact(family, exported, tmp_path):
    """The exported tensors are the original folder's, and converting the export gives the checkpoint back:
    config, every weight bit for bit, the tokenizer's pieces and language codes."""
    original, checkpoint, out = exported(family, 1.0)
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(original).state_dict()
    ours = load_exported(out)[0].state_dict()
    assert ours.keys() == theirs.keys()
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []
    again = str(tmp_path / "again.pt")
    convert_main([out, "--out", again])
    model, tokenizer, state = ckpt.load_model(checkpoint)
    back, back_tokenizer, back_state = ckpt.load_model(again)
    assert back.config == model.config
    assert back_state["source"]["transformers"] == state["source"]["transformers"]
    weights, back_weights = model.state_dict(), back.state_dict()
    assert weights.keys() == back_weights.keys()
    assert [name for name in weights if not torch.equal(weights[name], back_weights[name])] == []
    assert back_tokenizer.pieces() == tokenizer.pieces()
    assert back_tokenizer.source_pieces() == tokenizer.source_pieces()
    assert back_tokenizer.languages == tokenizer.languages and back_tokenizer.source_lang == tokenizer.source_lang


# ---- a model of fastformer.train -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bible(tmp_path_factory):
    """The trained model exported (a Marian folder), and that folder converted (a converted Marian checkpoint)
    and exported again."""
    root = tmp_path_factory.mktemp("bible")
    out, converted, again = str(root / "out"), str(root / "converted.pt"), str(root / "again")
    export_main(["--transformers", BIBLE, out])
    convert_main([out, "--out", converted])
    export_main(["--transformers", converted, again])
    with open(os.path.join(DATA, "test.de"), encoding="utf-8") as f:
        texts = [line.rstrip("\n") for line in f]
    return texts, out, converted, again


def test_permutation_turns_the_papers_table_into_marians():
    """Marian's column k is the paper's column marian_order(d)[k], for even and odd d: against transformers'
    own table (float32) and fastformer's "marian" table (float64, the same formula up to rounding)."""
    for d in (32, 33):
        paper = position_table(64, TransformerConfig.tiny(d_model=d, n_heads=1))[:, marian_order(d)]
        marian = position_table(64, TransformerConfig.tiny(d_model=d, n_heads=1, positions="marian"))
        torch.testing.assert_close(paper, marian, atol=1e-12, rtol=0)
        embedding = transformers.models.marian.modeling_marian.MarianSinusoidalPositionalEmbedding(64, d)
        torch.testing.assert_close(paper.float(), embedding.create_weight(), atol=1e-6, rtol=0)
    assert marian_order(6).tolist() == [0, 2, 4, 1, 3, 5]


@pytest.mark.parametrize("which", ["trained", "converted"])
def test_marian_export_of_the_trained_model_decodes_alike(which, bible):
    """The tiny trained model exported (``trained``), and its export converted and exported again (``converted``:
    a converted Marian checkpoint): MarianTokenizer gives fastformer's ids for all 40 sentences of test.de; logits
    agree; greedy tokens are identical for every sentence and beam 4 (matching mode) for every sentence whose
    hypotheses all end before the limit, each sentence with fastformer's own limit (floor(1.2 n + 10)); the texts
    decode alike."""
    texts, out, converted, again = bible
    model, tokenizer, _ = ckpt.load_model(BIBLE if which == "trained" else converted)
    hf, hf_tokenizer = load_exported(out if which == "trained" else again)
    assert type(hf).__name__ == "MarianMTModel" and type(hf_tokenizer).__name__ == "MarianTokenizer"
    assert hf.config.decoder_start_token_id == model.config.bos_id == 2  # fastformer's start, not Marian's pad 0
    ids = tokenizer.encode(texts)
    assert ids == [row[:-1] for row in hf_tokenizer(texts).input_ids]
    cfg = model.config
    src = collate(ids[:8])
    tgt = collate(tokenizer.encode(texts[8:16]))[:, :12].clone()
    tgt[:, 0] = cfg.start_id
    with torch.no_grad():
        expected = hf.double()(input_ids=src, attention_mask=src.ne(cfg.pad_id), decoder_input_ids=tgt).logits
        assert_close(model(src, tgt), expected, torch.float32, "exported logits")
    hf.float()
    limits = [length_limit(len(row) + 1, 1.2, 10) for row in ids]
    ours = {1: model.generate(collate(ids), beam_size=1, length_penalty=0.0, max_len_a=1.2, max_len_b=10)}
    hyps = model.beam_search(collate(ids), beam_size=4, length_penalty=0.0, max_len_a=1.2, max_len_b=10)
    ours[4] = [h[0][0] for h in hyps]
    theirs = {1: [None] * len(ids), 4: [None] * len(ids)}
    for limit in sorted(set(limits)):  # transformers' limit is one per call: the sentences sharing one
        group = [i for i, n in enumerate(limits) if n == limit]
        for beams in (1, 4):
            for i, row in zip(group, hf_best(hf, collate([ids[i] for i in group]), cfg, limit, beams)):
                theirs[beams][i] = row
    assert ours[1] == theirs[1]
    early = [i for i, h in enumerate(hyps) if all(len(tokens) < limits[i] for tokens, _ in h)]
    assert len(early) >= 20 and len({len(ours[4][i]) for i in early}) > 5, early
    assert [ours[4][i] for i in early] == [theirs[4][i] for i in early]
    assert hf_tokenizer.batch_decode(ours[1], skip_special_tokens=True) == tokenizer.decode(ours[1])
    assert hf_tokenizer.bos_token_id == cfg.bos_id and hf_tokenizer.pad_token_id == cfg.pad_id


def test_fastformer_model_round_trip_gives_the_same_logits(bible):
    """Converting the export back gives Marian's positions and the permuted weights, bit for bit (the
    permutation is a copy), and the same function: logits within the tolerance table of the original's
    (float64) on a padded batch; exporting that again changes nothing."""
    texts, out, converted, again = bible
    model, tokenizer, _ = ckpt.load_model(BIBLE)
    back, back_tokenizer = fastformer.from_transformers(out)
    assert back.config.positions == "marian" and back.config.decoder_start_id == model.config.bos_id
    assert back_tokenizer.encode(texts) == tokenizer.encode(texts)
    permuted = permute_residual(model.state_dict(), model.config.d_model)
    weights = back.state_dict()
    assert torch.equal(weights.pop("output_bias"), torch.zeros(model.config.vocab_size))
    assert [name for name in permuted if not torch.equal(permuted[name], weights[name])] == []
    src, tgt = collate(tokenizer.encode(texts[:6])), collate(tokenizer.encode(texts[6:12]))[:, :10].clone()
    tgt[:, 0] = model.config.start_id
    with torch.no_grad():
        expected = Transformer(model.config).double().eval()
        expected.load_state_dict(model.state_dict())
        assert_close(back(src, tgt), expected(src, tgt), torch.float32, "round-trip logits")
    # exporting the converted export again writes the same tensors and vocabulary (a converted Marian is copied)
    first, second = (load_file(os.path.join(folder, "model.safetensors")) for folder in (out, again))
    assert first.keys() == second.keys() and [k for k in first if not torch.equal(first[k], second[k])] == []
    with open(os.path.join(out, "vocab.json")) as f, open(os.path.join(again, "vocab.json")) as g:
        assert json.load(f) == json.load(g)


# ---- what is refused -----------------------------------------------------------------------------------------

def checkpoint_with(tmp_path, base, **changes):
    """A checkpoint of a random model whose config is ``base``'s with ``changes``, with its tokenizer and source."""
    model, tokenizer, state = ckpt.load_model(base)
    extra = {"source": state["source"]} if "source" in state else {}
    path = str(tmp_path / "changed.pt")
    ckpt.save(ckpt.model_state(Transformer(model.config.replace(**changes)), tokenizer, **extra), path)
    return path


@pytest.mark.parametrize("family, changes, message", [
    ("bible", dict(norm_first=True), "Marian cannot express this model: norm_first"),
    ("bible", dict(layer_norm_eps=1e-6), "layer_norm_eps 1e-06"),
    ("bible", dict(position_offset=2), "position_offset 2: Marian reads its table from row 0"),
    ("marian", dict(positions="fairseq"), "positions 'fairseq'"),
    ("m2m", dict(norm_first=False), "M2M-100/NLLB cannot express this model: post-norm"),
    ("m2m", dict(output_bias=True), "an output bias: M2M-100 has none"),
    ("nllb", dict(position_offset=0), "positions 'fairseq' at offset 0"),
])
def test_what_a_family_cannot_express_is_refused(family, changes, message, exported, tmp_path):
    base = BIBLE if family == "bible" else exported(family, 0.3)[1]
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=message):
        export_main(["--transformers", checkpoint_with(tmp_path, base, **changes), str(out)])
    assert sorted(os.listdir(tmp_path)) == ["changed.pt"]  # no OUT, no temporary folder left


def test_a_quantized_checkpoint_is_refused(tmp_path):
    int8 = str(tmp_path / "int8.pt")
    convert_main([BIBLE, "--out", int8, "--quantize", "int8"])
    with pytest.raises(SystemExit, match="takes a float model, not an int8 one"):
        export_main(["--transformers", int8, str(tmp_path / "out")])


def test_an_m2m100_tokenizer_whose_codes_are_elsewhere_is_refused(exported, tmp_path):
    """M2M100Tokenizer's language codes are len(vocab.json) + their index in its list: a checkpoint whose codes
    sit elsewhere cannot be written as M2M100Tokenizer files (its ids would change)."""
    state = ckpt.load(exported("m2m", 0.3)[1])
    languages = state["tokenizer"]["languages"]
    languages["de"], languages["ru"] = languages["ru"], languages["de"]
    path = str(tmp_path / "swapped.pt")
    ckpt.save(state, path)
    with pytest.raises(SystemExit, match="M2M100Tokenizer puts its language codes at len"):
        export_main(["--transformers", path, str(tmp_path / "out")])


def test_nllb_without_protobuf_is_refused_by_name(exported, tmp_path):
    """transformers reads NLLB's sentencepiece model with protobuf; without it the export says so."""
    checkpoint = exported("nllb", 0.3)[1]
    code = ("import sys; sys.modules['google'] = sys.modules['google.protobuf'] = None; "
            "from fastformer.export import main; main(sys.argv[1:])")
    run = subprocess.run([sys.executable, "-c", code, "--transformers", checkpoint, str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "it needs protobuf: pip install protobuf" in run.stderr.strip().splitlines()[-1]
    assert os.listdir(tmp_path) == []


def test_out_needs_force_and_force_replaces_it(bible, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier export")
    run = subprocess.run([sys.executable, "-m", "fastformer.export", "--transformers", BIBLE, str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "exists" in run.stderr and "--force" in run.stderr
    assert "Traceback" not in run.stderr
    export_main(["--transformers", BIBLE, str(out), "--force"])
    assert not (out / "stale.txt").exists()
    assert sorted(os.listdir(out)) == sorted(os.listdir(bible[1]))


def test_a_refusal_is_one_line_without_a_traceback(tmp_path):
    path = checkpoint_with(tmp_path, BIBLE, norm_first=True)
    run = subprocess.run([sys.executable, "-m", "fastformer.export", "--transformers", path, str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("error: Marian cannot express this model: norm_first")


def test_the_export_never_writes_over_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(BIBLE, run_dir / "checkpoint_1.pt")
    with pytest.raises(SystemExit, match="holds the checkpoint"):
        export_main(["--transformers", str(run_dir), str(run_dir), "--force"])
    assert os.path.exists(run_dir / "checkpoint_1.pt")


def test_help_explains_the_transformers_export():
    text = " ".join(build_parser().format_help().split())
    assert "--transformers" in text and "Marian, M2M-100, NLLB" in text and "--ctranslate2" in text
