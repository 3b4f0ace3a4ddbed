"""Models from transformers: a local MarianMT or M2M-100/NLLB folder as a fastformer Transformer and tokenizer.

    model, tokenizer = fastformer.from_transformers(DIR)       # offline; no transformers import needed
    python -m fastformer.convert DIR --out CHECKPOINT [--quantize int8]

Both families are the paper's encoder-decoder with options, and each option is a field of
``TransformerConfig`` that every path follows (training, the Python and C++ decoder steps, the CTranslate2
export), never a second model:

=======================  ==========================================  =========================================
config field             Marian (opus-mt)                            M2M-100 / NLLB
=======================  ==========================================  =========================================
activation               activation_function (swish -> silu)         activation_function (relu)
scale_embedding          scale_embedding                             scale_embedding
norm_first               False (post-norm)                           True, with the final layer_norm of each
                                                                     stack (encoder.final_norm, decoder.final_norm)
positions                "marian": [sin | cos] halves, 10000^(-2i/d)  "fairseq": [sin | cos], 10000^(-i/(d/2-1)),
position_offset          0                                           2 (pad_token_id + 1)
output_bias              final_logits_bias                           none
decoder_start_id         decoder_start_token_id (= pad)              decoder_start_token_id (= eos), and the
                                                                     target language forced next (--target-lang)
pad/unk/bos/eos ids      the config's and vocab.json's               the config's
src_vocab_size           vocab_size where share_encoder_decoder_     none (one vocabulary)
                         embeddings is false (vocab_size is then
                         decoder_vocab_size)
=======================  ==========================================  =========================================

Weights: ``model.shared.weight`` is the one embedding (source, target, output projection); with separate
vocabularies ``model.decoder.embed_tokens.weight`` is the target's (and the output projection's) and
``model.encoder.embed_tokens.weight`` the source's (``src_embed``); q, k, v
projections are concatenated into fastformer's qkv_proj (self-attention) and k, v into kv_proj
(cross-attention). Read from ``model.safetensors`` (needs the safetensors package) or ``pytorch_model.bin``
(``torch.load(weights_only=True)``).
Tokenizers (fastformer/data/tokenizer.py ``VocabTokenizer``): Marian's source.spm, target.spm and vocab.json
(with separate_vocabs, vocab.json the source's and target_vocab.json the target's);
M2M-100's sentencepiece.bpe.model and vocab.json; NLLB's sentencepiece.bpe.model with fairseq's id offset; the
language codes from tokenizer_config.json's added tokens.

What does not map is refused with ``ConversionError`` naming the field: another model_type, untied output
weights, encoder and decoder of different widths or heads, other activations, a tokenizer whose
separate_vocabs disagrees with the model's share_encoder_decoder_embeddings. Layer drop (M2M-100's
encoder_layerdrop and decoder_layerdrop) is a training-time option fastformer does not have: inference is
unaffected.
"""
from __future__ import annotations

import json
import os
import re

import torch

from fastformer.data.tokenizer import VocabTokenizer
from fastformer.nn import Transformer, TransformerConfig

FAMILIES = ("marian", "m2m_100")
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}
# A language-code token: M2M-100's __de__ (code "de"), NLLB's deu_Latn (code "deu_Latn").
_M2M_LANGUAGE = re.compile(r"^__([a-z]{2,3})__$")
_NLLB_LANGUAGE = re.compile(r"^[a-z]{3}_[A-Z][a-z]{3}$")

# M2M-100's language codes, in the order that gives their ids (len(vocab.json) + index), by the tokenizer's
# language_codes setting (tokenizer_config.json): fairseq's lists, as transformers' M2M100Tokenizer holds them.
M2M100_LANGUAGE_CODES = {
    "m2m100": [
        "af", "am", "ar", "ast", "az", "ba", "be", "bg", "bn", "br", "bs", "ca", "ceb", "cs", "cy", "da", "de", "el",
        "en", "es", "et", "fa", "ff", "fi", "fr", "fy", "ga", "gd", "gl", "gu", "ha", "he", "hi", "hr", "ht", "hu", "hy",
        "id", "ig", "ilo", "is", "it", "ja", "jv", "ka", "kk", "km", "kn", "ko", "lb", "lg", "ln", "lo", "lt", "lv",
        "mg", "mk", "ml", "mn", "mr", "ms", "my", "ne", "nl", "no", "ns", "oc", "or", "pa", "pl", "ps", "pt", "ro", "ru",
        "sd", "si", "sk", "sl", "so", "sq", "sr", "ss", "su", "sv", "sw", "ta", "th", "tl", "tn", "tr", "uk", "ur", "uz",
        "vi", "wo", "xh", "yi", "yo", "zh", "zu"],
    "wmt21": ["en", "ha", "is", "ja", "cs", "ru", "zh", "de"],
}


class ConversionError(ValueError):
    """A transformers model folder fastformer cannot read or map; the message names the file or field."""


def _read_json(directory: str, name: str, required: bool = True):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        if required:
            raise ConversionError(f"{directory} has no {name}")
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_bytes(directory: str, name: str) -> bytes:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise ConversionError(f"{directory} has no {name} (the tokenizer's sentencepiece model)")
    with open(path, "rb") as f:
        return f.read()


def model_config(hf: dict) -> TransformerConfig:
    """The TransformerConfig of a transformers config.json dict (Marian or M2M-100/NLLB), or ConversionError."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ConversionError(f"model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})")

    def same(encoder_field: str, decoder_field: str) -> int:
        if hf[encoder_field] != hf[decoder_field]:
            raise ConversionError(f"{encoder_field} {hf[encoder_field]} differs from {decoder_field} "
                                  f"{hf[decoder_field]}: fastformer's encoder and decoder share these sizes")
        return hf[encoder_field]

    activation = hf.get("activation_function", "relu")
    if activation not in _ACTIVATIONS:
        raise ConversionError(f"activation_function {activation!r} is not supported "
                              f"(supported: {', '.join(_ACTIVATIONS)})")
    if not hf.get("tie_word_embeddings", True):
        raise ConversionError("tie_word_embeddings is false: fastformer's output projection is the shared embedding")
    vocab, src_vocab = hf["vocab_size"], None
    if family == "marian":
        target_vocab = hf.get("decoder_vocab_size") or vocab
        if not hf.get("share_encoder_decoder_embeddings", True):
            vocab, src_vocab = target_vocab, vocab  # separate vocabularies: the source's is vocab_size
        elif target_vocab != vocab:
            raise ConversionError(f"decoder_vocab_size {target_vocab} differs from vocab_size {vocab} while "
                                  "share_encoder_decoder_embeddings is true")
    pad, eos = hf["pad_token_id"], hf["eos_token_id"]
    if isinstance(eos, list):
        raise ConversionError(f"eos_token_id {eos}: one end-of-sentence token is supported")
    start = hf.get("decoder_start_token_id")
    start = pad if start is None and family == "marian" else start
    if start is None:
        raise ConversionError("decoder_start_token_id is missing")
    # bos: a token the search never produces. Marian has none: its start token, pad (never produced either).
    bos = hf.get("bos_token_id")
    bos = start if bos is None or bos == eos else bos
    unk = hf.get("unk_token_id")  # rarely in config.json: the families' own (vocab.json's, for the tokenizer)
    unk = (1 if family == "marian" else 3) if unk is None else unk
    try:
        return TransformerConfig(
            vocab_size=vocab, d_model=hf["d_model"], n_heads=same("encoder_attention_heads", "decoder_attention_heads"),
            d_ff=same("encoder_ffn_dim", "decoder_ffn_dim"), n_encoder_layers=hf["encoder_layers"],
            n_decoder_layers=hf["decoder_layers"], dropout=hf.get("dropout", 0.1),
            attention_dropout=hf.get("attention_dropout", 0.0), activation_dropout=hf.get("activation_dropout", 0.0),
            activation=_ACTIVATIONS[activation], norm_first=family == "m2m_100", layer_norm_eps=1e-5,
            max_positions=hf.get("max_position_embeddings", 1024), pad_id=pad, unk_id=unk, bos_id=bos, eos_id=eos,
            scale_embedding=bool(hf.get("scale_embedding", False)), output_bias=family == "marian",
            positions="marian" if family == "marian" else "fairseq",
            position_offset=0 if family == "marian" else pad + 1, decoder_start_id=start, src_vocab_size=src_vocab)
    except KeyError as exc:
        raise ConversionError(f"config.json lacks {exc.args[0]}") from exc
    except ValueError as exc:
        raise ConversionError(f"config.json does not make a fastformer model: {exc}") from exc


def _load_weights(directory: str) -> dict[str, torch.Tensor]:
    safetensors_path = os.path.join(directory, "model.safetensors")
    if os.path.isfile(safetensors_path):
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise ConversionError("reading model.safetensors needs the safetensors package: "
                                  "pip install 'fastformer[hf]'") from exc
        return load_file(safetensors_path)
    bin_path = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(bin_path):
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    if any(name.endswith(".index.json") for name in os.listdir(directory)):
        raise ConversionError(f"{directory} holds a sharded checkpoint: not supported (one model.safetensors or "
                              "pytorch_model.bin)")
    raise ConversionError(f"{directory} has no model.safetensors or pytorch_model.bin")


def state_dict(hf_weights: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """fastformer's state dict of a transformers Marian or M2M-100 state dict (float32)."""
    w = {k.removeprefix("model."): v.float() for k, v in hf_weights.items()}

    def take(name: str) -> torch.Tensor:
        if name not in w:
            raise ConversionError(f"the weights lack {name}")
        return w[name]

    if config.src_vocab_size is None:  # one embedding: model.shared (or a copy of it in each stack)
        names = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    else:  # separate vocabularies: the decoder's (tied to lm_head) and the encoder's own
        names = ("decoder.embed_tokens.weight",)
    embed = next((w[k] for k in names if k in w), None)
    if embed is None:
        raise ConversionError(f"the weights lack model.{names[0]} (the {'target ' if len(names) == 1 else ''}"
                              "embedding)")
    lm_head = hf_weights.get("lm_head.weight")
    if lm_head is not None and not torch.equal(lm_head.float(), embed):
        raise ConversionError("lm_head.weight differs from the target embedding: untied output weights are not "
                              "supported")
    out = {"embed.weight": embed}
    if config.src_vocab_size is not None:
        out["src_embed.weight"] = take("encoder.embed_tokens.weight")
    if config.output_bias:
        out["output_bias"] = take("final_logits_bias").reshape(-1) if "final_logits_bias" in w else \
            torch.zeros(config.vocab_size)

    def linear(dst: str, *srcs: str) -> None:
        out[dst + ".weight"] = torch.cat([take(s + ".weight") for s in srcs])
        out[dst + ".bias"] = torch.cat([take(s + ".bias") for s in srcs])

    def norm(dst: str, src: str) -> None:
        out[dst + ".weight"], out[dst + ".bias"] = take(src + ".weight"), take(src + ".bias")

    for side, n in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        for i in range(n):
            s, d = f"{side}.layers.{i}.", f"{side}.layers.{i}."
            linear(d + "self_attn.qkv_proj", s + "self_attn.q_proj", s + "self_attn.k_proj", s + "self_attn.v_proj")
            linear(d + "self_attn.out_proj", s + "self_attn.out_proj")
            norm(d + "self_attn_norm", s + "self_attn_layer_norm")
            if side == "decoder":
                linear(d + "cross_attn.q_proj", s + "encoder_attn.q_proj")
                linear(d + "cross_attn.kv_proj", s + "encoder_attn.k_proj", s + "encoder_attn.v_proj")
                linear(d + "cross_attn.out_proj", s + "encoder_attn.out_proj")
                norm(d + "cross_attn_norm", s + "encoder_attn_layer_norm")
            linear(d + "ffn.fc1", s + "fc1")
            linear(d + "ffn.fc2", s + "fc2")
            norm(d + "ffn_norm", s + "final_layer_norm")
        if config.norm_first:
            norm(f"{side}.final_norm", f"{side}.layer_norm")
    return out


def _languages(directory: str) -> dict[str, int]:
    """Language code -> id, from the added tokens of tokenizer_config.json (or tokenizer.json)."""
    added: dict[int, str] = {}
    config = _read_json(directory, "tokenizer_config.json", required=False) or {}
    for index, entry in (config.get("added_tokens_decoder") or {}).items():
        added[int(index)] = entry["content"] if isinstance(entry, dict) else str(entry)
    fast = _read_json(directory, "tokenizer.json", required=False) or {}
    for entry in fast.get("added_tokens") or []:
        added.setdefault(int(entry["id"]), entry["content"])
    languages = {}
    for index, content in added.items():
        if (m := _M2M_LANGUAGE.match(content)) is not None:
            languages[m.group(1)] = index
        elif _NLLB_LANGUAGE.match(content):
            languages[content] = index
    return languages


def load_tokenizer(directory: str, config: TransformerConfig, family: str) -> VocabTokenizer:
    """The tokenizer of a Marian, M2M-100 or NLLB folder (see the module docstring)."""
    tokenizer_config = _read_json(directory, "tokenizer_config.json", required=False) or {}
    specials = [config.pad_id, config.eos_id, config.bos_id, config.start_id]
    source_encoder = None  # the source's own vocabulary (Marian's separate_vocabs), else the one of both
    if family == "marian":
        separate = bool(tokenizer_config.get("separate_vocabs"))
        if separate != (config.src_vocab_size is not None):
            raise ConversionError(f"tokenizer_config.json's separate_vocabs is {separate}, config.json's "
                                  f"share_encoder_decoder_embeddings is {config.src_vocab_size is None}: they disagree")
        source, target = _read_bytes(directory, "source.spm"), _read_bytes(directory, "target.spm")
        encoder = _read_json(directory, "vocab.json")
        if separate:  # vocab.json: the source's; target_vocab.json: the target's
            source_encoder, encoder = encoder, _read_json(directory, "target_vocab.json")
        languages: dict[str, int] = {}
    else:
        source = target = _read_bytes(directory, "sentencepiece.bpe.model")
        encoder = _read_json(directory, "vocab.json", required=False)
        languages = _languages(directory)
        if encoder is not None and not languages:  # M2M-100: the codes follow vocab.json's ids
            listed = tokenizer_config.get("language_codes", "m2m100")
            if listed not in M2M100_LANGUAGE_CODES:
                raise ConversionError(f"tokenizer_config.json's language_codes {listed!r} is not known "
                                      f"(known: {', '.join(M2M100_LANGUAGE_CODES)})")
            languages = {code: len(encoder) + i for i, code in enumerate(M2M100_LANGUAGE_CODES[listed])}
        if encoder is None:  # NLLB: sentencepiece ids + 1, with <s> <pad> </s> <unk> at 0 .. 3 (fairseq's order)
            import sentencepiece

            sp = sentencepiece.SentencePieceProcessor(model_proto=source)
            encoder = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
            for i in range(3, sp.get_piece_size()):
                encoder.setdefault(sp.id_to_piece(i), i + 1)
    def pieces(encoder: dict[str, int], size: int) -> list[str]:
        vocab = ["<unused>"] * size  # ids no file names (a model's padding rows)
        for piece, index in encoder.items():
            if 0 <= index < size:
                vocab[index] = piece
        return vocab

    vocab = pieces(encoder, config.vocab_size)
    source_vocab = None if source_encoder is None else pieces(source_encoder, config.source_vocab_size)
    for code, index in languages.items():  # M2M-100's __de__, NLLB's deu_Latn
        if 0 <= index < config.vocab_size:
            vocab[index] = f"__{code}__" if "_" not in code else code
    source_lang = tokenizer_config.get("src_lang") if languages else None
    if source_lang is not None and source_lang not in languages:
        source_lang = None
    try:
        return VocabTokenizer(source, target, vocab, (source_encoder or encoder).get("<unk>", config.unk_id),
                              specials, languages, source_lang, source_vocab=source_vocab)
    except (RuntimeError, OSError) as exc:
        raise ConversionError(f"{directory}: the tokenizer's sentencepiece model does not load ({exc})") from exc


def from_transformers(directory: str, backend: str | None = None, device: str = "cpu",
                      tokenizer: bool = True):
    """``(model, tokenizer)`` of a local MarianMT or M2M-100/NLLB folder: a ``fastformer.nn.Transformer`` in
    eval mode (float32, on ``device``) and its tokenizer (None with ``tokenizer=False``, for a folder of
    weights only). Offline: reads config.json, the weights and the tokenizer files."""
    if not os.path.isdir(directory):
        raise ConversionError(f"{directory} is not a folder (a transformers model folder holds config.json)")
    hf = _read_json(directory, "config.json")
    config = model_config(hf)
    model = Transformer(config, backend=backend)
    weights = state_dict(_load_weights(directory), config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ConversionError(f"the converted weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    tok = load_tokenizer(directory, config, hf["model_type"]) if tokenizer else None
    return model.to(device).eval(), tok
