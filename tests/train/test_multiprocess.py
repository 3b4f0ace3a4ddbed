"""python -m fastformer.train under torchrun, 2 CPU processes (gloo, tiny config): short runs finish
cleanly; a run stopped and resumed, and a run killed while writing a checkpoint and resumed from the one
before, end bit-identical to the run never stopped; resuming with another process count says how it
continues. Each torchrun launch takes some 10-20 s on 2 cores."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from fastformer import checkpoint as ckpt
from fastformer.train import main
from train_helpers import tiny_run_args

HERE = pathlib.Path(__file__).resolve().parent


def torchrun(*args, entry=("-m", "fastformer.train")):
    """Two training processes on this machine; the finished subprocess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *entry, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def run_args(out, *extra, test=False):
    return tiny_run_args(out, "--threads", "1", "--keep", "10", *extra, test=test)


def train_steps(run_dir):
    with open(run_dir / "log.jsonl") as f:
        return [r["step"] for r in map(json.loads, f) if r["kind"] == "train"]


def assert_same_training_state(a_path, b_path):
    a, b = ckpt.load(str(a_path)), ckpt.load(str(b_path))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs"
    for key, value in a["optimizer"]["state"].items():
        for slot in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(value[slot], b["optimizer"]["state"][key][slot]), f"optimizer {slot} {key} differs"
    timing = ("train_seconds",)  # wall time differs; everything else must be identical
    assert {k: v for k, v in a["train_state"].items() if k not in timing} == \
        {k: v for k, v in b["train_state"].items() if k not in timing}
    for rank_a, rank_b in zip(a["ranks"], b["ranks"], strict=True):
        assert (rank_a["epoch"], rank_a["batch_in_epoch"]) == (rank_b["epoch"], rank_b["batch_in_epoch"])
        assert torch.equal(rank_a["rng"]["torch"], rank_b["rng"]["torch"])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """12 updates on 2 processes, never stopped, a checkpoint every 4."""
    out = tmp_path_factory.mktemp("ddp") / "straight"
    done = torchrun(*run_args(out, "--max-steps", "12", "--checkpoint-every", "4"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es)" in done.stdout + done.stderr
    return out


def fresh_folder(tmp_path, straight, name):
    """A run folder holding the straight run's vocabulary (trained once, deterministic, reused)."""
    out = tmp_path / name
    out.mkdir()
    shutil.copy(straight / "spm.model", out / "spm.model")
    return out


def test_the_checkpoint_holds_every_process_state(straight):
    state = ckpt.load(str(straight / "checkpoint_12.pt"))
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    # The ranks read different shards: their RNG streams and generally their positions differ.
    assert not torch.equal(state["ranks"][0]["rng"]["torch"], state["ranks"][1]["rng"]["torch"])
    assert train_steps(straight) == list(range(1, 13))  # the main process logs each update once
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(straight))] == \
        ["checkpoint_4.pt", "checkpoint_8.pt", "checkpoint_12.pt"]


@pytest.mark.parametrize("updates", [1, 3, 8])
def test_short_runs_finish(tmp_path, straight, updates):
    # Shorter than --log-every 10; the 8-update run also evaluates (every 5) and translates the test split.
    out = fresh_folder(tmp_path, straight, "run")
    done = torchrun(*run_args(out, "--max-steps", str(updates), "--log-every", "10", "--eval-every", "5",
                              "--eval-sentences", "4", test=updates == 8))
    assert done.returncode == 0, done.stderr[-3000:]
    assert train_steps(out) == [updates]
    assert (out / "loss.png").exists() and (out / f"checkpoint_{updates}.pt").exists()
    assert ("test BLEU" in done.stdout) == (updates == 8)


def test_stop_and_resume_is_exact(tmp_path, straight):
    out = fresh_folder(tmp_path, straight, "stopped")
    for extra in (("--max-steps", "6"), ("--max-steps", "12", "--resume")):
        done = torchrun(*run_args(out, *extra))
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed" in done.stdout
    assert_same_training_state(straight / "checkpoint_12.pt", out / "checkpoint_12.pt")
    assert train_steps(out) == list(range(1, 13))


def test_killed_during_a_checkpoint_write_resumes_from_the_one_before(tmp_path, straight):
    out = fresh_folder(tmp_path, straight, "killed")
    args = run_args(out, "--max-steps", "12", "--checkpoint-every", "4")
    done = torchrun("8", *args, entry=(str(HERE / "die_during_checkpoint.py"),))
    assert done.returncode != 0
    # The write of update 8 was cut off: only its temporary file exists, half written.
    assert not (out / "checkpoint_8.pt").exists() and (out / "checkpoint_8.pt.tmp").stat().st_size > 0
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(out))] == ["checkpoint_4.pt"]
    assert train_steps(out)[-1] >= 8  # the log ran ahead of the last checkpoint
    done = torchrun(*run_args(out, "--max-steps", "12", "--checkpoint-every", "4", "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed" in done.stdout and "at update 4" in done.stdout
    assert not (out / "checkpoint_8.pt.tmp").exists()
    assert_same_training_state(straight / "checkpoint_12.pt", out / "checkpoint_12.pt")
    assert train_steps(out) == list(range(1, 13))  # records after update 4 were dropped, then rewritten


def test_resume_with_another_process_count_says_how_it_continues(tmp_path, straight, capsys):
    out = fresh_folder(tmp_path, straight, "one")
    shutil.copy(straight / "checkpoint_8.pt", out / "checkpoint_8.pt")
    result = main(run_args(out, "--max-steps", "10", "--resume"))
    said = capsys.readouterr().out
    assert "written by 2 process(es), with 1: not an exact continuation" in said, said
    state = ckpt.load(str(out / "checkpoint_10.pt"))
    first_epoch = ckpt.load(str(straight / "checkpoint_8.pt"))["ranks"][0]["epoch"]
    assert result["steps"] == 10 and state["ranks"][0]["epoch"] >= first_epoch + 1
