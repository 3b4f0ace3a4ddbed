"""Transformer.generate (batched beam search, beam 4) with and without the key/value cache, in sentences
per second.

An untrained model of the sizes' config (fixed seed) translates ``gen_sentences`` random source sentences
(lengths uniform in ``gen_src_len``) with max_len_a 0 and max_len_b ``gen_tgt_len``. Its eos embedding
row is zeroed, so eos's logit is 0 (the median of a random model's logits) and never beats the top
candidates before the length limit forces it: every hypothesis has exactly ``gen_tgt_len`` tokens, and
every backend and cache setting does the same decoding steps (checked). Without the cache each step
recomputes the whole prefix; the speedup of "cache" is over "no cache" of the same backend.
"""
import pytest
import torch

from fastformer.nn import Transformer


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "nocache"])
def test_generate(bench, ctx, impl, use_cache):
    config, n, (shortest, longest), length = (ctx.model_config(), ctx.sizes.gen_sentences, ctx.sizes.gen_src_len,
                                              ctx.sizes.gen_tgt_len)
    model = Transformer(config, backend=impl).to(ctx.device).eval()
    with torch.no_grad():
        model.embed.weight[config.eos_id].zero_()
    src = ctx.tokens(n, shortest, longest, config.pad_id, config.vocab_size)

    def generate():
        with ctx.autocast():
            return model.generate(src, beam_size=4, max_len_a=0.0, max_len_b=length, use_cache=use_cache)

    shape = f"{ctx.sizes.model}, {n} sentences of {shortest}-{longest} tokens -> {length}, beam 4"
    out = bench(generate, op="generate", shape=shape, pass_="cache" if use_cache else "no cache", impl=impl,
                group=f"generate {impl} {shape}", baseline=not use_cache,
                per_second={"sentences/s": n, "tokens/s": n * length})
    assert [len(tokens) for tokens in out] == [length] * n
