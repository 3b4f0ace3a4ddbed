"""The C++ decoding path (float32 on the CPU through the cpu backend): ``fastformer._C.CpuDecoder``
(csrc/decoder.cpp, csrc/cpu/decoder_step.cpp) against the Python incremental decoder over the same weights,
and ``fastformer._C.BeamSearch``'s pass over the vocabulary (csrc/cpu/search_candidates.cpp) against
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
    """The arguments IncrementalDecoder gives fastformer._C.CpuDecoder for ``model`` (default: a varied
    float32 model of ``config``), caught on their way."""
    model = model if model is not None else varied_model(config, "cpu", seed=4, dtype=torch.float32)
    caught = {}

    class Catch:
        def __init__(self, *args):
            caught["args"] = list(args)

    with torch.no_grad():
        memory, src_padding = model.encode(make_src(config, [3, 2]))
        real, C.CpuDecoder = C.CpuDecoder, Catch
        try:
            IncrementalDecoder(model, memory, src_padding, 2, steps=2)
        finally:
            C.CpuDecoder = real
    return caught["args"]


@pytest.mark.parametrize("change, message", [
    # two d x d projections swapped: the names travel with the tensors, so this is a rename
    (lambda w: w.update({"cross_attn.q_proj.panels": w.pop("self_attn.out_proj.panels")}),
     'decoder layer 0 has no weight "self_attn.out_proj.panels"'),
    (lambda w: w.pop("ffn_norm.bias"), 'decoder layer 0 has no weight "ffn_norm.bias"'),
    (lambda w: w.update({"ffn.fc3.bias": w["ffn.fc2.bias"]}), 'decoder layer 0 holds "ffn.fc3.bias", which'),
    (lambda w: w.update({"ffn.fc1.panels": w["ffn.fc2.panels"]}),
     "decoder layer 0 ffn.fc1.panels must be a contiguous float32 CPU tensor of shape"),
    (lambda w: w.update({"self_attn_norm.weight": w["self_attn_norm.weight"].double()}),
     "self_attn_norm.weight must be a contiguous float32"),
])
def test_cpp_decoder_binds_weights_by_name(change, message):
    """The C++ step takes each decoder weight by its DECODER_LAYER name and checks its shape: a missing,
    unknown or misshapen weight is refused with its name, never read by position."""
    args = cpp_decoder_arguments(TransformerConfig.tiny(d_ff=64))
    C.CpuDecoder(*args)  # as given: accepted
    layers = [dict(w) for w in args[0]]
    change(layers[0])
    with pytest.raises(ValueError, match=message):
        C.CpuDecoder(layers, *args[1:])


def test_cpp_decoder_refuses_another_activation():
    args = cpp_decoder_arguments(TransformerConfig.tiny())
    with pytest.raises(ValueError, match='implements the relu activation, not "gelu"'):
        C.CpuDecoder(*args[:-1], "gelu")


def test_cpp_decoder_binds_every_weight_of_the_description():
    """Every linear layer and LayerNorm of DECODER_LAYER crosses into C++ by name (the cross-attention's
    k|v projection is applied in Python, once per sentence)."""
    from fastformer.nn.layers import DECODER_LAYER
    layers = cpp_decoder_arguments(TransformerConfig.tiny())[0]
    expected = {f"{w.name}.{part}" for w in DECODER_LAYER if w.name != "cross_attn.kv_proj"
                for part in (("weight", "bias") if w.kind == "norm" else ("panels", "bias"))}
    assert all(set(layer) == expected for layer in layers)
