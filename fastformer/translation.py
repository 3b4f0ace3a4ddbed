"""Batch translation and scoring shared by the train, translate and evaluate commands."""
from __future__ import annotations

import sys
import time

import torch

from fastformer import cli
from fastformer.data.batching import collate
from fastformer.data.tokenizer import Tokenizer
from fastformer.nn import Transformer
from fastformer.nn import decoding


@torch.no_grad()
def translate(model: Transformer, tokenizer: Tokenizer, sentences: list[str], *, beam: int = decoding.BEAM_SIZE,
              lenpen: float = decoding.LENGTH_PENALTY, max_len_a: float = decoding.MAX_LEN_A,
              max_len_b: int = decoding.MAX_LEN_B, batch_tokens: int = 6000, device="cpu",
              progress: bool = False, stats: dict | None = None, source_lang: str | None = None,
              target_lang: str | None = None) -> list[str]:
    """Detokenized translations of ``sentences``, in order. Sentences are sorted by length into batches
    of at most ``batch_tokens`` source tokens (times the beam) so little compute goes to padding.
    ``stats``, if given, receives sentences, target tokens (eos included) and seconds spent decoding.
    ``source_lang`` and ``target_lang``: language codes of a converted multilingual model (NLLB's
    ``deu_Latn``, M2M-100's ``de``): the source's language token, and the target's, forced first (by default
    the tokenizer's ``target_lang``: the language a model was fine-tuned into, ``train --init``)."""
    forced = None
    if target_lang is None:
        target_lang = getattr(tokenizer, "target_lang", None)
    if source_lang is not None or target_lang is not None:
        if not hasattr(tokenizer, "language_id"):
            raise ValueError("--source-lang/--target-lang apply to converted multilingual models (NLLB, M2M-100); "
                             "this model's tokenizer has no language codes")
        if source_lang is not None:
            tokenizer.set_source_lang(source_lang)
        if target_lang is not None:
            forced = [tokenizer.language_id(target_lang)]
    cfg = model.config
    ids = tokenizer.encode(sentences)
    max_positions = model.config.max_positions
    ids = [s[: max_positions - 1] for s in ids]  # leave room for the eos
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    budget = max(1, batch_tokens // max(1, beam))
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * (len(ids[i]) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    out: list[str] = [""] * len(sentences)
    model.eval()
    start, tokens = time.perf_counter(), 0
    with cli.progress(total=len(sentences), desc="translate", unit="sent", disable=not progress, leave=False) as bar:
        for batch in batches:
            src = collate([ids[i] for i in batch], pad_id=cfg.pad_id, eos_id=cfg.eos_id).to(device)
            hyps = model.generate(src, beam_size=beam, length_penalty=lenpen, max_len_a=max_len_a, max_len_b=max_len_b,
                                  forced_tokens=forced)
            for i, text in zip(batch, tokenizer.decode(hyps)):
                out[i] = text
            tokens += sum(len(h) + 1 for h in hyps)
            bar.update(len(batch))
    if stats is not None:
        stats.update(sentences=len(sentences), tokens=tokens, seconds=time.perf_counter() - start)
    return out


def translate_lines(model: Transformer, tokenizer: Tokenizer, sentences: list[str | None], **kwargs) -> list[str]:
    """translate() of the lines that are not None (read_sentences' unreadable or empty lines), aligned with
    ``sentences``: a None line gives an empty translation."""
    good = [i for i, s in enumerate(sentences) if s is not None]
    out = [""] * len(sentences)
    for i, hyp in zip(good, translate(model, tokenizer, [sentences[i] for i in good], **kwargs)):
        out[i] = hyp
    return out


def report_line_problems(prog: str, problems: dict[int, str], what: str, consequence: str) -> None:
    """One stderr line per problem: ``<prog>: <what> <number>: <why>; <consequence>``."""
    for number, why in problems.items():
        print(f"{prog}: {what} {number}: {why}; {consequence}", file=sys.stderr)


def add_decoding_arguments(parser) -> None:
    """The flags every translating command shares: beam search settings (defaults: fastformer/nn/decoding.py,
    the same as ``Transformer.generate``'s), backend and device."""
    parser.add_argument("--beam", type=cli.int_at_least(1), default=decoding.BEAM_SIZE, help="beam size (1: greedy)")
    parser.add_argument("--lenpen", type=cli.float_at_least(0.0), default=decoding.LENGTH_PENALTY,
                        help="GNMT length penalty alpha (>= 0)")
    parser.add_argument("--max-len-a", type=cli.float_at_least(0.0), default=decoding.MAX_LEN_A,
                        help="a sentence of n source tokens (its eos included) gets at most floor(a n + b) target "
                             "tokens before its eos")
    parser.add_argument("--max-len-b", type=cli.int_at_least(1), default=decoding.MAX_LEN_B, help="see --max-len-a (>= 1)")
    parser.add_argument("--backend", help="fastformer op backend (default: the best for the device)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when a GPU is visible, else cpu; cpu with "
                                         "--quantize)")


def add_quantize_argument(parser) -> None:
    """--quantize: translate with ``fastformer.quantize(model, ...)`` (the CPU only)."""
    from fastformer.nn.quantize import QUANTIZATIONS

    parser.add_argument("--quantize", choices=QUANTIZATIONS,
                        help="quantize the model's projections before translating (int8: weights per output "
                             "channel, activations per row, as CTranslate2's int8; CPU only; docs/decoding.md). "
                             "An int8 checkpoint (python -m fastformer.convert --quantize int8) is int8 already "
                             "(default: as the checkpoint holds it: float32, or int8)")


def load_for_translation(prog: str, args):
    """The checkpoint's model (quantized if --quantize), tokenizer and state, for translate and evaluate; sets
    args.device when it was not given. A bad checkpoint or a bad combination of flags ends the program with
    its message."""
    from fastformer import checkpoint as ckpt
    from fastformer.nn.quantize import quantize

    try:  # an int8 checkpoint's model is quantized already, and runs on the CPU
        state = ckpt.load(args.checkpoint)
    except ckpt.CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from exc
    stored = ckpt.quantization(state)
    if args.quantize and stored is not None and args.quantize != stored:
        raise SystemExit(f"{prog}: error: {args.checkpoint} holds an {stored} model; it cannot be quantized to "
                         f"{args.quantize} (--quantize takes a float checkpoint)")
    on_cpu = args.quantize or stored
    if args.device is None:
        args.device = "cpu" if on_cpu or not torch.cuda.is_available() else "cuda"
    if on_cpu and torch.device(args.device).type != "cpu":
        what = f"--quantize {args.quantize}" if args.quantize else f"the {stored} checkpoint"
        raise SystemExit(f"{prog}: error: {what} runs on the CPU; use --device cpu")
    try:
        model, tokenizer, state = ckpt.from_state(state, args.checkpoint, backend=args.backend, device=args.device)
    except ckpt.CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from exc
    if args.quantize and stored is None:
        model = quantize(model.float(), args.quantize)
    return model, tokenizer, state


def score(hypotheses: list[str], references: list[str]) -> dict:
    """sacrebleu BLEU (13a tokenization, on detokenized text) and chrF, with their signatures."""
    import sacrebleu

    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2), "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature()), "bleu_detail": str(b)}
