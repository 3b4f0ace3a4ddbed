"""python -m fastformer.convert SOURCE --out CHECKPOINT [--quantize int8]: a fastformer checkpoint of a model.

SOURCE is a transformers model folder (config.json: MarianMT or M2M-100/NLLB, read offline by
fastformer/hf_convert.py), or a fastformer checkpoint file or run folder (its latest checkpoint). With ``--quantize int8`` the
written checkpoint holds ``fastformer.quantize``'s model: the projections' int8 weights and per-channel
scales, no float copy of them (fastformer/checkpoint.py ``model_state``), which ``translate``, ``evaluate``
and ``checkpoint.load_model`` load as the int8 model, giving the same tokens as quantizing after load.
Without it the model is written as it is (float32, or int8 already), without the training state
(optimizer, resume state): a checkpoint to ship.

A transformers folder's checkpoint also records where it came from (``source``: the family and the folder).

What cannot be read correctly ends the program with exit status 1 and one line naming the file (and the
field or tensor), no traceback: ``hf_convert.ConversionError`` (a config.json that is not JSON or lacks a
field, weights that are truncated, hold NaN or inf, or disagree with the config in shape, a missing
tokenizer file that decides the ids, e.g. an M2M-100 folder without vocab.json) and
``checkpoint.CheckpointError`` (a corrupt fastformer checkpoint, or one whose weights are not finite).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from fastformer import checkpoint as ckpt
from fastformer.cli import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    from fastformer.nn.quantize import QUANTIZATIONS

    p = argparse.ArgumentParser(prog="python -m fastformer.convert",
                                description="Write a checkpoint of a model to ship: its weights (quantized with "
                                            "--quantize), config and tokenizer, without the training state.",
                                formatter_class=HelpFormatter)
    p.add_argument("source", metavar="SOURCE",
                   help="a transformers model folder (MarianMT, M2M-100 or NLLB: config.json, model.safetensors or "
                        "pytorch_model.bin, the tokenizer files), or a fastformer checkpoint file or run folder "
                        "(its latest)")
    p.add_argument("--out", required=True, metavar="CHECKPOINT", help="the checkpoint file to write")
    p.add_argument("--quantize", choices=QUANTIZATIONS,
                   help="quantize the model's projections (int8: weights per output channel, as "
                        "fastformer.quantize; the model then runs on the CPU) (default: as SOURCE holds it)")
    p.add_argument("--force", action="store_true", help="overwrite CHECKPOINT if it exists")
    return p


def convert(source: str, out: str, quantize: str | None = None) -> dict:
    """Writes the checkpoint of ``source``'s model (quantized with ``quantize``) to ``out``; returns its state."""
    from fastformer.nn.quantize import quantize as quantize_model

    if os.path.isfile(os.path.join(source, "config.json")):
        from fastformer.hf_convert import ConversionError, from_transformers

        try:
            model, tokenizer = from_transformers(source)
        except ConversionError as exc:  # its message names the file (and the field or tensor)
            raise ckpt.CheckpointError(str(exc)) from exc
        with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
            family = json.load(f).get("model_type")
        extra = {"source": {"transformers": family, "folder": os.path.abspath(source)}}
    else:
        state = ckpt.load(source)
        stored = ckpt.quantization(state)
        if quantize is not None and stored is not None:
            raise ckpt.CheckpointError(f"{source} holds an {stored} model already; --quantize takes a float checkpoint")
        model, tokenizer, _ = ckpt.from_state(state, source)
        extra = {key: state[key] for key in ("data", "step", "source") if key in state}
    if quantize is not None:
        model = quantize_model(model.float(), quantize)
    written = ckpt.model_state(model, tokenizer, **extra)
    ckpt.save(written, out)
    return written


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if os.path.exists(args.out) and not args.force:
        raise SystemExit(f"error: {args.out} exists (use --force to overwrite it)")
    try:
        state = convert(args.source, args.out, args.quantize)
    except ckpt.CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from exc
    kind = state.get("quantization") or "float"
    print(f"wrote the {kind} checkpoint {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB)", file=sys.stderr)


if __name__ == "__main__":
    main()
