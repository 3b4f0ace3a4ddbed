"""fastformer's benchmarks: pytest-benchmark tests that time every backend beside the PyTorch code it
replaces, in one run, and put the derived figures into ``benchmark.extra_info``.

Run (how long it takes: docs/benchmarks.md, "Run it")::

    pytest benchmarks/ --benchmark-only --benchmark-json out.json
    python benchmarks/to_markdown.py out.json              # the markdown table, also printed at the end

(``pytest tests`` and a bare ``pytest`` collect only tests/. Run benchmarks/ on its own: both folders have
a test_attention.py and neither is a package, so one pytest call cannot import both.)

Optional packages: the suite runs with any subset of them. ``pip install ".[test]"`` brings pytest-benchmark
and every comparison's package (transformers, CTranslate2); without one, what needs it is left out with a
reason that names the package and the extra that brings it (OPTIONAL): a test or module that needs it skips
(``need``), and a contender inside a benchmark that runs anyway (CTranslate2 in test_decoding.py) is listed
under "not compared" in the summary and in the JSON's session info (``optional``).

What runs (docs/benchmarks.md, "What it compares", describes each file)
  test_<op>.py                 one per op of fastformer.ops.OPS: the op at translation shapes
  test_training_step.py        forward + backward + Adam step of a whole Transformer (tokens/s)
  test_hf_training_step.py     a transformers Marian training step with attn_implementation="fastformer"
  test_hf_decoding.py          an opus-mt-shaped Marian decoded by fastformer (converted), transformers, CTranslate2
  test_hf_finetune_step.py     fine-tuning a converted opus-mt-shaped Marian beside transformers' own step
  test_generate.py             Transformer.generate, beam 4, with and without the key/value cache (sentences/s)
  test_decoding.py             decoding beside CTranslate2 and a plain-PyTorch decoder
  test_overhead.py             the cost of a call on tiny tensors beside the PyTorch calls it replaces
  test_optim.py                the fused Adam step beside torch's Adam
  test_weight_grad.py          a projection's bf16 gradients on the CPU beside ATen's bf16 product and its cast
  Each op runs forward ("fwd"), backward alone ("bwd", on a graph kept from one forward) and both
  ("fwd+bwd"), at L = 32, 64, 128, 256 and the long case 1024.

Implementations, side by side in one group per (op, shape, pass)
  every fastformer backend that runs on the benchmark device (``fastformer.backends()``): on CPU
  tensors ``cpu`` and ``torch``; on CUDA tensors ``cuda``, ``triton`` and ``torch``. ``cuda_sim`` (test
  equipment) and ``triton`` on CPU tensors (its interpreter) never run here. Beside them the baselines
  each test module names in ``BASELINES``: the plain PyTorch composition the op replaces ("eager"
  attention, "masked_fill+softmax", "add+dropout+layer_norm", "log_softmax+gather", "add+relu+dropout"),
  ``F.cross_entropy``,
  ``F.scaled_dot_product_attention``
  ("sdpa"), ``torch.nn.Transformer`` ("nn.Transformer"); for generate, the same backend without the cache.

Sizes: ``--bench-sizes default|paper|smoke`` (or ``FASTFORMER_BENCH_SIZES=...``)
  default  translation shapes that fit a 2-core CPU in under 10 minutes: 4,096 tokens per batch
           (d_model 512, 8 heads of 64); training step of ``TransformerConfig.small`` (vocab 8,000) on
           128 sentence pairs of up to 32 tokens (~4,096 tokens, the training default --max-tokens);
           generate: 8 sentences of 8-24 tokens, 12 target tokens each, beam 4. Each benchmark is timed
           for about 0.4 s (at least 3 rounds).
  smoke    tiny shapes and models, to check the suite itself in seconds (the figures mean nothing).
  paper    the paper's sizes, for GPUs: about 25,000 tokens per batch (d_model 512, 8 heads of 64);
           training step of ``TransformerConfig.base`` (vocab 37,000) on 390 sentence pairs of up to 64
           tokens; generate: 128 sentences of 10-50 tokens, 50 target tokens each, beam 4. About 1 s per
           benchmark, at least 10 rounds.
  paper-quick  the paper's sizes timed for about 0.2 s each (at least 5 rounds): the op benchmarks of a
           cold lent GPU within tools/gpu_check.sh's time box.
Device: ``--bench-device cpu|cuda`` (default: cuda when a GPU is visible). dtype: ``--bench-dtype``
(default float32 on CPU; on CUDA bfloat16 where supported, else float16; the training step autocasts to
it on CUDA, and runs on CPU both in float32 and, where the CPU has bfloat16 dot products, in bfloat16
autocast, as ``python -m fastformer.train --precision auto`` picks).
malloc: ``--bench-malloc keep|default`` (default keep, as ``python -m fastformer.train``): with keep, glibc
keeps freed memory for reuse, so a fresh output does not page-fault each call (fastformer.runtime). It
applies to every implementation in the run alike; ``default`` shows what glibc's own policy costs.

The machinery (the size profiles, the session's settings, the timer and the figures it derives, the
optional packages, the speedups) is in benchmarks/harness.py, which the benchmark files import too; this
file holds the pytest side: the options, the hooks and the fixtures.
"""
from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from fastformer.runtime import keep_freed_memory
# benchmarks/ is on sys.path: pytest inserts a conftest's folder (the benchmark files import harness too)
from harness import (CONTEXT, COPY_GBPS, NOT_COMPARED, PASS_IDS, PASSES, SIZES, TIMED, AttentionShape, Bench, Context,
                     add_speedups, fastformer_backends, missing_reason, session_info, wall_time)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pytest_addoption(parser):
    group = parser.getgroup("fastformer benchmarks")
    group.addoption("--bench-sizes", choices=sorted(SIZES), default=os.environ.get("FASTFORMER_BENCH_SIZES", "default"),
                    help="size profile: default (a 2-core CPU, < 10 min), paper (GPUs) or smoke (checks the suite); "
                         "also FASTFORMER_BENCH_SIZES")
    group.addoption("--bench-device", choices=("cpu", "cuda"), default=None,
                    help="device of the benchmarks (default: cuda when a GPU is visible, else cpu)")
    group.addoption("--bench-dtype", choices=sorted(_DTYPES), default=None,
                    help="dtype of the op benchmarks (default: float32 on CPU; bfloat16 on GPUs that have it, "
                         "else float16)")
    group.addoption("--bench-malloc", choices=("keep", "default"),
                    default=os.environ.get("FASTFORMER_BENCH_MALLOC", "keep"),
                    help="glibc malloc policy of the benchmark process: keep (freed memory is kept for reuse, "
                         "as python -m fastformer.train --malloc keep does) or default (glibc's own: large "
                         "blocks are unmapped on free and fault in again); also FASTFORMER_BENCH_MALLOC")


def _context(config) -> Context:
    device = config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--bench-device cuda: no CUDA device is visible")
    dtype = config.getoption("--bench-dtype")
    if dtype is not None:
        dtype = _DTYPES[dtype]
    elif device == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        dtype = torch.float32
    return Context(SIZES[config.getoption("--bench-sizes")], torch.device(device), dtype)


def pytest_configure(config):
    if config.getoption("--bench-malloc") == "keep":
        keep_freed_memory()  # before the benchmarks allocate anything large
    config.stash[CONTEXT] = _context(config)
    config.stash[TIMED] = []
    config.stash[NOT_COMPARED] = {}
    if config.stash[CONTEXT].cuda and importlib.util.find_spec("triton") is None:
        config.stash[NOT_COMPARED]["triton"] = missing_reason("triton")  # the triton backend on the GPU


def pytest_generate_tests(metafunc):
    """Parametrizes ``impl`` (the backends here, then the module's BASELINES), ``pass_`` and ``length``."""
    ctx = metafunc.config.stash[CONTEXT]
    if "impl" in metafunc.fixturenames:
        impls = fastformer_backends(ctx) + list(getattr(metafunc.module, "BASELINES", ()))
        metafunc.parametrize("impl", impls)
    if "pass_" in metafunc.fixturenames:
        metafunc.parametrize("pass_", PASSES, ids=[PASS_IDS[p] for p in PASSES])
    if "precision" in metafunc.fixturenames:
        precisions = ctx.train_precisions
        metafunc.parametrize("precision", precisions, ids=[str(p).removeprefix("torch.") for p in precisions])
    if "length" in metafunc.fixturenames:
        metafunc.parametrize("length", ctx.sizes.lengths, ids=[f"L{n}" for n in ctx.sizes.lengths])


@pytest.fixture(scope="session")
def ctx(pytestconfig) -> Context:
    return pytestconfig.stash[CONTEXT]


@pytest.fixture
def attention_shape(ctx, length) -> AttentionShape:
    B = max(1, ctx.sizes.tokens // length)
    keep = torch.randint(math.ceil(0.75 * length), length + 1, (B,))
    mask = torch.arange(length)[None, :] >= keep[:, None]
    return AttentionShape(B, ctx.sizes.n_heads, length, ctx.sizes.head_dim, mask.to(ctx.device))


@pytest.fixture(autouse=True)
def _seed():
    """Every benchmark draws the same inputs on every run."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def copy_bandwidth(ctx, pytestconfig) -> float:
    """GB/s of a large copy on the benchmark device (bytes read + written), the median of 10 copies.
    512 MiB on CPU (far beyond the caches), 2 GiB on a GPU."""
    n = (2 << 30) if ctx.cuda else (512 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = sorted(wall_time(lambda: dst.copy_(src), ctx) for _ in range(10))
    pytestconfig.stash[COPY_GBPS] = 2 * n / times[len(times) // 2] / 1e9
    return pytestconfig.stash[COPY_GBPS]


@pytest.fixture
def bench(benchmark, request, ctx) -> Bench:
    """Times a function and fills benchmark.extra_info (see Bench.__call__). The copy bandwidth is
    measured (once per session) only when a benchmark is really timed."""
    copy_gbps = None if benchmark.disabled else request.getfixturevalue("copy_bandwidth")
    return Bench(benchmark, request, ctx, copy_gbps)


@pytest.fixture
def one_thread():
    """torch on one CPU thread for the test (the call-overhead and decoding targets' setting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Writes the speedups into the JSON's extra_info, and the session's settings as "fastformer"."""
    add_speedups(output_json["benchmarks"])
    output_json["fastformer"] = session_info(config)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    """Prints the comparisons left out for a missing package, then the benchmarks as benchmarks/to_markdown.py
    renders them: times, figures, speedups."""
    for reason in config.stash[NOT_COMPARED].values():
        terminalreporter.write_line(f"not compared: {reason}")
    timed = config.stash[TIMED]
    if not timed:
        return
    from to_markdown import render  # benchmarks/ is on sys.path: pytest inserts a conftest's folder

    entries = [b.stats.as_dict(include_data=False) for b in timed]
    add_speedups(entries)
    terminalreporter.write_sep("-", "fastformer benchmarks (python benchmarks/to_markdown.py renders a --benchmark-json)")
    terminalreporter.write_line(render(entries, session_info(config)))
