"""python -m fastformer.visualize: attention heatmaps of a sentence and its translation, per layer and head
(like figures 3 to 5 of the paper): encoder self-attention and decoder cross-attention."""
from __future__ import annotations

import argparse
import os

import torch

from fastformer import checkpoint as ckpt
from fastformer.cli import HelpFormatter, int_at_least
from fastformer.data.batching import collate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastformer.visualize",
                                description="Translate one sentence and draw its attention weights as PNG heatmaps: "
                                            "one figure per encoder layer (self-attention) and per decoder layer "
                                            "(cross-attention), one panel per head.",
                                formatter_class=HelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="P", help="checkpoint file, or run folder (its latest)")
    p.add_argument("--text", required=True, help="the source sentence")
    p.add_argument("--out", default="attention.png",
                   help="output path; figures are written as <stem>_encoder_layer<i>.png and "
                        "<stem>_decoder_cross_layer<i>.png beside it")
    p.add_argument("--beam", type=int_at_least(1), default=4, help="beam size of the translation")
    return p


def main(argv: list[str] | None = None) -> list[str]:
    args = build_parser().parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("visualize needs matplotlib: pip install matplotlib") from exc
    model, tokenizer, _ = ckpt.load_model_or_exit(args.checkpoint)
    src_ids = tokenizer.encode([args.text])[0]
    cfg = model.config
    src = collate([src_ids], pad_id=cfg.pad_id, eos_id=cfg.eos_id)
    hyp = model.generate(src, beam_size=args.beam)[0]
    tgt_in = torch.tensor([[cfg.start_id] + hyp])
    for module in model.modules():
        if hasattr(module, "record_attention"):
            module.record_attention = True
    with torch.no_grad():
        model(src, tgt_in)
    pieces = tokenizer.pieces()
    src_tokens = [pieces[i] for i in src_ids] + [pieces[cfg.eos_id]]
    tgt_tokens = [pieces[cfg.start_id]] + [pieces[i] for i in hyp]
    stem, ext = os.path.splitext(args.out)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    ext = ext or ".png"
    written = []
    panels = [(f"encoder self-attention, layer {i + 1}", f"{stem}_encoder_layer{i + 1}{ext}",
               layer.self_attn.last_attention[0], src_tokens, src_tokens) for i, layer in enumerate(model.encoder.layers)]
    panels += [(f"decoder cross-attention, layer {i + 1}", f"{stem}_decoder_cross_layer{i + 1}{ext}",
                layer.cross_attn.last_attention[0], tgt_tokens, src_tokens) for i, layer in enumerate(model.decoder.layers)]
    for title, path, weights, rows, cols in panels:  # weights (H, Lq, Lk)
        heads = weights.shape[0]
        fig, axes = plt.subplots(1, heads, figsize=(3.2 * heads + 1, 3.2 + 0.12 * len(rows)), squeeze=False)
        for h, ax in enumerate(axes[0]):
            ax.imshow(weights[h].float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_title(f"head {h + 1}", fontsize=9)
            ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=6)
            ax.set_yticks(range(len(rows)), rows if h == 0 else [""] * len(rows), fontsize=6)
        fig.suptitle(f"{title}: {args.text[:60]}", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    print(f"translation: {tokenizer.decode([hyp])[0]}")
    print("wrote " + ", ".join(written))
    return written


if __name__ == "__main__":
    main()
