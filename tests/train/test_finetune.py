"""python -m fastformer.train --init CHECKPOINT on a fastformer checkpoint (the committed tiny Bible model,
tests/data/tiny-bible-de-en.pt): the run keeps the checkpoint's config and tokenizer, the loss falls, dev and
test BLEU before the first update and at the end reach the log and the summary, --resume continues exactly,
two processes, bf16 and the int8 export take the result; an int8 checkpoint and flags that contradict --init
are refused with their reason. The fine-tuning schedules, and the dev evaluation leaving training mode as it
was. Converted transformers models: tests/hf/test_finetune_converted.py."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fastformer import checkpoint as ckpt
from fastformer.convert import main as convert
from fastformer.data.tokenizer import tokenizer_state
from fastformer.train import build_parser, main
from fastformer.training.evaluation import evaluate_dev
from fastformer.training.processes import Processes
from fastformer.training.setup import setup
from fastformer.training.step import fine_tuning_rate, scheduled_rate
from train_helpers import DATA, tiny_run_args

INIT = str(DATA / "tiny-bible-de-en.pt")  # the tiny config after 1,785 updates on bible-de-en (vocabulary 1,000)


def init_args(out, *extra, init=INIT):
    """A seconds-long fine-tuning run of ``init`` on the fixture's files."""
    return ["--init", str(init), "--out", str(out),
            "--train-src", str(DATA / "train.de"), "--train-tgt", str(DATA / "train.en"),
            "--valid-src", str(DATA / "dev.de"), "--valid-tgt", str(DATA / "dev.en"),
            "--test-src", str(DATA / "test.de"), "--test-tgt", str(DATA / "test.en"),
            "--max-tokens", "600", "--update-tokens", "400", "--lr", "2e-3", "--warmup", "3",
            "--eval-sentences", "8", "--log-every", "1", "--checkpoint-minutes", "100", "--beam", "2", *extra]


def read_log(run_dir):
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_fine_tuning_schedules():
    # inverse-sqrt: linear warmup to the peak at `warmup`, then peak sqrt(warmup / step)
    assert fine_tuning_rate(1, 1e-4, 10) == pytest.approx(1e-5)
    assert fine_tuning_rate(10, 1e-4, 10) == pytest.approx(1e-4)
    assert fine_tuning_rate(40, 1e-4, 10) == pytest.approx(0.5e-4)
    # linear: the same warmup, then down by the same amount each update, the last update (total) above 0
    total = 20
    rates = [fine_tuning_rate(s, 1e-4, 10, total) for s in range(1, total + 1)]
    assert rates[9] == pytest.approx(1e-4) and rates[-1] == pytest.approx(1e-4 / 11)
    steps = [a - b for a, b in zip(rates[9:], rates[10:])]
    assert all(d == pytest.approx(1e-4 / 11) for d in steps)
    # the flags pick the schedule: --init defaults to inverse-sqrt at 5e-5, 4% of --max-steps of warmup
    args = build_parser().parse_args(["--init", INIT, "--max-steps", "100"])
    from fastformer.training.finetune import resolve_flags

    resolve_flags(args)
    assert (args.schedule, args.lr, args.warmup, args.clip_norm) == ("inverse-sqrt", 5e-5, 4, 1.0)
    assert scheduled_rate(args, 4, 32) == pytest.approx(5e-5) and scheduled_rate(args, 16, 32) == pytest.approx(2.5e-5)
    scratch = build_parser().parse_args([])
    resolve_flags(scratch)
    assert (scratch.schedule, scratch.warmup, scratch.lr_factor, scratch.clip_norm, scratch.config,
            scratch.vocab_size) == ("paper", 300, 0.5, 0.0, "small", 8000)


def test_init_keeps_the_checkpoint_and_reports_bleu_before_and_after(tmp_path):
    out = tmp_path / "ft"
    result = main(init_args(out, "--max-steps", "30", "--eval-every", "15"))
    source, tuned = ckpt.load(INIT), ckpt.load(str(out))
    # the checkpoint's model and tokenizer as they were: no spm.model trained, the same vocabulary
    assert not (out / "spm.model").exists()
    assert torch.equal(tuned["tokenizer"], source["tokenizer"])
    config = ckpt.from_state(source, INIT)[0].config.to_dict()
    assert tuned["config"] == config and tuned["args"]["init"] == os.path.abspath(INIT)
    assert not torch.equal(tuned["model"]["embed.weight"], source["model"]["embed.weight"])
    log = read_log(out)
    losses = [r["loss"] for r in log if r["kind"] == "train"]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    assert [r["lr"] for r in log if r["kind"] == "train"][2] == pytest.approx(2e-3)  # the peak, after 3 of warmup
    # dev and test at update 0 (the checkpoint) and at the end; the summary sets them side by side
    assert [r["step"] for r in log if r["kind"] == "dev"] == [0, 15, 30]
    assert [r["step"] for r in log if r["kind"] == "test"] == [0, 30]
    dev = {r["step"]: r["dev_bleu_greedy"] for r in log if r["kind"] == "dev"}
    test = {r["step"]: r["bleu"] for r in log if r["kind"] == "test"}
    assert result["before_and_after"] == {"dev_bleu_greedy": [dev[0], dev[30]], "test_bleu": [test[0], test[30]]}
    summary = [r for r in log if r["kind"] == "summary"][-1]
    assert summary["before_and_after"] == result["before_and_after"] and summary["init"] == os.path.abspath(INIT)
    assert (out / "test_init.txt").exists() and (out / "test.txt").exists()
    # the dev loss at update 0 is the checkpoint's own on the dev files
    assert [r for r in log if r["kind"] == "dev"][0]["dev_loss"] < 6.0


def test_resume_of_an_init_run_matches_an_uninterrupted_run(tmp_path):
    """A run of 10 updates, and one stopped at 6 and resumed, end bit-identical, with dropout on and a dev
    evaluation (update 4) before the stop: the evaluation leaves the model in training mode in both."""
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    flags = ("--eval-every", "4", "--dropout", "0.2", "--no-test", "--keep", "10")
    main(init_args(straight, "--max-steps", "10", *flags))
    main(init_args(interrupted, "--max-steps", "6", *flags))
    main(init_args(interrupted, "--max-steps", "10", "--resume", *flags))
    a, b = ckpt.load(str(straight / "checkpoint_10.pt")), ckpt.load(str(interrupted / "checkpoint_10.pt"))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs after resuming"
    for key, value in a["optimizer"]["state"].items():
        assert torch.equal(value["exp_avg"], b["optimizer"]["state"][key]["exp_avg"])
    assert [r["step"] for r in read_log(interrupted) if r["kind"] == "train"] == list(range(1, 11))
    assert [r["step"] for r in read_log(interrupted) if r["kind"] == "dev"] == [0, 4, 6, 8, 10]
    # resuming without --init would read other token ids: refused
    with pytest.raises(SystemExit, match="fine-tunes .*tiny-bible-de-en.pt: resume with --init"):
        main(tiny_run_args(interrupted, "--max-steps", "12", "--resume"))


def test_dev_evaluation_leaves_the_training_mode(tmp_path):
    # translate() puts the model in eval mode; without restoring it, training went on without dropout
    args = build_parser().parse_args(tiny_run_args(tmp_path / "run", "--eval-sentences", "2"))
    run = setup(args, Processes.start("cpu"))
    run.model.train()
    evaluate_dev(run)
    assert run.model.training
    run.model.eval()
    evaluate_dev(run)
    assert not run.model.training


def test_init_is_refused_with_its_reason(tmp_path, capsys):
    int8 = tmp_path / "int8.pt"
    convert([INIT, "--out", str(int8), "--quantize", "int8"])
    cases = [
        (init_args(tmp_path / "a", init=int8), "holds an int8 model, which is for inference"),
        (init_args(tmp_path / "b", "--config", "tiny"), "drop --config"),
        (init_args(tmp_path / "c", "--vocab-size", "300"), "drop --vocab-size"),
        (init_args(tmp_path / "d", "--schedule", "paper"), "--lr is the peak of --schedule inverse-sqrt and linear"),
        (init_args(tmp_path / "e", "--lr-factor", "2"), "--lr-factor scales the paper schedule"),
        (init_args(tmp_path / "f", "--schedule", "linear"), "--schedule linear decays to 0 at --max-steps"),
        (init_args(tmp_path / "g", "--target-lang", "de"), "tokenizer has no language codes"),
        (init_args(tmp_path / "h", init=tmp_path / "missing.pt"), "no such checkpoint file or run folder"),
        (tiny_run_args(tmp_path / "i", "--target-lang", "de"), "fine-tuned with --init"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, message
        assert message in capsys.readouterr().err, message


def test_init_result_trains_in_bf16_and_exports_to_int8(tmp_path):
    out = tmp_path / "ft"
    result = main(init_args(out, "--max-steps", "4", "--precision", "bf16", "--eval-every", "0", "--no-test"))
    assert result["precision"] == "bfloat16" and "before_and_after" in result
    int8 = tmp_path / "int8.pt"
    convert([str(out), "--out", str(int8), "--quantize", "int8"])
    model, tokenizer, state = ckpt.load_model(str(int8))
    assert model.quantization == "int8" and torch.equal(tokenizer_state(tokenizer), ckpt.load(INIT)["tokenizer"])
    done = subprocess.run([sys.executable, "-m", "fastformer.translate", "--checkpoint", str(int8), "--beam", "2"],
                          input="Und Gott sprach.\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 1, done.stderr


def test_init_under_two_processes(tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "fastformer.train", *init_args(out, "--max-steps", "4", "--threads", "1", "--eval-every", "0")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es)" in done.stdout + done.stderr
    summary = [r for r in read_log(out) if r["kind"] == "summary"][-1]
    assert summary["steps"] == 4 and len(summary["before_and_after"]["test_bleu"]) == 2
    shutil.rmtree(out)
