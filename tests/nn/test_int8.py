"""int8 translation: the int8 GEMM (``fastformer._C.int8_linear``, csrc/gemm/int8_linear.cpp) against a float64
reference of the same quantized arithmetic, for every dot-product variant this CPU runs at the loaded level
(CI runs this file at every level the machine supports); ``fastformer.quantize`` and its model (the C++
decoder step in int8 against the Python step over the same quantized weights; the log-probabilities beside
float32's); bad input."""
import copy

import pytest
import torch

import fastformer
from fastformer._ext import C
from fastformer.nn import TransformerConfig
from fastformer.nn.decoding import IncrementalDecoder
from fastformer.nn import Transformer
from fastformer.nn.linear import Embedding, Int8Embedding, Int8Linear, Int8Weight, Linear
from fastformer.nn.quantize import prepare
from int8_fixture import CHECKPOINT as INT8_9AEA6A7, RECORDED as INT8_9AEA6A7_TOKENS
from model_reference import varied_model
from test_model_decoding import make_src
from test_native_decoding import cpp_decoder_arguments, with_layer0

VARIANTS = C.int8_variants()
# (113, 256, 70): rows split into blocks of 16 (the last one short) over three panels, as a d x d
# projection at batch 32 splits
SHAPES = [(1, 1, 1), (7, 97, 113), (4, 64, 32), (13, 203, 70), (97, 7, 33), (2, 5, 1), (3, 8, 64), (113, 256, 70)]


def quantize_rows_reference(x):
    """The activations' quantization as the kernel states it: per row s = amax / 127 and
    q = round-half-even(x (127 / amax)) in [-127, 127], in float32."""
    amax = x.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(x * inv[:, None]).clamp(-127, 127), amax / 127.0


def int8_linear_reference(x, weight, bias):
    """float64 of the quantized arithmetic: Wq per output channel (derived here from W, not from the packed
    panels), xq per row, exact integer products, then the scales and the bias."""
    w_amax = weight.abs().amax(dim=1)
    w_inv = torch.where(w_amax > 0, torch.tensor(127.0) / w_amax, torch.zeros_like(w_amax))
    wq, sw = torch.round(weight * w_inv[:, None]).clamp(-127, 127), w_amax / 127.0
    xq, sx = quantize_rows_reference(x)
    y = (xq.double() @ wq.double().T) * (sx.double()[:, None] * sw.double()[None, :])
    return y if bias is None else y + bias.double()


def quantize_weight(weight):
    """C.quantize_int8 (csrc/gemm/gemm.cpp: the one owner of the rule and the layout) as an Int8Weight."""
    return Int8Weight(*C.quantize_int8(weight))


def make_case(M, K, N, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 3
    weight = torch.randn(N, K, generator=g) / K ** 0.5
    if M > 2:
        x[1] = 0.0  # a row of zeros: y = b
    if N > 2:
        weight[2] = 0.0  # a channel of zeros
    return x, weight, (torch.randn(N, generator=g) if bias else None)


def test_this_cpu_runs_a_variant_of_its_level():
    expected = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}.get(fastformer.cpu_capability())
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    best = expected if expected and {"avx512_vnni": "avx512_vnni", "avx_vnni": "avx_vnni"}[expected] in flags \
        else {"avx512": "avx2", "avx2": "avx2"}.get(fastformer.cpu_capability(), "default")
    assert VARIANTS[0] == best, (VARIANTS, fastformer.cpu_capability())
    own = [v for v in VARIANTS if v != "onednn"]
    assert own[-1] in ("avx2", "default")
    # oneDNN's products are listed last wherever torch has oneDNN (x86-64 builds of torch do)
    assert ("onednn" in VARIANTS) == torch.backends.mkldnn.is_available() and VARIANTS[-1] in own + ["onednn"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("M, K, N", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_matches_the_float64_reference_of_its_arithmetic(variant, M, K, N, bias):
    x, weight, b = make_case(M, K, N, bias)
    q = quantize_weight(weight)
    y = C.int8_linear(x, q.weight, q.weight_scale, q.weight_colsum, b, N, variant)
    ref = int8_linear_reference(x, weight, b)
    # float32 epilogue: the int32 sum rounded to float, times a float32 product of the scales, plus the bias
    torch.testing.assert_close(y.double(), ref, rtol=2e-6, atol=2e-6 * float(ref.abs().max()) + 1e-7)
    if M > 2 and b is not None:
        assert torch.equal(y[1], b)  # a row of zeros gives the bias exactly
    if N > 2:
        assert torch.equal(y[:, 2], b[2].expand(M) if b is not None else torch.zeros(M))


@pytest.mark.parametrize("M, K, N", SHAPES)
def test_int8_variants_agree_bit_for_bit(M, K, N):
    """The same int32 sums, whichever dot-product instruction made them, and the same epilogue."""
    x, weight, b = make_case(M, K, N, seed=1)
    q = quantize_weight(weight)
    outs = [C.int8_linear(x, q.weight, q.weight_scale, q.weight_colsum, b, N, v) for v in VARIANTS]
    for v, y in zip(VARIANTS[1:], outs[1:]):
        assert torch.equal(y, outs[0]), (VARIANTS[0], v)


@pytest.mark.parametrize("M, K, N", [(64, 203, 1000), (113, 1031, 70), (203, 512, 40)])
def test_int8_linear_does_not_depend_on_the_thread_count(M, K, N):
    """Many panels; few panels and many rows (split by row blocks too), unevenly over 2 and 3 threads; x
    read at memory offsets of 0, 1, 2, 3 and 8 elements (a misaligned data pointer)."""
    x, weight, b = make_case(M, K, N, seed=2)
    q = quantize_weight(weight)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for offset in (0, 1, 2, 3, 8):
                shifted = torch.empty(x.numel() + offset)[offset:].view(x.shape).copy_(x)
                outs.append(C.int8_linear(shifted, q.weight, q.weight_scale, q.weight_colsum, b, N))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], y) for y in outs[1:])


def test_quantize_weight_packs_and_dequantizes():
    weight = torch.randn(70, 13)
    weight[5] = 0.0
    q = quantize_weight(weight)
    assert q.weight.dtype == torch.int8 and q.weight.shape == (3, 4, 32, 4)
    assert q.weight.abs().max() <= 127
    dequantized = C.dequantize_int8(q.weight, q.weight_scale, 70, 13)
    # every weight within half a step of its dequantized value, the largest of a channel exactly +-127 steps
    assert ((dequantized - weight).abs() <= q.weight_scale[:, None] / 2 * (1 + 1e-5)).all()
    unpacked = q.weight.transpose(1, 2).reshape(96, 16)[:70, :13].float()
    torch.testing.assert_close(unpacked * q.weight_scale[:, None], dequantized)
    assert torch.equal(q.weight_colsum, unpacked.sum(1).int())
    assert (unpacked.abs().amax(1)[torch.arange(70) != 5] == 127).all() and not unpacked[5].any()
    assert torch.equal(q.weight.transpose(1, 2).reshape(96, 16)[70:], torch.zeros(26, 16, dtype=torch.int8))
    # the rule stated in csrc/gemm/gemm.h, written out here in float32: round half to even
    inv = 127.0 / weight.abs().amax(1, keepdim=True)
    expected = torch.round(weight * torch.where(inv.isfinite(), inv, 0)).clamp(-127, 127)
    assert torch.equal(unpacked, expected)
    # a quantized model's embedding lookup: rows of the same dequantized weight, for ids of any shape
    ids = torch.tensor([[5, 0, 69], [31, 32, 33]])
    rows = C.int8_embedding(ids, q.weight, q.weight_scale, 70, 13)
    assert rows.shape == (2, 3, 13) and torch.equal(rows, dequantized[ids])
    assert C.int8_embedding(torch.zeros(0, dtype=torch.long), q.weight, q.weight_scale, 70, 13).shape == (0, 13)


def unpacked(q, n, K):
    """Wq (n, K) of an Int8Weight: its packed weight (P, K4, 32, 4) read back."""
    return q.weight.transpose(1, 2).reshape(-1, q.weight.shape[1] * 4)[:n, :K]


def test_a_non_finite_weight_channel_quantizes_to_zeros_and_a_nan_scale():
    """The one int8 rule (csrc/gemm/gemm.h): a channel with a NaN or an infinity gets int8 values 0 (never
    -127 or 127), a NaN scale and column sum 0, so its outputs are NaN; the other channels are untouched."""
    weight = torch.randn(40, 13)
    weight[3, 5] = float("nan")
    weight[7, 12] = float("inf")
    weight[8, 0] = -float("inf")
    q = quantize_weight(weight)
    bad = torch.tensor([3, 7, 8])
    good = torch.ones(40, dtype=torch.bool)
    good[bad] = False
    assert not unpacked(q, 40, 13)[bad].any() and not q.weight_colsum[bad].any()
    assert q.weight_scale[bad].isnan().all() and q.weight_scale[good].isfinite().all()
    clean = quantize_weight(torch.where(good[:, None], weight, 0.0))
    assert torch.equal(unpacked(q, 40, 13)[good], unpacked(clean, 40, 13)[good])
    assert torch.equal(q.weight_scale[good], clean.weight_scale[good])
    x = torch.randn(5, 13)
    for variant in VARIANTS:
        y = C.int8_linear(x, q.weight, q.weight_scale, q.weight_colsum, None, 40, variant)
        assert y[:, bad].isnan().all() and y[:, good].isfinite().all(), variant
    assert C.dequantize_int8(q.weight, q.weight_scale, 40, 13)[bad].isnan().all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("K", [7, 97])
def test_activations_take_the_weights_rule_exactly(variant, K):
    """The kernel's vectorized activation quantization gives exactly the scalar rule that quantizes the weights
    (C.quantize_int8 of x), NaN and infinity included: through an identity weight (Wq = 127 I, s_w = 1/127)
    y[m, n] = float(127 xq[m, n]) (s_x[m] s_w[n]) in float32, bit for bit; a row with a NaN (first, last, in
    the vector tail) or an infinity gives NaN outputs, a row of zeros zeros."""
    g = torch.Generator().manual_seed(K)
    x = torch.randn(9, K, generator=g) * 3
    x[1, 0] = float("nan")
    x[2, K - 1] = float("nan")
    x[3, K // 2] = float("inf")
    x[4, 1] = -float("inf")
    x[5] = 0.0
    x[6, 2:] = 1e-30  # tiny values beside a larger one
    eye = quantize_weight(torch.eye(K))
    y = C.int8_linear(x, eye.weight, eye.weight_scale, eye.weight_colsum, None, K, variant)
    rule = quantize_weight(x)  # the scalar rule, as the weights take it
    expected = (127 * unpacked(rule, 9, K).int()).float() * (rule.weight_scale[:, None] * eye.weight_scale[None, :])
    torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
    assert y[1:5].isnan().all() and not y[5].any() and y[[0, 6, 7, 8]].isfinite().all()


def test_pack_linear_is_the_packed_kernels_layout():
    weight = torch.randn(70, 13)
    panels = C.pack_linear(weight)
    assert panels.shape == (3, 2, 13, 16)  # panels of 32 columns, each two contiguous strips of 16
    columns = panels.transpose(2, 3).reshape(96, 13)  # row p 32 + s 16 + j: strip s of panel p, column j
    assert torch.equal(columns[:70], weight)
    assert not columns[70:].any()


@pytest.mark.parametrize("call, message", [
    (lambda: C.quantize_int8(torch.randn(3, 4, 5)), "expected a 2-D float32 CPU weight"),
    (lambda: C.quantize_int8(torch.randn(3, 4).double()), "expected a 2-D float32 CPU weight"),
    (lambda: C.quantize_int8(torch.zeros(1, 65537)), "at most 65,536 inputs"),
    (lambda: C.pack_linear(torch.randn(3)), "expected a 2-D float32 CPU weight"),
    (lambda: C.dequantize_int8(torch.zeros(1, 2, 32, 4, dtype=torch.int8), torch.zeros(3), 3, 9), "weight must be"),
    (lambda: C.int8_embedding(torch.tensor([3]), torch.zeros(1, 3, 32, 4, dtype=torch.int8), torch.zeros(3), 3, 9),
     r"id 3 is outside \[0, 3\)"),
    (lambda: C.int8_embedding(torch.tensor([-1]), torch.zeros(1, 3, 32, 4, dtype=torch.int8), torch.zeros(3), 3, 9),
     r"id -1 is outside"),
    (lambda: C.int8_embedding(torch.tensor([0.0]), torch.zeros(1, 3, 32, 4, dtype=torch.int8), torch.zeros(3), 3, 9),
     "ids must be an int64 CPU tensor"),
    (lambda: C.int8_embedding(torch.tensor([0]), torch.zeros(1, 3, 32, 4, dtype=torch.int8), torch.zeros(2), 3, 9),
     "scale must be"),
])
def test_weight_preparation_bad_arguments_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("call, message", [
    (lambda x, q, b: C.int8_linear(x.double(), q.weight, q.weight_scale, q.weight_colsum, b, 33), "x must be a 2-D float32"),
    (lambda x, q, b: C.int8_linear(x, q.weight.float(), q.weight_scale, q.weight_colsum, b, 33), "weight must be a contiguous int8"),
    (lambda x, q, b: C.int8_linear(x, q.weight, q.weight_scale, q.weight_colsum, b, 65), "weight must be a contiguous int8"),
    (lambda x, q, b: C.int8_linear(x[:, :4], q.weight, q.weight_scale, q.weight_colsum, b, 33), "weight must be a contiguous"),
    (lambda x, q, b: C.int8_linear(x, q.weight, q.weight_scale.double(), q.weight_colsum, b, 33), "weight_scale must be a contiguous float32"),
    (lambda x, q, b: C.int8_linear(x, q.weight, q.weight_scale, q.weight_colsum.long(), b, 33), "weight_colsum must be a contiguous int32"),
    (lambda x, q, b: C.int8_linear(x, q.weight, q.weight_scale, q.weight_colsum, b[:5], 33), "bias must be a contiguous float32"),
    (lambda x, q, b: C.int8_linear(x, q.weight, q.weight_scale, q.weight_colsum, b, 33, "sse9"), 'variant "sse9" does not run'),
    (lambda x, q, b: C.int8_linear(torch.zeros(1, 65537), q.weight, q.weight_scale, q.weight_colsum, b, 33), "at most 65,536"),
])
def test_int8_linear_bad_arguments_raise(call, message):
    x, weight, b = make_case(4, 7, 33)
    with pytest.raises(ValueError, match=message):
        call(x, quantize_weight(weight), b)


# ----------------------------------------------------------------------------------------------------
# The quantized model

CONFIG = TransformerConfig.tiny(d_model=64, n_heads=4, d_ff=96, vocab_size=97)


def test_quantize_copies_the_model_and_quantizes_every_projection():
    model = varied_model(CONFIG, "cpu", seed=4, dtype=torch.float32)
    before = copy.deepcopy(model.state_dict())
    quantized = fastformer.quantize(model, "int8")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the original untouched
    assert not any(isinstance(m, (Linear, Embedding)) for m in quantized.modules())
    int8 = [m for m in quantized.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == len([m for m in model.modules() if isinstance(m, Linear)])
    # the same class, the same names: the target's table (also the output projection) is an Int8Embedding
    assert type(quantized) is type(model) and isinstance(quantized.embed, Int8Embedding)
    assert quantized.quantization == "int8" and model.quantization is None
    assert not any(p.requires_grad for p in quantized.parameters())
    # no float copy of a quantized weight, the embedding's included: the float32 tensors left are norms,
    # biases and scales; the state dict's names are the float model's and each int8 weight's scale and sums
    state = quantized.state_dict()
    floats = {k for k, v in state.items() if v.dtype == torch.float32 and v.dim() == 2}
    assert floats == set() and state["embed.weight"].dtype == torch.int8, floats
    assert set(state) == set(model.state_dict()) | {k.replace(".weight", f".weight_{part}") for k, v in
                                                    model.state_dict().items() if v.dim() == 2 for part in ("scale", "colsum")}
    layer = quantized.decoder.layers[0].ffn.fc1
    expected = quantize_weight(model.decoder.layers[0].ffn.fc1.weight)
    assert torch.equal(layer.weight, expected.weight) and torch.equal(layer.weight_scale, expected.weight_scale)
    assert torch.equal(layer.bias, model.decoder.layers[0].ffn.fc1.bias)


def test_int8_weights_round_trip_through_the_state_dict(tmp_path):
    """A quantized model saves as int8 (state_dict: int8 weights, float32 scales) and loads into
    ``prepare(Transformer(config), "int8")``: the same logits and tokens; its file is at most 30% of the
    float model's (the embedding is the int8 output projection's rows)."""
    config = TransformerConfig.tiny(d_model=128, n_heads=4, d_ff=512, vocab_size=97)
    model = varied_model(config, "cpu", seed=4, dtype=torch.float32)
    quantized = fastformer.quantize(model)
    torch.save(model.state_dict(), tmp_path / "float.pt")
    torch.save(quantized.state_dict(), tmp_path / "int8.pt")
    state = torch.load(tmp_path / "int8.pt", weights_only=True)
    assert state["decoder.layers.0.ffn.fc1.weight"].dtype == torch.int8
    assert state["embed.weight_scale"].shape == (97,)
    loaded = prepare(Transformer(config), "int8")
    loaded.load_state_dict(state)
    src = make_src(config, [9, 7, 12, 5])
    tgt = torch.randint(4, config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(src, tgt), quantized(src, tgt))
    assert loaded.generate(src) == quantized.generate(src)
    float_size, int8_size = (tmp_path / "float.pt").stat().st_size, (tmp_path / "int8.pt").stat().st_size
    assert int8_size <= 0.3 * float_size, (int8_size, float_size)
    with pytest.raises(RuntimeError, match="size mismatch|Missing key|Unexpected key"):
        Transformer(config).load_state_dict(state)  # a float model refuses int8 weights


def test_int8_projection_outside_the_kernel_uses_the_dequantized_weight():
    """With grad enabled (the kernel does not apply) an Int8Linear computes F.linear on its dequantized
    weight: the kernel's result up to the activations' rounding."""
    layer = Int8Linear.quantize(torch.randn(33, 20), torch.randn(33))
    x = torch.randn(5, 20)
    with torch.enable_grad():
        y = layer(x)
    expected = x @ C.dequantize_int8(layer.weight, layer.weight_scale, 33, 20).T + layer.bias
    torch.testing.assert_close(y, expected)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=0.05, atol=0.05 * float(expected.abs().max()))


@pytest.mark.parametrize("call, message", [
    (lambda m: fastformer.quantize(m, "int4"), "dtype must be one of int8, got 'int4'"),
    (lambda m: fastformer.quantize(m.double(), "int8"), "int8 runs on the CPU in float32"),
    (lambda m: fastformer.quantize(fastformer.quantize(m)), "already quantized"),
    (lambda m: fastformer.quantize(torch.nn.Linear(2, 2)), "expected a fastformer.nn.Transformer"),
])
def test_quantize_bad_arguments_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call(varied_model(CONFIG, "cpu", seed=4, dtype=torch.float32))


def test_cpp_int8_step_matches_the_python_int8_step():
    """The C++ decoder step (int8 projections inside the step) against the Python step (backend "torch":
    each projection one C.int8_linear call) over the same quantized model and rows, through beam reorders."""
    model = fastformer.quantize(varied_model(CONFIG, "cpu", seed=4, dtype=torch.float32))
    python_model = copy.copy(model)
    python_model.backend = "torch"
    K, lengths, steps = 2, [5, 3, 6], 5
    src = make_src(CONFIG, lengths)
    with torch.no_grad():
        native = IncrementalDecoder(model, *model.encode(src), K, steps)
        python = IncrementalDecoder(python_model, *model.encode(src), K, steps)
        assert native.native is not None and python.native is None
        prefixes = torch.full((len(lengths) * K, 1), CONFIG.bos_id)
        generator = torch.Generator().manual_seed(0)
        for step in range(steps):
            # both in float32, and an activation's quantization step can fall either side of a rounding
            # boundary when the float32 attention and LayerNorm before it round differently
            a, b = native.logits(prefixes), python.logits(prefixes)
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * float(b.abs().max()), msg=f"step {step}")
            parents = torch.tensor([i * K + int(torch.randint(0, K, (), generator=generator))
                                    for i in range(len(lengths)) for _ in range(K)])
            prefixes = torch.cat([prefixes[parents], torch.randint(4, CONFIG.vocab_size, (len(parents), 1),
                                                                   generator=generator)], dim=1)
            native.select(parents, None)
            python.select(parents, None)


# The quantized model's log-probabilities beside float32's, teacher-forced over random targets: the bound
# this test states (docs/decoding.md repeats it). Each projection's inputs and weights carry a relative
# rounding error of at most 1/254 of their row's or channel's largest magnitude.
MEAN_LOGPROB_BOUND, MAX_LOGPROB_BOUND = 0.05, 0.5


def test_quantized_log_probabilities_stay_near_float32():
    model = varied_model(CONFIG, "cpu", seed=4, dtype=torch.float32)
    quantized = fastformer.quantize(model)
    src = make_src(CONFIG, [9, 7, 12, 5])
    tgt = torch.randint(4, CONFIG.vocab_size, (4, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lp = torch.log_softmax(model(src, tgt).double(), -1)
        lq = torch.log_softmax(quantized(src, tgt).double(), -1)
    diff = (lp - lq).abs()
    assert float(diff.mean()) < MEAN_LOGPROB_BOUND and float(diff.max()) < MAX_LOGPROB_BOUND, \
        (float(diff.mean()), float(diff.max()))
    assert float(diff.max()) > 0  # the int8 path ran


def test_quantized_generate_takes_the_float_models_arguments():
    model = varied_model(CONFIG, "cpu", seed=4, dtype=torch.float32)
    quantized = fastformer.quantize(model)
    src = make_src(CONFIG, [9, 7, 12, 5])
    for kwargs in ({}, {"beam_size": 1}, {"beam_size": 3, "length_penalty": 1.0, "max_len_a": 1.0, "max_len_b": 4}):
        out = quantized.generate(src, **kwargs)
        assert len(out) == 4 and all(isinstance(t, int) for hyp in out for t in hyp)
    # most sentences translate as the float model does (random weights: not all)
    same = sum(a == b for a, b in zip(quantized.generate(src), model.generate(src)))
    assert same >= 2, same


def test_cpp_decoder_binds_int8_projections_by_name():
    """A quantized model's projections cross into the C++ step by their state dict names, "<name>.weight",
    "<name>.weight_scale" and "<name>.weight_colsum" (the tied embedding and output projection as "embed.*"),
    each checked like the float32 panels; and "<name>.onednn" where the module holds a oneDNN packing (AMX)."""
    model = fastformer.quantize(varied_model(CONFIG, "cpu", seed=4, dtype=torch.float32))
    description = cpp_decoder_arguments(CONFIG, model)
    packed = {"embed.onednn"} if model.embed.onednn is not None else set()
    assert set(description["embed"]) == {"embed.weight", "embed.weight_scale", "embed.weight_colsum"} | packed
    assert "ffn.fc1.weight" in description["layers"][0] and "ffn.fc1.panels" not in description["layers"][0]
    C.CpuDecoder(description)  # as given: accepted
    for change, message in [
        (lambda w: w.update({"ffn.fc1.weight": w["ffn.fc2.weight"]}),
         "ffn.fc1.weight must be a contiguous int8 CPU tensor of shape"),
        (lambda w: w.update({"ffn.fc1.weight_scale": w["ffn.fc1.weight_scale"].double()}),
         "ffn.fc1.weight_scale must be a contiguous float32"),
        (lambda w: w.pop("ffn.fc1.weight_colsum"), 'has no weight "ffn.fc1.weight_colsum"'),
    ]:
        with pytest.raises(ValueError, match=message):
            C.CpuDecoder(with_layer0(description, change))


def test_int8_checkpoint_of_9aea6a7_loads_and_translates_as_recorded():
    """An int8 checkpoint written by commit 9aea6a7's code (tests/nn/int8_fixture.py: a source embedding of its
    own and an output bias, so every int8 name of that format) loads, by ``load_model`` and by ``prepare`` +
    ``load_state_dict``, and gives the tokens recorded then, on the C++ step and on the full recompute."""
    import json

    from fastformer import checkpoint as ckpt

    with open(INT8_9AEA6A7_TOKENS) as f:
        recorded = json.load(f)["batches"]
    model, _, state = ckpt.load_model(INT8_9AEA6A7)
    loaded = prepare(Transformer(model.config), "int8")
    loaded.load_state_dict(state["model"])
    assert model.quantization == loaded.quantization == "int8"
    for batch in recorded:
        src = torch.tensor(batch["src"])
        for case in batch["cases"]:
            for m in (model, loaded):
                assert m.generate(src, beam_size=case["beam"], use_cache=case["use_cache"]) == case["tokens"], \
                    (case["beam"], case["use_cache"])
