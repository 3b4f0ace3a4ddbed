"""Checkpoints: written atomically (temporary file, then rename), loaded with ``weights_only=True``.

A checkpoint is a dict of tensors and plain values: ``config`` (TransformerConfig as a dict), ``model``
(state dict), ``tokenizer`` (the sentencepiece model's bytes as a uint8 tensor), ``data`` (how the corpus
was chosen), ``step``, and for resuming ``optimizer``, ``train_state`` and ``ranks`` (each training
process's batch position and RNG states; see fastformer.training.resume). A quantized model's checkpoint
(``model_state`` of a ``fastformer.quantize`` model; ``python -m fastformer.convert --quantize int8``)
also holds ``quantization`` ("int8"): its state dict holds the projections' int8 weights and scales
(fastformer/nn/linear.py ``Int8Linear``, ``Int8Embedding``), and ``load_model`` gives the quantized model
back, on the CPU (the int8 checkpoints of 9aea6a7's format too: ``Transformer`` maps their keys on load).
A file that does not load, lacks an entry, or whose weights do not fit its config or hold NaN or inf
(``nonfinite``) is refused with ``CheckpointError`` naming the file (and the tensor).
Files are ``checkpoint_<step>.pt`` in the run folder; the last ``keep`` are kept.
"""
from __future__ import annotations

import glob
import os
import re

import torch

from fastformer.data.tokenizer import Tokenizer, tokenizer_from_state, tokenizer_state
from fastformer.nn import Transformer, TransformerConfig

_NAME = re.compile(r"checkpoint_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    pass


def save(state: dict, path: str) -> None:
    """Write ``path`` whole or not at all: a temporary file, flushed to disk, then renamed over it. A run
    killed during the write leaves ``<path>.tmp`` (ignored, removed by the next run) and the previous
    checkpoints intact."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_partial(run_dir: str) -> None:
    """Delete the temporary files of checkpoint writes that were cut short."""
    for path in glob.glob(os.path.join(run_dir, "checkpoint_*.pt.tmp")):
        os.remove(path)


def list_checkpoints(run_dir: str) -> list[str]:
    """Checkpoint files of a run folder, oldest first (by step)."""
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(run_dir, "checkpoint_*.pt"))
             if (m := _NAME.search(os.path.basename(p)))]
    return [p for _, p in sorted(found)]


def prune(run_dir: str, keep: int) -> None:
    for path in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        os.remove(path)


def resolve(path: str) -> str:
    """A checkpoint file, or a run folder's latest checkpoint."""
    if os.path.isdir(path):
        found = list_checkpoints(path) or sorted(glob.glob(os.path.join(path, "*.pt")))
        if not found:
            raise CheckpointError(f"{path} holds no checkpoint_*.pt file")
        return found[-1]
    if not os.path.exists(path):
        raise CheckpointError(f"no such checkpoint file or run folder: {path}")
    return path


def load(path: str) -> dict:
    path = resolve(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which and why
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{path} is not a readable fastformer checkpoint (corrupt, truncated or not a "
                              f"checkpoint: {type(exc).__name__}: {reason[:120]})") from exc
    missing = [key for key in ("config", "model", "tokenizer") if not isinstance(state, dict) or key not in state]
    if missing:
        raise CheckpointError(f"{path} is not a fastformer checkpoint: missing {', '.join(missing)}")
    return state


def nonfinite(tensors: dict) -> str | None:
    """The first floating-point tensor of a state dict that holds NaN or inf, described ("NAME holds K
    non-finite values (NaN or inf) of N"), or None where every value is finite. A model with such a weight
    gives NaN logits (a diverged training run, a corrupt file): loading and converting refuse it, naming
    the tensor. One pass over the weights (isfinite, then a count only where it fails)."""
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            return f"{name} holds {bad} non-finite value{'s' if bad > 1 else ''} (NaN or inf) of {tensor.numel()}"
    return None


def model_state(model: Transformer, tokenizer: Tokenizer, **extra) -> dict:
    """A checkpoint of ``model`` (float or quantized) and its tokenizer, with ``extra`` entries (e.g. data)."""
    state = {"config": model.config.to_dict(), "model": model.state_dict(),
             "tokenizer": tokenizer_state(tokenizer), **extra}
    if model.quantization is not None:
        state["quantization"] = model.quantization
    return state


def quantization(state: dict) -> str | None:
    """The quantization of a checkpoint's model ("int8"), or None for a float model."""
    return state.get("quantization")


def load_model(path: str, backend: str | None = None, device: str = "cpu") -> tuple[Transformer, Tokenizer, dict]:
    """The model (eval mode) and tokenizer of a checkpoint file or run folder, and the raw state. The model of
    an int8 checkpoint is quantized (``fastformer.quantize``'s), and runs on the CPU only."""
    return from_state(load(path), path, backend=backend, device=device)


def from_state(state: dict, path: str, backend: str | None = None,
               device: str = "cpu") -> tuple[Transformer, Tokenizer, dict]:
    """load_model of a state ``load(path)`` has read already."""
    from fastformer.nn.quantize import QUANTIZATIONS, prepare

    quantized = quantization(state)
    if quantized is not None and quantized not in QUANTIZATIONS:
        raise CheckpointError(f"{resolve(path)}: unknown quantization {quantized!r} (known: {', '.join(QUANTIZATIONS)})")
    if quantized is not None and torch.device(device).type != "cpu":
        raise CheckpointError(f"{resolve(path)} holds an {quantized} model, which runs on the CPU; load it with "
                              f"device 'cpu' (--device cpu), not {device!r}")
    bad = nonfinite(state["model"]) if isinstance(state["model"], dict) else None
    if bad is not None:
        raise CheckpointError(f"{resolve(path)}: {bad}: its weights are not finite (a diverged or corrupt model)")
    try:
        config = TransformerConfig.from_dict(state["config"])
        model = Transformer(config, backend=backend)
        if quantized is not None:
            model = prepare(model, quantized)
        model.load_state_dict(state["model"])
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{resolve(path)}: weights do not match the stored config ({exc})") from exc
    try:
        tokenizer = tokenizer_from_state(state["tokenizer"])
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{resolve(path)}: unreadable tokenizer ({exc})") from exc
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(f"{resolve(path)}: tokenizer has {tokenizer.vocab_size} pieces, model {config.vocab_size}")
    if len(tokenizer.source_pieces()) != config.source_vocab_size:
        raise CheckpointError(f"{resolve(path)}: tokenizer has {len(tokenizer.source_pieces())} source pieces, model "
                              f"{config.source_vocab_size}")
    return model.to(device).eval(), tokenizer, state


def load_model_or_exit(path: str, backend: str | None = None, device: str = "cpu"):
    """load_model for the command-line tools: a bad checkpoint ends the program with its message."""
    try:
        return load_model(path, backend=backend, device=device)
    except CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from exc


def average(paths: list[str]) -> dict:
    """The first checkpoint's state with its model weights replaced by the mean over all of them
    (float parameters averaged in float64), as the paper averaged its last checkpoints."""
    if not paths:
        raise CheckpointError("nothing to average")
    states = [load(p) for p in paths]
    first = states[0]
    for p, s in zip(paths[1:], states[1:]):
        if s["config"] != first["config"] or s["model"].keys() != first["model"].keys():
            raise CheckpointError(f"{p} has a different model than {paths[0]}; cannot average them")
    averaged = {}
    for name, tensor in first["model"].items():
        if tensor.is_floating_point():
            total = sum(s["model"][name].double() for s in states)
            averaged[name] = (total / len(states)).to(tensor.dtype)
        else:
            averaged[name] = tensor
    keep = {k: first[k] for k in ("config", "tokenizer", "data", "args", "step") if k in first}
    return {**keep, "model": averaged, "averaged_from": [os.path.basename(p) for p in paths]}
