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
language codes from tokenizer_config.json's added tokens. Which of M2M-100 and NLLB a folder holds is
tokenizer_config.json's tokenizer_class (``_m2m100_or_nllb``): the two give the same pieces other ids.

What does not map is refused with ``ConversionError`` naming the field: another model_type, untied output
weights, encoder and decoder of different widths or heads, other activations, a tokenizer whose
separate_vocabs disagrees with the model's share_encoder_decoder_embeddings. So is what cannot be read
correctly, naming the file and the field or tensor: a config.json that is not JSON or whose field is
missing or of the wrong type, weights that do not load (truncated), hold NaN or inf, or disagree with the
config in shape or layer count, a missing tokenizer file that decides the ids (an M2M-100 folder without
vocab.json). Layer drop (M2M-100's
encoder_layerdrop and decoder_layerdrop) is a training-time option fastformer does not have: inference is
unaffected.
"""
from __future__ import annotations

import json
import os
import re

import torch

from fastformer.checkpoint import nonfinite
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


# The piece of an id that no tokenizer file names (a model's padding rows, NLLB's <mask>): fastformer decodes it
# to this text; the transformers export (fastformer/hf_export.py) writes no piece for it.
UNUSED = "<unused>"


def nllb_vocabulary(sp) -> dict[str, int]:
    """NLLB's ids of a sentencepiece model's pieces (transformers' NllbTokenizer, fairseq's dictionary):
    <s> <pad> </s> <unk> at 0 .. 3, then each piece of sentencepiece id i >= 3 at i + 1."""
    encoder = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(3, sp.get_piece_size()):
        encoder.setdefault(sp.id_to_piece(i), i + 1)
    return encoder


class ConversionError(ValueError):
    """A transformers model folder fastformer cannot read or map; the message names the file or field."""


def _read_json(directory: str, name: str, required: bool = True) -> dict | None:
    """The JSON object in ``directory/name`` (every file read here holds one), or None if it is absent and
    not ``required``; a file that is not a JSON object is refused, naming it."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        if required:
            raise ConversionError(f"{directory} has no {name}")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConversionError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


_REQUIRED = object()


def _field(hf: dict, name: str, kind: type, default=_REQUIRED, minimum: int | None = None):
    """config.json's ``name`` as a ``kind`` (int, float, bool or str; an int is a float, a bool is no int),
    at least ``minimum``; ``default`` where it is absent or null (else it is required)."""
    value = hf.get(name)
    if value is None:
        if default is _REQUIRED:
            raise ConversionError(f"{name} is {'null' if name in hf else 'missing'}")
        return default
    fits = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, fits = float(value), True
    if not fits:
        expected = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[kind]
        raise ConversionError(f"{name} is {value!r} ({type(value).__name__}): expected {expected}")
    if minimum is not None and value < minimum:
        raise ConversionError(f"{name} is {value}: expected at least {minimum}")
    return value


def _read_bytes(directory: str, name: str) -> bytes:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise ConversionError(f"{directory} has no {name} (the tokenizer's sentencepiece model)")
    with open(path, "rb") as f:
        return f.read()


def model_config(hf: dict) -> TransformerConfig:
    """The TransformerConfig of a transformers config.json dict (Marian or M2M-100/NLLB), or ConversionError
    naming the field: one that is missing, of the wrong type or out of range, or one that does not map."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ConversionError(f"model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})")

    def same(encoder_field: str, decoder_field: str) -> int:
        encoder, decoder = _field(hf, encoder_field, int, minimum=1), _field(hf, decoder_field, int, minimum=1)
        if encoder != decoder:
            raise ConversionError(f"{encoder_field} {encoder} differs from {decoder_field} {decoder}: "
                                  "fastformer's encoder and decoder share these sizes")
        return encoder

    activation = _field(hf, "activation_function", str, "relu")
    if activation not in _ACTIVATIONS:
        raise ConversionError(f"activation_function {activation!r} is not supported "
                              f"(supported: {', '.join(_ACTIVATIONS)})")
    if not _field(hf, "tie_word_embeddings", bool, True):
        raise ConversionError("tie_word_embeddings is false: fastformer's output projection is the shared embedding")
    vocab, src_vocab = _field(hf, "vocab_size", int, minimum=1), None
    if family == "marian":
        target_vocab = _field(hf, "decoder_vocab_size", int, vocab, minimum=1)
        if not _field(hf, "share_encoder_decoder_embeddings", bool, True):
            vocab, src_vocab = target_vocab, vocab  # separate vocabularies: the source's is vocab_size
        elif target_vocab != vocab:
            raise ConversionError(f"decoder_vocab_size {target_vocab} differs from vocab_size {vocab} while "
                                  "share_encoder_decoder_embeddings is true")
    if isinstance(hf.get("eos_token_id"), list):
        raise ConversionError(f"eos_token_id {hf['eos_token_id']}: one end-of-sentence token is supported")
    pad, eos = _field(hf, "pad_token_id", int, minimum=0), _field(hf, "eos_token_id", int, minimum=0)
    start = _field(hf, "decoder_start_token_id", int, pad if family == "marian" else _REQUIRED, minimum=0)
    # bos: a token the search never produces. Marian has none: its start token, pad (never produced either).
    bos = _field(hf, "bos_token_id", int, None, minimum=0)
    bos = start if bos is None or bos == eos else bos
    # unk: rarely in config.json: the families' own (vocab.json's, for the tokenizer)
    unk = _field(hf, "unk_token_id", int, 1 if family == "marian" else 3, minimum=0)
    d_model = _field(hf, "d_model", int, minimum=1)
    n_heads = same("encoder_attention_heads", "decoder_attention_heads")
    d_ff = same("encoder_ffn_dim", "decoder_ffn_dim")
    sizes = dict(n_encoder_layers=_field(hf, "encoder_layers", int, minimum=1),
                 n_decoder_layers=_field(hf, "decoder_layers", int, minimum=1),
                 max_positions=_field(hf, "max_position_embeddings", int, 1024, minimum=1))
    rates = {name: _field(hf, field, float, default)
             for name, field, default in (("dropout", "dropout", 0.1), ("attention_dropout", "attention_dropout", 0.0),
                                          ("activation_dropout", "activation_dropout", 0.0))}
    scale_embedding = _field(hf, "scale_embedding", bool, False)
    try:  # TransformerConfig's own checks (ids inside the vocabulary, heads dividing d_model, rates in [0, 1))
        return TransformerConfig(
            vocab_size=vocab, d_model=d_model, n_heads=n_heads, d_ff=d_ff, **sizes, **rates,
            activation=_ACTIVATIONS[activation], norm_first=family == "m2m_100", layer_norm_eps=1e-5, pad_id=pad,
            unk_id=unk, bos_id=bos, eos_id=eos, scale_embedding=scale_embedding, output_bias=family == "marian",
            positions="marian" if family == "marian" else "fairseq",
            position_offset=0 if family == "marian" else pad + 1, decoder_start_id=start, src_vocab_size=src_vocab)
    except ValueError as exc:
        raise ConversionError(f"its fields do not make a fastformer model: {exc}") from exc


def _load_weights(directory: str) -> tuple[str, dict[str, torch.Tensor]]:
    """The weights file of ``directory`` and its tensors by name. A file that does not load (truncated,
    corrupt, not a state dict) is refused naming it, as are non-finite values (naming the tensor)."""
    path = os.path.join(directory, "model.safetensors")
    if os.path.isfile(path):
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise ConversionError(f"reading {path} needs the safetensors package: "
                                  "pip install 'fastformer[hf]'") from exc
        load = load_file
    elif os.path.isfile(path := os.path.join(directory, "pytorch_model.bin")):
        def load(p):
            return torch.load(p, map_location="cpu", weights_only=True)
    else:
        load = None
    if load is not None:
        try:
            weights = load(path)
        except Exception as exc:  # SafetensorError, a zip or unpickling error, EOFError, ...: say which and why
            reason = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else ""
            raise ConversionError(f"{path} does not load (truncated or corrupt: {type(exc).__name__}: "
                                  f"{reason[:160]})") from exc
        if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                    for k, v in weights.items()):
            raise ConversionError(f"{path} holds a {type(weights).__name__}, not a state dict of tensors by name")
        bad = nonfinite(weights)
        if bad is not None:
            raise ConversionError(f"{path}: {bad}: the model cannot be converted (a corrupt or diverged model)")
        return path, weights
    if any(name.endswith(".index.json") for name in os.listdir(directory)):
        raise ConversionError(f"{directory} holds a sharded checkpoint: not supported (one model.safetensors or "
                              "pytorch_model.bin)")
    raise ConversionError(f"{directory} has no model.safetensors or pytorch_model.bin")


def state_dict(hf_weights: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """fastformer's state dict of a transformers Marian or M2M-100 state dict (float32). Every tensor read
    must have the shape the config gives it (d = d_model, f = the ffn dim, V = the vocabulary): embeddings
    (V, d), q/k/v/out projections (d, d) and (d,), fc1 (f, d) and (f,), fc2 (d, f) and (d,), LayerNorms (d,),
    final_logits_bias V values; a tensor of another shape, a missing one, or layers beyond the config's
    counts are refused, naming the tensor (and both shapes)."""
    names = {k.removeprefix("model."): k for k in hf_weights}  # the weights' own names, for the messages
    d, f, V = config.d_model, config.d_ff, config.vocab_size

    def hf_name(name: str) -> str:
        return names.get(name, name if name == "final_logits_bias" else "model." + name)

    def checked(name: str, shape: tuple[int, ...], what: str = "") -> torch.Tensor:
        tensor = hf_weights[hf_name(name)]
        if tuple(tensor.shape) != shape:
            raise ConversionError(f"{hf_name(name)}{what} has shape {tuple(tensor.shape)}; config.json makes it "
                                  f"{shape} (d_model {d}, ffn_dim {f}, vocabulary {V})")
        return tensor.float()

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in names:
            raise ConversionError(f"the weights lack {hf_name(name)}")
        return checked(name, shape)

    if config.src_vocab_size is None:  # one embedding: model.shared (or a copy of it in each stack)
        candidates = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    else:  # separate vocabularies: the decoder's (tied to lm_head) and the encoder's own
        candidates = ("decoder.embed_tokens.weight",)
    embed_name = next((k for k in candidates if k in names), None)
    if embed_name is None:
        raise ConversionError(f"the weights lack model.{candidates[0]} (the "
                              f"{'target ' if len(candidates) == 1 else ''}embedding)")
    embed = checked(embed_name, (V, d), " (the embedding)")
    lm_head = hf_weights.get("lm_head.weight")
    if lm_head is not None and (lm_head.shape != embed.shape or not torch.equal(lm_head.float(), embed)):
        raise ConversionError("lm_head.weight differs from the target embedding: untied output weights are not "
                              "supported")
    out = {"embed.weight": embed}
    if config.src_vocab_size is not None:
        out["src_embed.weight"] = take("encoder.embed_tokens.weight", (config.src_vocab_size, d))
    if config.output_bias:
        bias = torch.zeros(V)
        if "final_logits_bias" in names:
            bias = hf_weights[hf_name("final_logits_bias")]
            if bias.numel() != V:
                raise ConversionError(f"{hf_name('final_logits_bias')} has shape {tuple(bias.shape)}; config.json "
                                      f"makes it (1, {V}) (vocabulary {V})")
        out["output_bias"] = bias.reshape(-1).float()

    def linear(dst: str, shape: tuple[int, int], *srcs: str) -> None:
        out[dst + ".weight"] = torch.cat([take(s + ".weight", shape) for s in srcs])
        out[dst + ".bias"] = torch.cat([take(s + ".bias", shape[:1]) for s in srcs])

    def norm(dst: str, src: str) -> None:
        out[dst + ".weight"], out[dst + ".bias"] = take(src + ".weight", (d,)), take(src + ".bias", (d,))

    for side, n in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        beyond = sorted(k for k in names if k.startswith(f"{side}.layers.") and k.split(".")[2].isdigit()
                        and int(k.split(".")[2]) >= n)
        if beyond:
            raise ConversionError(f"{hf_name(beyond[0])} is beyond config.json's {side}_layers {n}: the weights "
                                  "hold more layers than the config")
        for i in range(n):
            s = dst = f"{side}.layers.{i}."  # the layer's prefix in both state dicts
            linear(dst + "self_attn.qkv_proj", (d, d), s + "self_attn.q_proj", s + "self_attn.k_proj",
                   s + "self_attn.v_proj")
            linear(dst + "self_attn.out_proj", (d, d), s + "self_attn.out_proj")
            norm(dst + "self_attn_norm", s + "self_attn_layer_norm")
            if side == "decoder":
                linear(dst + "cross_attn.q_proj", (d, d), s + "encoder_attn.q_proj")
                linear(dst + "cross_attn.kv_proj", (d, d), s + "encoder_attn.k_proj", s + "encoder_attn.v_proj")
                linear(dst + "cross_attn.out_proj", (d, d), s + "encoder_attn.out_proj")
                norm(dst + "cross_attn_norm", s + "encoder_attn_layer_norm")
            linear(dst + "ffn.fc1", (f, d), s + "fc1")
            linear(dst + "ffn.fc2", (d, f), s + "fc2")
            norm(dst + "ffn_norm", s + "final_layer_norm")
        if config.norm_first:
            norm(f"{side}.final_norm", f"{side}.layer_norm")
    return out


def _languages(directory: str) -> dict[str, int]:
    """Language code -> id, from the added tokens of tokenizer_config.json (or tokenizer.json)."""
    added: dict[int, str] = {}
    config = _read_json(directory, "tokenizer_config.json", required=False) or {}
    try:
        for index, entry in (config.get("added_tokens_decoder") or {}).items():
            added[int(index)] = entry["content"] if isinstance(entry, dict) else str(entry)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ConversionError(f"{os.path.join(directory, 'tokenizer_config.json')}: added_tokens_decoder is not "
                              f"a map of ids to tokens ({type(exc).__name__}: {exc})") from exc
    fast = _read_json(directory, "tokenizer.json", required=False) or {}
    try:
        for entry in fast.get("added_tokens") or []:
            added.setdefault(int(entry["id"]), entry["content"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConversionError(f"{os.path.join(directory, 'tokenizer.json')}: added_tokens is not a list of "
                              f"{{id, content}} ({type(exc).__name__}: {exc})") from exc
    languages = {}
    for index, content in added.items():
        if (m := _M2M_LANGUAGE.match(content)) is not None:
            languages[m.group(1)] = index
        elif _NLLB_LANGUAGE.match(content):
            languages[content] = index
    return languages


def _m2m100_or_nllb(directory: str, tokenizer_config: dict, encoder: dict | None, languages: dict) -> str:
    """Which tokenizer a model_type m2m_100 folder holds, "m2m100" or "nllb": they map the same
    sentencepiece.bpe.model to different ids (M2M-100 through vocab.json, whose order is not sentencepiece's;
    NLLB by sentencepiece id + 1, its language codes from the added tokens), so the folder must say which
    (tokenizer_config.json's tokenizer_class, else its files) and hold that one's files; else ConversionError
    naming the file that is missing."""
    named = tokenizer_config.get("tokenizer_class")
    if isinstance(named, str) and named.startswith("M2M100"):
        kind = "m2m100"
    elif isinstance(named, str) and named.startswith("Nllb"):
        kind = "nllb"
    elif named is not None:
        raise ConversionError(f"{os.path.join(directory, 'tokenizer_config.json')}'s tokenizer_class {named!r} is "
                              "neither M2M100Tokenizer nor NllbTokenizer (model_type m2m_100)")
    elif encoder is not None:  # only M2M100Tokenizer reads a vocab.json
        kind = "m2m100"
    elif languages and all("_" in code for code in languages):  # NLLB's codes: deu_Latn
        kind = "nllb"
    else:
        raise ConversionError(f"{directory} has no vocab.json and no tokenizer_config.json naming its "
                              "tokenizer_class: an M2M-100 folder's ids are vocab.json's, an NLLB folder says "
                              "NllbTokenizer; the ids cannot be known")
    if kind == "m2m100" and encoder is None:
        raise ConversionError(f"{directory} has no vocab.json: its tokenizer is M2M-100's, whose ids are "
                              "vocab.json's (sentencepiece.bpe.model's own order gives other ids)")
    if kind == "nllb" and not languages:
        raise ConversionError(f"{directory}: its NLLB tokenizer's language codes are in neither tokenizer.json's "
                              "added_tokens nor tokenizer_config.json's added_tokens_decoder: their ids cannot "
                              "be known")
    return kind


def load_tokenizer(directory: str, config: TransformerConfig, family: str) -> VocabTokenizer:
    """The tokenizer of a Marian, M2M-100 or NLLB folder (see the module docstring)."""
    tokenizer_config = _read_json(directory, "tokenizer_config.json", required=False) or {}
    specials = [config.pad_id, config.eos_id, config.bos_id, config.start_id]
    source_encoder = None  # the source's own vocabulary (Marian's separate_vocabs), else the one of both
    if family == "marian":
        separate = bool(tokenizer_config.get("separate_vocabs"))
        if separate != (config.src_vocab_size is not None):
            raise ConversionError(f"{os.path.join(directory, 'tokenizer_config.json')}'s separate_vocabs is "
                                  f"{separate}, config.json's share_encoder_decoder_embeddings is "
                                  f"{config.src_vocab_size is None}: they disagree")
        source, target = _read_bytes(directory, "source.spm"), _read_bytes(directory, "target.spm")
        encoder = _read_json(directory, "vocab.json")
        if separate:  # vocab.json: the source's; target_vocab.json: the target's
            source_encoder, encoder = encoder, _read_json(directory, "target_vocab.json")
        languages: dict[str, int] = {}
    else:
        source = target = _read_bytes(directory, "sentencepiece.bpe.model")
        encoder = _read_json(directory, "vocab.json", required=False)
        languages = _languages(directory)
        if _m2m100_or_nllb(directory, tokenizer_config, encoder, languages) == "m2m100":
            if not languages:  # the codes follow vocab.json's ids
                listed = tokenizer_config.get("language_codes", "m2m100")
                if listed not in M2M100_LANGUAGE_CODES:
                    raise ConversionError(f"{os.path.join(directory, 'tokenizer_config.json')}'s language_codes "
                                          f"{listed!r} is not known (known: {', '.join(M2M100_LANGUAGE_CODES)})")
                languages = {code: len(encoder) + i for i, code in enumerate(M2M100_LANGUAGE_CODES[listed])}
        else:
            import sentencepiece

            try:
                sp = sentencepiece.SentencePieceProcessor(model_proto=source)
            except (RuntimeError, OSError) as exc:
                raise ConversionError(f"{os.path.join(directory, 'sentencepiece.bpe.model')} does not load "
                                      f"({exc})") from exc
            encoder = nllb_vocabulary(sp)

    def pieces(encoder: dict[str, int], size: int, name: str) -> list[str]:
        vocab = [UNUSED] * size  # ids no file names (a model's padding rows)
        for piece, index in encoder.items():
            if not isinstance(index, int) or isinstance(index, bool):
                raise ConversionError(f"{os.path.join(directory, name)}: piece {piece!r} has the id {index!r}, "
                                      "not an integer")
            if 0 <= index < size:
                vocab[index] = piece
        return vocab

    target_file = "target_vocab.json" if source_encoder is not None else "vocab.json"
    vocab = pieces(encoder, config.vocab_size, target_file)
    source_vocab = None if source_encoder is None else pieces(source_encoder, config.source_vocab_size, "vocab.json")
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
    weights only). Offline: reads config.json, the weights and the tokenizer files.

    What it cannot read correctly raises ``ConversionError`` naming the file and the field or tensor: a
    config.json that is not JSON or whose field is missing, of the wrong type or does not map; weights that
    do not load (truncated, corrupt), hold NaN or inf, or disagree with the config (a tensor of another
    shape, missing, or layers beyond its counts); a missing tokenizer file that decides the ids (Marian's
    source.spm, target.spm, vocab.json; M2M-100's vocab.json; NLLB's language codes)."""
    if not os.path.isdir(directory):
        raise ConversionError(f"{directory} is not a folder (a transformers model folder holds config.json)")
    hf = _read_json(directory, "config.json")
    try:
        config = model_config(hf)
    except ConversionError as exc:
        raise ConversionError(f"{os.path.join(directory, 'config.json')}: {exc}") from exc
    model = Transformer(config, backend=backend)
    path, hf_weights = _load_weights(directory)
    try:
        weights = state_dict(hf_weights, config)
    except ConversionError as exc:
        raise ConversionError(f"{path}: {exc}") from exc
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ConversionError(f"{path}: the converted weights do not fit: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    tok = load_tokenizer(directory, config, hf["model_type"]) if tokenizer else None
    return model.to(device).eval(), tok
