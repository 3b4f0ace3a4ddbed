"""The int8 checkpoint that tests/nn/test_int8.py holds later code to: written by the int8 format of commit
9aea6a7 (``output_projection.*`` holding the tied embedding's int8 form, ``src_embed.weight`` /
``src_embed.weight_scale``, each projection's ``weight`` / ``weight_scale`` / ``weight_colsum``), and the tokens
``generate`` gave with it then. Run as a script, it writes both, as it did at commit 5f47a02 (whose int8 code
was 9aea6a7's):

    python tests/nn/int8_fixture.py

The model: the tiny Bible model (tests/data/tiny-bible-de-en.pt, 1,785 updates) made into one with both
options a converted model may have, so that the file holds every int8 name: a source embedding of its own
(config.src_vocab_size; the target's table plus noise of 0.1 its scale) and an output bias (config.output_bias;
normal, std 0.3), then ``python -m fastformer.convert --quantize int8``'s ``convert``. Its tokenizer is the
tiny model's sentencepiece model without its normalization table (13 KB instead of 254 KB; the same pieces;
the sources here are ids). tests/data/int8-9aea6a7.pt is about 100 KB; int8-9aea6a7.tokens.json holds the
source batches (ids, the first sentences of tests/data/test.de) and, per batch, beam size and path (the C++
step, use_cache=True, and the full recompute in Python, use_cache=False), the tokens.
"""
import json
import os
import sys
import tempfile

import torch

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]

from fastformer import checkpoint as ckpt  # noqa: E402
from fastformer.data import collate  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
SOURCE = os.path.join(DATA, "tiny-bible-de-en.pt")
CHECKPOINT = os.path.join(DATA, "int8-9aea6a7.pt")
RECORDED = os.path.join(DATA, "int8-9aea6a7.tokens.json")
BATCHES = [(0, 1), (1, 8)]  # (first, end) lines of tests/data/test.de: one sentence, then seven (padded)
CASES = [(beam, use_cache) for beam in (1, 4) for use_cache in (True, False)]


def small_tokenizer_state(proto: bytes) -> torch.Tensor:
    """The sentencepiece model ``proto`` without its normalization table, as a checkpoint stores it."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    model.normalizer_spec.precompiled_charsmap = b""
    model.normalizer_spec.name = "identity"
    return torch.frombuffer(bytearray(model.SerializeToString()), dtype=torch.uint8)


def float_state() -> dict:
    """The tiny model's checkpoint with a source embedding and an output bias of its own."""
    state = ckpt.load(SOURCE)
    config = dict(state["config"], src_vocab_size=state["config"]["vocab_size"], output_bias=True)
    weights = dict(state["model"])
    g = torch.Generator().manual_seed(0)
    embed = weights["embed.weight"]
    src_embed = embed + 0.1 * embed.std() * torch.randn(embed.shape, generator=g)
    src_embed[config["pad_id"]] = 0.0
    weights["src_embed.weight"] = src_embed
    weights["output_bias"] = 0.3 * torch.randn(config["vocab_size"], generator=g)
    return dict(state, config=config, model=weights, tokenizer=small_tokenizer_state(bytes(state["tokenizer"].tolist())))


def source_batches() -> list[torch.Tensor]:
    """BATCHES as int64 (B, S) sources, encoded by the tiny model's tokenizer (eos appended, padded)."""
    _, tokenizer, _ = ckpt.load_model(SOURCE)
    with open(os.path.join(DATA, "test.de"), encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return [collate(tokenizer.encode(lines[a:b])) for a, b in BATCHES]


def main():
    from fastformer.convert import convert

    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "float.pt")
        ckpt.save(float_state(), source)
        convert(source, CHECKPOINT, "int8")
    model, _, _ = ckpt.load_model(CHECKPOINT)
    recorded = []
    for src in source_batches():
        cases = [dict(beam=beam, use_cache=use_cache, tokens=model.generate(src, beam_size=beam, use_cache=use_cache))
                 for beam, use_cache in CASES]
        recorded.append(dict(src=src.tolist(), cases=cases))
    with open(RECORDED, "w") as f:
        json.dump({"recorded_at": "5f47a02 (int8 format of 9aea6a7)", "batches": recorded}, f)
        f.write("\n")


if __name__ == "__main__":
    main()
