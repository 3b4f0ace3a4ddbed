"""The translate, evaluate, average, visualize and convert commands on a checkpoint trained on the fixture, their
--help, and clear errors for corrupt or mismatched checkpoints."""
import argparse
import importlib
import json
import re
import subprocess
import sys

import pytest
import torch

from fastformer import checkpoint as ckpt
from fastformer.train import main
from train_helpers import DATA, tiny_run_args

COMMANDS = ("train", "translate", "evaluate", "average", "visualize", "convert")


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, input=stdin, timeout=300)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    main(tiny_run_args(out, "--max-steps", "30"))
    return out


@pytest.mark.parametrize("command", COMMANDS)
def test_help_explains_every_flag(command):
    module = importlib.import_module(f"fastformer.{command}")
    for action in module.build_parser()._actions:
        assert action.help and action.help.strip(), f"{command}: {action.option_strings} has no help text"
    done = run(f"fastformer.{command}", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m fastformer." + command)


@pytest.mark.parametrize("command", COMMANDS + ("export",))
def test_help_gives_each_default_once(command):
    # argparse's ArgumentDefaultsHelpFormatter appends "(default: X)" even after a default written in words,
    # which printed "(default: runs/<config>-<data>) (default: None)": fastformer.cli.HelpFormatter does not.
    parser = importlib.import_module(f"fastformer.{command}").build_parser()
    shown = 0
    for action in parser._actions:
        formatter = parser._get_formatter()
        formatter.add_argument(action)
        text = " ".join(formatter.format_help().split())  # one line, whatever the terminal's width
        assert text.count("(default:") <= 1, f"{command}: two defaults: {text}"
        assert "(default: None)" not in text, f"{command}: {text}"
        if action.default not in (None, argparse.SUPPRESS) and action.nargs != 0:
            assert text.count("(default:") == 1, f"{command}: the default {action.default!r} is not shown: {text}"
        shown += text.count("(default:")
    # the command's own --help prints those flags, and nothing else says a default
    printed = " ".join(run(f"fastformer.{command}", "--help").stdout.split())
    assert printed.count("(default:") == shown and "(default: None)" not in printed


def test_translate_files_and_stdin(run_dir, tmp_path):
    output = tmp_path / "out.en"
    done = run("fastformer.translate", "--checkpoint", str(run_dir), "--input", str(DATA / "test.de"),
               "--output", str(output), "--beam", "2")
    assert done.returncode == 0, done.stderr
    lines = output.read_text().splitlines()
    assert len(lines) == 40 and sum(bool(line.strip()) for line in lines) > 30
    piped = run("fastformer.translate", "--checkpoint", str(run_dir / "checkpoint_30.pt"), "--beam", "2",
                stdin="Im Anfang schuf Gott die Himmel und die Erde.\nUnd Gott sprach.\n")
    assert piped.returncode == 0, piped.stderr
    assert len(piped.stdout.splitlines()) == 2
    # the throughput goes to stderr, after the translations
    match = re.search(r"translated 2 sentences \((\d+) target tokens\) in [\d.]+ s: [\d.]+ sentences/s, \d+ tokens/s",
                      piped.stderr)
    assert match and int(match.group(1)) >= 2, piped.stderr


def test_evaluate_prints_bleu_chrf_and_signature(run_dir):
    done = run("fastformer.evaluate", "--checkpoint", str(run_dir), "--split", "test", "--beam", "1", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sentences"] == 40 and 0.0 <= result["bleu"] <= 100.0 and result["chrf"] > 0.0
    assert "tok:13a" in result["bleu_signature"]
    text = run("fastformer.evaluate", "--checkpoint", str(run_dir), "--split", "dev", "--beam", "1", "--limit", "5")
    assert text.returncode == 0 and "BLEU signature: nrefs:1" in text.stdout and "chrF" in text.stdout


def test_translate_and_evaluate_quantize_int8(run_dir, tmp_path):
    """--quantize int8 translates with fastformer.quantize's model: line-aligned output, a BLEU near the
    float32 model's on the same sentences (a 30-step tiny model: near-zero BLEU either way, so the check is
    loose; docs/results/ holds the trained model's), and a clear error on CUDA."""
    done = run("fastformer.translate", "--checkpoint", str(run_dir), "--quantize", "int8", "--beam", "2",
               stdin="Im Anfang schuf Gott die Himmel und die Erde.\nUnd Gott sprach.\n")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2 and "translated 2 sentences" in done.stderr
    scores = {}
    for quantize in ([], ["--quantize", "int8"]):
        out = run("fastformer.evaluate", "--checkpoint", str(run_dir), "--split", "test", "--beam", "1", "--json",
                  "--limit", "20", *quantize)
        assert out.returncode == 0, out.stderr
        scores[bool(quantize)] = json.loads(out.stdout.strip().splitlines()[-1])
    assert scores[True]["sentences"] == 20 and abs(scores[True]["chrf"] - scores[False]["chrf"]) < 10, scores
    refused = run("fastformer.translate", "--checkpoint", str(run_dir), "--quantize", "int8", "--device", "cuda",
                  stdin="Und Gott sprach.\n")
    assert refused.returncode != 0 and "--quantize int8 runs on the CPU; use --device cpu" in refused.stderr


def test_convert_writes_an_int8_checkpoint_that_loads_as_quantizing_after_load(run_dir, tmp_path):
    """python -m fastformer.convert --quantize int8 writes the int8 model: int8 projection weights and no float
    copy of them, a smaller file than the float checkpoint convert writes, no training state; loaded, it gives
    the logits and tokens of quantizing the float model after load, translate takes it as it is, and the bad
    uses are refused with their reason."""
    from fastformer import quantize
    from fastformer.nn.linear import Int8Linear

    from fastformer.convert import main as convert

    float_path, int8_path = tmp_path / "float.pt", tmp_path / "int8.pt"
    convert([str(run_dir), "--out", str(float_path)])
    convert([str(run_dir), "--out", str(int8_path), "--quantize", "int8"])
    float_state, int8_state = (torch.load(p, weights_only=True) for p in (float_path, int8_path))
    assert ckpt.quantization(float_state) is None and ckpt.quantization(int8_state) == "int8"
    assert not {"optimizer", "train_state", "ranks"} & (float_state.keys() | int8_state.keys())

    model, tokenizer, _ = ckpt.load_model(str(int8_path))
    reference = quantize(ckpt.load_model(str(float_path))[0])
    projections = [name for name, module in model.named_modules() if isinstance(module, Int8Linear)]
    assert projections and model.quantization == "int8"
    for name in projections:  # int8 in the file; the float weight is not there
        assert int8_state["model"][name + ".weight"].dtype == torch.int8, name
    float_projection_bytes = sum(t.numel() * t.element_size() for key, t in float_state["model"].items()
                                 if key.endswith(".weight") and key[:-len(".weight")] in projections)
    int8_float_bytes = sum(t.numel() * t.element_size() for t in int8_state["model"].values() if t.is_floating_point())
    float_bytes = sum(t.numel() * t.element_size() for t in float_state["model"].values())
    assert int8_float_bytes <= float_bytes - float_projection_bytes + sum(
        int8_state["model"][name + ".weight_scale"].numel() * 4 for name in projections)
    assert int8_path.stat().st_size < float_path.stat().st_size

    src = torch.tensor([tokenizer.encode(["Und Gott sprach."])[0] + [model.config.eos_id]])
    tgt = torch.tensor([[model.config.bos_id, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(model(src, tgt), reference(src, tgt))
    assert model.generate(src) == reference.generate(src)

    text = "Im Anfang schuf Gott die Himmel und die Erde.\nUnd Gott sprach.\n"
    as_stored = run("fastformer.translate", "--checkpoint", str(int8_path), "--beam", "2", stdin=text)
    after_load = run("fastformer.translate", "--checkpoint", str(float_path), "--quantize", "int8", "--beam", "2",
                     stdin=text)
    assert as_stored.returncode == 0 and after_load.returncode == 0, as_stored.stderr + after_load.stderr
    assert as_stored.stdout == after_load.stdout and len(as_stored.stdout.splitlines()) == 2

    refused = run("fastformer.translate", "--checkpoint", str(int8_path), "--device", "cuda", stdin="Und Gott sprach.\n")
    assert refused.returncode != 0 and "the int8 checkpoint runs on the CPU; use --device cpu" in refused.stderr
    with pytest.raises(ckpt.CheckpointError, match="runs on the CPU"):
        ckpt.load_model(str(int8_path), device="cuda")
    with pytest.raises(SystemExit, match="holds an int8 model already"):
        convert([str(int8_path), "--out", str(tmp_path / "again.pt"), "--quantize", "int8"])
    with pytest.raises(SystemExit, match=r"exists \(use --force"):
        convert([str(run_dir), "--out", str(float_path)])
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")  # a transformers folder of no known family
    with pytest.raises(SystemExit, match="model_type None is not supported"):
        convert([str(tmp_path / "hf"), "--out", str(tmp_path / "hf.pt")])


def test_visualize_writes_one_png_per_layer(run_dir, tmp_path):
    done = run("fastformer.visualize", "--checkpoint", str(run_dir), "--text", "Und Gott sprach.",
               "--out", str(tmp_path / "att.png"), "--beam", "1")
    assert done.returncode == 0, done.stderr
    pngs = sorted(p.name for p in tmp_path.glob("att_*.png"))
    assert pngs == ["att_decoder_cross_layer1.png", "att_decoder_cross_layer2.png",
                    "att_encoder_layer1.png", "att_encoder_layer2.png"]
    assert all((tmp_path / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_recorded_attention_rows_are_distributions(run_dir):
    model, tokenizer, _ = ckpt.load_model(str(run_dir))
    layer = model.encoder.layers[0].self_attn
    layer.record_attention = True
    src = torch.tensor([tokenizer.encode(["Und Gott sprach."])[0] + [3]])
    model.encode(src)
    weights = layer.last_attention  # (1, H, S, S)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))


def test_corrupt_and_mismatched_checkpoints_are_rejected(run_dir, tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"this is not a checkpoint")
    done = run("fastformer.translate", "--checkpoint", str(corrupt), stdin="Hallo\n")
    assert done.returncode != 0 and "not a readable fastformer checkpoint" in done.stderr
    assert "Traceback" not in done.stderr
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes((run_dir / "checkpoint_30.pt").read_bytes()[:2000])
    with pytest.raises(ckpt.CheckpointError, match="not a readable"):
        ckpt.load(str(truncated))
    state = ckpt.load(str(run_dir))
    state["config"] = {**state["config"], "d_model": 64, "d_ff": 128}
    mismatched = tmp_path / "mismatched.pt"
    torch.save(state, mismatched)
    with pytest.raises(ckpt.CheckpointError, match="do not match"):
        ckpt.load_model(str(mismatched))
    with pytest.raises(ckpt.CheckpointError, match="no such checkpoint"):
        ckpt.load(str(tmp_path / "nothing-here"))
    empty = tmp_path / "empty_run"
    empty.mkdir()
    with pytest.raises(ckpt.CheckpointError, match="holds no checkpoint"):
        ckpt.load(str(empty))
