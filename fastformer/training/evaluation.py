"""Evaluation during and after training (main process only): dev loss and greedy dev BLEU every
--eval-every updates; at the end, test BLEU and chrF with beam search (optionally on the average of the
last checkpoints), the translations written to test.txt."""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch

from fastformer import checkpoint as ckpt
from fastformer.data import collate, token_batches
from fastformer.training.step import loss_sums
from fastformer.translation import score, translate

if TYPE_CHECKING:
    from fastformer.training.setup import Run


@torch.no_grad()
def dev_loss(model, src_ids, tgt_ids, max_tokens, pad_id, device) -> float:
    """Per-token NLL (nats) on the dev split, no label smoothing, no dropout."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in token_batches(src_ids, tgt_ids, max_tokens, shuffle=False):
        src, tgt_in, tgt_out = collate([src_ids[i] for i in batch], [tgt_ids[i] for i in batch])
        count += int(tgt_out.ne(pad_id).sum())
        _, nll = loss_sums(model, src.to(device), tgt_in.to(device), tgt_out.to(device), pad_id, 0.0,
                           backend=model.backend)
        total += float(nll)
    model.train(was_training)
    return total / max(count, 1)


def evaluate_dev(run: Run) -> None:
    """Dev loss and greedy dev BLEU on the first --eval-sentences, logged and printed. The model is left in the
    mode it was in (translate puts it in eval mode): training continues with its dropout."""
    args, corpus, step = run.args, run.corpus, run.state["step"]
    was_training = run.model.training
    loss = dev_loss(run.model, *run.ids["dev"], args.max_tokens, run.config.pad_id, run.procs.device)
    n = min(args.eval_sentences, len(corpus.src["dev"]))
    hyps = translate(run.model, run.tokenizer, corpus.src["dev"][:n], beam=1, device=run.procs.device)
    run.model.train(was_training)
    bleu = score(hyps, corpus.tgt["dev"][:n])["bleu"]
    run.log.write({"kind": "dev", "step": step, "dev_loss": round(loss, 4), "dev_bleu_greedy": bleu,
                   "dev_sentences": n})
    run.procs.say(f"update {step}: dev loss {loss:.3f}, dev BLEU (greedy, {n} sentences) {bleu:.2f}")
    run.last_dev_step = step


def final_test(run: Run) -> dict:
    """Test BLEU and chrF with beam search (--beam, --lenpen), on the average of the last --average-last
    checkpoints when > 1; prints a few sample translations."""
    args, corpus, say = run.args, run.corpus, run.procs.say
    if args.average_last > 1:
        paths = ckpt.list_checkpoints(run.run_dir)[-args.average_last:]
        run.model.load_state_dict(ckpt.average(paths)["model"])
        say(f"testing the average of {len(paths)} checkpoints: {', '.join(os.path.basename(p) for p in paths)}")
    start = time.monotonic()
    hyps = translate(run.model, run.tokenizer, corpus.src["test"], beam=args.beam, lenpen=args.lenpen,
                     device=run.procs.device, progress=True)
    seconds = time.monotonic() - start
    scores = score(hyps, corpus.tgt["test"])
    with open(os.path.join(run.run_dir, "test.txt"), "w") as f:
        f.write("\n".join(hyps) + "\n")
    run.log.write({"kind": "test", "step": run.state["step"], "bleu": scores["bleu"], "chrf": scores["chrf"],
                   "signature": scores["bleu_signature"], "sentences": len(hyps), "seconds": round(seconds, 1)})
    say(f"test BLEU {scores['bleu']:.2f}  chrF {scores['chrf']:.2f}  ({len(hyps)} sentences, beam {args.beam}, "
        f"lenpen {args.lenpen}, {seconds:.0f} s)\n  {scores['bleu_detail']}\n  signature: {scores['bleu_signature']}")
    for i in range(min(5, len(hyps))):
        say(f"  src: {corpus.src['test'][i]}\n  ref: {corpus.tgt['test'][i]}\n  hyp: {hyps[i]}")
    return {"test_bleu": scores["bleu"], "test_chrf": scores["chrf"], "bleu_signature": scores["bleu_signature"]}
