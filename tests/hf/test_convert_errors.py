"""Folders the converter cannot read correctly are refused (fastformer/hf_convert.py, issue 45): tiny random
Marian and M2M-100 folders (test_converted.py's builders, ``save_pretrained`` into a temporary folder) broken
one way each: a missing tokenizer file that decides the ids (an M2M-100 folder without vocab.json), a
config.json that is not JSON or whose field is missing or of the wrong type, weights that disagree with the
config (d_model changed, one tensor of another shape, more layers), a truncated model.safetensors or
pytorch_model.bin, a NaN or inf in one tensor. Each raises ``ConversionError`` naming the file and the field
or tensor; ``python -m fastformer.convert`` prints it on one line and exits 1, without a traceback. A
fastformer checkpoint with a NaN weight is refused at load (``load_model``, ``translate``), naming the tensor.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import sentencepiece
import torch
from safetensors.torch import load_file, save_file

import fastformer
from fastformer import checkpoint as ckpt
from fastformer.convert import main as convert_main
from fastformer import hf_convert
from fastformer.hf_convert import ConversionError
from test_converted import TEXT, write_m2m, write_marian


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A working M2M-100 folder and a working Marian folder, written once; tests break copies of them."""
    spm = tmp_path_factory.mktemp("spm")
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(TEXT * 20), model_prefix=str(spm / "sp"),
                                             vocab_size=60, model_type="bpe", minloglevel=2)
    return {"m2m": write_m2m(tmp_path_factory.mktemp("m2m100"), str(spm / "sp.model"), 0.3),
            "marian": write_marian(tmp_path_factory.mktemp("marian"), str(spm / "sp.model"), 0.3)}


def copy(folders, family, tmp_path):
    folder = tmp_path / family
    shutil.copytree(folders[family], folder)
    return folder


_DELETE = object()  # edit_json: remove the field


def edit_json(path, **changes):
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    for key in [k for k, v in changes.items() if v is _DELETE]:
        del data[key]
    with open(path, "w") as f:
        json.dump(data, f)


def edit_weights(folder, change):
    weights = load_file(str(folder / "model.safetensors"))
    change(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def assert_refused(folder, *parts):
    """from_transformers raises ConversionError whose one-line message holds every part; returns it."""
    with pytest.raises(ConversionError) as info:
        fastformer.from_transformers(str(folder))
    message = str(info.value)
    assert "\n" not in message and all(part in message for part in parts), message
    return message


def run_convert(folder, out):
    return subprocess.run([sys.executable, "-m", "fastformer.convert", str(folder), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("breakage, parts", [
    ("vocab", ["has no vocab.json", "M2M-100"]),
    ("safetensors", ["model.safetensors does not load", "SafetensorError"]),
])
def test_the_cli_refuses_on_one_line_with_exit_1(folders, tmp_path, breakage, parts):
    """The issue's cases through the command: an M2M-100 folder without vocab.json (it was read as NLLB,
    sentencepiece id + 1: every id wrong, exit 0) and a truncated model.safetensors (a SafetensorError
    traceback)."""
    folder = copy(folders, "m2m", tmp_path)
    if breakage == "vocab":
        os.remove(folder / "vocab.json")
    else:
        truncate(folder / "model.safetensors")
    done = run_convert(folder, tmp_path / "out.pt")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and str(folder) in lines[0] and all(part in lines[0] for part in parts), done.stderr
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("family, name", [("m2m", "vocab.json"), ("m2m", "sentencepiece.bpe.model"),
                                          ("marian", "vocab.json"), ("marian", "source.spm"),
                                          ("marian", "target.spm")])
def test_a_missing_tokenizer_file_that_decides_the_ids_is_refused(folders, tmp_path, family, name):
    folder = copy(folders, family, tmp_path)
    os.remove(folder / name)
    assert_refused(folder, str(folder), f"has no {name}")
    _, tokenizer = hf_convert.from_transformers(str(folder), tokenizer=False)  # the weights alone still convert
    assert tokenizer is None


def test_m2m100_and_nllb_are_told_apart_or_refused(folders, tmp_path):
    """Without tokenizer_class a vocab.json means M2M-100; without either the ids cannot be known. An NLLB
    tokenizer_class whose language codes no file lists is refused too."""
    folder = copy(folders, "m2m", tmp_path)
    edit_json(folder / "tokenizer_config.json", tokenizer_class=_DELETE)
    _, tokenizer = fastformer.from_transformers(str(folder))
    assert tokenizer.encode(TEXT) == fastformer.from_transformers(folders["m2m"])[1].encode(TEXT)
    os.remove(folder / "vocab.json")
    assert_refused(folder, "has no vocab.json and no tokenizer_config.json naming its tokenizer_class")
    edit_json(folder / "tokenizer_config.json", tokenizer_class="NllbTokenizer")
    assert_refused(folder, "NLLB tokenizer's language codes are in neither tokenizer.json")
    edit_json(folder / "tokenizer_config.json", tokenizer_class="BertTokenizer")
    assert_refused(folder, "tokenizer_config.json's tokenizer_class 'BertTokenizer' is neither M2M100Tokenizer nor "
                    "NllbTokenizer")


@pytest.mark.parametrize("family, change, parts", [
    ("m2m", {"d_model": "32"}, ["config.json: d_model is '32' (str): expected an integer"]),
    ("m2m", {"encoder_layers": _DELETE}, ["config.json: encoder_layers is missing"]),
    ("m2m", {"pad_token_id": None}, ["config.json: pad_token_id is null"]),
    ("m2m", {"scale_embedding": "yes"}, ["config.json: scale_embedding is 'yes' (str): expected true or false"]),
    ("m2m", {"dropout": [0.1]}, ["config.json: dropout is [0.1] (list): expected a number"]),
    ("marian", {"share_encoder_decoder_embeddings": "no"},
     ["config.json: share_encoder_decoder_embeddings is 'no' (str): expected true or false"]),
    ("m2m", {"encoder_ffn_dim": 0, "decoder_ffn_dim": 0}, ["config.json: encoder_ffn_dim is 0: expected at least 1"]),
    ("m2m", {"vocab_size": 3}, ["config.json: its fields do not make a fastformer model: vocab_size 3 must "
                                "exceed the special token ids"]),
])
def test_a_config_field_missing_or_of_the_wrong_type_is_refused_by_name(folders, tmp_path, family, change, parts):
    folder = copy(folders, family, tmp_path)
    edit_json(folder / "config.json", **change)
    assert_refused(folder, str(folder / "config.json"), *parts)


@pytest.mark.parametrize("junk", ["{not json", "[1, 2]", b"\xff\xfe\x00"])
def test_a_config_json_that_is_not_a_json_object_is_refused(folders, tmp_path, junk):
    folder = copy(folders, "m2m", tmp_path)
    (folder / "config.json").write_bytes(junk if isinstance(junk, bytes) else junk.encode())
    message = assert_refused(folder, str(folder / "config.json"))
    assert "is not valid JSON" in message or "holds a JSON list, not an object" in message
    with pytest.raises(SystemExit, match=f"error: {folder / 'config.json'}"):
        convert_main([str(folder), "--out", str(tmp_path / "x.pt")])


def test_weights_that_disagree_with_the_config_are_refused_naming_the_tensor_and_both_shapes(folders, tmp_path):
    folder = copy(folders, "m2m", tmp_path)
    with open(folder / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    edit_json(folder / "config.json", d_model=64)  # every tensor is now of another shape: the first one named
    assert_refused(folder, str(folder / "model.safetensors"), "model.shared.weight (the embedding) has shape "
            f"({vocab}, 32); config.json makes it ({vocab}, 64)")

    folder = copy(folders, "marian", tmp_path)
    edit_weights(folder, lambda w: w.update({"model.decoder.layers.1.fc1.weight": torch.randn(63, 32)}))
    assert_refused(folder, "model.decoder.layers.1.fc1.weight has shape (63, 32); config.json makes it (64, 32)")

    folder = tmp_path / "layers"
    shutil.copytree(folders["m2m"], folder)
    edit_json(folder / "config.json", encoder_layers=1)  # the weights hold 2
    assert_refused(folder, "model.encoder.layers.1.", "is beyond config.json's encoder_layers 1")
    edit_json(folder / "config.json", encoder_layers=3)
    assert_refused(folder, "the weights lack model.encoder.layers.2.")


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_truncated_weights_file_is_refused(folders, tmp_path, name):
    folder = copy(folders, "marian", tmp_path)
    if name == "pytorch_model.bin":
        torch.save(load_file(str(folder / "model.safetensors")), folder / name)
        os.remove(folder / "model.safetensors")
        fastformer.from_transformers(str(folder))  # whole, it converts
    truncate(folder / name)
    assert_refused(folder, f"{folder / name} does not load (truncated or corrupt: ")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_conversion_naming_the_tensor(folders, tmp_path, value):
    folder = copy(folders, "m2m", tmp_path)

    def poison(weights):
        weights["model.encoder.layers.0.fc2.weight"][3, 4] = value
    edit_weights(folder, poison)
    assert_refused(folder, str(folder / "model.safetensors"), "model.encoder.layers.0.fc2.weight holds 1 non-finite "
            "value (NaN or inf)")
    with pytest.raises(SystemExit, match="model.encoder.layers.0.fc2.weight holds 1 non-finite value"):
        convert_main([str(folder), "--out", str(tmp_path / "x.pt")])
    assert not (tmp_path / "x.pt").exists()


def test_a_checkpoint_with_nan_weights_is_refused_at_load_naming_the_tensor(folders, tmp_path):
    """A converted checkpoint whose weight became NaN afterwards: load_model (and so translate, evaluate,
    convert) refuses it as it refuses a corrupt checkpoint, instead of decoding NaN logits."""
    from fastformer.translate import main as translate_main

    path = tmp_path / "model.pt"
    convert_main([folders["marian"], "--out", str(path)])
    state = ckpt.load(str(path))
    state["model"]["decoder.layers.1.ffn.fc1.weight"][0, 0] = float("nan")
    ckpt.save(state, str(path))
    with pytest.raises(ckpt.CheckpointError, match="decoder.layers.1.ffn.fc1.weight holds 1 non-finite value"):
        ckpt.load_model(str(path))
    with pytest.raises(SystemExit, match=f"error: {path}: decoder.layers.1.ffn.fc1.weight holds 1 non-finite"):
        translate_main(["--checkpoint", str(path), "--input", os.devnull])
