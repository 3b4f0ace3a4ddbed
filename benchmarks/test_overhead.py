"""Call overhead: each op on tiny tensors beside the PyTorch calls it replaces, and the latency of
Transformer.generate for one short sentence.

On tensors this small the arithmetic is nothing: what is timed is the cost of a call (argument checks,
dispatch, the op registration and autograd machinery, allocations; on a GPU the kernel launches and one
synchronization). The targets are ratios of per-call time, fastformer / PyTorch: no-grad forward
<= 1.5x, forward + backward <= 1.3x.

Cases, float32, fastformer's default backend (backend=None), beside the PyTorch calls they replace:
  attention       q, k, v (1, 1, 4, 8)                   F.scaled_dot_product_attention(q, k, v)
  attention+mask  the same, key_padding_mask (1, 4)      SDPA with the equivalent bool attn_mask
                  (the last key is padding)              ~key_padding_mask[:, None, None, :], made once
  softmax+mask    x (4, 8), bool mask (4, 8)             x.masked_fill(mask, -inf).softmax(-1)
  layer_norm_residual  x, residual (4, 8), w, b (8,)     F.layer_norm(x + residual, (8,), w, b)
  cross_entropy   logits (4, 16), int64 target (4,)      F.cross_entropy(logits, target, reduction="none")
  attention_varlen  q, k, v (4, 1, 8): 2 packed sequences  SDPA on the padded batch of the same sequences
                  of 3 and 1 tokens, int32 cu_seqlens    (2, 1, 3, 8) with the bool key mask (2, 1, 1, 3),
                  (3,), made once                        made once (the padded tensors are its inputs)
  bias_activation  x (4, 16), bias (16,)                 F.relu(x + bias)
Passes: "no-grad fwd" (the call under torch.no_grad()) and "fwd+bwd" (the call, then .sum().backward();
the activations require grad; gradients accumulate in .grad, on both sides alike). Weight and bias
require grad in both passes, as a model's parameters do. Devices: cpu, and cuda where a GPU is visible
(each call then ends with torch.cuda.synchronize(), inside its timing). One thread (torch.set_num_threads(1)).

Side by side in one process: both sides are first checked to agree (outputs and gradients) and warmed
up, then timed in strict alternation, one call each per turn (PyTorch, fastformer, PyTorch, ...), both
timed by the same code, for the sizes' time budget per case (0.4 s by default; at least min_rounds and at
most 20,000 turns). A change in the machine's load hits both sides alike, and medians ignore the turns
a preemption or a garbage collection hit. extra_info: "fastformer us" and "pytorch us" (median per call),
"ratio" = fastformer / pytorch, "target" (1.5 or 1.3), "turns", and "speedup" {baseline: pytorch /
fastformer} as the other benchmarks' speedups read. pytest-benchmark's own statistics are those of the
fastformer calls (its timer around the same call, so within a few tenths of a microsecond of "fastformer us").

generate: TransformerConfig.small (vocab 8,000) with seeded random weights in eval mode translates one
source sentence of 12 tokens, beam 1 and beam 4, max_len_a 0 and max_len_b 12. Its eos embedding row is
zeroed, as in test_generate.py, so eos never wins before the length limit forces it: every run decodes
exactly 12 tokens (13 decoder steps; checked). The median is the latency a person waits for: extra_info
"ms/sentence". pytest-benchmark times it for the sizes' budget, at least 10 rounds.

    pytest benchmarks/test_overhead.py --benchmark-only --benchmark-json overhead.json
    python benchmarks/to_markdown.py overhead.json       # the overhead table (also printed at the end)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from time import perf_counter
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import ops
from fastformer.nn import Transformer, TransformerConfig
from harness import TIMED  # benchmarks/ is on sys.path (pytest inserts a conftest's folder)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CASES = ("attention", "attention+mask", "softmax+mask", "layer_norm_residual", "cross_entropy", "attention_varlen",
         "bias_activation")
TARGETS = {"no-grad fwd": 1.5, "fwd+bwd": 1.3}  # the most fastformer / pytorch per call may be
MAX_TURNS = 20_000
GEN_SRC_LEN, GEN_TGT_LEN = 12, 12


def default_backend(device: str) -> str:
    """The backend that backend=None runs on ``device`` (the label of the rows): FASTFORMER_BACKEND if
    set, else the automatic choice among the available backends (docs/api.md, "Backends")."""
    if os.environ.get("FASTFORMER_BACKEND"):
        return os.environ["FASTFORMER_BACKEND"]
    available = fastformer.backends()
    if device == "cpu":
        order = ("cpu", "torch")
    elif torch.cuda.get_device_capability() >= (8, 0):
        order = ("triton", "cuda", "torch")
    else:
        order = ("cuda", "triton", "torch")
    return next(name for name in order if available.get(name))


@dataclass
class Case:
    """One op call and the PyTorch calls it replaces, on the same inputs."""
    fastformer: Callable[[], torch.Tensor]
    pytorch: Callable[[], torch.Tensor]
    baseline: str  # the PyTorch side, in words
    shape: str
    inputs: list[torch.Tensor]  # those that require grad
    # Where the PyTorch side computes on other tensors (attention_varlen: the padded batch of the packed
    # sequences): its leaves, its output or gradient in fastformer's layout, fastformer's upstream in its own.
    pytorch_inputs: list[torch.Tensor] | None = None
    unpad: Callable[[torch.Tensor], torch.Tensor] | None = None
    pad: Callable[[torch.Tensor], torch.Tensor] | None = None


def make_case(name: str, device: str, grad: bool) -> Case:
    """Fresh random inputs of the case on ``device``; activations require grad iff ``grad``."""
    def randn(*shape: int, requires_grad: bool = grad) -> torch.Tensor:
        return torch.randn(*shape, device=device, requires_grad=requires_grad)

    if name in ("attention", "attention+mask"):
        q, k, v = (randn(1, 1, 4, 8) for _ in range(3))
        inputs = [q, k, v] if grad else []
        if name == "attention":
            return Case(lambda: ops.attention(q, k, v), lambda: F.scaled_dot_product_attention(q, k, v),
                        "sdpa", "q,k,v (1, 1, 4, 8)", inputs)
        padding = torch.tensor([[False, False, False, True]], device=device)  # (B, Lk), True = padding
        attend = ~padding[:, None, None, :]  # (B, 1, 1, Lk), True = attend: SDPA's bool attn_mask
        return Case(lambda: ops.attention(q, k, v, key_padding_mask=padding),
                    lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attend),
                    "sdpa, bool attn_mask", "q,k,v (1, 1, 4, 8), key_padding_mask (1, 4)", inputs)
    if name == "softmax+mask":
        x = randn(4, 8)
        mask = torch.rand(4, 8, device=device) < 0.25
        mask[:, 0] = False  # no fully masked row: masked_fill + softmax would give NaN there
        return Case(lambda: ops.softmax(x, mask=mask), lambda: x.masked_fill(mask, float("-inf")).softmax(-1),
                    "masked_fill+softmax", "x (4, 8), mask (4, 8)", [x] if grad else [])
    if name == "layer_norm_residual":
        x, residual = randn(4, 8), randn(4, 8)
        weight, bias = randn(8, requires_grad=True), randn(8, requires_grad=True)
        return Case(lambda: ops.layer_norm_residual(x, residual, weight, bias),
                    lambda: F.layer_norm(x + residual, (8,), weight, bias),
                    "add+layer_norm", "x,residual (4, 8), weight,bias (8,)",
                    [x, residual, weight, bias] if grad else [weight, bias])
    if name == "cross_entropy":
        logits = randn(4, 16)
        target = torch.randint(0, 16, (4,), device=device)
        return Case(lambda: ops.cross_entropy(logits, target),
                    lambda: F.cross_entropy(logits, target, reduction="none"),
                    "F.cross_entropy", "logits (4, 16), target (4,)", [logits] if grad else [])
    if name == "attention_varlen":
        lens, H, D = (3, 1), 1, 8
        B, L, T = len(lens), max(lens), sum(lens)
        cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
        rows = torch.tensor([b * L + i for b, n in enumerate(lens) for i in range(n)], device=device)

        def pad(t: torch.Tensor) -> torch.Tensor:  # (T, H, D) -> (B, H, L, D), zeros at padding
            out = t.new_zeros(B * L, H, D)
            out[rows] = t
            return out.view(B, L, H, D).transpose(1, 2)

        def unpad(t: torch.Tensor) -> torch.Tensor:  # (B, H, L, D) -> (T, H, D), the real rows
            return t.transpose(1, 2).reshape(B * L, H, D)[rows]

        q, k, v = (randn(T, H, D) for _ in range(3))
        real = torch.arange(L, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]  # (B, L)
        # The same sequences as (B, H, L, D) leaves of their own, padding rows random (masked away as keys).
        padded = [torch.where(real[:, None, :, None], pad(t.detach()), torch.randn(B, H, L, D, device=device))
                  .requires_grad_(grad) for t in (q, k, v)]
        qp, kp, vp = padded
        keep = real[:, None, None, :]  # SDPA's bool attn_mask, True = attend
        return Case(lambda: ops.attention_varlen(q, k, v, cu, cu, L, L),
                    lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=keep),
                    "sdpa on the padded batch, bool attn_mask",
                    "q,k,v (4, 1, 8): sequences of 3 and 1 (padded (2, 1, 3, 8))",
                    [q, k, v] if grad else [], pytorch_inputs=padded if grad else [], unpad=unpad, pad=pad)
    if name == "bias_activation":
        x, bias = randn(4, 16), randn(16, requires_grad=True)
        return Case(lambda: ops.bias_activation(x, bias), lambda: F.relu(x + bias), "add+relu",
                    "x (4, 16), bias (16,)", [x, bias] if grad else [bias])
    raise ValueError(name)


TOLERANCES = {"cpu": {"rtol": 1e-4, "atol": 1e-5}, "cuda": {"rtol": 5e-3, "atol": 5e-3}}  # cuda: TF32 dots


def check(case: Case, grad: bool, device: str) -> None:
    """Both sides agree: outputs, and with ``grad`` the gradients of a random projection of them."""
    unpad = case.unpad or (lambda t: t)
    pad = case.pad or (lambda t: t)
    with torch.set_grad_enabled(grad):
        ours, theirs = case.fastformer(), case.pytorch()
    torch.testing.assert_close(ours, unpad(theirs), **TOLERANCES[device])
    if grad:
        dout = torch.randn_like(ours)
        their_inputs = case.inputs if case.pytorch_inputs is None else case.pytorch_inputs
        torch.testing.assert_close(torch.autograd.grad(ours, case.inputs, dout),
                                   tuple(unpad(g) for g in torch.autograd.grad(theirs, their_inputs, pad(dout))),
                                   **TOLERANCES[device])


def per_call(forward: Callable[[], torch.Tensor], mode: str, device: str) -> Callable[[], None]:
    """The timed call of a mode: the forward, or forward then .sum().backward(); on a GPU then a sync."""
    if mode == "fwd+bwd":
        call = lambda: forward().sum().backward()  # noqa: E731
    else:
        call = forward
    if device != "cuda":
        return call

    def synced():
        call()
        torch.cuda.synchronize()

    return synced


def alternate(benchmark, fastformer_call: Callable[[], object], pytorch_call: Callable[[], object],
              turns: int) -> tuple[list[float], list[float]]:
    """Seconds of each call of both, in ``turns`` alternating turns of one call each: pytest-benchmark's
    setup runs the PyTorch call, its timed target the fastformer call; both are timed here alike."""
    ours: list[float] = []
    theirs: list[float] = []

    def timed(call, into):
        start = perf_counter()
        call()
        into.append(perf_counter() - start)

    benchmark.pedantic(timed, args=(fastformer_call, ours), setup=lambda: timed(pytorch_call, theirs),
                       rounds=turns)
    return ours, theirs


def median(values: list[float]) -> float:
    values = sorted(values)
    n = len(values)
    return (values[(n - 1) // 2] + values[n // 2]) / 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(TARGETS), ids=["nograd_fwd", "fwdbwd"])
@pytest.mark.parametrize("case_name", CASES)
def test_overhead(benchmark, request, ctx, one_thread, case_name, mode, device):
    grad = mode == "fwd+bwd"
    case = make_case(case_name, device, grad)
    check(case, grad, device)
    ours, theirs = per_call(case.fastformer, mode, device), per_call(case.pytorch, mode, device)
    impl = default_backend(device)
    benchmark.group = f"overhead {device} {mode}"
    info = benchmark.extra_info
    info.update({"op": "overhead", "case": case_name, "shape": case.shape, "pass": mode, "impl": impl,
                 "baseline": False, "pytorch": case.baseline, "device": device, "dtype": "float32",
                 "threads": torch.get_num_threads(), "sizes": ctx.sizes.name, "target": TARGETS[mode]})
    with torch.set_grad_enabled(grad):
        if benchmark.disabled:  # --benchmark-disable: one call of each, as a smoke test
            theirs()
            benchmark.pedantic(ours)
            return
        for _ in range(20):  # warm-up: allocator, caches, lazy initialization
            theirs()
            ours()
        start = perf_counter()
        for _ in range(20):
            theirs()
            ours()
        pair = (perf_counter() - start) / 20
        turns = min(max(math.ceil(ctx.sizes.seconds / pair), ctx.sizes.min_rounds), MAX_TURNS)
        ours_s, theirs_s = alternate(benchmark, ours, theirs, turns)
    ours_us, theirs_us = median(ours_s) * 1e6, median(theirs_s) * 1e6
    info.update({"fastformer us": ours_us, "pytorch us": theirs_us, "ratio": ours_us / theirs_us,
                 "turns": turns, "speedup": {case.baseline: theirs_us / ours_us}})
    request.config.stash[TIMED].append(benchmark)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beam", [1, 4], ids=["beam1", "beam4"])
def test_generate_latency(benchmark, request, ctx, one_thread, beam, device):
    config = TransformerConfig.small(vocab_size=8000)
    model = Transformer(config).to(device).eval()
    with torch.no_grad():
        model.embed.weight[config.eos_id].zero_()  # eos's logit 0: never among the best before the limit
    src = ctx.tokens(1, GEN_SRC_LEN, GEN_SRC_LEN, config.pad_id, config.vocab_size).to(device)

    def generate():
        return model.generate(src, beam_size=beam, max_len_a=0.0, max_len_b=GEN_TGT_LEN)

    benchmark.group = f"generate latency {device}"
    info = benchmark.extra_info
    info.update({"op": "generate", "shape": f"small, 1 sentence of {GEN_SRC_LEN} tokens -> {GEN_TGT_LEN}, "
                                            f"beam {beam}, {device}",
                 "pass": "latency", "impl": default_backend(device), "baseline": False, "device": device,
                 "dtype": "float32", "threads": torch.get_num_threads(), "sizes": ctx.sizes.name, "beam": beam})
    if benchmark.disabled:
        out = benchmark.pedantic(generate)
    else:
        start = perf_counter()
        generate()  # warm-up
        rounds = max(math.ceil(ctx.sizes.seconds / (perf_counter() - start)), ctx.sizes.min_rounds, 10)
        out = benchmark.pedantic(generate, rounds=rounds)
        median_s = benchmark.stats.stats.median
        info.update({"ms/sentence": median_s * 1e3, "sentences/s": 1 / median_s, "tokens/s": GEN_TGT_LEN / median_s})
        request.config.stash[TIMED].append(benchmark)
    assert [len(tokens) for tokens in out] == [GEN_TGT_LEN]
