"""Beam-search decoding, side by side on the same weights: fastformer's ``generate`` against a plain-PyTorch
decoder (benchmarks/plain_decoder.py, run by the same search) and against CTranslate2 on the model that
``python -m fastformer.export --ctranslate2`` writes (when ctranslate2 is installed and the device is the CPU).

A seeded random model of the config (small and base; tiny for --bench-sizes smoke) translates ``batch``
random 20-token sentences with beam 1 or 4, length penalty 0.6, max_len_a 0 and max_len_b 30 (smoke: 4).
Its eos embedding row is zeroed, so eos never beats the top candidates before the limit: every contender
decodes the same steps, and the test asserts that all of them return the same tokens.

pytest-benchmark times ``generate``; then the contenders run in alternating short turns, each after a
0.2 s pause (CTranslate2's Intel OpenMP threads spin for 200 ms after a call), all at torch's thread
count, and ``extra_info`` gets each one's median ms per sentence and tokens/s and fastformer's speed ratio
over each ("x plain", "x ctranslate2": above 1 means fastformer is faster).
"""
import statistics
import time

import pytest
import torch

from fastformer.nn import Transformer, TransformerConfig
from fastformer.nn.decoding import beam_search
from plain_decoder import PlainDecoder

LENGTH_PENALTY, SOURCE_LENGTH = 0.6, 20


def _ctranslate2(model, ctx, tmp_path):
    """A CTranslate2 Translator of the exported model and a function ids -> pieces, or None."""
    try:
        import ctranslate2
    except ImportError:
        return None
    if ctx.device.type != "cpu":
        return None
    from fastformer.export import ctranslate2_spec

    class Pieces:  # sentencepiece's interface for a vocabulary of made-up pieces
        vocab_size = model.config.vocab_size

        class sp:
            @staticmethod
            def id_to_piece(i):
                return {0: "<pad>", 1: "<unk>", 2: "<s>", 3: "</s>"}.get(i, f"t{i}")

            unk_id, bos_id, eos_id = (lambda: 1), (lambda: 2), (lambda: 3)

    class Converter(ctranslate2.converters.Converter):
        def _load(self):
            return ctranslate2_spec(model, Pieces)

    out = Converter().convert(str(tmp_path / "ct2"))
    threads = torch.get_num_threads()
    return ctranslate2.Translator(out, device="cpu", inter_threads=1, intra_threads=threads), Pieces.sp.id_to_piece


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("size", ["small", "base"])
def test_decoding(bench, ctx, size, batch, beam, tmp_path):
    smoke = ctx.sizes.name == "smoke"
    if smoke and size == "base":
        pytest.skip("smoke sizes run the tiny model once (size 'small' stands for it)")
    config = (TransformerConfig.tiny(vocab_size=1000) if smoke else getattr(TransformerConfig, size)(vocab_size=8000))
    length = 4 if smoke else 30
    torch.manual_seed(0)
    model = Transformer(config).to(ctx.device).eval()
    with torch.no_grad():
        model.embed.weight[config.eos_id].zero_()
    src = torch.randint(4, config.vocab_size, (batch, SOURCE_LENGTH), device=ctx.device)
    src[:, -1] = config.eos_id
    settings = dict(length_penalty=LENGTH_PENALTY, max_len_a=0.0, max_len_b=length)

    contenders = {
        "fastformer": lambda: model.generate(src, beam_size=beam, **settings),
        "plain": lambda: [h[0][0] for h in torch.no_grad()(beam_search)(
            model, src, beam, LENGTH_PENALTY, 0.0, length, True, stepper=PlainDecoder)],
    }
    ct2 = _ctranslate2(model, ctx, tmp_path)
    if ct2 is not None:
        translator, piece = ct2
        pieces = [[piece(t) for t in row[:-1].tolist()] for row in src.cpu()]
        never = [[piece(config.pad_id)], [piece(config.bos_id)]]  # fastformer's search never produces them

        def ctranslate2_generate():
            results = translator.translate_batch(pieces, beam_size=beam, length_penalty=LENGTH_PENALTY,
                                                 max_decoding_length=length, suppress_sequences=never)
            return [[int(p[1:]) for p in r.hypotheses[0]] for r in results]

        contenders["ctranslate2"] = ctranslate2_generate

    outputs = {name: fn() for name, fn in contenders.items()}
    for name, tokens in outputs.items():
        assert tokens == outputs["fastformer"], f"{name} decodes other tokens than fastformer"
    assert all(len(t) == length for t in outputs["fastformer"])

    shape = f"{size if not smoke else 'tiny'}, batch {batch}, beam {beam}, {SOURCE_LENGTH} -> {length} tokens"
    bench(contenders["fastformer"], op="decoding", shape=shape, pass_="generate", impl="fastformer",
          per_second={"sentences/s": batch, "tokens/s": batch * length})
    if smoke or bench.benchmark.disabled:
        return
    times = {name: [] for name in contenders}
    turns = 3 if size == "base" or batch > 1 else 7
    for _ in range(turns):
        for name, fn in contenders.items():
            time.sleep(0.2)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    info = bench.benchmark.extra_info
    info["side by side"] = {name: {"ms/sentence": 1e3 * m / batch, "tokens/s": batch * length / m}
                            for name, m in median.items()}
    for name in contenders:
        if name != "fastformer":
            info[f"x {name}"] = median[name] / median["fastformer"]
