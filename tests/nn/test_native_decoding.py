"""The C++ decoding path (float32 on the CPU through the cpu backend): ``fastformer._C.CpuDecoder``
(csrc/inference/decoder.cpp, decoder_step.cpp) against the Python incremental decoder over the same weights,
and ``fastformer._C.BeamSearch``'s pass over the vocabulary (csrc/inference/search_candidates.cpp) against
``decoding.search_candidates``'s torch ops; bad arguments raise ValueError.

The recorded tokens (test_fast_decoding.py) and the step-by-step comparison with a full recompute
(test_fast_decoding.py, test_model_decoding.py) run through the C++ path too wherever it applies: the first
test here pins where that is. CI runs this file at every CPU instruction-set level the machine supports.
"""
import copy

import pytest
import torch

from fastformer._ext import C
from fastformer.nn import TransformerConfig
from fastformer.nn import decoding
from fastformer.nn.decoding import IncrementalDecoder, search_candidates
from model_reference import varied_model
from test_model_decoding import make_src
from tolerances import assert_close


def test_the_cpp_decoder_runs_where_it_applies():
    config = TransformerConfig.tiny()
    src = make_src(config, [5, 3])
    for backend, dtype, native in [("cpu", torch.float32, True), (None, torch.float32, True),
                                   ("torch", torch.float32, False), ("cpu", torch.float64, False)]:
        model = varied_model(config, backend, seed=4, dtype=dtype)
        with torch.no_grad():
            memory, src_padding = model.encode(src)
            decoder = IncrementalDecoder(model, memory, src_padding, 2, steps=3)
        assert (decoder.native is not None) == native, (backend, dtype)


CONFIGS = {  # head sizes: 8 (tiny), 64 (register accumulators at every level), 7 (the generic loop)
    "tiny": TransformerConfig.tiny(),
    "dh64": TransformerConfig.tiny(d_model=128, n_heads=2, d_ff=96, vocab_size=97),
    "dh7-prenorm": TransformerConfig.tiny(d_model=42, n_heads=6, d_ff=50, vocab_size=113, norm_first=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cpp_steps_match_the_float64_python_steps_through_reorders(name):
    """The C++ decoder in float32 against the Python decoder over the same weights in float64 (the
    reference), fed the same rows: parents repeat, skip and swap rows (as beams do), and sentences leave the
    batch; the logits of every step agree."""
    config = CONFIGS[name]
    model = varied_model(config, "cpu", seed=4, dtype=torch.float32)
    reference = copy.deepcopy(model).double()
    K, lengths, steps = 3, [7, 4, 6, 1, 5], 7
    src = make_src(config, lengths)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        native = IncrementalDecoder(model, *model.encode(src), K, steps)
        python = IncrementalDecoder(reference, *reference.encode(src), K, steps)
        assert native.native is not None and python.native is None
        live = len(lengths)
        prefixes = torch.full((live * K, 1), config.bos_id)
        for step in range(steps):
            assert_close(native.logits(prefixes), python.logits(prefixes), torch.float32, f"step {step}")
            keep = list(range(live))
            if step in (1, 3, 4):  # a sentence finishes
                keep.pop(step % live)
            parents = torch.tensor([i * K + int(torch.randint(0, K, (), generator=generator))
                                    for i in keep for _ in range(K)])
            if step == 2:
                parents = parents.flip(0)  # rows swap
            new_tokens = torch.randint(4, config.vocab_size, (len(parents), 1), generator=generator)
            prefixes = torch.cat([prefixes[parents], new_tokens], dim=1)
            sentences = None if len(keep) == live else torch.tensor(keep)
            native.select(parents, sentences)
            python.select(parents, sentences)
            live = len(keep)


def test_cpp_decoder_pads_logits_rows_and_never_overwrites_held_logits():
    """The C++ decoder writes a step's logits (N, V) into rows padded to whole 64-byte lines (a view: row
    stride V rounded up to 16 floats) and takes one buffer again at each step, unless the last step's logits
    are still held: then a fresh one, so a tensor the caller keeps never changes."""
    config = CONFIGS["dh64"]  # V = 97: rows 112 floats apart
    model = varied_model(config, "cpu", seed=4, dtype=torch.float32)
    with torch.no_grad():
        decoder = IncrementalDecoder(model, *model.encode(make_src(config, [3, 2])), 2, steps=3).native
    first = decoder.logits(torch.full((4,), config.bos_id))
    assert first.shape == (4, 97) and first.stride() == (112, 1)
    kept = first.clone()
    second = decoder.logits(torch.full((4,), 5))
    assert torch.equal(first, kept) and second.data_ptr() != first.data_ptr()
    address = second.data_ptr()
    del first, second
    third = decoder.logits(torch.full((4,), 6))
    assert third.data_ptr() == address  # nothing held it: the same buffer


def test_search_kernel_reads_logits_rows_in_place():
    """step_logits takes logits whose rows lie further apart than V (the C++ decoder's padded rows) as they
    are: NaN in the padding changes nothing."""
    K, V, max_len = 2, 50, [3, 2]
    generator = torch.Generator().manual_seed(1)
    plain, strided = _search(K, V, max_len), _search(K, V, max_len)
    for step in range(4):
        logits = torch.randn(plain.rows, V, generator=generator) * 3
        padded = torch.full((plain.rows, 64), float("nan"))
        padded[:, :V] = logits
        assert plain.step_logits(logits) == strided.step_logits(padded[:, :V])
        assert torch.equal(plain.tokens(), strided.tokens())
    assert plain.hypotheses() == strided.hypotheses()


def _search(K, V, max_len, alpha=0.6):
    return C.BeamSearch(max_len, K, alpha, V, 0, 2, 3)


@pytest.mark.parametrize("K, V", [(1, 8000), (4, 97), (3, 7), (5, 6)])
def test_search_kernel_matches_the_torch_ops(K, V):
    """The same random logits through step_logits (the C++ pass) and step_candidates(search_candidates(...))
    (torch ops): the same survivors, tokens and hypotheses, scores to float32 accuracy. Vocabularies smaller
    than 2 K fill the candidate lists with -inf; sentences reach their length limit at different steps.
    Ties are tested below."""
    config = TransformerConfig.tiny(vocab_size=V)
    max_len = [0, 3, 5, 1, 4]
    generator = torch.Generator().manual_seed(K * V)
    cpp, ops = _search(K, V, max_len), _search(K, V, max_len)
    for step in range(6):
        assert cpp.rows == ops.rows
        logits = torch.randn(cpp.rows, V, generator=generator) * 3
        cpp_going = cpp.step_logits(logits.clone())
        ops_going = ops.step_candidates(*search_candidates(logits.clone(), ops.at_limit(), config, ops.width))
        assert cpp_going == ops_going
        if not cpp_going:
            break
        assert torch.equal(cpp.parents, ops.parents) and torch.equal(cpp.tokens(), ops.tokens())
        assert (cpp.sentences is None) == (ops.sentences is None)
    assert not cpp_going, "every sentence reaches its limit within 6 steps"
    for mine, theirs in zip(cpp.hypotheses(), ops.hypotheses()):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        assert [s for _, s in mine] == pytest.approx([s for _, s in theirs], rel=1e-6, abs=1e-6)
        assert mine, "every sentence ends with a hypothesis"


@pytest.mark.parametrize("K, V", [(1, 50), (4, 97), (3, 7)])
def test_search_kernel_and_torch_ops_break_ties_alike(K, V):
    """Logits with many ties (three distinct values, or two and -inf), sentences reaching their length
    limits at different steps: the kernel and the torch ops pick the same tokens step by step, which
    needs the same candidates in the same order (ties to the lower token id)."""
    config = TransformerConfig.tiny(vocab_size=V)
    for trial in range(4):
        generator = torch.Generator().manual_seed(V * 10 + trial)
        max_len = [2, 0, 4, 3]
        cpp, ops = _search(K, V, max_len), _search(K, V, max_len)
        for step in range(6):
            logits = torch.randint(0, 3, (cpp.rows, V), generator=generator).float()
            if trial % 2:
                logits[logits == 0] = float("-inf")
            cpp_going = cpp.step_logits(logits.clone())
            ops_going = ops.step_candidates(*search_candidates(logits.clone(), ops.at_limit(), config, ops.width))
            assert cpp_going == ops_going
            if not cpp_going:
                break
            assert torch.equal(cpp.tokens(), ops.tokens()), f"trial {trial}, step {step}"
            assert torch.equal(cpp.parents, ops.parents)
        assert [[t for t, _ in h] for h in cpp.hypotheses()] == [[t for t, _ in h] for h in ops.hypotheses()]


@pytest.mark.parametrize("K, V", [(1, 50), (4, 97), (2, 300)])
def test_search_kernel_and_torch_ops_treat_nan_alike(K, V):
    """NaN logits (scattered, a whole block of 64, a whole row) are tokens that cannot be produced, on both
    paths: never candidates, left out of the log-sum-exp; the other tokens of the row and their scores are
    as if the NaN were -inf. The kernel once skipped a whole block of logits around a NaN."""
    config = TransformerConfig.tiny(vocab_size=V)
    generator = torch.Generator().manual_seed(V)
    max_len = [3, 4]
    cpp, ops, clean = _search(K, V, max_len), _search(K, V, max_len), _search(K, V, max_len)
    for step in range(4):
        logits = torch.randn(cpp.rows, V, generator=generator) * 3
        logits[torch.rand(cpp.rows, V, generator=generator) < 0.1] = float("nan")
        logits[0, :min(V, 64)] = float("nan")  # a whole block, the row's best among it
        logits[0, min(V, 64) - 1] = 50.0 if V > 64 else logits[0, -1]
        if cpp.rows > 1:
            logits[-1] = float("nan")  # a row of NaN: no candidate at all
        as_inf = logits.masked_fill(logits.isnan(), float("-inf"))
        cpp_going = cpp.step_logits(logits.clone())
        ops_going = ops.step_candidates(*search_candidates(logits.clone(), ops.at_limit(), config, ops.width))
        clean_going = clean.step_logits(as_inf.clone())
        assert cpp_going == ops_going == clean_going
        if not cpp_going:
            break
        assert torch.equal(cpp.tokens(), ops.tokens()) and torch.equal(cpp.tokens(), clean.tokens()), f"step {step}"
        assert not any(t in (0, 2) for row in cpp.tokens()[:, 1:].tolist() for t in row)
    hyps = [cpp.hypotheses(), ops.hypotheses(), clean.hypotheses()]
    assert [[t for t, _ in h] for h in hyps[0]] == [[t for t, _ in h] for h in hyps[1]] \
        == [[t for t, _ in h] for h in hyps[2]]
    for a, b in zip(hyps[0], hyps[1]):
        scores = [s for _, s in a]
        assert all(s == s for s in scores), "no NaN score"
        assert scores == pytest.approx([s for _, s in b], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("backend", ["cpu", "torch"])  # the C++ step and search kernel; the Python step, torch ops
def test_a_sentence_whose_logits_are_all_nan_ends_empty_and_the_others_do_not_change(backend, beam):
    """A model with a NaN weight (here the embedding row of a token only sentence 1 holds: its encoder output,
    and so every logit of its rows, is NaN) decodes without an IndexError: sentence 1 ends with one empty
    hypothesis of score -inf, and the other sentences get what they get in a batch without sentence 1."""
    config = TransformerConfig.tiny()
    model = varied_model(config, backend, seed=4, dtype=torch.float32)
    poison = 5
    src = make_src(config, [6, 7, 4])
    src[src == poison] = poison + 1
    src[1, 2] = poison
    with torch.no_grad():
        model.embed.weight[poison] = float("nan")
        memory, padding = model.encode(src)
        assert (IncrementalDecoder(model, memory, padding, beam, 3).native is not None) == (backend == "cpu")
    hyps = model.beam_search(src, beam_size=beam)
    assert hyps[1] == [([], float("-inf"))]
    assert model.generate(src, beam_size=beam)[1] == []
    others = model.beam_search(src[[0, 2]], beam_size=beam)
    assert [[t for t, _ in h] for h in (hyps[0], hyps[2])] == [[t for t, _ in h] for h in others]
    assert [s for _, s in hyps[0] + hyps[2]] == pytest.approx([s for _, s in others[0] + others[1]], rel=1e-5)
    assert all(len(h[0][0]) > 0 and h[0][1] > float("-inf") for h in others), "the other sentences must decode"


def test_search_kernel_gives_float64_log_softmax_scores():
    """Greedy over one step: the finished hypothesis' score is the float64 log-softmax of its eos."""
    V = 1000
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1)) * 4
    search = _search(1, V, [0])  # the limit at once: only eos
    assert not search.step_logits(logits)
    (tokens, score), = search.hypotheses()[0]
    assert tokens == []
    expected = torch.log_softmax(logits.double(), dim=1)[0, 3].item() / ((5 + 1) / 6) ** 0.6
    assert score == pytest.approx(expected, rel=1e-7, abs=1e-7)


@pytest.mark.parametrize("call, message", [
    (lambda s: s.step_logits(torch.zeros(2, 10)), "logits must be a float32 CPU tensor"),
    (lambda s: s.step_logits(torch.zeros(1, 10, dtype=torch.float64)), "logits must be a float32 CPU tensor"),
    (lambda s: s.step_candidates(torch.zeros(1), torch.zeros(1, 3), torch.zeros(1, 3)), "expected lse"),
])
def test_beam_search_bad_arguments_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call(_search(1, 10, [3]))


def test_beam_search_rejects_no_beams():
    with pytest.raises(ValueError, match="beams must be >= 1"):
        _search(0, 10, [3])


def test_cpp_decoder_bad_arguments_raise():
    config = TransformerConfig.tiny()
    model = varied_model(config, "cpu", seed=4, dtype=torch.float32)
    with torch.no_grad():
        memory, src_padding = model.encode(make_src(config, [3, 2]))
        decoder = IncrementalDecoder(model, memory, src_padding, 2, steps=2).native
    with pytest.raises(ValueError, match="last_tokens must be an int64 CPU tensor of shape \\(4\\)"):
        decoder.logits(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside \\[0, 64\\)"):
        decoder.logits(torch.full((4,), 64))
    decoder.logits(torch.full((4,), config.bos_id))
    with pytest.raises(ValueError, match="parent 4 is not a row of 4"):
        decoder.select(torch.tensor([0, 1, 2, 4]), None)
    with pytest.raises(ValueError, match="3 parents for 4 rows"):
        decoder.select(torch.tensor([0, 1, 2]), None)
    decoder.select(torch.tensor([1, 1, 0, 3]), None)
    decoder.logits(torch.full((4,), 5))
    with pytest.raises(ValueError, match="all 2 positions have been decoded"):
        decoder.logits(torch.full((4,), 5))


def cpp_decoder_arguments(config, model=None):
    """The description IncrementalDecoder gives fastformer._C.CpuDecoder for ``model`` (default: a varied
    float32 model of ``config``), caught on its way: one dict."""
    model = model if model is not None else varied_model(config, "cpu", seed=4, dtype=torch.float32)
    caught = {}

    class Catch:
        def __init__(self, description):
            caught["description"] = description

    with torch.no_grad():
        memory, src_padding = model.encode(make_src(config, [3, 2]))
        real, C.CpuDecoder = C.CpuDecoder, Catch
        try:
            IncrementalDecoder(model, memory, src_padding, 2, steps=2)
        finally:
            C.CpuDecoder = real
    return caught["description"]


def with_layer0(description, change):
    """The description with ``change`` applied to a copy of layer 0's weights."""
    layers = [dict(w) for w in description["layers"]]
    change(layers[0])
    return {**description, "layers": layers}


@pytest.mark.parametrize("change, message", [
    # two d x d projections swapped: the names travel with the tensors, so this is a rename
    (lambda w: w.update({"cross_attn.q_proj.panels": w.pop("self_attn.out_proj.panels")}),
     'decoder layer 0 has no weight "self_attn.out_proj.panels"'),
    (lambda w: w.pop("ffn_norm.bias"), 'decoder layer 0 has no weight "ffn_norm.bias"'),
    (lambda w: w.update({"ffn.fc3.bias": w["ffn.fc2.bias"]}), 'decoder layer 0 holds "ffn.fc3.bias", which'),
    (lambda w: w.update({"ffn.fc1.panels": w["ffn.fc2.panels"]}),
     "decoder layer 0: ffn.fc1.panels must be a contiguous float32 CPU tensor of shape"),
    (lambda w: w.update({"self_attn_norm.weight": w["self_attn_norm.weight"].double()}),
     "self_attn_norm.weight must be a contiguous float32"),
])
def test_cpp_decoder_binds_weights_by_name(change, message):
    description = cpp_decoder_arguments(TransformerConfig.tiny(d_ff=64))
    C.CpuDecoder(description)  # as given: accepted
    with pytest.raises(ValueError, match=message):
        C.CpuDecoder(with_layer0(description, change))


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(activation="tanh"), 'implements the activations relu, gelu and silu, not "tanh"'),
    (lambda d: d.pop("heads"), 'the description has no field "heads"'),
    (lambda d: d.update(head_count=4), 'unknown field "head_count"'),
    (lambda d: d.update(beams="2"), 'field "beams" has the wrong type'),
    (lambda d: d.update(sublayers=d["sublayers"] + [d["sublayers"][0]]), "at most one self-attention"),
    (lambda d: d.update(sublayers=[("recurrent", "ffn_norm", {})]), 'no sublayer kind "recurrent"'),
    (lambda d: d.update(sublayers=[("feed_forward", "ffn_norm", {"fc1": "ffn.fc1"})]),
     "a feed_forward sublayer takes the weights fc1, fc2, got fc1"),
    (lambda d: d.update(cross=d["cross"][:1]), "cross must hold a \\(k, v\\) pair per layer"),
])
def test_cpp_decoder_checks_its_description(change, message):
    description = dict(cpp_decoder_arguments(TransformerConfig.tiny()))
    change(description)
    with pytest.raises(ValueError, match=message):
        C.CpuDecoder(description)


def test_cpp_decoder_binds_every_weight_of_the_description():
    """Every linear layer and LayerNorm of DECODER_LAYER crosses into C++ by name (the cross-attention's
    k|v projection is applied in Python, once per sentence), and the sublayers cross in the description's
    order with the names it gives."""
    from fastformer.nn.layers import DECODER_LAYER, DECODER_SUBLAYERS
    description = cpp_decoder_arguments(TransformerConfig.tiny())
    expected = {f"{w.name}.{part}" for w in DECODER_LAYER if w.name != "cross_attn.kv_proj"
                for part in (("weight", "bias") if w.kind == "norm" else ("panels", "bias"))}
    assert all(set(layer) == expected for layer in description["layers"])
    assert set(description["embed"]) == {"embed.weight", "embed.panels"}  # the table and its tied projection
    assert [kind for kind, _, _ in description["sublayers"]] == [s.kind for s in DECODER_SUBLAYERS]
    assert [norm for _, norm, _ in description["sublayers"]] == [s.norm for s in DECODER_SUBLAYERS]


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_cpp_step_follows_the_configured_activation(activation):
    """config.activation reaches the model, the Python step and the C++ step: the C++ step in float32 matches
    the Python step in float64, and the logits differ from relu's."""
    config = TransformerConfig.tiny(activation=activation, d_ff=48)
    model = varied_model(config, "cpu", seed=4, dtype=torch.float32)
    relu = copy.deepcopy(model)
    relu.config = config.replace(activation="relu")
    for layer in relu.decoder.layers:
        layer.ffn.activation = "relu"
    reference = copy.deepcopy(model).double()
    src = make_src(config, [4, 6])
    with torch.no_grad():
        native = IncrementalDecoder(model, *model.encode(src), 2, 2)
        python = IncrementalDecoder(reference, *reference.encode(src), 2, 2)
        other = IncrementalDecoder(relu, *relu.encode(src), 2, 2)
        prefixes = torch.full((4, 1), config.bos_id)
        a, b, c = native.logits(prefixes), python.logits(prefixes), other.logits(prefixes)
        full = reference.decode(prefixes, *[t.repeat_interleave(2, 0) for t in reference.encode(src)])[:, -1]
    assert native.native is not None and python.native is None
    assert_close(a, b, torch.float32, activation)
    assert_close(b, full, torch.float64, "the Python step against the training path")
    assert (a - c).abs().max() > 1e-3, "the activation changed nothing"


def test_every_path_follows_the_one_sublayer_order(monkeypatch):
    """Change the decoder layer's description (the feed-forward first, then cross-attention, then
    self-attention) and nothing else: training's forward, the Python step and the C++ step all follow it
    and still agree with one another."""
    from fastformer.nn import decoding as decoding_module, layers
    reordered = tuple(reversed(layers.DECODER_SUBLAYERS))
    monkeypatch.setattr(layers, "DECODER_SUBLAYERS", reordered)
    monkeypatch.setattr(decoding_module, "DECODER_SUBLAYERS", reordered)
    config = TransformerConfig.tiny(d_ff=48)
    model = varied_model(config, "cpu", seed=4, dtype=torch.float32)
    reference = copy.deepcopy(model).double()
    src = make_src(config, [4, 6])
    with torch.no_grad():
        native = IncrementalDecoder(model, *model.encode(src), 1, 3)
        python = IncrementalDecoder(reference, *reference.encode(src), 1, 3)
        prefixes = torch.full((2, 1), config.bos_id)
        generator = torch.Generator().manual_seed(0)
        for step in range(3):
            a, b = native.logits(prefixes), python.logits(prefixes)
            full = reference.decode(prefixes, *reference.encode(src))[:, -1]
            assert_close(a, b, torch.float32, f"step {step}")
            assert_close(b, full, torch.float64, f"step {step}: the Python step against the training path")
            first = b if step == 0 else first
            native.select(torch.arange(2), None)
            python.select(torch.arange(2), None)
            prefixes = torch.cat([prefixes, torch.randint(4, config.vocab_size, (2, 1), generator=generator)], dim=1)
    monkeypatch.undo()
    with torch.no_grad():  # the paper's order gives other logits: the change was real
        memory, padding = reference.encode(src)
        paper = reference.decode(torch.full((2, 1), config.bos_id), memory, padding)[:, -1]
    assert (paper - first).abs().max() > 1e-3
