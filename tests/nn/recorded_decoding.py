"""The recorded translations that test_fast_decoding.py holds ``generate`` to: the checkpoint, the
source sentences, the settings, and (run as a script) the recording itself, which writes
tests/data/tiny-bible-de-en.tokens.json with the beam search of commit 0bf9cbd
(model_reference.legacy_beam_search holds that code):

    python tests/nn/recorded_decoding.py
"""
import json
import os
import sys

import torch

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]

from fastformer import checkpoint as ckpt  # noqa: E402
from fastformer.data import collate  # noqa: E402
from model_reference import legacy_beam_search  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
CHECKPOINT = os.path.join(DATA, "tiny-bible-de-en.pt")  # the tiny config after 1,785 updates on bible-de-en
RECORDED = os.path.join(DATA, "tiny-bible-de-en.tokens.json")
SETTINGS = dict(length_penalty=0.6, max_len_a=1.2, max_len_b=10)  # translate's defaults


def source_ids(tokenizer, batch):
    """The first ``batch`` sentences of tests/data/test.de as ids (no eos)."""
    with open(os.path.join(DATA, "test.de"), encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f][:batch]
    return tokenizer.encode(lines)


def main():
    cases = []
    for dtype in ("float32", "float64"):
        model, tokenizer, _ = ckpt.load_model(CHECKPOINT, backend="cpu")
        model = model.to(getattr(torch, dtype))
        for beam in (1, 4):
            for batch in (1, 32):
                src = collate(source_ids(tokenizer, batch))
                hyps = legacy_beam_search(model, src, beam, SETTINGS["length_penalty"], SETTINGS["max_len_a"],
                                          SETTINGS["max_len_b"])
                cases.append(dict(name=f"{dtype}-beam{beam}-batch{batch}", dtype=dtype, beam=beam, batch=batch,
                                  tokens=[h[0][0] for h in hyps]))
    with open(RECORDED, "w") as f:
        json.dump({"recorded_by": "legacy_beam_search (the beam search of commit 0bf9cbd)", "settings": SETTINGS,
                   "cases": cases}, f)
        f.write("\n")


if __name__ == "__main__":
    main()
