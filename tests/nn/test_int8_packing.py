"""The oneDNN packings of int8 weights (csrc/gemm/int8_onednn.cpp, fastformer/nn/linear.py ``Int8Module``): each
held by the int8 module whose weight it packs, as torch's LinearPackedParams by its Linear, and passed to every
call and to the C++ decoder; no cache. Issue 55: ``fastformer.quantize`` under ``torch.inference_mode()``
raised "Inference tensors do not track version counter" (the cache was keyed on the weight's version), and a
deleted model's packings stayed in that cache.

oneDNN's products are forced here (FASTFORMER_INT8_PROVIDER=onednn, read when a module is bound: at quantization,
load and pack_for_providers; and when a C++ decoder is built), so packings are made and used on any CPU whose torch has oneDNN. Outputs are compared with oneDNN's
own elsewhere, and with our kernel's only where the CPU has VNNI or AMX (without, oneDNN's 16-bit pair sums can
saturate: tests/nn/test_int8_providers.py)."""
import copy
import gc
import pickle
import weakref

import pytest
import torch

import fastformer
from fastformer._ext import C
from fastformer.nn.linear import INT8_BUFFERS, Int8Linear, Int8Module
from fastformer.nn.quantize import pack_for_providers, prepare
from fastformer.nn.transformer import Transformer
from model_reference import varied_model
from test_int8 import CONFIG
from test_model_decoding import make_src
from test_native_decoding import cpp_decoder_arguments, with_layer0

pytestmark = pytest.mark.skipif("onednn" not in C.int8_variants(),
                                reason="this torch has no oneDNN (no variant onednn to pack for)")

OURS = C.int8_variants()[0]
SENTENCES = [5, 3, 6, 7, 2, 8, 4, 6, 5]  # beam 4: 36 rows a decoder step


@pytest.fixture(autouse=True)
def onednn_forced(monkeypatch):
    monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", "onednn")


def float_model(seed=4):
    return varied_model(CONFIG, "cpu", seed=seed, dtype=torch.float32)


def int8_modules(model):
    return [m for m in model.modules() if isinstance(m, Int8Module)]


def translate(model, src):
    return model.beam_search(src, beam_size=4, max_len_b=6)


def live():
    """The oneDNN packings this process holds, after a collection."""
    gc.collect()
    return C.int8_onednn_live()


def packings(description):
    """The packings a C++ decoder's description hands over ("<name>.onednn")."""
    named = [*description["layers"], description["embed"]]
    return [v for weights in named for k, v in weights.items() if k.endswith(".onednn")]


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_quantize_and_translate_under_inference_mode_and_no_grad(mode, monkeypatch):
    """fastformer.quantize and beam_search inside the mode: every int8 module holds a packing (of inference
    tensors' weights under inference_mode), and the hypotheses and scores are those of a model quantized and
    run outside it, inside the mode and after it; our kernel's too (the same int32 sums)."""
    model, src = float_model(), make_src(CONFIG, SENTENCES)
    expected = translate(fastformer.quantize(model), src)
    assert any(len(tokens) > 1 for hyps in expected for tokens, _ in hyps)
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        quantized = fastformer.quantize(model)
        assert quantized.embed.weight.is_inference() == (mode == "inference_mode")
        assert all(m.onednn is not None for m in int8_modules(quantized))
        assert translate(quantized, src) == expected
    assert translate(quantized, src) == expected
    if C.cpu_has_int8_dot():
        monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", OURS)
        assert translate(quantized, src) == expected


def test_a_projection_under_inference_mode():
    """An Int8Linear quantized and called inside inference_mode (K past oneDNN's exact chunk: two packed chunks)
    gives the outputs of one made outside it, and called outside it too."""
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(97, 1041, generator=g), torch.randn(97, generator=g)
    x = torch.randn(40, 1041, generator=g)
    with torch.no_grad():
        expected = Int8Linear.quantize(weight, bias)(x)
    with torch.inference_mode():
        layer = Int8Linear.quantize(weight, bias)
        assert layer.weight.is_inference() and layer.onednn is not None
        assert torch.equal(layer(x), expected)
    with torch.no_grad():
        assert torch.equal(layer(x), expected)


def test_packings_are_freed_with_their_model():
    """A quantized model's packings (one per int8 module) are freed when the model is: after del and a
    collection, the live count is back where it was; a translation holds them only while its C++ decoder lives."""
    src = make_src(CONFIG, SENTENCES)
    before = live()
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            quantized = fastformer.quantize(float_model())
        count = len(int8_modules(quantized))
        assert count > 0 and live() == before + count
        translate(quantized, src)
        assert live() == before + count
        owner = weakref.ref(int8_modules(quantized)[0])
        del quantized
        assert live() == before and owner() is None


def test_a_cpp_decoder_holds_the_packings_given_and_frees_those_it_makes():
    """The C++ decoder binds "<name>.onednn" by name and holds what it is given while it lives (the model gone);
    given none, it packs the int8 weights itself (the same logits) and frees those packings with itself."""
    quantized = fastformer.quantize(float_model())
    torch.manual_seed(0)  # the source sentences of cpp_decoder_arguments
    description = cpp_decoder_arguments(CONFIG, quantized)
    given, count = len(packings(description)), len(int8_modules(quantized))
    assert "ffn.fc1.onednn" in description["layers"][0] and "embed.onednn" in description["embed"]
    before = live()
    decoder = C.CpuDecoder(description)
    assert live() == before  # nothing packed: the model's packings are bound
    del quantized, description
    baseline = live()
    assert baseline == before - count + given  # the decoder's, held
    tokens = torch.tensor([5, 6, 7, 8])  # 2 sentences x 2 beams
    logits = decoder.logits(tokens).clone()
    same = fastformer.quantize(float_model())
    torch.manual_seed(0)
    stripped = cpp_decoder_arguments(CONFIG, same)
    del same
    for weights in [*stripped["layers"], stripped["embed"]]:
        for name in [k for k in weights if k.endswith(".onednn")]:
            del weights[name]
    unpacked = C.CpuDecoder(stripped)
    assert live() == baseline + given  # packed by the decoder for itself
    assert torch.equal(unpacked.logits(tokens), logits)
    del unpacked
    assert live() == baseline
    del decoder
    assert live() == baseline - given


@pytest.mark.parametrize("change, message", [
    (lambda w: w.update({"ffn.fc1.onednn": w["ffn.fc2.onednn"]}),
     r"ffn.fc1.onednn is the packing of a \(64, 96\) weight, not of this \(96, 64\) one"),
    (lambda w: w.update({"ffn.fc1.onednn": w["ffn.fc1.weight"]}), '"ffn.fc1.onednn" must be a oneDNN packing'),
    (lambda w: w.update({"ffn.fc1.weight": w["ffn.fc1.onednn"]}), '"ffn.fc1.weight" must be a tensor'),
], ids=["another weight's", "a tensor as a packing", "a packing as a weight"])
def test_a_cpp_decoder_refuses_a_wrong_packing(change, message):
    description = cpp_decoder_arguments(CONFIG, fastformer.quantize(float_model()))
    with pytest.raises(ValueError, match=message):
        C.CpuDecoder(with_layer0(description, change))


def test_load_state_dict_packs_the_loaded_weights():
    """A quantized model loaded with another's weights (copied into its own tensors) packs them anew and then
    translates as that model does; so does an empty prepared model (checkpoint loading)."""
    src = make_src(CONFIG, SENTENCES)
    model, other = fastformer.quantize(float_model(4)), fastformer.quantize(float_model(5))
    expected = translate(other, src)
    assert translate(model, src) != expected
    weights = [m.weight for m in int8_modules(model)]
    first = [m.onednn for m in int8_modules(model)]
    model.load_state_dict(other.state_dict())
    assert all(m.weight is w for m, w in zip(int8_modules(model), weights))  # loaded in place
    assert all(m.onednn is not None and m.onednn is not f for m, f in zip(int8_modules(model), first))
    assert translate(model, src) == expected
    x = torch.randn(40, CONFIG.d_model)
    with torch.no_grad():
        assert torch.equal(model.decoder.layers[0].ffn.fc1(x), other.decoder.layers[0].ffn.fc1(x))
    loaded = prepare(Transformer(CONFIG), "int8")
    loaded.load_state_dict(other.state_dict())
    assert all(m.onednn is not None for m in int8_modules(loaded))
    assert translate(loaded, src) == expected


def test_a_replaced_weight_and_a_copy_are_packed_again():
    """An int8 module whose weight tensor is replaced packs the new one at its next call; a deep copy or a
    pickled copy takes no packing and packs its own: each gives the new weight's outputs."""
    g = torch.Generator().manual_seed(2)
    bias, x = torch.randn(97, generator=g), torch.randn(40, 1041, generator=g)
    layer = Int8Linear.quantize(torch.randn(97, 1041, generator=g), bias)
    other = Int8Linear.quantize(torch.randn(97, 1041, generator=g), bias)
    first = layer.onednn
    with torch.no_grad():
        expected, before = other(x), layer(x)
        assert not torch.equal(before, expected)
        for name in INT8_BUFFERS:
            setattr(layer, name, getattr(other, name))
        assert torch.equal(layer(x), expected)
        assert layer.onednn is not None and layer.onednn is not first
        for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert copied._binding == (None, "auto", None)
            assert torch.equal(copied(x), expected)
            assert copied.onednn is not None and copied.onednn is not layer.onednn


def test_a_call_without_a_packing_packs_for_itself_only(monkeypatch):
    """C.int8_linear running oneDNN's products without a packing packs the weight for that call (the outputs of
    a call given one), and keeps nothing; a model quantized while oneDNN could not be chosen (no packings)
    translates the same once oneDNN is forced, and keeps nothing either. A packing of another shape is refused."""
    g = torch.Generator().manual_seed(3)
    weight, scale, colsum = C.quantize_int8(torch.randn(97, 1041, generator=g))
    bias, x = torch.randn(97, generator=g), torch.randn(40, 1041, generator=g)
    packed = C.int8_prepare(weight, scale, colsum, 97, 1041)
    before = live()
    given = C.int8_linear(x, weight, scale, colsum, bias, 97, onednn=packed)
    with torch.inference_mode():
        assert torch.equal(C.int8_linear(x, weight, scale, colsum, bias, 97), given)
    assert torch.equal(C.int8_linear(x, weight, scale, colsum, bias, 97, "onednn"), given)
    if C.cpu_has_int8_dot():
        assert torch.equal(C.int8_linear(x, weight, scale, colsum, bias, 97, OURS, onednn=packed), given)
    assert live() == before
    other = C.int8_prepare(*C.quantize_int8(torch.randn(96, 1041, generator=g)), 96, 1041)
    with pytest.raises(ValueError, match=r"onednn is the packing of a \(96, 1041\) weight, not of this \(97, 1041\)"):
        C.int8_linear(x, weight, scale, colsum, bias, 97, onednn=other)

    src = make_src(CONFIG, SENTENCES)
    expected = translate(fastformer.quantize(float_model()), src)
    monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", OURS)
    quantized = fastformer.quantize(float_model())
    assert all(m.onednn is None for m in int8_modules(quantized))
    before = live()
    monkeypatch.setenv("FASTFORMER_INT8_PROVIDER", "onednn")
    assert translate(quantized, src) == expected
    assert live() == before
    assert all(m.onednn is not None for m in int8_modules(pack_for_providers(quantized)))
    assert translate(quantized, src) == expected
