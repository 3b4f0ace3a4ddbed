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

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.sp.decode(ids)
