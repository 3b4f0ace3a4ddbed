"""python -m fastformer.export --ctranslate2: the exported model decodes to generate's tokens.

The tiny model trained on the Bible (tests/data/tiny-bible-de-en.pt) translates the 40 sentences of
tests/data/test.de with fastformer and with CTranslate2 on the exported model (1 thread each), under the
rules both engines share (fastformer/export.py says which differ):
- greedy: every translation identical;
- beam 4, length penalty 0 (both rank by the sum of log-probabilities): identical for every sentence that
  ends with its own eos before its length limit (at the limit fastformer forces the eos and scores it,
  CTranslate2 stops without it).
"""
import os
import subprocess
import sys

import pytest
import torch

ctranslate2 = pytest.importorskip("ctranslate2", reason="the export's optional dependency (pip install '.[test]' has it)")

from fastformer import checkpoint as ckpt  # noqa: E402
from fastformer.data import collate  # noqa: E402
from fastformer.export import ctranslate2_translate, vocabulary  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")
CHECKPOINT = os.path.join(DATA, "tiny-bible-de-en.pt")
LIMIT = dict(max_len_a=1.2, max_len_b=10)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ct2") / "model")
    run = subprocess.run([sys.executable, "-m", "fastformer.export", "--ctranslate2", CHECKPOINT, out],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.bin", "shared_vocabulary.json"]
    model, tokenizer, _ = ckpt.load_model(CHECKPOINT, backend="cpu")
    with open(os.path.join(DATA, "test.de"), encoding="utf-8") as f:
        ids = tokenizer.encode([line.rstrip("\n") for line in f])
    translator = ctranslate2.Translator(out, device="cpu", inter_threads=1, intra_threads=1)
    return model, vocabulary(tokenizer), ids, translator


@pytest.mark.parametrize("beam_size", [1, 4])
def test_ctranslate2_decodes_the_same_tokens(exported, beam_size):
    model, pieces, ids, translator = exported
    ours = model.generate(collate(ids), beam_size=beam_size, length_penalty=0.0, **LIMIT)
    theirs = ctranslate2_translate(translator, pieces, ids, beam_size=beam_size, length_penalty=0.0, **LIMIT)
    limits = [int(LIMIT["max_len_a"] * (len(s) + 1) + LIMIT["max_len_b"]) for s in ids]
    compared = [i for i, t in enumerate(ours) if beam_size == 1 or len(t) < limits[i]]
    assert len(compared) >= 30, f"only {len(compared)} of {len(ids)} sentences end before their limit"
    assert len({len(ours[i]) for i in compared}) > 10  # sentences of many lengths
    mismatched = [i for i in compared if ours[i] != theirs[i]]
    assert not mismatched, [(ours[i], theirs[i]) for i in mismatched[:2]]


def test_export_refuses_to_overwrite_and_names_a_missing_checkpoint(tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    run = subprocess.run([sys.executable, "-m", "fastformer.export", "--ctranslate2", CHECKPOINT, str(out)],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "exists" in run.stderr and "--force" in run.stderr
    run = subprocess.run([sys.executable, "-m", "fastformer.export", "--ctranslate2", str(tmp_path / "none.pt"),
                          str(tmp_path / "new")], capture_output=True, text=True)
    assert run.returncode != 0 and "no such checkpoint" in run.stderr
    assert "Traceback" not in run.stderr
