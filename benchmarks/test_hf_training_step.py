"""A transformers Marian training step (forward + backward) with attn_implementation="fastformer"
(fastformer/hf.py) beside transformers' own "sdpa" and "eager" attention, in target tokens per second.

The model: opus-mt-de-en's shape (d_model 512, 6+6 layers, 8 heads, d_ff 2048, swish) with the size
profile's vocabulary (default 8,000: the 58,101 of opus-mt would make the step mostly the output
projection) and random weights; smoke sizes use a 2+2-layer d_model 64 model. The batch: 32 sentence pairs
(smoke: 4) of source and target lengths uniform in [max/2, max], max 32 tokens, right-padded, so every
attention call gets a padding mask. The step: the mean label-smoothed (0.1) cross-entropy over the
non-pad target tokens, backward; no optimizer step (the same for every attention). "fastformer" runs
on each fastformer backend of the benchmark device; all of them in float32 (issue 37's target is the CPU's).
On the CPU each fastformer case also runs "sdpa" and "eager" in every one of its rounds (in a rotating
order, before the fastformer step), and its speed-ups are the medians of those rounds: side by side, so that
the machine's drift over the run cancels. At least 9 rounds (the default size profile's minimum is 3): the
attention is a small part of the step and the projections' GEMMs, the same for every attention, most of it,
so the ratios sought are within a few percent of 1, about a round's noise (the figures: docs/benchmarks.md,
"Rounds and alternation"). The baseline rows are their own cases, timed alone. Without transformers the module
skips, the reason naming the extra that brings it (harness.need).
"""
import torch

import fastformer
from harness import need  # benchmarks/ is on sys.path (pytest inserts a conftest's folder)

transformers = need("transformers")
import fastformer.hf  # noqa: E402, F401  (registers attn_implementation="fastformer"; needs transformers)

BASELINES = ("sdpa", "eager")


def marian(ctx):
    smoke = ctx.sizes.name == "smoke"
    d, layers, heads, ff = (64, 2, 2, 128) if smoke else (512, 6, 8, 2048)
    config = transformers.MarianConfig(vocab_size=ctx.sizes.vocab_size, d_model=d, encoder_layers=layers,
                                       decoder_layers=layers, encoder_attention_heads=heads,
                                       decoder_attention_heads=heads, encoder_ffn_dim=ff, decoder_ffn_dim=ff,
                                       max_position_embeddings=512, activation_function="swish",
                                       pad_token_id=0, decoder_start_token_id=0)
    return transformers.MarianMTModel(config)


def test_hf_marian_training_step(bench, ctx, impl):
    model = marian(ctx).to(ctx.device).train()
    n = 4 if ctx.sizes.name == "smoke" else 32
    torch.manual_seed(1)  # the same batch for every impl, whatever drew from the generator before
    src = ctx.tokens(n, 16, 32, 0, ctx.sizes.vocab_size)
    tgt = ctx.tokens(n, 16, 32, 0, ctx.sizes.vocab_size)
    labels = tgt.masked_fill(tgt.eq(0), -100)
    backend = None if impl in BASELINES else impl

    def step_with(attention):
        def step():
            model.set_attn_implementation(attention)
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=src, attention_mask=src.ne(0), decoder_input_ids=tgt,
                           decoder_attention_mask=tgt.ne(0)).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1)
            loss.backward()
        return step

    # fastformer on the CPU: timed in alternation with both baselines (Bench's turns_with), round by round
    turns_with = ({name: step_with(name) for name in BASELINES}
                  if backend is not None and ctx.device.type == "cpu" else None)
    fastformer.set_backend(backend)
    try:
        tokens = int(tgt.ne(0).sum())
        bench(step_with(impl if impl in BASELINES else "fastformer"), op="hf_marian_training_step",
              shape=f"opus-mt shape, {n} pairs <= 32 tokens ({tokens} target)",
              pass_="fwd+bwd, float32", impl=impl if impl in BASELINES else f"fastformer ({impl})",
              baseline=impl in BASELINES, per_second={"tokens/s": tokens}, turns_with=turns_with,
              min_rounds=1 if ctx.sizes.name == "smoke" else 9)
    finally:
        fastformer.set_backend(None)
