"""The int8 providers (csrc/gemm/int8_linear.cpp, csrc/gemm/int8_onednn.h): fastformer's own dot-product kernels
and oneDNN's products through torch ("onednn", AMX tiles where the CPU has them) compute the same int32 sums, so
the same outputs and the same tokens, whichever runs. Each test forces every variant this machine runs
(``C.int8_variants()``; the ids name them) and compares.

Where the CPU has VNNI or AMX, the operands are full range. Elsewhere oneDNN's int8 kernels sum byte pairs in
16 bits (vpmaddubsw), which full-range operands can saturate (so the rule never chooses oneDNN there): the
weights are then kept within [-64, 63], which no pair can saturate, and the tests check the plumbing. The
parameter ``operands`` names which of the two ran ("full-range" or "no-16-bit-saturation")."""
import os
import subprocess
import sys

import pytest
import torch

import fastformer
from fastformer._ext import C
from fastformer.nn.linear import Int8Linear, Int8Module
from fastformer.nn.quantize import pack_for_providers
from model_reference import varied_model
from test_int8 import CONFIG
from test_model_decoding import make_src

VARIANTS = C.int8_variants()
OPERANDS = "full-range" if C.cpu_has_int8_dot() else "no-16-bit-saturation"
ONEDNN_ROWS = C.int8_onednn_rule()[0]
# M from 1 to 129 (both sides of the rule's 32 and of the row blocks); K not a multiple of 4 and past oneDNN's
# exact float32 chunk (1,040: 1,041 and 2,047 are split); N not a multiple of 16 and past its column block (4,096)
SHAPES = [(1, 1, 1), (1, 7, 33), (2, 97, 97), (7, 203, 16), (31, 1041, 33), (32, 7, 4100), (33, 2047, 50),
          (64, 256, 97), (127, 1040, 17), (128, 2048, 40), (129, 97, 4113)]


@pytest.fixture(autouse=True)
def no_forced_provider(monkeypatch):
    monkeypatch.delenv("FASTFORMER_INT8_PROVIDER", raising=False)


def integer_case(M, K, N, seed):
    """x (M, K) and W (N, K) whose quantization keeps their integers: values in [-127, 127] with +-127 in every
    row, so s = 127 / 127 = 1 and xq = x, Wq = W (the weight's rows scaled by 1 too). Row 0 of x and of W is
    all 127 (the largest sum, K 127^2: past 2^24 for K > 1,040). Without VNNI or AMX, Wq is then halved
    (floor) in place in the packed weight, colsum recomputed: |Wq| <= 64. Returns x, the int8 weight
    (weight, weight_scale, weight_colsum) and Wq as int64 (N, K)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (M, K), generator=g).float()
    w = torch.randint(-127, 128, (N, K), generator=g).float()
    x[:, 0], w[:, 0] = 127.0, -127.0
    x[0], w[0] = 127.0, 127.0
    weight, scale, colsum = C.quantize_int8(w)
    assert torch.equal(scale, torch.ones(N))
    if OPERANDS != "full-range":
        weight = torch.div(weight, 2, rounding_mode="floor")
    wq = C.dequantize_int8(weight, torch.ones(N), N, K).long()
    return x, (weight, scale, wq.sum(1).int()), wq


@pytest.mark.parametrize("operands", [OPERANDS])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("M, K, N", SHAPES)
def test_every_variant_gives_the_exact_int32_sums(operands, variant, M, K, N):
    """y = float(sum_k xq Wq) with unit scales and no bias: the int32 sums themselves (compared as integers
    below 2^24; above, as that integer rounded to float32), bit-identical at 1, 2 and 3 threads."""
    x, (weight, scale, colsum), wq = integer_case(M, K, N, seed=M * 7 + K + N)
    sums = x.long() @ wq.T  # int64: the exact sums
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(C.int8_linear(x, weight, scale, colsum, None, N, variant))
    finally:
        torch.set_num_threads(threads)
    y = outs[0]
    assert all(torch.equal(y, other) for other in outs[1:]), "depends on the thread count"
    small = sums.abs() < 2 ** 24
    assert torch.equal(y[small].long(), sums[small])
    assert torch.equal(y[~small], sums[~small].float())
    if OPERANDS == "full-range" and K > 1040:
        assert not small[0, 0]  # the largest sum, K 127^2 >= 2^24, was exercised


@pytest.mark.parametrize("M, K, N", SHAPES)
def test_every_variant_gives_the_same_outputs(M, K, N):
    """Float inputs, scales and a bias: every variant's y bit-identical to the first's (the same sums and the
    same float epilogue), x read at a shifted memory offset too."""
    g = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=g) * 3
    shifted = torch.empty(x.numel() + 3)[3:].view(x.shape).copy_(x)
    weight, scale, colsum = C.quantize_int8(torch.randn(N, K, generator=g) / K ** 0.5)
    if OPERANDS != "full-range":
        weight = torch.div(weight, 2, rounding_mode="floor")
        colsum = C.dequantize_int8(weight, torch.ones(N), N, K).sum(1).int()
    bias = torch.randn(N, generator=g)
    outs = {v: C.int8_linear(x, weight, scale, colsum, bias, N, v) for v in VARIANTS}
    outs["shifted"] = C.int8_linear(shifted, weight, scale, colsum, bias, N, VARIANTS[-1])
    for name, y in outs.items():
        assert torch.equal(y, outs[VARIANTS[0]]), (VARIANTS[0], name)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("M", [1, 40])
def test_a_projection_of_no_inputs_gives_the_bias(variant, M):
    weight, scale, colsum = C.quantize_int8(torch.empty(5, 0))
    bias = torch.randn(5)
    assert torch.equal(C.int8_linear(torch.empty(M, 0), weight, scale, colsum, bias, 5, variant), bias.expand(M, 5))


def small_weights(model):
    """Where oneDNN could saturate (no VNNI, no AMX), every int8 weight of ``model`` halved in place (see the top),
    and packed again (pack_for_providers: a weight changed in place is not re-packed by itself)."""
    if OPERANDS == "full-range":
        return model
    for module in model.modules():
        if hasattr(module, "weight_colsum"):
            n = module.weight_scale.shape[0]
            module.weight.copy_(torch.div(module.weight, 2, rounding_mode="floor"))
            K = module.weight.shape[1] * 4
            module.weight_colsum.copy_(C.dequantize_int8(module.weight, torch.ones(n), n, K).sum(1).int())
    return pack_for_providers(model)


@pytest.mark.parametrize("operands", [OPERANDS])
def test_every_variant_translates_to_the_same_tokens(operands, monkeypatch):
    """generate on a quantized model with each variant forced (FASTFORMER_INT8_PROVIDER): 9 sentences, beam 4
    (36 rows a step: past the rule's 32 rows), the encoder's projections (rows = tokens) and the C++ decoder step's;
    at 1 and 3 threads. The same tokens and the same scores everywhere."""
    torch.manual_seed(0)
    model = small_weights(fastformer.quantize(varied_model(CONFIG, "cpu", seed=4, dtype=torch.float32)))
    src = make_src(CONFIG, [5, 3, 6, 7, 2, 8, 4, 6, 5])
    results = {}
    threads = torch.get_num_threads()
    try:
        for variant in VARIANTS:
            monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", variant)
            assert {m.provider for m in pack_for_providers(model).modules() if isinstance(m, Int8Module)} == {variant}
            for n in (1, 3):
                torch.set_num_threads(n)
                results[variant, n] = model.beam_search(src, beam_size=4, max_len_b=6)
    finally:
        torch.set_num_threads(threads)
    first = results[VARIANTS[0], 1]
    assert any(len(tokens) > 1 for hyps in first for tokens, _ in hyps)
    for key, hyps in results.items():
        assert hyps == first, key


def test_the_rule_and_the_forced_provider(monkeypatch):
    """oneDNN's products on a CPU with AMX from 32 rows and 2^22 multiply-adds, our best kernel otherwise; the
    report says the same; FASTFORMER_INT8_PROVIDER forces any variant, "fastformer" our best, "auto" the rule."""
    amx = C.cpu_has_amx_int8()
    assert C.int8_onednn_rule() == (ONEDNN_ROWS, 2.0 ** 22)
    cases = [((1, 8000, 512), False), ((4, 37000, 512), False), ((31, 58101, 512), False), ((32, 256, 256), False),
             ((64, 256, 255), False), ((64, 256, 256), True), ((32, 512, 256), True), ((128, 8000, 256), True),
             ((129, 97, 1041), True)]
    for (M, N, K), large in cases:
        assert C.int8_onednn_rule_holds(M, N, K) == large, (M, N, K)  # the bounds, on any CPU
        expected = "onednn" if amx and large and "onednn" in VARIANTS else VARIANTS[0]
        assert C.int8_variant_for(M, N, K) == expected, (M, N, K)
    report = fastformer.int8_providers()
    assert report["variants"] == VARIANTS and report["amx_int8"] == amx and report["forced"] is None
    assert report["above both"] == C.int8_variant_for(1024, 1024, 1024)
    assert report[f"below {ONEDNN_ROWS} rows or 4,194,304 multiply-adds"] == VARIANTS[0]
    for variant in VARIANTS:
        monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", variant)
        assert C.int8_variant_for(1, 1, 1) == C.int8_variant_for(500, 800, 900) == variant
    monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", "fastformer")
    assert C.int8_variant_for(128, 8000, 256) == VARIANTS[0]
    monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", "auto")
    assert C.int8_variant_for(128, 8000, 256) == ("onednn" if amx and "onednn" in VARIANTS else VARIANTS[0])
    monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", "amx_please")
    with pytest.raises(ValueError, match='FASTFORMER_INT8_PROVIDER "amx_please" does not run here'):
        C.int8_variant_for(1, 1, 1)
    x, weight = torch.randn(2, 8), C.quantize_int8(torch.randn(3, 8))
    with pytest.raises(ValueError, match='FASTFORMER_INT8_PROVIDER "amx_please"'):
        C.int8_linear(x, *weight, None, 3)
    with pytest.raises(ValueError, match='variant "amx" does not run here'):
        C.int8_linear(x, *weight, None, 3, "amx")


def test_a_module_reads_the_provider_once_when_bound(monkeypatch):
    """C.int8_provider names what FASTFORMER_INT8_PROVIDER forces ("fastformer": our best; unset or "auto": the
    rule). An int8 module reads it when bound (quantization, load_state_dict, pack_for_providers) and keeps it:
    changing the variable later changes nothing until it is bound again; its outputs are the same whichever
    variant it runs (the same int32 sums)."""
    monkeypatch.delenv("FASTFORMER_INT8_PROVIDER", raising=False)
    assert C.int8_provider() == "auto" and C.int8_provider("fastformer") == VARIANTS[0]
    assert [C.int8_provider(v) for v in VARIANTS] == VARIANTS
    with pytest.raises(ValueError, match='variant "amx" does not run here'):
        C.int8_provider("amx")
    g = torch.Generator().manual_seed(3)
    weight, bias, x = torch.randn(40, 24, generator=g), torch.randn(40, generator=g), torch.randn(7, 24, generator=g)
    layer = Int8Linear.quantize(weight, bias)
    assert layer.provider == "auto"
    with torch.no_grad():
        expected = layer(x)
    last = VARIANTS[-1] if OPERANDS == "full-range" or VARIANTS[-1] != "onednn" else VARIANTS[0]
    monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", last)
    assert C.int8_provider() == last and layer.provider == "auto"  # bound before: unchanged
    state = layer.state_dict()
    layer.load_state_dict(state)
    assert layer.provider == last
    with torch.no_grad():
        assert torch.equal(layer(x), expected)
    monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", "fastformer")
    assert layer.provider == last and pack_for_providers(layer).provider == VARIANTS[0]
    monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", "amx_please")
    with pytest.raises(ValueError, match='FASTFORMER_INT8_PROVIDER "amx_please" does not run here'):
        Int8Linear.quantize(weight, bias)


@pytest.mark.skipif("onednn" not in VARIANTS, reason="this torch has no oneDNN (no variant onednn to pack for)")
def test_weights_are_packed_at_quantization_and_load_when_onednn_can_run(monkeypatch):
    """C.int8_prepare packs where oneDNN can be chosen (forced, or the rule on AMX), else gives None; an int8
    module holds what it gave at quantization (and pack_for_providers packs it again under the provider of the
    time)."""
    layer = Int8Linear.quantize(torch.randn(40, 24), torch.randn(40))
    assert (layer.onednn is not None) == C.cpu_has_amx_int8()
    args = (layer.weight, layer.weight_scale, layer.weight_colsum, 40, 24)
    monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", VARIANTS[0])
    assert C.int8_prepare(*args) is None
    assert pack_for_providers(layer) is layer and layer.onednn is None
    monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", "onednn")
    packed = C.int8_prepare(*args)
    assert isinstance(packed, C.OnednnInt8) and (packed.n, packed.K) == (40, 24)
    assert pack_for_providers(layer).onednn is not None
    assert Int8Linear.quantize(torch.randn(40, 24)).onednn is not None
    monkeypatch.delenv("FASTFORMER_INT8_PROVIDER")
    assert (C.int8_prepare(*args) is not None) == C.cpu_has_amx_int8()


@pytest.mark.skipif("onednn" not in VARIANTS, reason="this torch has no oneDNN (no variant onednn to check)")
def test_onednn_never_reorders_a_weight_per_call():
    """oneDNN's own log (ONEDNN_VERBOSE=1) over calls at 1, 33 and 129 rows after quantization: matmuls run,
    and no reorder does (the weights were packed once, at quantization)."""
    script = (
        "import torch\n"
        "from fastformer.nn.linear import Int8Linear\n"
        "layers = [Int8Linear.quantize(torch.randn(n, k), torch.randn(n)) for n, k in ((50, 2047), (4113, 97))]\n"
        "print('CALLS', flush=True)\n"
        "with torch.no_grad():\n"
        "    for M in (1, 33, 129, 33):\n"
        "        for layer in layers:\n"
        "            layer(torch.randn(M, layer.in_features))\n"
        "print('END', flush=True)\n")
    env = dict(os.environ, ONEDNN_VERBOSE="1", FASTFORMER_INT8_PROVIDER="onednn")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    calls = out.stdout.split("CALLS", 1)[1].split("END", 1)[0]
    executed = [line for line in calls.splitlines() if ",exec," in line]
    assert sum(",matmul," in line for line in executed) == 4 * (2 + 2), executed  # 2047: two chunks; 4113: two blocks
    assert not [line for line in executed if ",reorder," in line]
