"""python -m fastformer.export --transformers CHECKPOINT OUT: a fastformer checkpoint as a transformers folder.

OUT loads offline with ``AutoModelForSeq2SeqLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)``
and computes the checkpoint's function: the same logits (within float32 rounding), and the same tokens under the
search rules both engines share (docs/transformers.md). The family written:

- a converted model (``python -m fastformer.convert`` of a transformers folder: the checkpoint's ``source``) goes
  back to its family: Marian (MarianMTModel and MarianTokenizer), M2M-100 (M2M100ForConditionalGeneration and
  M2M100Tokenizer) or NLLB (the same model, NllbTokenizer; told from M2M-100 by its language codes, deu_Latn
  against de). Its weights are the converted ones, cut back into transformers' tensors (q|k|v and k|v into q, k,
  v), so that converting OUT gives the checkpoint's weights bit for bit (tests/hf/test_export_transformers.py).
- a model trained by fastformer.train (the paper's post-norm Transformer with one joint sentencepiece vocabulary)
  becomes a Marian folder. Marian's position table is the paper's with its columns reordered: the paper puts
  sin(p w_i) in column 2i and cos(p w_i) in column 2i + 1, Marian sin(p w_i) in column i and cos(p w_i) in column
  h + i (h = ceil(d / 2), the same w_i = 10000^(-2i/d)), so Marian's column k is the paper's column order[k] with
  order = [0, 2, 4, ..., 1, 3, 5, ...]. Reordering every residual-stream dimension the same way, x'[k] = x[order[k]],
  changes nothing the model computes: the embeddings' columns are reordered (E'[:, k] = E[:, order[k]], so token
  plus position embedding is x'), a projection that reads the stream gets its input columns reordered
  (W' = W[:, order]: W' x' = W x), one that writes it (the attention's out_proj, fc2) its output rows and bias
  (W' = W[order], b' = b[order]), a LayerNorm its weight and bias (mean and variance do not depend on the order),
  and the output projection, the embedding again, gives E' h' = E h: the same logits. The heads' dimensions are
  untouched. The joint sentencepiece model serves as both of Marian's (source.spm, target.spm), vocab.json maps
  each piece to fastformer's id, and the decoder starts from fastformer's start token (bos) through Marian's own
  ``decoder_start_token_id``: an exact mapping, not Marian's usual pad.

What a family has no field for is refused (``ExportError``, a ValueError naming the option), never written
another way: a quantized model (transformers holds float weights); a LayerNorm epsilon other than 1e-5 (both
families' LayerNorms are PyTorch's default); for Marian, pre-norm (Marian is post-norm), fairseq's positions or a
position offset; for M2M-100 and NLLB, post-norm, positions other than fairseq's at offset pad + 1, an output bias,
or separate vocabularies; a tokenizer whose ids the family's tokenizer cannot give (M2M-100's language codes not at
len(vocab.json) + their index in one of its lists, NLLB's vocabulary not in fairseq's order or its language codes
not right after it, a piece named twice).

The folder is written beside OUT and moved there only once it reads back: ``fastformer.from_transformers`` must
give the exported config and weights bit for bit and the tokenizer's pieces, and transformers' tokenizer the same
piece for every id; anything else stops the export. generation_config.json: the decoder's start token,
``forced_eos_token_id`` (fastformer forces eos at its length limit), ``bad_words_ids`` pad and bos (fastformer's
search never produces them) and ``max_length`` the model's position count; the search itself (beam size, length
penalty) is the caller's. ``label_smoothing``, a training setting, is not part of a transformers config.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

from fastformer import checkpoint as ckpt
from fastformer.data.tokenizer import Tokenizer, VocabTokenizer
from fastformer.hf_convert import M2M100_LANGUAGE_CODES, UNUSED, nllb_vocabulary
from fastformer.nn import Transformer, TransformerConfig
from fastformer.nn.layers import DECODER_LAYER

FAMILIES = ("marian", "m2m100", "nllb")


class ExportError(ValueError):
    """A checkpoint that a transformers family cannot express exactly; the message names the option."""


def _transformers():
    try:
        import safetensors  # noqa: F401  (save_pretrained writes model.safetensors)
        import transformers
    except ImportError as exc:
        raise ExportError("the transformers export needs transformers and safetensors: pip install 'fastformer[hf]'") \
            from exc
    return transformers


# Where each weight of a fastformer layer (fastformer/nn/layers.py DECODER_LAYER by name; the encoder's layer is
# the same without cross-attention) goes in a transformers Marian or M2M-100 layer (both name theirs alike): the
# modules its rows split into, in order. The fused q|k|v and k|v projections are cut into equal row blocks, the
# inverse of fastformer/hf_convert.py's concatenation. A weight of DECODER_LAYER without a place here stops the
# export.
_HF_LAYER = {
    "self_attn_norm": ("self_attn_layer_norm",),
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.out_proj": ("self_attn.out_proj",),
    "cross_attn_norm": ("encoder_attn_layer_norm",),
    "cross_attn.q_proj": ("encoder_attn.q_proj",),
    "cross_attn.kv_proj": ("encoder_attn.k_proj", "encoder_attn.v_proj"),
    "cross_attn.out_proj": ("encoder_attn.out_proj",),
    "ffn_norm": ("final_layer_norm",),
    "ffn.fc1": ("fc1",),
    "ffn.fc2": ("fc2",),
}

# The modules whose weights meet the residual stream, by their last name (the permutation's three cases): those
# that read it (the weight's input columns; the embeddings' columns), those that write it (the weight's output
# rows and the bias) and the LayerNorms (weight and bias).
_READS = ("embed", "src_embed", "qkv_proj", "q_proj", "kv_proj", "fc1")
_WRITES = ("out_proj", "fc2", "self_attn_norm", "cross_attn_norm", "ffn_norm", "final_norm")

# config.activation -> transformers' activation_function (ACT2FN; Marian's opus-mt models call silu swish)
_ACTIVATION = {"relu": "relu", "gelu": "gelu", "silu": "swish"}


def marian_order(d_model: int) -> torch.Tensor:
    """order[k] = the paper table's column that is Marian's column k: [0, 2, 4, ..., 1, 3, 5, ...] (sin columns,
    then cos columns; an odd d has one more sin column, as both tables do)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def permute_residual(state: dict[str, torch.Tensor], d_model: int) -> dict[str, torch.Tensor]:
    """The state dict of the same function with every residual-stream dimension reordered by marian_order
    (x'[k] = x[order[k]]; the module docstring says why nothing else changes). Exact copies: no arithmetic."""
    order = marian_order(d_model)
    out = {}
    for name, tensor in state.items():
        module, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        last = module.rsplit(".", 1)[-1]
        if name == "output_bias":  # over the vocabulary
            out[name] = tensor
        elif last in _READS:  # weight (out, d): its columns; its bias is not on the stream
            out[name] = tensor[:, order].contiguous() if leaf == "weight" else tensor
        elif last in _WRITES:  # weight (d, in) and bias (d,), or a LayerNorm's (d,): rows
            out[name] = tensor[order].contiguous()
        else:
            raise ExportError(f"the permutation has no rule for the weight {name}")
    return out


def family_of(state: dict, config: TransformerConfig, tokenizer) -> str:
    """The family a checkpoint is written as: a converted model's own (``source``; model_type m2m_100 is NLLB
    where its language codes are NLLB's, deu_Latn, and M2M-100 where they are M2M-100's, de), else Marian (a
    model of fastformer.train), or M2M-100/NLLB for fairseq's positions."""
    model_type = (state.get("source") or {}).get("transformers")
    if model_type is None:
        model_type = "m2m_100" if config.positions == "fairseq" else "marian"
    if model_type == "marian":
        return "marian"
    if model_type != "m2m_100":
        raise ExportError(f"the checkpoint was converted from a {model_type!r} model; the export writes marian and "
                          "m2m_100 (M2M-100, NLLB)")
    codes = getattr(tokenizer, "languages", None) or {}
    if codes and all("_" in code for code in codes):
        return "nllb"
    if codes and not any("_" in code for code in codes):
        return "m2m100"
    raise ExportError("an M2M-100 or NLLB model's tokenizer needs its language codes, all M2M-100's (de) or all "
                      f"NLLB's (deu_Latn): this one has {sorted(codes)[:6] or 'none'}")


def check_expressible(config: TransformerConfig, family: str, quantization: str | None) -> None:
    """ExportError naming the first option of ``config`` that ``family`` has no field for."""
    def refuse(reason: str):
        raise ExportError(f"{'Marian' if family == 'marian' else 'M2M-100/NLLB'} cannot express this model: {reason}")

    if quantization is not None:
        raise ExportError(f"the transformers export takes a float model, not an {quantization} one: export the float "
                          "checkpoint (transformers' Marian and M2M-100 hold float weights)")
    if config.layer_norm_eps != 1e-5:
        refuse(f"layer_norm_eps {config.layer_norm_eps}: its LayerNorms use PyTorch's default 1e-5 and have no "
               "field for another")
    if family == "marian":
        if config.norm_first:
            refuse("norm_first (pre-norm): Marian's layers are post-norm")
        if config.positions not in ("paper", "marian"):
            refuse(f"positions {config.positions!r}: Marian's table is [sin | cos] with frequencies 10000^(-2i/d) "
                   "(the paper's, reordered); fairseq's frequencies differ")
        if config.position_offset != 0:
            refuse(f"position_offset {config.position_offset}: Marian reads its table from row 0")
        return
    if not config.norm_first:
        refuse("post-norm: M2M-100's layers are pre-norm with a final LayerNorm")
    if config.positions != "fairseq" or config.position_offset != config.pad_id + 1:
        refuse(f"positions {config.positions!r} at offset {config.position_offset}: M2M-100's table is fairseq's "
               f"read from row pad_id + 1 = {config.pad_id + 1}")
    if config.output_bias:
        refuse("an output bias: M2M-100 has none")
    if config.src_vocab_size is not None:
        refuse("separate source and target vocabularies: M2M-100 has one")


def exported_model(model: Transformer, family: str) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    """The config and state dict (fastformer's names) that the written folder holds, i.e. what
    ``fastformer.from_transformers(OUT)`` gives back: the model's own, except that a model with the paper's
    positions becomes Marian's (permute_residual), and Marian always has an output bias (zeros where the model
    has none) and names its start token."""
    cfg = model.config
    state = {name: tensor.detach().float().cpu() for name, tensor in model.state_dict().items()}
    if family != "marian":
        return cfg, state
    if cfg.positions == "paper":
        state = permute_residual(state, cfg.d_model)
        cfg = cfg.replace(positions="marian")
    if not cfg.output_bias:
        state["output_bias"] = torch.zeros(cfg.vocab_size)
        cfg = cfg.replace(output_bias=True)
    return cfg.replace(decoder_start_id=cfg.start_id), state


def hf_config(transformers, cfg: TransformerConfig, family: str):
    """The transformers config (MarianConfig or M2M100Config) of an exported config."""
    fields = dict(d_model=cfg.d_model, encoder_layers=cfg.n_encoder_layers, decoder_layers=cfg.n_decoder_layers,
                  encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
                  encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, max_position_embeddings=cfg.max_positions,
                  activation_function=_ACTIVATION[cfg.activation], dropout=cfg.dropout,
                  attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
                  scale_embedding=cfg.scale_embedding, pad_token_id=cfg.pad_id, eos_token_id=cfg.eos_id,
                  bos_token_id=cfg.bos_id, unk_token_id=cfg.unk_id, decoder_start_token_id=cfg.start_id,
                  tie_word_embeddings=True)
    if family == "marian":  # vocab_size is the source's; decoder_vocab_size the target's (and the output's)
        return transformers.MarianConfig(vocab_size=cfg.source_vocab_size, decoder_vocab_size=cfg.vocab_size,
                                         share_encoder_decoder_embeddings=cfg.src_vocab_size is None,
                                         forced_eos_token_id=cfg.eos_id, **fields)
    return transformers.M2M100Config(vocab_size=cfg.vocab_size, **fields)


def hf_state_dict(state: dict[str, torch.Tensor], cfg: TransformerConfig, family: str) -> dict[str, torch.Tensor]:
    """transformers' state dict (MarianMTModel's or M2M100ForConditionalGeneration's names) of an exported state
    dict: the inverse of fastformer/hf_convert.py ``state_dict``. Every tensor of ``state`` must find a place."""
    missing = [w.name for w in DECODER_LAYER if w.name not in _HF_LAYER]
    if missing:
        raise ExportError(f"the transformers export has no place for decoder weights {missing}")
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return state[name]

    out = {}
    if cfg.src_vocab_size is None:  # one table: encoder, decoder and output projection (tied)
        out["model.shared.weight"] = take("embed.weight")
    else:  # Marian's separate vocabularies: the decoder's table is tied to the output projection
        out["model.encoder.embed_tokens.weight"] = take("src_embed.weight")
        out["model.decoder.embed_tokens.weight"] = take("embed.weight")
    if family == "marian":
        out["final_logits_bias"] = take("output_bias")[None]  # (1, V)
    for side, n in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(n):
            for name, targets in _HF_LAYER.items():
                if side == "encoder" and name.startswith("cross_attn"):
                    continue
                for leaf in ("weight", "bias"):
                    blocks = take(f"{side}.layers.{i}.{name}.{leaf}").chunk(len(targets))
                    for target, block in zip(targets, blocks):
                        out[f"model.{side}.layers.{i}.{target}.{leaf}"] = block
        if cfg.norm_first:
            for leaf in ("weight", "bias"):
                out[f"model.{side}.layer_norm.{leaf}"] = take(f"{side}.final_norm.{leaf}")
    left = sorted(set(state) - used)
    if left:
        raise ExportError(f"the transformers export has no place for {left[:5]}")
    return out


def _hf_model(transformers, config, family: str, weights: dict[str, torch.Tensor]):
    """The transformers model of ``config`` holding ``weights``: every tensor it has is one of them, or tied to
    one (the shared embedding's other names, the output projection), or its own position table (Marian's is
    computed from the config, not saved; M2M-100's is a buffer)."""
    cls = transformers.MarianMTModel if family == "marian" else transformers.M2M100ForConditionalGeneration
    model = cls(config).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected:
        raise ExportError(f"transformers' {cls.__name__} has no tensors {unexpected[:5]}")
    own = model.state_dict()
    loaded = {own[name].data_ptr() for name in weights}
    untied = [name for name in missing if "embed_positions" not in name and own[name].data_ptr() not in loaded]
    if untied:
        raise ExportError(f"the export gives transformers' {cls.__name__} no weights for {untied[:5]}")
    return model


def _vocabulary_json(pieces: list[str], tokenizer, what: str) -> dict[str, int]:
    """{piece: id} of a vocabulary: every piece once; a converted model's ids that no file named (UNUSED) are left
    out, as they were in its files."""
    out: dict[str, int] = {}
    for index, piece in enumerate(pieces):
        if isinstance(tokenizer, VocabTokenizer) and piece == UNUSED:
            continue
        if piece in out:
            raise ExportError(f"the {what} vocabulary names the piece {piece!r} twice (ids {out[piece]} and {index}): "
                              "a vocab.json maps each piece to one id")
        out[piece] = index
    return out


def _write(folder: str, name: str, data) -> str:
    path = os.path.join(folder, name)
    if isinstance(data, bytes):
        with open(path, "wb") as f:
            f.write(data)
    else:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=2)
    return path


def _spm(tokenizer) -> tuple[bytes, bytes]:
    """The source and target sentencepiece models' bytes (a fastformer tokenizer's one joint model, twice)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.model_proto, tokenizer.model_proto
    return tokenizer.source_spm, tokenizer.target_spm


def write_marian_tokenizer(transformers, tokenizer, cfg: TransformerConfig, folder: str) -> None:
    """MarianTokenizer's files: source.spm and target.spm, vocab.json (the source's, or the joint one) and, with
    separate vocabularies, target_vocab.json; its unk, eos and pad tokens are the pieces of the config's ids."""
    if getattr(tokenizer, "languages", None):
        raise ExportError("Marian's tokenizer has no language codes of its own (its multilingual models name a "
                          ">>xx<< piece in the text): this tokenizer has some")
    source_spm, target_spm = _spm(tokenizer)
    pieces, source_pieces = tokenizer.pieces(), tokenizer.source_pieces()
    separate = cfg.src_vocab_size is not None
    for name, index in (("eos", cfg.eos_id), ("pad", cfg.pad_id)):  # the source ends with eos and pads with pad
        if source_pieces[index] != pieces[index]:
            raise ExportError(f"MarianTokenizer has one {name} token: the source's id {index} is "
                              f"{source_pieces[index]!r}, the target's {pieces[index]!r}")
    unk = source_pieces[tokenizer.unk_id if isinstance(tokenizer, VocabTokenizer) else cfg.unk_id]
    source = _vocabulary_json(source_pieces, tokenizer, "source")
    if unk not in source:
        raise ExportError("MarianTokenizer needs its unk token in vocab.json: this vocabulary names no piece for the "
                          f"unk id {tokenizer.unk_id}")
    files = dict(source_spm=_write(folder, "source.spm", source_spm),
                 target_spm=_write(folder, "target.spm", target_spm), vocab=_write(folder, "vocab.json", source))
    if separate:
        files["target_vocab_file"] = _write(folder, "target_vocab.json", _vocabulary_json(pieces, tokenizer, "target"))
    # bos (<s>, a fastformer model's start token): the tokenizer's bos_token, as it is config.json's bos_token_id
    bos = {} if cfg.bos_id == cfg.pad_id else {"bos_token": pieces[cfg.bos_id]}
    transformers.MarianTokenizer(**files, separate_vocabs=separate, unk_token=unk, eos_token=pieces[cfg.eos_id],
                                 pad_token=pieces[cfg.pad_id], **bos).save_pretrained(folder)


def write_m2m100_tokenizer(transformers, tokenizer: VocabTokenizer, cfg: TransformerConfig, folder: str) -> None:
    """M2M100Tokenizer's files: vocab.json (ids below the first language code) and sentencepiece.bpe.model. Its
    language codes are not in a file: the code of index j in the list named by language_codes is id
    len(vocab.json) + j, so the model's codes must sit there in one of the lists."""
    first = min(tokenizer.languages.values())
    listed = next((name for name, codes in M2M100_LANGUAGE_CODES.items()
                   if all(code in codes and first + codes.index(code) == index
                          for code, index in tokenizer.languages.items())), None)
    if listed is None:
        raise ExportError(f"M2M100Tokenizer puts its language codes at len(vocab.json) + their index in one of its "
                          f"lists ({', '.join(M2M100_LANGUAGE_CODES)}); this model's codes are elsewhere")
    pieces = tokenizer.pieces()[:first]
    if UNUSED in pieces:
        raise ExportError(f"M2M100Tokenizer's vocab.json must name every id below the first language code ({first}); "
                          f"this vocabulary names no piece for id {pieces.index(UNUSED)}")
    _write(folder, "sentencepiece.bpe.model", tokenizer.source_spm)
    vocab = _write(folder, "vocab.json", _vocabulary_json(pieces, tokenizer, "M2M-100"))
    # The codes' tokens as special tokens, which decoding skips as fastformer's does (transformers 5's
    # M2M100Tokenizer no longer makes them special by itself) and which tokenizer_config.json then lists.
    codes = [f"__{code}__" for code in sorted(tokenizer.languages, key=tokenizer.languages.get)]
    transformers.M2M100Tokenizer(vocab, os.path.join(folder, "sentencepiece.bpe.model"), language_codes=listed,
                                 src_lang=tokenizer.source_lang, extra_special_tokens=codes).save_pretrained(folder)


def write_nllb_tokenizer(transformers, tokenizer: VocabTokenizer, cfg: TransformerConfig, folder: str) -> None:
    """NllbTokenizer's files: sentencepiece.bpe.model, and the tokenizer.json and tokenizer_config.json that
    transformers writes after reading it (its ids: fairseq's order of the pieces, then the language codes as added
    tokens in id order, so they must follow the pieces without a gap; no <mask> token, which fastformer's
    tokenizer does not name)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=tokenizer.source_spm)
    pieces = tokenizer.pieces()
    wrong = next(((piece, index) for piece, index in nllb_vocabulary(sp).items()
                  if index >= len(pieces) or pieces[index] != piece), None)
    if wrong is not None:
        raise ExportError(f"NllbTokenizer gives the piece {wrong[0]!r} the id {wrong[1]} (sentencepiece id + 1); "
                          "this vocabulary does not")
    codes = sorted(tokenizer.languages, key=tokenizer.languages.get)
    base = sp.get_piece_size() + 1
    if [tokenizer.languages[code] for code in codes] != list(range(base, base + len(codes))):
        raise ExportError(f"NllbTokenizer puts its language codes right after the pieces (ids {base} on); this "
                          f"model's are at {sorted(tokenizer.languages.values())[:4]} ...")
    _write(folder, "sentencepiece.bpe.model", tokenizer.source_spm)
    _write(folder, "tokenizer_config.json", {"tokenizer_class": "NllbTokenizer", "src_lang": tokenizer.source_lang,
                                             "extra_special_tokens": codes, "mask_token": None})
    try:  # transformers converts the sentencepiece model (with protobuf) into its tokenizers one
        hf = transformers.AutoTokenizer.from_pretrained(folder)
    except (ImportError, ValueError) as exc:  # without protobuf: a ValueError about another format
        raise ExportError("transformers could not read the NLLB sentencepiece model (it needs protobuf: pip install "
                          f"protobuf): {type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}") from exc
    hf.save_pretrained(folder)


_TOKENIZER_WRITERS = {"marian": write_marian_tokenizer, "m2m100": write_m2m100_tokenizer,
                      "nllb": write_nllb_tokenizer}


def _verify(folder: str, transformers, cfg: TransformerConfig, state: dict[str, torch.Tensor], tokenizer) -> None:
    """The written folder read back: fastformer's converter must give ``cfg`` (but label_smoothing) and ``state``
    bit for bit and the tokenizer's pieces and language codes; transformers' tokenizer the same piece for every id
    the vocabulary names. ExportError otherwise."""
    from fastformer.hf_convert import ConversionError, from_transformers

    try:
        model, reread = from_transformers(folder)
    except ConversionError as exc:
        raise ExportError(f"the written folder does not convert back: {exc}") from exc
    if model.config != cfg.replace(label_smoothing=model.config.label_smoothing):
        raise ExportError(f"the written folder converts back to another config: {model.config}, not {cfg}")
    weights = model.state_dict()
    if weights.keys() != state.keys():
        odd = sorted(weights.keys() ^ state.keys())
        raise ExportError(f"the written folder converts back to other tensors: {odd[:5]}")
    differ = [name for name, tensor in weights.items() if not torch.equal(tensor, state[name])]
    if differ:
        raise ExportError(f"the written folder converts back to other weights: {differ[:5]}")
    for what in ("pieces", "source_pieces"):
        if getattr(reread, what)() != getattr(tokenizer, what)():
            raise ExportError(f"the written tokenizer files give other {what.replace('_', ' ')}")
    if (reread.languages, reread.source_lang) != (getattr(tokenizer, "languages", None) or {},
                                                  getattr(tokenizer, "source_lang", None)):
        raise ExportError("the written tokenizer files give other language codes or another source language")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    pieces = tokenizer.pieces()
    named = [i for i, piece in enumerate(pieces) if not (isinstance(tokenizer, VocabTokenizer) and piece == UNUSED)]
    theirs = hf.convert_ids_to_tokens(named)
    wrong = [(i, pieces[i], token) for i, token in zip(named, theirs) if token != pieces[i]]
    if wrong:
        raise ExportError(f"transformers' {type(hf).__name__} reads other pieces: (id, ours, theirs) {wrong[:3]}")


def write_transformers(model: Transformer, tokenizer, family: str, out_dir: str) -> str:
    """Writes ``model`` and ``tokenizer`` as a transformers folder of ``family`` (FAMILIES) into ``out_dir``,
    replacing it: written into a temporary folder beside it and moved into place once it reads back (_verify)."""
    transformers = _transformers()
    if family not in FAMILIES:
        raise ExportError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    check_expressible(model.config, family, model.quantization)
    cfg, state = exported_model(model, family)
    config = hf_config(transformers, cfg, family)
    hf = _hf_model(transformers, config, family, hf_state_dict(state, cfg, family))
    generation = hf.generation_config
    generation.decoder_start_token_id, generation.forced_eos_token_id = cfg.start_id, cfg.eos_id
    generation.bad_words_ids = [[t] for t in sorted({cfg.pad_id, cfg.bos_id})]
    generation.max_length = cfg.max_positions
    out_dir = os.path.abspath(out_dir)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".", dir=os.path.dirname(out_dir))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private; OUT gets a new folder's permissions
    try:
        hf.save_pretrained(tmp)
        _TOKENIZER_WRITERS[family](transformers, tokenizer, cfg, tmp)
        _verify(tmp, transformers, cfg, state, tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    elif os.path.exists(out_dir):
        os.remove(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def export_transformers(checkpoint: str, out_dir: str) -> tuple[str, str]:
    """Writes the transformers folder of ``checkpoint`` (file or run folder) into ``out_dir`` (replacing it);
    returns the folder and the family written. A folder that holds the checkpoint is refused."""
    path = os.path.abspath(ckpt.resolve(checkpoint))
    out = os.path.abspath(out_dir)
    if path == out or path.startswith(out + os.sep):
        raise ExportError(f"{out_dir} holds the checkpoint {checkpoint}: write the export elsewhere")
    state = ckpt.load(path)
    model, tokenizer, _ = ckpt.from_state(state, path)
    family = family_of(state, model.config, tokenizer)
    return write_transformers(model, tokenizer, family, out_dir), family
