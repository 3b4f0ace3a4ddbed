"""Bad input to the command-line tools gets an ``error:`` line and exit status 2 (argparse's), not a
traceback; translate and evaluate report unreadable lines by number and still translate the others."""
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train_helpers import DATA, tiny_run_args

CHECKPOINT = Path(__file__).resolve().parent.parent / "data" / "tiny-bible-de-en.pt"

# (command, flag, bad value): every numeric flag with a range, at a value outside it.
BAD_NUMBERS = [
    *[(cmd, "--beam", v) for cmd in ("translate", "evaluate", "train") for v in ("0", "-1", "2.5", "x")],
    *[(cmd, "--lenpen", v) for cmd in ("translate", "evaluate", "train") for v in ("nan", "inf", "-inf", "-0.1")],
    *[(cmd, "--max-len-a", v) for cmd in ("translate", "evaluate") for v in ("nan", "-1")],
    *[(cmd, "--max-len-b", "0") for cmd in ("translate", "evaluate")],
    ("evaluate", "--limit", "0"),
    ("train", "--max-steps", "0"),
    ("train", "--max-minutes", "0"),
    ("train", "--max-minutes", "nan"),
    ("train", "--max-tokens", "0"),
    ("train", "--update-tokens", "-5"),
    ("train", "--warmup", "0"),
    ("train", "--lr-factor", "0"),
    ("train", "--lr-factor", "inf"),
    ("train", "--dropout", "1"),
    ("train", "--dropout", "-0.1"),
    ("train", "--dropout", "nan"),
    ("train", "--label-smoothing", "1.5"),
    ("train", "--clip-norm", "-1"),
    ("train", "--eval-every", "-1"),
    ("train", "--eval-sentences", "0"),
    ("train", "--checkpoint-minutes", "0"),
    ("train", "--keep", "0"),
    ("train", "--average-last", "0"),
    ("train", "--log-every", "0"),
    ("train", "--threads", "0"),
    ("train", "--vocab-size", "1"),
    ("train", "--checkpoint-every", "-1"),
    ("average", "--last", "0"),
    ("visualize", "--beam", "0"),
]
REQUIRED = {"translate": ["--checkpoint", "x"], "evaluate": ["--checkpoint", "x"], "train": [],
            "average": ["--inputs", "x", "--output", "y"], "visualize": ["--checkpoint", "x", "--text", "y"]}


@pytest.mark.parametrize("command,flag,value", BAD_NUMBERS, ids=lambda v: str(v))
def test_out_of_range_numbers_are_usage_errors(command, flag, value, capsys):
    parser = importlib.import_module(f"fastformer.{command}").build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(REQUIRED[command] + [f"{flag}={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}" in err, err


def test_good_numbers_still_parse():
    args = importlib.import_module("fastformer.train").build_parser().parse_args(
        ["--beam", "1", "--lenpen", "0", "--dropout", "0", "--eval-every", "0", "--max-minutes", "0.5"])
    assert (args.beam, args.lenpen, args.dropout, args.eval_every, args.max_minutes) == (1, 0.0, 0.0, 0, 0.5)


@pytest.mark.parametrize("problem", ["mismatched", "empty", "missing"])
def test_bad_training_files_are_usage_errors(problem, tmp_path, capsys):
    from fastformer.train import main

    src, tgt = tmp_path / "train.de", tmp_path / "train.en"
    src.write_text("Ein Haus.\nZwei.\n" if problem != "empty" else "\n\n", encoding="utf-8")
    tgt.write_text("A house.\n" if problem == "mismatched" else "A house.\nTwo.\n", encoding="utf-8")
    if problem == "missing":
        src.unlink()
    args = tiny_run_args(tmp_path / "run", "--max-steps", "1", "--no-test")
    args += ["--train-src", str(src), "--train-tgt", str(tgt), "--valid-src", str(DATA / "dev.de"),
             "--valid-tgt", str(DATA / "dev.en")]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m fastformer.train: error: " in err and "train" in err, err


def test_translate_reports_undecodable_and_empty_lines():
    # The example plus an empty line: two translations, the bad lines named, alignment kept, status 1.
    done = subprocess.run([sys.executable, "-m", "fastformer.translate", "--checkpoint", str(CHECKPOINT),
                           "--beam", "2"], input=b"Das ist gut.\n\xff\xfe kaputt\nEin Haus.\n \n",
                          capture_output=True, timeout=300)
    assert done.returncode == 1, done.stderr.decode()
    out = done.stdout.decode("utf-8").split("\n")
    assert len(out) == 5 and out[4] == "", out  # four lines, each ended by a newline
    assert out[0].strip() and out[1] == "" and out[2].strip() and out[3] == "", out
    err = done.stderr.decode()
    assert "line 2: not valid UTF-8" in err and "line 4: empty line" in err, err
    assert "translated 2 sentences" in err


def test_evaluate_reports_undecodable_and_empty_lines(tmp_path):
    # A checkpoint whose test split is a pair of user files with bad lines on either side.
    src, ref = tmp_path / "test.de", tmp_path / "test.en"
    src.write_bytes(b"Das ist gut.\n\xff kaputt\nEin Haus.\n\n")
    ref.write_bytes(b"This is good.\nBroken.\n\nEmpty.\n")
    state = torch.load(CHECKPOINT, weights_only=True)
    state["data"] = {"kind": "files", "train": [str(src), str(ref)], "dev": [str(src), str(ref)],
                     "test": [str(src), str(ref)]}
    checkpoint, output = tmp_path / "checkpoint.pt", tmp_path / "hyps.en"
    torch.save(state, checkpoint)
    done = subprocess.run([sys.executable, "-m", "fastformer.evaluate", "--checkpoint", str(checkpoint), "--beam", "2",
                           "--json", "--output", str(output)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["sentences"] == 3  # reference line 3 is not scored
    hyps = output.read_text(encoding="utf-8").split("\n")
    assert len(hyps) == 5 and hyps[0].strip() and hyps[1] == "" and hyps[2].strip() and hyps[3] == "", hyps
    assert f"{src}, line 2: not valid UTF-8" in done.stderr and f"{src}, line 4: empty line" in done.stderr
    assert f"{ref}, line 3: empty line; its pair is not scored" in done.stderr
