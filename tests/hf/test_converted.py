"""Models converted from transformers (fastformer/hf_convert.py, ``fastformer.from_transformers``) against
transformers itself, on tiny random models built in the test (``save_pretrained`` into a temporary folder,
with real tokenizer files made from a sentencepiece model trained here; no network):

- Marian (post-norm, swish, its [sin | cos] positions, final_logits_bias, decoding from pad; one shared
  vocabulary, and separate source and target vocabularies with their own embeddings) and M2M-100
  (pre-norm with final layer norms, relu, fairseq positions at offset 2, a forced target-language token):
  logits on a padded batch within the tolerance table; greedy tokens identical to ``generate(num_beams=1)``,
  on the C++ decoder step and on the Python one;
- the tokenizers: the ids of transformers' MarianTokenizer and M2M100Tokenizer, and their decoded text;
- ``python -m fastformer.convert DIR`` (float and int8) and the CTranslate2 export take a converted model;
- what does not map is refused, naming the config field.
A random decoder tends to repeat one token: the weights are drawn with std 1.0 (``init_std``) so that the
tokens vary, and the logits are compared as well as the tokens.
"""
import json
import os

import pytest
import sentencepiece
import torch
import transformers

import fastformer
from fastformer import checkpoint as ckpt
from fastformer.convert import main as convert_main
from fastformer.data.batching import collate
from fastformer.hf_convert import ConversionError
from fastformer.nn.decoding import IncrementalDecoder
from fastformer.nn.linear import Int8Embedding
from tolerances import assert_close

TEXT = ["the quick brown fox jumps over the lazy dog", "a man a plan a canal panama",
        "she sells sea shells by the sea shore", "how much wood would a woodchuck chuck",
        "peter piper picked a peck of pickled peppers", "red lorry yellow lorry red lorry"]
LANGUAGES = ["en", "ha", "is", "ja", "cs", "ru", "zh", "de"]  # M2M100Tokenizer's language_codes="wmt21"
LAYERS = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
              encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
              attention_dropout=0.0)


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm")
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(TEXT * 20), model_prefix=str(folder / "sp"),
                                             vocab_size=60, model_type="bpe", minloglevel=2)
    return str(folder / "sp.model")


def spm_pieces(path):
    sp = sentencepiece.SentencePieceProcessor(model_file=path)
    return [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]  # not its <unk> <s> </s>


def write_marian(folder, spm_file, init_std, separate=False):
    """A Marian folder; ``separate``: separate vocabularies (vocab.json the source's, target_vocab.json the
    target's: the pieces in reverse order and 5 more, so that an id means another piece on each side) and
    embeddings (share_encoder_decoder_embeddings false)."""
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(spm_pieces(spm_file))}}
    vocab["<pad>"] = len(vocab)
    pad = len(vocab) - 1
    with open(folder / "vocab.json", "w") as f:
        json.dump(vocab, f)
    sizes = {"vocab_size": len(vocab)}
    files = {}
    if separate:
        pieces = spm_pieces(spm_file)[::-1] + [f"\u2581filler{i}" for i in range(5)]
        target = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces[: pad - 2])}, "<pad>": pad,
                  **{p: pad + 1 + i for i, p in enumerate(pieces[pad - 2:])}}
        with open(folder / "target_vocab.json", "w") as f:
            json.dump(target, f)
        sizes.update(decoder_vocab_size=len(target), share_encoder_decoder_embeddings=False)
        files = dict(target_vocab_file=str(folder / "target_vocab.json"), separate_vocabs=True)
    tokenizer = transformers.MarianTokenizer(spm_file, spm_file, str(folder / "vocab.json"), **files)
    tokenizer.save_pretrained(folder)
    config = transformers.MarianConfig(pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0,
                                       forced_eos_token_id=0, activation_function="swish", scale_embedding=True,
                                       init_std=init_std, **sizes, **LAYERS)
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_()
    model.save_pretrained(folder)
    return str(folder)


def write_m2m(folder, spm_file, init_std):
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3,
             **{p: i + 4 for i, p in enumerate(spm_pieces(spm_file))}}
    with open(folder / "vocab.json", "w") as f:
        json.dump(vocab, f)
    tokenizer = transformers.M2M100Tokenizer(str(folder / "vocab.json"), spm_file, language_codes="wmt21",
                                             src_lang="en", tgt_lang="de")
    tokenizer.save_pretrained(folder)
    config = transformers.M2M100Config(vocab_size=len(vocab) + len(LANGUAGES) + 8, scale_embedding=True,
                                       init_std=init_std, **LAYERS)
    torch.manual_seed(1)
    transformers.M2M100ForConditionalGeneration(config).eval().save_pretrained(folder)
    return str(folder)


def write_nllb(folder, spm_file, init_std):
    """An NLLB folder as the hub's: no vocab.json; sentencepiece.bpe.model, the language codes as tokenizer.json's
    added tokens past the pieces (fairseq's ids: a piece's sentencepiece id + 1, <s> <pad> </s> <unk> at 0 .. 3),
    tokenizer_config.json naming NllbTokenizer and the source language; the model an M2M-100 (NLLB's class).
    Returns the folder and the codes' ids {"deu_Latn": ..., "eng_Latn": ...}."""
    import shutil

    shutil.copy(spm_file, folder / "sentencepiece.bpe.model")
    size = sentencepiece.SentencePieceProcessor(model_file=spm_file).get_piece_size()
    codes = {"deu_Latn": size + 1, "eng_Latn": size + 2}
    added = [{"id": i, "content": c} for i, c in enumerate(["<s>", "<pad>", "</s>", "<unk>"])]
    added += [{"id": i, "content": c} for c, i in codes.items()]
    with open(folder / "tokenizer.json", "w") as f:
        json.dump({"added_tokens": added}, f)
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump({"src_lang": "eng_Latn", "tokenizer_class": "NllbTokenizer"}, f)
    config = transformers.M2M100Config(vocab_size=size + 1 + len(codes) + 8, scale_embedding=True,
                                       init_std=init_std, **LAYERS)
    torch.manual_seed(1)
    transformers.M2M100ForConditionalGeneration(config).eval().save_pretrained(folder)
    return str(folder), codes


# Weights of std 1: the decoders' tokens vary (greedy comparisons); std 0.3: logits of a size whose float32
# error the tolerance table bounds (logit comparisons).
@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory, spm_file):
    return write_marian(tmp_path_factory.mktemp("marian"), spm_file, 1.0)


@pytest.fixture(scope="module")
def separate_dir(tmp_path_factory, spm_file):
    return write_marian(tmp_path_factory.mktemp("marian_separate"), spm_file, 1.0, separate=True)


@pytest.fixture(scope="module")
def m2m_dir(tmp_path_factory, spm_file):
    return write_m2m(tmp_path_factory.mktemp("m2m100"), spm_file, 1.0)


@pytest.fixture(scope="module")
def small_weights(tmp_path_factory, spm_file):
    return {"marian": write_marian(tmp_path_factory.mktemp("marian_small"), spm_file, 0.3),
            "marian-separate": write_marian(tmp_path_factory.mktemp("marian_separate_small"), spm_file, 0.3,
                                            separate=True),
            "m2m": write_m2m(tmp_path_factory.mktemp("m2m100_small"), spm_file, 0.3)}


def load_hf(family, folder):
    cls = transformers.MarianMTModel if family.startswith("marian") else transformers.M2M100ForConditionalGeneration
    return cls.from_pretrained(folder).eval()


def batch(model, tokenizer):
    """TEXT[:4] through fastformer's tokenizer, right-padded with eos: src (4, S) and its attention mask."""
    cfg = model.config
    src = collate(tokenizer.encode(TEXT[:4]), pad_id=cfg.pad_id, eos_id=cfg.eos_id)
    return src, src.ne(cfg.pad_id)


@pytest.mark.parametrize("family", ["marian", "marian-separate", "m2m"])
def test_converted_logits_match_transformers(family, small_weights):
    folder = small_weights[family]
    hf, (model, tokenizer) = load_hf(family, folder), fastformer.from_transformers(folder)
    assert (model.src_embed is not None) == (family == "marian-separate")
    src, mask = batch(model, tokenizer)
    assert not bool(mask.all()), "the batch must hold padding"
    torch.manual_seed(2)
    tgt = torch.randint(4, 40, (src.shape[0], 9))
    tgt[:, 0] = model.config.start_id
    with torch.no_grad():  # fastformer in float32 against transformers in float64
        expected = hf.double()(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        got = model(src, tgt)
    assert_close(got, expected, torch.float32, f"{family} logits")


@pytest.mark.parametrize("step", ["cpp", "python"])
@pytest.mark.parametrize("family", ["marian", "marian-separate", "m2m"])
def test_converted_greedy_tokens_match_generate(family, step, marian_dir, separate_dir, m2m_dir):
    """Greedy tokens equal transformers' generate(num_beams=1) token for token: both stop at eos or force it
    after the same number of tokens (fastformer: max_len_b tokens, then eos; transformers: max_new_tokens with
    forced_eos_token_id). M2M-100 decodes into German: its __de__ token forced first (forced_bos_token_id).
    Neither engine may produce pad or bos (transformers: bad_words_ids, as opus-mt's generation config)."""
    folder = {"marian": marian_dir, "marian-separate": separate_dir, "m2m": m2m_dir}[family]
    hf = load_hf(family, folder)
    model, tokenizer = fastformer.from_transformers(folder, backend="cpu" if step == "cpp" else "torch")
    cfg, limit = model.config, 24
    src, mask = batch(model, tokenizer)
    forced = None if family.startswith("marian") else [tokenizer.language_id("de")]
    extra = {} if forced is None else {"forced_bos_token_id": forced[0]}
    out = hf.generate(input_ids=src, attention_mask=mask, num_beams=1, do_sample=False,
                      max_new_tokens=limit + 1 + len(forced or []), forced_eos_token_id=cfg.eos_id,
                      bad_words_ids=[[cfg.pad_id], [cfg.bos_id]], **extra)
    expected = []
    for row in out[:, 1:].tolist():  # without the start token; up to its eos
        expected.append(row[: row.index(cfg.eos_id)])
    got = model.generate(src, beam_size=1, max_len_a=0, max_len_b=limit, forced_tokens=forced)
    assert got == expected
    assert len({t for row in got for t in row}) > 3, "the random model repeats one token: nothing is compared"
    with torch.no_grad():  # the step that ran: the C++ one (cpu backend, float32) or the Python one
        memory, padding = model.encode(src)
        assert (IncrementalDecoder(model, memory, padding, 1, 8).native is not None) == (step == "cpp")
    if forced is not None:
        assert all(row[0] == forced[0] for row in got)


def test_converted_beam_search_matches_transformers_in_the_matching_mode(small_weights):
    """Beam 4 in the mode where the two searches' rules agree (docs/transformers.md): no length penalty
    (fastformer's alpha 0, transformers' length_penalty 0) and transformers' early_stopping=True (a sentence
    stops when 4 hypotheses have finished). The eos bias (Marian's final_logits_bias) is raised so that some
    sentences end early and others at the length limit."""
    folder = small_weights["marian"]
    hf = load_hf("marian", folder)
    model, tokenizer = fastformer.from_transformers(folder)
    cfg, limit = model.config, 40
    with torch.no_grad():
        hf.final_logits_bias[0, cfg.eos_id] = model.output_bias[cfg.eos_id] = 7.0
    src, mask = batch(model, tokenizer)
    out = hf.generate(input_ids=src, attention_mask=mask, num_beams=4, do_sample=False, max_new_tokens=limit + 1,
                      length_penalty=0.0, early_stopping=True, forced_eos_token_id=cfg.eos_id,
                      bad_words_ids=[[cfg.pad_id]])
    expected = [row[1:][: row[1:].index(cfg.eos_id)] for row in out.tolist()]
    got = model.generate(src, beam_size=4, length_penalty=0.0, max_len_a=0, max_len_b=limit)
    assert got == expected
    lengths = {len(row) for row in got}
    assert limit in lengths and min(lengths) < limit, lengths


def test_converted_m2m_beam_search_matches_transformers_before_the_limit(m2m_dir):
    """The matching mode on M2M-100 (docs/transformers.md): beam 4, no length penalty, early_stopping=True,
    the target language forced first; transformers also needs bos in bad_words_ids (M2M-100's bos is not its
    pad) and forced_eos_token_id (its config sets none). A sentence whose 4 hypotheses all finish before the
    length limit gets the same tokens; one that reaches the limit may not (the eos there is scored
    differently). The eos row of the (tied) embedding is scaled so that both kinds occur."""
    hf = load_hf("m2m", m2m_dir)
    model, tokenizer = fastformer.from_transformers(m2m_dir)
    cfg, limit, de = model.config, 12, tokenizer.language_id("de")
    with torch.no_grad():
        hf.model.shared.weight[cfg.eos_id] *= 2.5
        model.embed.weight[cfg.eos_id] *= 2.5
    words = " ".join(TEXT).split()
    texts = [" ".join(words[i:i + 3 + i % 5]) for i in range(0, 60, 3)]
    src = collate(tokenizer.encode(texts), pad_id=cfg.pad_id, eos_id=cfg.eos_id)
    out = hf.generate(input_ids=src, attention_mask=src.ne(cfg.pad_id), num_beams=4, do_sample=False,
                      max_new_tokens=limit + 2, length_penalty=0.0, early_stopping=True, forced_bos_token_id=de,
                      forced_eos_token_id=cfg.eos_id, bad_words_ids=[[cfg.pad_id], [cfg.bos_id]])
    expected = [row[1:][: row[1:].index(cfg.eos_id)] for row in out.tolist()]
    hyps = model.beam_search(src, beam_size=4, length_penalty=0.0, max_len_a=0, max_len_b=limit, forced_tokens=[de])
    early = [i for i, h in enumerate(hyps) if all(len(tokens) <= limit for tokens, _ in h)]  # the limit: 1 + 12
    assert 5 <= len(early) < len(texts), early
    assert [hyps[i][0][0] for i in early] == [expected[i] for i in early]


def test_m2m_target_language_changes_the_translation(m2m_dir):
    model, tokenizer = fastformer.from_transformers(m2m_dir)
    src, _ = batch(model, tokenizer)
    german = model.generate(src, beam_size=2, forced_tokens=[tokenizer.language_id("de")])
    russian = model.generate(src, beam_size=2, forced_tokens=[tokenizer.language_id("ru")])
    assert german != russian
    with pytest.raises(ValueError, match="unknown target language 'xx'"):
        tokenizer.language_id("xx")


def test_marian_tokenizer_matches_transformers(marian_dir):
    _, tokenizer = fastformer.from_transformers(marian_dir)
    hf = transformers.MarianTokenizer.from_pretrained(marian_dir)
    texts = TEXT + ["zebra quokka"]  # pieces outside the vocabulary: unk
    expected = [ids[:-1] for ids in hf(texts).input_ids]  # transformers appends eos; fastformer's collate does
    assert tokenizer.encode(texts) == expected
    assert tokenizer.decode(expected[:6]) == TEXT


def test_marian_separate_vocabularies_match_transformers(separate_dir, tmp_path):
    """Separate vocabularies: source ids from vocab.json as transformers' MarianTokenizer gives them, target
    ids decoded through target_vocab.json as it decodes them; the checkpoint keeps both (convert, load), and
    the CTranslate2 export takes the source's vocabulary and embedding."""
    model, tokenizer = fastformer.from_transformers(separate_dir)
    hf = transformers.MarianTokenizer.from_pretrained(separate_dir)
    assert model.config.src_vocab_size == len(hf.encoder) != model.config.vocab_size == len(hf.target_encoder)
    assert tokenizer.encode(TEXT) == [ids[:-1] for ids in hf(TEXT).input_ids]
    target_ids = [[hf.target_encoder[p] for p in hf.spm_target.encode(text, out_type=str)] for text in TEXT]
    assert target_ids != tokenizer.encode(TEXT), "the two vocabularies must differ for this to test anything"
    assert tokenizer.decode(target_ids) == hf.batch_decode(target_ids, skip_special_tokens=True) == TEXT
    path = str(tmp_path / "separate.pt")
    convert_main([separate_dir, "--out", path])
    loaded, loaded_tokenizer, _ = ckpt.load_model(path)
    assert loaded.config.src_vocab_size == model.config.src_vocab_size
    assert torch.equal(loaded.src_embed.weight, model.src_embed.weight)
    assert loaded_tokenizer.encode(TEXT) == tokenizer.encode(TEXT)
    src, _ = batch(model, tokenizer)
    assert loaded.generate(src) == model.generate(src)
    # int8: the source's table quantized too (no float copy), saved and loaded as int8, the same tokens
    quantized = fastformer.quantize(loaded, "int8")
    assert isinstance(quantized.src_embed, Int8Embedding) and quantized.src_embed.weight.dtype == torch.int8
    assert not any(t.is_floating_point() and t.numel() >= model.config.d_model * model.config.source_vocab_size
                   for t in quantized.state_dict().values())
    int8_path = str(tmp_path / "separate-int8.pt")
    convert_main([separate_dir, "--out", int8_path, "--quantize", "int8"])
    loaded_int8, _, state = ckpt.load_model(int8_path)
    assert state["quantization"] == "int8" and isinstance(loaded_int8.src_embed, Int8Embedding)
    assert loaded_int8.generate(src) == quantized.generate(src)
    rows = torch.arange(model.config.source_vocab_size)  # the lookup: the rows dequantized
    scale = quantized.src_embed.weight_scale[:, None]
    assert (quantized.src_embed(rows) - model.src_embed.weight).abs().le(scale * 0.5 + 1e-7).all()
    ctranslate2 = pytest.importorskip("ctranslate2")
    from fastformer.export import ctranslate2_translate, write_ctranslate2

    write_ctranslate2(model, tokenizer.pieces(), str(tmp_path / "ct2"), source_pieces=tokenizer.source_pieces())
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    ids = tokenizer.encode(TEXT)
    theirs = ctranslate2_translate(translator, tokenizer.pieces(), ids, beam_size=1, length_penalty=0.0,
                                   source_pieces=tokenizer.source_pieces())
    assert theirs == model.generate(collate(ids, pad_id=model.config.pad_id, eos_id=model.config.eos_id),
                                    beam_size=1, length_penalty=0.0)


def test_m2m_tokenizer_matches_transformers(m2m_dir):
    _, tokenizer = fastformer.from_transformers(m2m_dir)
    hf = transformers.M2M100Tokenizer.from_pretrained(m2m_dir, src_lang="en")
    assert tokenizer.source_lang == "en"  # tokenizer_config.json's src_lang
    assert tokenizer.encode(TEXT) == [ids[:-1] for ids in hf(TEXT).input_ids]  # __en__ first, no eos
    assert tokenizer.languages == {code: hf.get_lang_id(code) for code in LANGUAGES}
    de = tokenizer.language_id("de")
    assert tokenizer.decode([[de] + ids[1:] for ids in tokenizer.encode(TEXT)]) == TEXT


def test_convert_cli_writes_float_and_int8_checkpoints(marian_dir, tmp_path, capsys):
    float_path, int8_path = str(tmp_path / "opus.pt"), str(tmp_path / "opus-int8.pt")
    convert_main([marian_dir, "--out", float_path])
    convert_main([marian_dir, "--out", int8_path, "--quantize", "int8"])
    model, tokenizer = fastformer.from_transformers(marian_dir)
    loaded, loaded_tokenizer, state = ckpt.load_model(float_path)
    assert state["source"]["transformers"] == "marian"
    assert loaded_tokenizer.encode(TEXT) == tokenizer.encode(TEXT)
    src, _ = batch(model, tokenizer)
    assert loaded.generate(src) == model.generate(src)
    quantized, _, state = ckpt.load_model(int8_path)
    assert state["quantization"] == "int8" and isinstance(quantized.embed, Int8Embedding)
    assert torch.equal(quantized.output_bias, model.output_bias)  # final_logits_bias, float32 beside the int8 table
    assert quantized.generate(src) == fastformer.quantize(model, "int8").generate(src)
    assert "wrote the int8 checkpoint" in capsys.readouterr().err


def test_converted_marian_exports_to_ctranslate2(marian_dir, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from fastformer.export import ctranslate2_translate, write_ctranslate2

    model, tokenizer = fastformer.from_transformers(marian_dir)
    write_ctranslate2(model, tokenizer.pieces(), str(tmp_path / "ct2"))
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    ids = tokenizer.encode(TEXT)
    src = collate(ids, pad_id=model.config.pad_id, eos_id=model.config.eos_id)
    ours = model.generate(src, beam_size=1, length_penalty=0.0)
    theirs = ctranslate2_translate(translator, tokenizer.pieces(), ids, beam_size=1, length_penalty=0.0)
    assert theirs == ours


def test_bin_weights_are_read_with_weights_only(marian_dir, tmp_path):
    import shutil

    for name in os.listdir(marian_dir):
        if name != "model.safetensors":
            shutil.copy(os.path.join(marian_dir, name), tmp_path / name)
    torch.save(load_hf("marian", marian_dir).state_dict(), tmp_path / "pytorch_model.bin")
    model, tokenizer = fastformer.from_transformers(str(tmp_path))
    reference, _ = fastformer.from_transformers(marian_dir)
    src, _ = batch(model, tokenizer)
    assert model.generate(src) == reference.generate(src)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "bert"}, "model_type 'bert' is not supported"),
    ({"share_encoder_decoder_embeddings": False}, "the weights lack model.decoder.embed_tokens.weight"),
    ({"decoder_vocab_size": 99}, "decoder_vocab_size 99 differs from vocab_size"),
    ({"activation_function": "gelu_new"}, "activation_function 'gelu_new' is not supported"),
    ({"decoder_attention_heads": 2}, "encoder_attention_heads 4 differs from decoder_attention_heads 2"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings is false"),
])
def test_what_does_not_map_is_refused_by_name(marian_dir, tmp_path, change, message):
    import shutil

    folder = tmp_path / "changed"
    shutil.copytree(marian_dir, folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    with open(folder / "config.json", "w") as f:
        json.dump({**config, **change}, f)
    with pytest.raises(ConversionError, match=message):
        fastformer.from_transformers(str(folder))
    with pytest.raises(SystemExit, match=message):
        convert_main([str(folder), "--out", str(tmp_path / "x.pt")])


def test_tokenizer_and_model_must_agree_on_separate_vocabularies(separate_dir, tmp_path):
    import shutil

    folder = tmp_path / "disagree"
    shutil.copytree(separate_dir, folder)
    with open(folder / "tokenizer_config.json") as f:
        config = json.load(f)
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump({**config, "separate_vocabs": False}, f)
    with pytest.raises(ConversionError, match="separate_vocabs is False, config.json's "
                                              "share_encoder_decoder_embeddings is False: they disagree"):
        fastformer.from_transformers(str(folder))


def test_nllb_tokenizer_follows_fairseqs_ids(spm_file, tmp_path):
    """An NLLB folder (no vocab.json): sentencepiece id + 1 for every piece, <s> <pad> </s> <unk> at 0 .. 3
    (sentencepiece's unk becomes 3), the language codes at the ids of tokenizer.json's added tokens, the
    source-language code first: checked against the rule, and the pieces' ids against transformers'
    NllbTokenizer read from the same sentencepiece model (its conversion, which needs protobuf, adds no
    language codes: those are compared by the rule only)."""
    import shutil

    (folder := tmp_path / "nllb").mkdir()
    folder, codes = write_nllb(folder, spm_file, 1.0)
    sp = sentencepiece.SentencePieceProcessor(model_file=spm_file)
    _, tokenizer = fastformer.from_transformers(folder)
    assert tokenizer.languages == codes and tokenizer.source_lang == "eng_Latn"
    for text, ids in zip(TEXT + ["zebra"], tokenizer.encode(TEXT + ["zebra"])):
        pieces = sp.encode(text)
        assert ids == [codes["eng_Latn"]] + [p + 1 if p != sp.unk_id() else 3 for p in pieces]
    assert tokenizer.decode([[codes["deu_Latn"]] + ids[1:] for ids in tokenizer.encode(TEXT)]) == TEXT
    reference = tmp_path / "nllb-spm-only"  # transformers' own reading of the sentencepiece model
    reference.mkdir()
    shutil.copy(spm_file, reference / "sentencepiece.bpe.model")
    with open(reference / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "NllbTokenizer", "src_lang": "eng_Latn"}, f)
    hf = transformers.AutoTokenizer.from_pretrained(str(reference))
    assert type(hf).__name__ == "NllbTokenizer"
    texts = TEXT + ["zebra quokka"]
    expected = [row[1:-1] for row in hf(texts).input_ids]  # without its language token and eos
    assert [ids[1:] for ids in tokenizer.encode(texts)] == expected
    assert hf.batch_decode(expected, skip_special_tokens=True) == tokenizer.decode(expected)


def test_translate_cli_takes_a_converted_m2m_checkpoint_and_target_lang(m2m_dir, tmp_path):
    import subprocess
    import sys

    path = str(tmp_path / "m2m.pt")
    convert_main([m2m_dir, "--out", path])
    model, tokenizer = fastformer.from_transformers(m2m_dir)
    src, _ = batch(model, tokenizer)
    expected = tokenizer.decode(model.generate(src[:2], forced_tokens=[tokenizer.language_id("de")]))

    def run(*flags):
        return subprocess.run([sys.executable, "-m", "fastformer.translate", "--checkpoint", path, *flags],
                              input="\n".join(TEXT[:2]) + "\n", capture_output=True, text=True, timeout=300)

    done = run("--target-lang", "de", "--beam", "4")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == expected
    bad = run("--target-lang", "xx")
    assert bad.returncode != 0 and "unknown target language 'xx'" in bad.stderr
