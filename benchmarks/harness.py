"""The benchmark suite's machinery, imported by benchmarks/conftest.py (its pytest hooks, options and
fixtures) and by the benchmark files: the size profiles (``Sizes``, ``SIZES``), the session's settings
(``Context``), the optional packages (``need``, ``optional``), the timer that fills ``extra_info``
(``Bench``) and the speedups and session settings of the summary. conftest.py's docstring says how to run
the suite and what each option does.

Derived figures in ``extra_info`` (from the median time)
  bytes, GB/s       the bytes the op must move: every input read once, every output written once
                    (counts in each test module); GB/s for every op.
  copy GB/s, fraction of copy
                    for the memory-bound ops (softmax, layer_norm_residual, cross_entropy): GB/s over the bandwidth of
                    a large device copy (bytes read + written) measured once per session, here. On a GPU
                    that copy is the device's attainable peak bandwidth.
  flops, TFLOP/s    attention only (counts in test_attention.py).
  tokens/s          training step: non-pad target tokens per second, as fastformer.train reports.
  sentences/s       generate.
  speedup           {baseline: baseline median / this median} against every baseline of the same group,
                    computed after all benchmarks ran (pytest_benchmark_update_json writes it into the
                    JSON; the table printed at the end shows it too).
"""
from __future__ import annotations

import importlib
import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import pytest
import torch

import fastformer
from fastformer import _dispatch
from fastformer.nn import TransformerConfig
from fastformer.runtime import native_bf16_cpu

PASSES = ("fwd", "bwd", "fwd+bwd")
PASS_IDS = {"fwd": "fwd", "bwd": "bwd", "fwd+bwd": "fwdbwd"}


@dataclass(frozen=True)
class Sizes:
    """One size profile (conftest.py's docstring describes each, under "Sizes")."""
    name: str
    tokens: int  # tokens per batch of the op benchmarks: B * L
    lengths: tuple[int, ...]  # sequence lengths; the last is the long case
    d_model: int  # layer_norm_residual's row size; heads * head_dim for attention and softmax
    n_heads: int
    model: str  # TransformerConfig constructor of the training step and generate
    vocab_size: int
    train_sentences: int  # sentence pairs per training batch
    train_max_len: int  # longest source / target sentence (tokens, eos included)
    gen_sentences: int  # source sentences per generate call
    gen_src_len: tuple[int, int]  # shortest and longest source sentence
    gen_tgt_len: int  # target tokens generated per sentence (max_len_a = 0, max_len_b = this)
    seconds: float  # timing budget per benchmark (rounds = budget / one call's time, within the bounds)
    min_rounds: int
    max_rounds: int = 1000

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


SIZES = {
    "default": Sizes("default", tokens=4096, lengths=(32, 64, 128, 256, 1024), d_model=512, n_heads=8,
                     model="small", vocab_size=8000, train_sentences=128, train_max_len=32, gen_sentences=8,
                     gen_src_len=(8, 24), gen_tgt_len=12, seconds=0.4, min_rounds=3),
    "smoke": Sizes("smoke", tokens=256, lengths=(16, 64), d_model=64, n_heads=2, model="tiny", vocab_size=64,
                   train_sentences=8, train_max_len=16, gen_sentences=2, gen_src_len=(4, 8), gen_tgt_len=4,
                   seconds=0.01, min_rounds=1),
    "paper": Sizes("paper", tokens=25000, lengths=(32, 64, 128, 256, 1024), d_model=512, n_heads=8,
                   model="base", vocab_size=37000, train_sentences=390, train_max_len=64, gen_sentences=128,
                   gen_src_len=(10, 50), gen_tgt_len=50, seconds=1.0, min_rounds=10),
}
SIZES["paper-quick"] = replace(SIZES["paper"], name="paper-quick", seconds=0.2, min_rounds=5)


@dataclass(frozen=True)
class MarianShape:
    """The sizes of a Marian model with random weights that the transformers benchmarks build (opus-mt-de-en's:
    d_model 512, 6 + 6 layers, 8 heads, d_ff 2048, 58,101 tokens); each benchmark adds its batch's fields."""
    name: str
    d_model: int
    layers: int
    heads: int
    d_ff: int
    vocab_size: int

    def marian_config(self, transformers, **options):
        """transformers.MarianConfig of these sizes, opus-mt's form (swish, scaled embeddings, 512 positions, pad
        the last id and the decoder's start token), with ``options`` added or overriding."""
        pad = self.vocab_size - 1
        return transformers.MarianConfig(**{
            "vocab_size": self.vocab_size, "d_model": self.d_model, "encoder_layers": self.layers,
            "decoder_layers": self.layers, "encoder_attention_heads": self.heads,
            "decoder_attention_heads": self.heads, "encoder_ffn_dim": self.d_ff, "decoder_ffn_dim": self.d_ff,
            "max_position_embeddings": 512, "activation_function": "swish", "scale_embedding": True,
            "pad_token_id": pad, "decoder_start_token_id": pad, **options})


@dataclass(frozen=True)
class Context:
    """The session's benchmark settings, read once from the command line."""
    sizes: Sizes
    device: torch.device
    dtype: torch.dtype

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def randn(self, *shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.dtype, requires_grad=grad)

    def autocast(self, dtype: Optional[torch.dtype] = None):
        """Autocast of the whole-model benchmarks to ``dtype`` (float32: none). By default float32 on CPU,
        ctx.dtype on a GPU."""
        dtype = dtype or (self.dtype if self.cuda else torch.float32)
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype != torch.float32)

    @property
    def train_precisions(self) -> tuple[torch.dtype, ...]:
        """The training step's precisions, as python -m fastformer.train --precision picks them: autocast
        to ctx.dtype on a GPU; on CPU float32 and, where the CPU has bfloat16 dot products, also bfloat16
        autocast."""
        if self.cuda:
            return (self.dtype,)
        return (torch.float32, torch.bfloat16) if native_bf16_cpu() else (torch.float32,)

    def model_config(self) -> TransformerConfig:
        return getattr(TransformerConfig, self.sizes.model)(vocab_size=self.sizes.vocab_size)

    def tokens(self, n: int, min_len: int, max_len: int, pad_id: int, vocab_size: int) -> torch.Tensor:
        """(n, max_len) int64 right-padded sentences, lengths uniform in [min_len, max_len] (the first
        of them max_len), ids uniform over the vocabulary less the special ids 0-3."""
        lengths = torch.randint(min_len, max_len + 1, (n,))
        lengths[0] = max_len
        ids = torch.randint(4, vocab_size, (n, max_len))
        ids[torch.arange(max_len)[None, :] >= lengths[:, None]] = pad_id
        return ids.to(self.device)


@dataclass(frozen=True)
class AttentionShape:
    """The attention and softmax benchmarks' batch: B = tokens / L sequences of L, H heads of D, and a
    key padding mask (B, L) (True = padding) under which each sequence keeps between 3/4 L and L keys."""
    B: int
    H: int
    L: int
    D: int
    key_padding_mask: torch.Tensor



def fastformer_backends(ctx: Context) -> list[str]:
    """The fastformer backends benchmarked on ctx's device and dtype: those the dispatcher accepts there,
    less cuda_sim (test equipment) and triton on CPU tensors (its interpreter)."""
    names = []
    for name, available in fastformer.backends().items():
        if not available or name == "cuda_sim" or (name == "triton" and not ctx.cuda):
            continue
        try:
            _dispatch.resolve("softmax", name, ctx.device, ctx.dtype)
        except (ValueError, RuntimeError):
            continue
        names.append(name)
    return names


CONTEXT = pytest.StashKey[Context]()
TIMED = pytest.StashKey[list]()  # the benchmark fixtures that timed something, for the summary table
COPY_GBPS = pytest.StashKey[float]()  # the copy_bandwidth fixture's result, for the session's info
NOT_COMPARED = pytest.StashKey[dict]()  # {package: why its comparisons are left out}, for the summary

# The optional packages of the comparisons -> the extra of pyproject.toml that brings each (the test extra
# brings transformers and ctranslate2 too; triton comes with PyPI's CUDA build of torch)
OPTIONAL = {"transformers": "hf", "ctranslate2": "ctranslate2", "triton": "triton"}


def missing_reason(package: str) -> str:
    return f"{package} is not installed: pip install '.[{OPTIONAL[package]}]'"


def need(package: str):
    """The optional ``package``, imported; without it the calling test (at module level: the whole module)
    skips with missing_reason, reported at the caller's line."""
    __tracebackhide__ = True
    return pytest.importorskip(package, reason=missing_reason(package))


def optional(package: str, config):
    """The optional ``package``, imported, or None: then its comparison is left out of a benchmark that runs
    anyway, and listed under "not compared" (the summary, the JSON's session info)."""
    try:
        return importlib.import_module(package)
    except ImportError:
        config.stash[NOT_COMPARED][package] = missing_reason(package)
        return None


def int8_provider(config, decoder_rows: int, encoder_rows: int) -> str:
    """Which int8 products a quantized model of ``config`` (d_model, d_ff, vocab_size) runs here, per kind of
    projection, at the decoder's and the encoder's row counts (``C.int8_variant_for``: fastformer's own kernels,
    or oneDNN's on a CPU with AMX for large enough products; FASTFORMER_INT8_PROVIDER forces one), e.g.
    "128 decoder rows: avx512_vnni (d x d), onednn (feed-forward, output); 640 encoder rows: onednn (d x d,
    feed-forward)": for the int8 rows of the decoding benchmarks."""
    from fastformer._ext import C

    d = config.d_model
    shapes = {"d x d": (d, d), "feed-forward": (config.d_ff, d), "output": (config.vocab_size, d)}

    def describe(rows, names):
        by_variant = {}
        for name in names:
            by_variant.setdefault(C.int8_variant_for(rows, *shapes[name]), []).append(name)
        return ", ".join(f"{variant} ({', '.join(kinds)})" for variant, kinds in by_variant.items())

    return (f"{decoder_rows} decoder rows: {describe(decoder_rows, shapes)}; "
            f"{encoder_rows} encoder rows: {describe(encoder_rows, ['d x d', 'feed-forward'])}")


# ----------------------------------------------------------------------------------------------------
# Timing


def wall_time(fn: Callable[[], object], ctx: Context) -> float:
    """The wall time of one call of fn, the device's queue drained before and after."""
    ctx.sync()
    start = time.perf_counter()
    fn()
    ctx.sync()
    return time.perf_counter() - start


def _plan(fn: Callable[[], object], ctx: Context) -> tuple[int, int]:
    """(rounds, iterations per round) from the time t of one call, after a warm-up call (which compiles,
    allocates, fills caches). A warm-up longer than the budget stands for t (min_rounds follow). On a GPU
    a round lasts at least 1 ms (several calls, one sync)."""
    t = wall_time(fn, ctx)
    if t < ctx.sizes.seconds:
        t = max(wall_time(fn, ctx), 1e-7)
    iterations = max(1, math.ceil(1e-3 / t)) if ctx.cuda else 1
    rounds = math.ceil(ctx.sizes.seconds / (t * iterations))
    return min(max(rounds, ctx.sizes.min_rounds), ctx.sizes.max_rounds), iterations


def _synced(fn: Callable[[], object], ctx: Context, every: int) -> Callable[[], object]:
    """fn, waiting for the device after every ``every``-th call: pytest-benchmark times ``every`` calls
    per round, so each round ends with all its work done."""
    if not ctx.cuda:
        return fn
    calls = [0]

    def run():
        out = fn()
        calls[0] += 1
        if calls[0] % every == 0:
            ctx.sync()
        return out

    return run


class Bench:
    """Times a function with pytest-benchmark and fills ``extra_info``; made by the ``bench`` fixture."""

    def __init__(self, benchmark, request, ctx: Context, copy_gbps: Optional[float]):
        self.benchmark, self.request, self.ctx, self.copy_gbps = benchmark, request, ctx, copy_gbps

    def __call__(self, fn: Callable[[], object], *, op: str, shape: str, pass_: str, impl: str,
                 bytes_moved: Optional[float] = None, flops: Optional[float] = None, memory_bound: bool = False,
                 per_second: Optional[dict[str, float]] = None, group: Optional[str] = None,
                 baseline: Optional[bool] = None, length: Optional[int] = None,
                 turns_with: Optional[dict[str, Callable[[], object]]] = None, min_rounds: int = 1):
        """Times ``fn`` and records in extra_info: op, shape, pass, impl, whether it is a baseline (default:
        impl is in the test module's BASELINES), and from the median time GB/s (of ``bytes_moved``),
        TFLOP/s (of ``flops``), the fraction of the copy bandwidth (``memory_bound``) and, for each
        ``per_second`` entry {name: count}, count / median. Benchmarks of one ``group`` (default:
        op, shape and pass) are compared: each non-baseline gets its speedup over each baseline.
        ``turns_with`` {impl: call}: baselines timed in alternation with ``fn`` instead (CPU only): each
        round runs them, in an order that rotates, then ``fn``; the speedups are their medians over fn's, from
        the same rounds, so drift over the run cancels. ``min_rounds``: at least that many rounds (beyond the
        size profile's own minimum) where one call outlasts the budget and the ratio sought is small. Returns
        what the last call of ``fn`` returned."""
        ctx, benchmark = self.ctx, self.benchmark
        if baseline is None:
            baseline = impl in getattr(self.request.module, "BASELINES", ())
        benchmark.group = group or f"{op} {shape} {pass_}"
        info = benchmark.extra_info
        info.update({"op": op, "shape": shape, "pass": pass_, "impl": impl, "baseline": baseline,
                     "device": str(ctx.device), "dtype": str(ctx.dtype).removeprefix("torch."),
                     "sizes": ctx.sizes.name})
        if length is not None:
            info["length"] = length  # orders the table's rows
        if benchmark.disabled:
            return benchmark.pedantic(fn)  # --benchmark-disable: one call, as a smoke test
        rounds, iterations = _plan(fn, ctx)
        rounds = max(rounds, min_rounds)
        if turns_with:
            times: dict[str, list[float]] = {name: [] for name in turns_with}
            names = list(turns_with)
            for call in turns_with.values():  # their warm-up (fn's was _plan's)
                call()

            def baselines():  # a round's baselines, in a rotating order
                names.append(names.pop(0))
                for name in names:
                    start = time.perf_counter()
                    turns_with[name]()
                    times[name].append(time.perf_counter() - start)

            result = benchmark.pedantic(fn, setup=baselines, rounds=rounds)
        else:
            result = benchmark.pedantic(_synced(fn, ctx, iterations), rounds=rounds, iterations=iterations)
        median = benchmark.stats.stats.median
        if turns_with:
            info["speedup"] = {name: statistics.median(t) / median for name, t in times.items()}
            info["alternated"] = {name + " median s": statistics.median(t) for name, t in times.items()}
        if bytes_moved is not None:
            info["bytes"] = int(bytes_moved)
            info["GB/s"] = bytes_moved / median / 1e9
        if memory_bound:
            info["copy GB/s"] = self.copy_gbps
            info["fraction of copy"] = info["GB/s"] / self.copy_gbps
        if flops is not None:
            info["flops"] = int(flops)
            info["TFLOP/s"] = flops / median / 1e12
        for name, count in (per_second or {}).items():
            info[name] = count / median
        self.request.config.stash[TIMED].append(benchmark)
        return result

    def op(self, forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor, *,
           pass_: str, bytes_moved: tuple[float, float], flops: Optional[tuple[float, float]] = None,
           **info) -> None:
        """Times one pass of an op. ``forward()`` runs it on ``inputs`` (which require grad) as in
        training; "bwd" keeps one forward's graph and times backward alone on it; "fwd+bwd" times both.
        Gradients (of ``grad``, the output's) come from torch.autograd.grad, so nothing accumulates in
        .grad. ``bytes_moved`` and ``flops`` are the (forward, backward) counts; fwd+bwd is their sum."""
        if pass_ == "fwd":
            fn = forward
        elif pass_ == "bwd":
            out = forward()
            fn = lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)  # noqa: E731
        else:
            fn = lambda: torch.autograd.grad(forward(), inputs, grad)  # noqa: E731
        pick = {"fwd": lambda c: c[0], "bwd": lambda c: c[1], "fwd+bwd": sum}[pass_]
        self(fn, pass_=pass_, bytes_moved=pick(bytes_moved), flops=None if flops is None else pick(flops), **info)


# ----------------------------------------------------------------------------------------------------
# Speedups over the baselines, once every benchmark has run; the session's settings


def add_speedups(benchmarks: list[dict]) -> None:
    """Sets extra_info["speedup"] = {baseline impl: baseline median / own median} on every non-baseline
    of a group that holds baselines. ``benchmarks``: pytest-benchmark's JSON entries (group,
    extra_info, stats.median)."""
    baselines: dict[str, list[dict]] = {}
    for b in benchmarks:
        if b["extra_info"].get("baseline"):
            baselines.setdefault(b["group"], []).append(b)
    for b in benchmarks:
        if b["extra_info"].get("baseline") or b["group"] not in baselines or "alternated" in b["extra_info"]:
            continue  # (alternated: its speedups come from its own rounds, Bench's turns_with)
        b["extra_info"]["speedup"] = {base["extra_info"]["impl"]: base["stats"]["median"] / b["stats"]["median"]
                                      for base in baselines[b["group"]]}


def session_info(config) -> dict:
    """The session's settings, for the JSON ("fastformer") and the summary table's opening line."""
    ctx = config.stash[CONTEXT]
    info = {"sizes": ctx.sizes.name, "device": str(ctx.device), "dtype": str(ctx.dtype).removeprefix("torch."),
            "cpu level": fastformer.cpu_capability(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "command": " ".join(["pytest", *config.invocation_params.args]),
            "malloc": config.getoption("--bench-malloc"),
            "backends": fastformer_backends(ctx)}
    if ctx.cuda:
        info["gpu"] = torch.cuda.get_device_name(ctx.device)
        info["compute capability"] = "%d.%d" % torch.cuda.get_device_capability(ctx.device)
    if COPY_GBPS in config.stash:
        info["copy GB/s"] = config.stash[COPY_GBPS]
    if config.stash[NOT_COMPARED]:
        info["not compared"] = dict(config.stash[NOT_COMPARED])
    return info
