"""python -m fastformer.train on the committed fixture, one process: the loss falls, --resume continues
exactly, runs of a few updates finish cleanly, checkpoints average. Several processes: test_multiprocess.py."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fastformer import checkpoint as ckpt
from fastformer.runtime import native_bf16_cpu
from fastformer.train import main
from fastformer.training.setup import autocast_dtype
from fastformer.training.step import learning_rate
from train_helpers import tiny_run_args


def read_log(run_dir):
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_learning_rate_is_the_papers_schedule():
    # lr = factor d^-0.5 min(step^-0.5, step warmup^-1.5): linear warmup, peak at `warmup`, then 1/sqrt.
    d, warmup = 512, 4000
    assert learning_rate(1, d, warmup, 1.0) == pytest.approx(d ** -0.5 * warmup ** -1.5)
    assert learning_rate(warmup, d, warmup, 1.0) == pytest.approx(d ** -0.5 * warmup ** -0.5)
    assert learning_rate(4 * warmup, d, warmup, 2.0) == pytest.approx(2.0 * d ** -0.5 * (4 * warmup) ** -0.5)
    peak = learning_rate(warmup, d, warmup, 1.0)
    assert learning_rate(warmup - 1, d, warmup, 1.0) < peak and learning_rate(warmup + 1, d, warmup, 1.0) < peak


def test_precision_flag_picks_the_autocast_dtype():
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) == (torch.bfloat16 if native_bf16_cpu() else None)
    assert autocast_dtype("fp32", cpu) is None and autocast_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(SystemExit, match="fp16 needs a CUDA device"):
        autocast_dtype("fp16", cpu)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_loss_falls_and_run_folder_is_complete(tmp_path, precision):
    out = tmp_path / "run"
    result = main(tiny_run_args(out, "--max-steps", "40", "--eval-every", "20", "--eval-sentences", "8",
                                "--precision", precision))
    assert result["steps"] == 40 and result["precision"] == {"fp32": "float32", "bf16": "bfloat16"}[precision]
    log = read_log(out)
    train = [r["loss"] for r in log if r["kind"] == "train"]
    assert len(train) == 40
    first, last = sum(train[:5]) / 5, sum(train[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: {first:.2f} -> {last:.2f}"
    dev = [r for r in log if r["kind"] == "dev"]
    assert [r["step"] for r in dev] == [20, 40] and dev[1]["dev_loss"] < dev[0]["dev_loss"]
    for name in ("spm.model", "checkpoint_40.pt", "loss.png", "log.jsonl"):
        assert (out / name).exists(), name
    state = ckpt.load(str(out))
    assert state["step"] == 40 and state["data"]["kind"] == "files"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # bf16: the projections' compute-dtype copies rebuilt
def test_resume_matches_an_uninterrupted_run(tmp_path, precision):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    main(tiny_run_args(straight, "--max-steps", "12", "--keep", "10", "--precision", precision))
    interrupted.mkdir()
    shutil.copy(straight / "spm.model", interrupted / "spm.model")
    main(tiny_run_args(interrupted, "--max-steps", "5", "--precision", precision))
    main(tiny_run_args(interrupted, "--max-steps", "12", "--resume", "--precision", precision))
    a = ckpt.load(str(straight / "checkpoint_12.pt"))
    b = ckpt.load(str(interrupted / "checkpoint_12.pt"))
    timing = ("train_seconds",)  # wall time differs; everything else must be identical
    assert {k: v for k, v in a["train_state"].items() if k not in timing} == \
        {k: v for k, v in b["train_state"].items() if k not in timing}
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs after resuming"
    for key, value in a["optimizer"]["state"].items():
        assert torch.equal(value["exp_avg"], b["optimizer"]["state"][key]["exp_avg"])
    # The resumed log continues the interrupted one: steps 1..12, each once.
    assert [r["step"] for r in read_log(interrupted) if r["kind"] == "train"] == list(range(1, 13))


def test_resume_refuses_a_folder_without_checkpoints(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint"):
        main(tiny_run_args(tmp_path / "empty", "--max-steps", "2", "--resume"))


def test_average_of_checkpoints(tmp_path):
    out = tmp_path / "run"
    main(tiny_run_args(out, "--max-steps", "3"))
    main(tiny_run_args(out, "--max-steps", "6", "--resume"))
    paths = ckpt.list_checkpoints(str(out))
    assert [os.path.basename(p) for p in paths] == ["checkpoint_3.pt", "checkpoint_6.pt"]
    averaged_path = tmp_path / "avg.pt"
    done = subprocess.run([sys.executable, "-m", "fastformer.average", "--inputs", str(out), "--last", "2",
                           "--output", str(averaged_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    averaged = ckpt.load(str(averaged_path))["model"]
    first, second = (ckpt.load(p)["model"] for p in paths)
    for name in first:
        torch.testing.assert_close(averaged[name], (first[name].double() + second[name].double()).div(2).to(
            first[name].dtype), rtol=0, atol=0)
    assert not torch.equal(first["embed.weight"], second["embed.weight"])


@pytest.mark.parametrize("updates", [1, 3, 8])
def test_runs_shorter_than_the_log_interval_finish(tmp_path, updates):
    # --log-every 10 (the default) is longer than the run: the last update is logged all the same, so the
    # log and loss.png exist, and a final dev evaluation runs.
    out = tmp_path / "run"
    result = main(tiny_run_args(out, "--max-steps", str(updates), "--log-every", "10", "--eval-every", "250",
                                "--eval-sentences", "4"))
    assert result["steps"] == updates
    assert "triton_plans" not in result  # no triton call on CUDA tensors: the plans' line is left out
    log = read_log(out)
    assert [r["step"] for r in log if r["kind"] == "train"] == [updates]
    assert [r["step"] for r in log if r["kind"] == "dev"] == [updates]
    assert (out / "loss.png").exists() and (out / f"checkpoint_{updates}.pt").exists()


def test_compiled_run_trains_and_checkpoints_the_eager_names(tmp_path):
    """--compile compiles the encoder and decoder stacks in place: the run trains, and its checkpoint holds
    the eager model's parameter names, so it loads into an uncompiled Transformer."""
    from fastformer.nn import Transformer, TransformerConfig

    out = tmp_path / "run"
    result = main(tiny_run_args(out, "--max-steps", "4", "--log-every", "1", "--eval-every", "0", "--compile"))
    assert result["steps"] == 4
    losses = [r["loss"] for r in read_log(out) if r["kind"] == "train"]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    state = ckpt.load(str(out))
    model = Transformer(TransformerConfig.from_dict(state["config"]))
    assert set(state["model"]) == set(model.state_dict())
    model.load_state_dict(state["model"])


def test_fresh_run_refuses_a_folder_with_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    main(tiny_run_args(out, "--max-steps", "1"))
    with pytest.raises(SystemExit) as exit_info:
        main(tiny_run_args(out, "--max-steps", "2"))
    assert exit_info.value.code == 2
    assert "holds checkpoints of an earlier run: add --resume" in capsys.readouterr().err


def test_resume_refuses_a_checkpoint_without_process_state(tmp_path):
    out = tmp_path / "run"
    main(tiny_run_args(out, "--max-steps", "1"))
    state = ckpt.load(str(out))
    del state["ranks"]
    torch.save(state, out / "checkpoint_1.pt")
    with pytest.raises(SystemExit, match="older fastformer without the per-process training state"):
        main(tiny_run_args(out, "--max-steps", "2", "--resume"))


def test_progress_off_a_terminal_refreshes_once_a_minute(tmp_path):
    # stderr is a pipe here, as in a log file or CI: tqdm draws the bar at the start and the end only
    # (mininterval 60 s), not at every update (tqdm's default 0.1 s gave 2,480 refreshes in 4 minutes).
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "fastformer.train", *tiny_run_args(out, "--max-steps", "30")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    refreshes = done.stderr.count("train: ")
    assert 1 <= refreshes <= 3, done.stderr
    assert "30/30" in done.stderr
