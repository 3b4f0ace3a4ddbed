"""Beam-search decoding, side by side on the same weights: fastformer's ``generate`` against a plain-PyTorch
decoder (benchmarks/plain_decoder.py, run by the same search) and against CTranslate2 on the model that
``python -m fastformer.export --ctranslate2`` writes (on the CPU; without ctranslate2 it is left out, and the
summary names it under "not compared").

Compute types: float32, and int8 (``fastformer.quantize(model, "int8")`` beside CTranslate2's
``compute_type="int8"`` and beside fastformer's own float32 model; the plain decoder is float32 only). An int8
row names the int8 products that ran (``fastformer.int8_providers()``: fastformer's own kernels, or oneDNN's
on a CPU with AMX, by row count); where torch has oneDNN, the other provider runs beside it, forced with
FASTFORMER_INT8_PROVIDER ("fastformer int8 onednn" or "fastformer int8 <our best kernel>"), and must give the
same tokens.

A seeded random model of the config (small and base; tiny alone for --bench-sizes smoke) translates ``batch``
random 20-token sentences with beam 1 or 4, length penalty 0.6, max_len_a 0 and max_len_b 30 (smoke: 4).
Its eos embedding row is zeroed, so eos never beats the top candidates before the limit: every contender
decodes the same steps, and the test asserts that all of them return the same tokens (in float32; in int8
each engine rounds its own way, so the test asserts the same lengths and reports the share of sentences
whose tokens equal CTranslate2's, "same tokens as ctranslate2").

pytest-benchmark times ``generate``; then the contenders run in alternating short turns, each after a
0.2 s pause (CTranslate2's Intel OpenMP threads spin for 200 ms after a call), on ``threads`` CPU threads
(1 or 2: torch.set_num_threads for the test, CTranslate2's intra_threads), and ``extra_info`` gets each one's
median ms per sentence, tokens/s and the 90th percentile of a call's time (at batch 1: a sentence's
latency), and fastformer's speed ratio over each ("x plain", "x ctranslate2": above 1 means fastformer
is faster).

``test_decoding_threads`` measures thread scaling apart from the engines: fastformer's ``generate`` (float32
and int8, batch 1 and 32, beam 4) at 1 and 2 threads beside a large float32 GEMM at 1 and 2 threads, in
alternating turns, and reports decoding's speed-up as a share of the GEMM's (benchmarks/to_markdown.py
renders them as a table of their own).
"""
import math
import os
import statistics
import time

import pytest
import torch

import fastformer
from fastformer._ext import C
from fastformer.export import ctranslate2_translate, write_ctranslate2
from fastformer.nn import Transformer, TransformerConfig
from fastformer.nn.decoding import beam_search
from harness import int8_provider, optional  # benchmarks/ is on sys.path (pytest inserts a conftest's folder)
from plain_decoder import PlainDecoder

LENGTH_PENALTY, SOURCE_LENGTH = 0.6, 20


def pytest_generate_tests(metafunc):
    """Model sizes: small and base; the tiny model alone under --bench-sizes smoke."""
    smoke = metafunc.config.getoption("--bench-sizes") == "smoke"
    metafunc.parametrize("size", ["tiny"] if smoke else ["small", "base"])


def _ctranslate2_translator(model, pieces, ctx, config, tmp_path, compute_type, threads):
    """A CTranslate2 Translator of the exported model in ``compute_type``, or None (not the CPU, or not
    installed: then recorded under "not compared", harness.optional)."""
    if ctx.device.type != "cpu":
        return None
    ctranslate2 = optional("ctranslate2", config)
    if ctranslate2 is None:
        return None
    out = write_ctranslate2(model, pieces, str(tmp_path / "ct2"))
    return ctranslate2.Translator(out, device="cpu", compute_type=compute_type, inter_threads=1,
                                  intra_threads=threads)


def _model_and_sources(size: str, batch: int, device: torch.device):
    """(config, model, src, target length): a seeded random model of the config in eval mode, its eos
    embedding row zeroed (so eos never wins before the length limit and every contender decodes the same
    steps), and ``batch`` random SOURCE_LENGTH-token sentences ending in eos."""
    smoke = size == "tiny"
    config = getattr(TransformerConfig, size)(vocab_size=1000 if smoke else 8000)
    torch.manual_seed(0)
    model = Transformer(config).to(device).eval()
    with torch.no_grad():
        model.embed.weight[config.eos_id].zero_()
    src = torch.randint(4, config.vocab_size, (batch, SOURCE_LENGTH), device=device)
    src[:, -1] = config.eos_id
    return config, model, src, 4 if smoke else 30


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request):
    """torch on 1 or 2 CPU threads for the test (CTranslate2 gets as many)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _forcing(variant: str, fn):
    """fn, run with FASTFORMER_INT8_PROVIDER=variant (the int8 products it names; restored after)."""
    def run():
        before = os.environ.get("FASTFORMER_INT8_PROVIDER")
        os.environ["FASTFORMER_INT8_PROVIDER"] = variant
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["FASTFORMER_INT8_PROVIDER"]
            else:
                os.environ["FASTFORMER_INT8_PROVIDER"] = before
    return run


@pytest.mark.parametrize("compute", ["float32", "int8"])
@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("batch", [1, 32])
def test_decoding(bench, ctx, size, batch, beam, compute, tmp_path, threads):
    smoke = size == "tiny"
    if compute == "int8" and ctx.device.type != "cpu":
        pytest.skip("int8 decoding runs on the CPU")
    config, model, src, length = _model_and_sources(size, batch, ctx.device)
    settings = dict(length_penalty=LENGTH_PENALTY, max_len_a=0.0, max_len_b=length)

    if compute == "float32":
        contenders = {
            "fastformer": lambda: model.generate(src, beam_size=beam, **settings),
            "plain": lambda: [h[0][0] for h in torch.no_grad()(beam_search)(
                model, src, beam, LENGTH_PENALTY, 0.0, length, True, stepper=PlainDecoder)],
        }
    else:
        quantized = fastformer.quantize(model, "int8")
        contenders = {
            "fastformer": lambda: quantized.generate(src, beam_size=beam, **settings),
            "fastformer float32": lambda: model.generate(src, beam_size=beam, **settings),
        }
        # The other int8 provider, forced (the same tokens: the same int32 sums): our best kernel where the
        # rule takes oneDNN's products for the output projection (AMX), oneDNN's where it takes ours.
        variants = C.int8_variants()
        if "onednn" in variants:
            at_output = C.int8_variant_for(batch * beam, config.vocab_size, config.d_model)
            other = "onednn" if at_output != "onednn" else variants[0]
            # a copy bound to it (its modules read FASTFORMER_INT8_PROVIDER when quantized, the C++ decoder when
            # built), packed for oneDNN where it is the other
            forced = _forcing(other, lambda: fastformer.quantize(model, "int8"))()
            contenders[f"fastformer int8 {other}"] = _forcing(
                other, lambda: forced.generate(src, beam_size=beam, **settings))
    pieces = ["<pad>", "<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(4, config.vocab_size)]  # made-up vocabulary
    translator = _ctranslate2_translator(model, pieces, ctx, bench.request.config, tmp_path, compute, threads)
    if translator is not None:
        ids = [row[:-1] for row in src.tolist()]  # ctranslate2_translate appends the eos
        never = [[pieces[config.pad_id]], [pieces[config.bos_id]]]  # fastformer's search never produces them
        contenders["ctranslate2"] = lambda: ctranslate2_translate(
            translator, pieces, ids, beam_size=beam, length_penalty=LENGTH_PENALTY, max_len_a=0.0, max_len_b=length,
            suppress_sequences=never)

    outputs = {name: fn() for name, fn in contenders.items()}  # CTranslate2 last
    for name, tokens in outputs.items():
        assert all(len(t) == length for t in tokens), f"{name} decodes other lengths"
        if compute == "float32" or name.startswith("fastformer int8"):
            assert tokens == outputs["fastformer"], f"{name} decodes other tokens than fastformer"

    products = f" ({int8_provider(config, batch * beam, batch * SOURCE_LENGTH)})" if compute == "int8" else ""
    shape = f"{size}, batch {batch}, beam {beam}, {SOURCE_LENGTH} -> {length} tokens, {compute}{products}, " \
        f"{threads} thread" + ("s" if threads > 1 else "")
    if not smoke:
        time.sleep(0.3)  # CTranslate2's threads, which just ran, stop spinning before fastformer is timed
    bench(contenders["fastformer"], op="decoding", shape=shape, pass_="generate", impl="fastformer",
          per_second={"sentences/s": batch, "tokens/s": batch * length})
    if smoke or bench.benchmark.disabled:
        return
    times = {name: [] for name in contenders}
    turns = 3 if size == "base" or batch > 1 else 21  # batch 1: enough turns for a latency p90
    for _ in range(turns):
        for name, fn in contenders.items():
            time.sleep(0.2)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    info = bench.benchmark.extra_info
    if compute == "int8" and "ctranslate2" in outputs:
        info["same tokens as ctranslate2"] = sum(
            a == b for a, b in zip(outputs["fastformer"], outputs["ctranslate2"])) / batch
    info["side by side"] = {name: {"ms/sentence": 1e3 * m / batch, "tokens/s": batch * length / m,
                                   "p90 ms/call": 1e3 * statistics.quantiles(times[name], n=10)[-1]}
                            for name, m in median.items()}
    for name in contenders:
        if name != "fastformer":
            info[f"x {name}"] = median[name] / median["fastformer"]


GEMM_SIZE = 2048  # the large float32 GEMM beside which thread scaling is judged (torch.mm, n x n x n)
TURNS = 7  # alternating turns of the thread-scaling measurement: each times both at 1 and at 2 threads
TIMING_SECONDS = 0.15  # the least time of one timing (repeated calls of a short function)


@pytest.mark.parametrize("compute", ["float32", "int8"])
@pytest.mark.parametrize("batch", [1, 32])
def test_decoding_threads(bench, ctx, size, batch, compute):
    """Thread scaling: ``generate`` (beam 4, the setup of test_decoding) at 1 and at 2 threads, beside a large
    float32 GEMM (torch.mm, GEMM_SIZE^3) at 1 and at 2 threads, in TURNS alternating turns of one run; a timing
    is one untimed call (steady state: both threads awake), then calls lasting at least TIMING_SECONDS.
    extra_info gets the median time of each at each thread count, each one's speed-up (the median over
    turns of a turn's 1-thread time / its 2-thread time) and decoding's speed-up as a share of the GEMM's:
    how well decoding uses a second core compared with what the machine gives a compute-bound kernel
    (target: at least 90% at batch 32; at batch 1, not slower at 2 threads than at 1). pytest-benchmark
    times ``generate`` at 2 threads."""
    if ctx.device.type != "cpu":
        pytest.skip("thread scaling is a CPU measurement")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("thread scaling needs at least 2 CPU cores")
    smoke = size == "tiny"
    _, model, src, length = _model_and_sources(size, batch, ctx.device)
    if compute == "int8":
        model = fastformer.quantize(model, "int8")
    generate = lambda: model.generate(src, beam_size=4, length_penalty=LENGTH_PENALTY, max_len_a=0.0,  # noqa: E731
                                      max_len_b=length)
    n = 64 if smoke else GEMM_SIZE
    a, b = torch.randn(n, n), torch.randn(n, n)
    gemm = lambda: torch.mm(a, b)  # noqa: E731

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        shape = f"{size}, batch {batch}, beam 4, {SOURCE_LENGTH} -> {length} tokens, {compute}"
        if not smoke:
            time.sleep(0.3)  # a CTranslate2 of the test before stops spinning
        bench(generate, op="threads", shape=shape, pass_="generate", impl="fastformer",
              per_second={"sentences/s": batch})
        if smoke or bench.benchmark.disabled:
            return
        def timed(fn, calls):  # seconds a call, over `calls` calls back to back
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - start) / calls

        # Warm-up at each thread count; a timing is as many calls as take TIMING_SECONDS at the faster
        # thread count, so that every timing lasts at least that (a batch-1 decoding is short, within the
        # noise of a shared VM a call: docs/benchmarks.md, "Rounds and alternation").
        calls = {"gemm": 1, "decoding": 1}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, fn in (("gemm", gemm), ("decoding", generate)):
                calls[name] = max(calls[name], math.ceil(TIMING_SECONDS / timed(fn, 1)))
        times = {(name, threads): [] for name in ("decoding", "gemm") for threads in (1, 2)}
        for turn in range(TURNS):
            for threads in (1, 2) if turn % 2 == 0 else (2, 1):  # the order alternates: drift cancels
                torch.set_num_threads(threads)
                for name, fn in (("gemm", gemm), ("decoding", generate)):
                    # One untimed call first: the timing finds the threads awake and the caches warm. (No
                    # pause between timings: after one, a call at 2 threads first waits for the sleeping
                    # second core, which made a batch-1 decoding much slower in some turns: a wake-up
                    # measurement, not thread scaling; docs/decoding.md, "How it is tested".)
                    fn()
                    times[name, threads].append(timed(fn, calls[name]))
    finally:
        torch.set_num_threads(before)
    # Each turn's speed-up (its 1-thread time over its 2-thread time), then their median: a shared machine's
    # slow spells hit both halves of a turn alike.
    speedup = {name: statistics.median(one / two for one, two in zip(times[name, 1], times[name, 2]))
               for name in ("decoding", "gemm")}
    info = bench.benchmark.extra_info
    for name in ("decoding", "gemm"):
        info[f"{name} ms"] = {str(threads): 1e3 * statistics.median(times[name, threads]) for threads in (1, 2)}
        info[f"{name} speed-up"] = speedup[name]
    info["gemm"] = f"{n} x {n} x {n} float32, torch.mm"
    info["calls a timing"] = calls
    info["share of gemm's speed-up"] = speedup["decoding"] / speedup["gemm"]
