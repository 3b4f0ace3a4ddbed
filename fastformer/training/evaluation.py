"""Evaluation during and after training (main process only): dev loss and greedy dev BLEU every
--eval-every updates; at the end, test BLEU and chrF with beam search (optionally on the average of the
last checkpoints), the translations written to test.txt. A fine-tuning run (--init) also evaluates the model
as loaded, before its first update (test translations in test_init.txt), and its summary holds both."""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch

from fastformer import checkpoint as ckpt
from fastformer.data import collate, token_batches
from fastformer.training.batches import special_ids
from fastformer.training.step import loss_sums
from fastformer.translation import score, translate

if TYPE_CHECKING:
    from fastformer.training.run import Run


@torch.no_grad()
def dev_loss(model, src_ids, tgt_ids, max_tokens, pad_id, device) -> float:
    """Per-token NLL (nats) on the dev split, no label smoothing, no dropout."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in token_batches(src_ids, tgt_ids, max_tokens, shuffle=False):
        src, tgt_in, tgt_out = collate([src_ids[i] for i in batch], [tgt_ids[i] for i in batch],
                                       **special_ids(model.config))
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
    checkpoints when > 1; the translations in test.txt; prints a few sample translations."""
    args = run.args
    if args.average_last > 1:
        paths = ckpt.list_checkpoints(run.run_dir)[-args.average_last:]
        run.model.load_state_dict(ckpt.average(paths)["model"])
        names = ", ".join(os.path.basename(p) for p in paths)
        run.procs.say(f"testing the average of {len(paths)} checkpoints: {names}")
    return translate_test(run, "test.txt")


def translate_test(run: Run, filename: str) -> dict:
    """run.model's test BLEU and chrF with beam search (--beam, --lenpen), logged and printed with a few
    sample translations; the translations written to ``filename`` in the run folder."""
    args, corpus, say = run.args, run.corpus, run.procs.say
    start = time.monotonic()
    hyps = translate(run.model, run.tokenizer, corpus.src["test"], beam=args.beam, lenpen=args.lenpen,
                     device=run.procs.device, progress=True)
    seconds = time.monotonic() - start
    scores = score(hyps, corpus.tgt["test"])
    with open(os.path.join(run.run_dir, filename), "w") as f:
        f.write("\n".join(hyps) + "\n")
    run.log.write({"kind": "test", "step": run.state["step"], "bleu": scores["bleu"], "chrf": scores["chrf"],
                   "signature": scores["bleu_signature"], "sentences": len(hyps), "seconds": round(seconds, 1)})
    say(f"update {run.state['step']}: test BLEU {scores['bleu']:.2f}  chrF {scores['chrf']:.2f}  ({len(hyps)} "
        f"sentences, beam {args.beam}, lenpen {args.lenpen}, {seconds:.0f} s)\n  {scores['bleu_detail']}\n"
        f"  signature: {scores['bleu_signature']}")
    for i in range(min(5, len(hyps))):
        say(f"  src: {corpus.src['test'][i]}\n  ref: {corpus.tgt['test'][i]}\n  hyp: {hyps[i]}")
    return {"test_bleu": scores["bleu"], "test_chrf": scores["chrf"], "bleu_signature": scores["bleu_signature"]}


def evaluate_init(run: Run) -> None:
    """--init: the model as loaded, before the first update: dev loss and dev BLEU (with --eval-every > 0, as at
    the end) and test BLEU (unless --no-test), in the log at update 0; the test translations in test_init.txt."""
    if run.args.eval_every:
        evaluate_dev(run)
    if not run.args.no_test:
        translate_test(run, "test_init.txt")


def fine_tuning_gain(run: Run) -> dict:
    """A fine-tuning run's summary entries: the --init checkpoint, and for dev BLEU (greedy) and test BLEU the
    score before the first update and at the end (the log's records at update 0 and at the last update, so a
    resumed run reports its whole course), printed as one line. Empty for a run without --init."""
    if not run.args.init:
        return {}
    step, records = run.state["step"], run.log.records()

    def scores(kind: str, key: str) -> list | None:
        at = {r["step"]: r[key] for r in records if r.get("kind") == kind}
        return [at[0], at[step]] if 0 in at and step in at else None

    found = {name: pair for name, pair in (("dev_bleu_greedy", scores("dev", "dev_bleu_greedy")),
                                           ("test_bleu", scores("test", "bleu"))) if pair is not None}
    if found:
        run.procs.say(f"fine-tuning {run.args.init} for {step} updates: " + ", ".join(
            f"{name} {a:.2f} -> {b:.2f} ({b - a:+.2f})" for name, (a, b) in found.items()))
    return {"init": run.args.init, "before_and_after": found}
