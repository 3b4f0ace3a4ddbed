"""A joint sentencepiece BPE vocabulary over source and target text.

Ids: pad 0, unk 1, bos 2, eos 3 (TransformerConfig's defaults). The model file is kept beside the
run (``spm.model``) and its bytes are stored inside every checkpoint, so a checkpoint alone translates.
"""
from __future__ import annotations

import io
import os

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


def _sentencepiece():
    try:
        import sentencepiece
    except ImportError as exc:
        raise RuntimeError("the tokenizer needs sentencepiece: pip install sentencepiece") from exc
    return sentencepiece


class Tokenizer:
    def __init__(self, model_proto: bytes):
        spm = _sentencepiece()
        self.model_proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        if (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()) != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ValueError("the sentencepiece model must use pad 0, unk 1, bos 2, eos 3")

    @classmethod
    def train(cls, sentences: list[str], vocab_size: int, path: str | None = None,
              max_sentences: int = 200_000) -> "Tokenizer":
        """Trains a BPE model on ``sentences`` (source and target together) and writes it to ``path``."""
        spm = _sentencepiece()
        proto = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=proto, model_type="bpe", vocab_size=vocab_size,
            character_coverage=1.0, pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            input_sentence_size=max_sentences, shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1, minloglevel=2)
        tokenizer = cls(proto.getvalue())
        if path is not None:
            tokenizer.save(path)
        return tokenizer

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        with open(path, "rb") as f:
            return cls(f.read())

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(self.model_proto)
        os.replace(tmp, path)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def encode_target(self, texts: list[str]) -> list[list[int]]:
        """Target text as training's labels take it: the same ids as ``encode`` (one joint model)."""
        return self.encode(texts)

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.sp.decode(ids)

    def pieces(self) -> list[str]:
        """The pieces of ids 0 .. V - 1."""
        return [self.sp.id_to_piece(i) for i in range(self.vocab_size)]

    def source_pieces(self) -> list[str]:
        """The source's pieces: the same (one joint vocabulary)."""
        return self.pieces()


class VocabTokenizer:
    """The tokenizer of a model converted from transformers (fastformer/hf_convert.py): sentencepiece pieces
    looked up in the model's own vocabulary, as transformers' Marian, M2M-100 and NLLB tokenizers do.

    - ``encode``: the source model's pieces of each text, each piece's id in ``source_vocab`` (the source's own
      vocabulary, Marian's separate_vocabs; by default ``vocab``; unk where it has none),
      after the source-language token (``source_lang``, M2M-100 and NLLB; Marian's multilingual models take
      a ``>>xx<<`` code at the start of the text, as their tokenizer does). No eos: ``collate`` appends it.
    - ``encode_target``: target text as transformers' tokenizers make the labels of fine-tuning (``text_target``):
      the target sentencepiece model's pieces, each piece's id in ``vocab`` (the target's vocabulary), after the
      target-language token (``target_lang``, M2M-100 and NLLB: the decoder learns to follow its start token
      with it). No eos: ``collate`` appends it.
    - ``decode``: the pieces of the ids (special tokens and language codes dropped), joined by the target
      sentencepiece model.
    ``target_lang`` (None for a converted model; the language a model was fine-tuned into, ``--init``) is also
    the language ``fastformer.translation.translate`` forces by default.
    Not done (as transformers does when sacremoses is installed): Moses punctuation normalization of Marian's
    source text.
    """

    def __init__(self, source_spm: bytes, target_spm: bytes, vocab: list[str], unk_id: int, specials: list[int],
                 languages: dict[str, int] | None = None, source_lang: str | None = None,
                 source_vocab: list[str] | None = None, target_lang: str | None = None):
        spm = _sentencepiece()
        self.source_spm, self.target_spm = source_spm, target_spm
        self.source = spm.SentencePieceProcessor(model_proto=source_spm)
        self.target = self.source if target_spm == source_spm else spm.SentencePieceProcessor(model_proto=target_spm)
        self.vocab, self.unk_id = list(vocab), unk_id
        self.source_vocab = None if source_vocab is None else list(source_vocab)
        self.index = {piece: i for i, piece in enumerate(self.vocab if source_vocab is None else source_vocab)}
        self.target_index = self.index if source_vocab is None else {piece: i for i, piece in enumerate(self.vocab)}
        self.languages = dict(languages or {})
        self.specials = set(specials) | set(self.languages.values())
        self.source_lang = self.target_lang = None
        self.set_source_lang(source_lang)
        self.set_target_lang(target_lang)

    def set_source_lang(self, lang: str | None) -> None:
        """The source-language token put before every encoded text (M2M-100, NLLB); None: none."""
        if lang is not None and lang not in self.languages:
            raise ValueError(f"unknown source language {lang!r}; this model knows {self.language_list()}")
        self.source_lang = lang

    def set_target_lang(self, lang: str | None) -> None:
        """The target-language token put before every encoded target text and forced first in translations
        (M2M-100, NLLB); None: none."""
        if lang is not None:
            self.language_id(lang)  # refuses an unknown code
        self.target_lang = lang

    def language_id(self, lang: str) -> int:
        """The id of a language code (NLLB's ``deu_Latn``, M2M-100's ``de``), for ``--target-lang``."""
        if lang not in self.languages:
            raise ValueError(f"unknown target language {lang!r}; this model knows {self.language_list()}")
        return self.languages[lang]

    def language_list(self) -> str:
        codes = sorted(self.languages)
        return "no language codes" if not codes else ", ".join(codes[:12]) + (" ..." if len(codes) > 12 else "")

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size (the model's config.vocab_size)."""
        return len(self.vocab)

    @property
    def source_vocab_size(self) -> int:
        return len(self.vocab if self.source_vocab is None else self.source_vocab)

    def pieces(self) -> list[str]:
        """The target's pieces by id."""
        return list(self.vocab)

    def source_pieces(self) -> list[str]:
        """The source's pieces by id (the target's where the two share one vocabulary)."""
        return list(self.vocab if self.source_vocab is None else self.source_vocab)

    def encode(self, texts: list[str]) -> list[list[int]]:
        prefix = [] if self.source_lang is None else [self.languages[self.source_lang]]
        out = []
        for text in texts:
            code = []
            if text.startswith(">>") and (end := text.find("<<")) != -1 and text[: end + 2] in self.index:
                code, text = [self.index[text[: end + 2]]], text[end + 2:]  # Marian's target-language code
            pieces = self.source.encode(text, out_type=str)
            out.append(prefix + code + [self.index.get(p, self.unk_id) for p in pieces])
        return out

    def encode_target(self, texts: list[str]) -> list[list[int]]:
        prefix = [] if self.target_lang is None else [self.languages[self.target_lang]]
        unk = self.target_index.get("<unk>", self.unk_id)
        return [prefix + [self.target_index.get(p, unk) for p in self.target.encode(text, out_type=str)]
                for text in texts]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return [self.target.decode_pieces([self.vocab[i] for i in row if i not in self.specials]) for row in ids]

    def to_state(self) -> dict:
        return {"kind": "vocab", "source_spm": _as_tensor(self.source_spm), "target_spm": _as_tensor(self.target_spm),
                "vocab": self.vocab, "unk_id": self.unk_id, "specials": sorted(self.specials - set(self.languages.values())),
                "languages": self.languages, "source_lang": self.source_lang, "source_vocab": self.source_vocab,
                "target_lang": self.target_lang}

    @classmethod
    def from_state(cls, state: dict) -> "VocabTokenizer":
        return cls(_as_bytes(state["source_spm"]), _as_bytes(state["target_spm"]), state["vocab"],
                   state["unk_id"], state["specials"], state["languages"], state["source_lang"],
                   state.get("source_vocab"), state.get("target_lang"))


def _as_tensor(proto: bytes):
    """A sentencepiece model's bytes as a checkpoint holds them: a uint8 tensor (weights_only loads it)."""
    import torch

    return torch.frombuffer(bytearray(proto), dtype=torch.uint8)


def _as_bytes(tensor) -> bytes:
    return bytes(tensor.tolist())


def tokenizer_state(tokenizer):
    """What a checkpoint stores of a tokenizer: a fastformer model's sentencepiece bytes (uint8 tensor), or a
    converted model's ``VocabTokenizer.to_state()`` dict."""
    if isinstance(tokenizer, VocabTokenizer):
        return tokenizer.to_state()
    return _as_tensor(tokenizer.model_proto)


def tokenizer_from_state(state):
    """The tokenizer of ``tokenizer_state``'s output."""
    if isinstance(state, dict):
        if state.get("kind") != "vocab":
            raise ValueError(f"unknown tokenizer kind {state.get('kind')!r}")
        return VocabTokenizer.from_state(state)
    return Tokenizer(_as_bytes(state))
