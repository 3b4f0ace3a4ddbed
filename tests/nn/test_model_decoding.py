"""Incremental decoding, beam search and generate, in float64 on randomly initialised tiny models.

Rules of Transformer.beam_search (fastformer/nn/transformer.py) that these tests pin down:
- a sentence of n source tokens (padding excluded) may produce at most floor(a * n + b) target tokens
  before its eos (fairseq's rule, clamped at 0); at the position after them eos is forced;
- pad and bos are never produced;
- a hypothesis' score is the sum of the log-probabilities of its tokens and its eos, divided by
  ((5 + len) / 6) ** alpha with len = number of tokens + 1 (the eos);
- returned tokens exclude bos and eos; hypotheses come best first; beam_size=1 is greedy decoding.

The models come from model_reference.varied_model (decoder sublayers scaled up so that a random model
does not just repeat one token); the tests assert that the outputs they compare are not degenerate.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from fastformer.nn import TransformerConfig
from fastformer.nn.decoding import IncrementalDecoder
from model_reference import varied_model
from tolerances import assert_close

BACKENDS = ["torch", "cpu"]
MODEL_BACKEND = "cpu"  # the backend of the tests that are not run on every backend


def make_src(config, lengths):
    """(len(lengths), max(lengths)) int64 source: random non-special tokens, each row padded at the end."""
    src = torch.full((len(lengths), max(lengths)), config.pad_id, dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(4, config.vocab_size, (n,))
    return src


def max_length(config, src_row, a, b):
    """floor(a * n + b), at least 0: the most target tokens (eos excluded) for a source of n real tokens."""
    n = int((src_row != config.pad_id).sum())
    return max(0, math.floor(a * n + b))


def penalty(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def greedy_reference(model, src_row, a, b, alpha):
    """Greedy decoding by full recomputation of the prefix at every step.

    Returns (tokens without bos/eos, score, whether it ended with a chosen eos rather than the forced one).
    """
    cfg = model.config
    limit = max_length(cfg, src_row, a, b)
    memory, src_padding = model.encode(src_row[None])
    prefix, total = [cfg.bos_id], 0.0
    for step in range(limit + 1):
        logits = model.decode(torch.tensor([prefix]), memory, src_padding)[0, -1]
        lprobs = F.log_softmax(logits.double(), dim=-1)
        if step >= limit:
            token = cfg.eos_id
        else:
            allowed = lprobs.clone()
            allowed[[cfg.pad_id, cfg.bos_id]] = float("-inf")
            token = int(allowed.argmax())
        total += float(lprobs[token])
        if token == cfg.eos_id:
            tokens = prefix[1:]
            return tokens, total / penalty(len(tokens) + 1, alpha), step < limit
        prefix.append(token)
    raise AssertionError("unreachable: eos is forced at the last step")


def teacher_forced_scores(model, src_row, hypotheses, alpha):
    """Length-normalised log-probability of each token list + eos under a full forward pass (one batch)."""
    cfg = model.config
    longest = max(len(t) for t in hypotheses) + 1
    tgt_in = torch.full((len(hypotheses), longest), cfg.pad_id, dtype=torch.long)
    tgt_out = torch.full((len(hypotheses), longest), cfg.pad_id, dtype=torch.long)
    for i, tokens in enumerate(hypotheses):
        tgt_in[i, :len(tokens) + 1] = torch.tensor([cfg.bos_id] + tokens)
        tgt_out[i, :len(tokens) + 1] = torch.tensor(tokens + [cfg.eos_id])
    with torch.no_grad():
        lprobs = F.log_softmax(model(src_row[None].expand(len(hypotheses), -1), tgt_in).double(), dim=-1)
    picked = lprobs.gather(-1, tgt_out[..., None])[..., 0].masked_fill(tgt_out == cfg.pad_id, 0.0)
    return [float(picked[i].sum()) / penalty(len(t) + 1, alpha) for i, t in enumerate(hypotheses)]


def assert_varied(translations):
    """The outputs compared are not degenerate: sentences get different translations, built from more than
    one token."""
    assert len({tuple(t) for t in translations}) > 1, f"every sentence got the same translation: {translations}"
    assert len({token for t in translations for token in t}) > 1, f"one token makes every translation: {translations}"


# ------------------------------------------------------------------------------------------------------
# (a) cached incremental decoding


@pytest.mark.parametrize("norm_first", [False, True], ids=["postnorm", "prenorm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decoding_matches_full_recompute(backend, norm_first):
    config = TransformerConfig.tiny(norm_first=norm_first)
    model = varied_model(config, backend, seed=4)
    src = make_src(config, [7, 4, 6])
    tokens = torch.cat([torch.full((3, 1), config.bos_id), torch.randint(4, config.vocab_size, (3, 6))], dim=1)
    with torch.no_grad():
        memory, src_padding = model.encode(src)
        decoder = IncrementalDecoder(model, memory, src_padding, 1, steps=tokens.shape[1])
        for step in range(tokens.shape[1]):
            incremental = decoder.logits(tokens[:, :step + 1])
            assert incremental.shape == (3, config.vocab_size)
            full = model.decode(tokens[:, :step + 1], memory, src_padding)[:, -1]
            assert_close(incremental, full, torch.float64, f"step {step}")
            decoder.select(torch.arange(3), None)


# ------------------------------------------------------------------------------------------------------
# (b) beam_size=1 is greedy decoding


@pytest.mark.parametrize("backend", BACKENDS)
def test_beam_size_one_is_greedy_decoding(backend):
    config = TransformerConfig.tiny()
    model = varied_model(config, backend, seed=4)
    src = make_src(config, [9, 5, 7, 2, 8, 3, 6, 1])
    a, b, alpha = 1.0, 2, 0.6
    results = model.beam_search(src, beam_size=1, length_penalty=alpha, max_len_a=a, max_len_b=b)
    assert len(results) == src.shape[0]
    ended = []
    for i, hyps in enumerate(results):
        tokens, score, by_eos = greedy_reference(model, src[i], a, b, alpha)
        assert len(hyps) == 1, f"sentence {i}: beam_size=1 returned {len(hyps)} hypotheses"
        assert hyps[0][0] == tokens, f"sentence {i}"
        assert hyps[0][1] == pytest.approx(score, rel=1e-9, abs=1e-12), f"sentence {i}"
        ended.append(by_eos)
    # Both ways of ending occur: a chosen eos before the limit, and the forced eos at the limit.
    assert any(ended) and not all(ended), ended
    assert_varied([hyps[0][0] for hyps in results])


# ------------------------------------------------------------------------------------------------------
# (c) hypotheses and their scores


@pytest.mark.parametrize("norm_first", [False, True], ids=["postnorm", "prenorm"])
def test_beam_hypotheses_are_sorted_and_scored_by_normalised_log_probability(norm_first):
    config = TransformerConfig.tiny(norm_first=norm_first)
    model = varied_model(config, MODEL_BACKEND, seed=4)
    src = make_src(config, [6, 3, 8])
    K, a, b, alpha = 4, 1.0, 2, 0.6
    results = model.beam_search(src, beam_size=K, length_penalty=alpha, max_len_a=a, max_len_b=b)
    assert len(results) == src.shape[0]
    for i, hyps in enumerate(results):
        assert 1 <= len(hyps) <= K, f"sentence {i}: {len(hyps)} hypotheses"
        scores = [score for _, score in hyps]
        assert scores == sorted(scores, reverse=True), f"sentence {i}: not best first: {scores}"
        limit = max_length(config, src[i], a, b)
        for tokens, _ in hyps:
            assert len(tokens) <= limit
            assert not {config.pad_id, config.bos_id, config.eos_id} & set(tokens), tokens
        expected = teacher_forced_scores(model, src[i], [t for t, _ in hyps], alpha)
        assert scores == pytest.approx(expected, rel=1e-9, abs=1e-12), f"sentence {i}"
    assert any(len(hyps) > 1 for hyps in results), "no sentence returned several hypotheses to order"
    assert_varied([hyps[0][0] for hyps in results])


def test_wide_beam_finds_every_hypothesis_with_its_exact_score():
    """With vocab 8 (5 producible tokens besides eos) and at most 2 tokens before the eos there are
    1 + 5 + 25 = 31 hypotheses; a beam of 64 keeps them all, so beam search must return exactly the
    exhaustive enumeration, sorted by the teacher-forced, length-normalised score."""
    config = TransformerConfig.tiny(vocab_size=8)
    model = varied_model(config, MODEL_BACKEND, seed=4)
    src = make_src(config, [5, 2])
    alpha = 1.0
    producible = [t for t in range(config.vocab_size) if t not in (config.pad_id, config.bos_id, config.eos_id)]
    every = [[]] + [[t] for t in producible] + [[t, u] for t in producible for u in producible]
    results = model.beam_search(src, beam_size=64, length_penalty=alpha, max_len_a=0.0, max_len_b=2)
    for i, hyps in enumerate(results):
        expected = sorted(zip(teacher_forced_scores(model, src[i], every, alpha), map(tuple, every)), reverse=True)
        got = [(tuple(tokens), score) for tokens, score in hyps]
        assert [t for t, _ in got] == [t for _, t in expected], f"sentence {i}"
        assert [s for _, s in got] == pytest.approx([s for s, _ in expected], rel=1e-9, abs=1e-12)


# ------------------------------------------------------------------------------------------------------
# (d) batching invariance, (e) cache invariance


@pytest.mark.parametrize("beam_size", [1, 4])
def test_translation_does_not_depend_on_the_batch(beam_size):
    """Each sentence translated alone (no padding) and inside a batch with longer, padded sentences."""
    config = TransformerConfig.tiny()
    model = varied_model(config, MODEL_BACKEND, seed=4)
    lengths = [3, 9, 6, 8]
    src = make_src(config, lengths)
    kw = dict(beam_size=beam_size, max_len_a=1.0, max_len_b=2)
    batched = model.beam_search(src, **kw)
    for i, n in enumerate(lengths):
        alone = model.beam_search(src[i:i + 1, :n], **kw)[0]
        assert [t for t, _ in alone] == [t for t, _ in batched[i]], f"sentence {i}"
        assert [s for _, s in alone] == pytest.approx([s for _, s in batched[i]], rel=1e-9, abs=1e-12)
    assert_varied([hyps[0][0] for hyps in batched])


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_and_uncached_beam_search_agree(backend, beam_size):
    config = TransformerConfig.tiny()
    model = varied_model(config, backend, seed=4)
    src = make_src(config, [7, 3, 9, 5])
    kw = dict(beam_size=beam_size, length_penalty=0.6, max_len_a=1.0, max_len_b=2)
    cached = model.beam_search(src, use_cache=True, **kw)
    uncached = model.beam_search(src, use_cache=False, **kw)
    for i, (c, u) in enumerate(zip(cached, uncached)):
        assert [t for t, _ in c] == [t for t, _ in u], f"sentence {i}"
        assert [s for _, s in c] == pytest.approx([s for _, s in u], rel=1e-9, abs=1e-12)
    assert_varied([hyps[0][0] for hyps in cached])


# ------------------------------------------------------------------------------------------------------
# (f) generate


def test_generate_returns_best_hypothesis_as_lists_of_ints():
    config = TransformerConfig.tiny()
    model = varied_model(config, MODEL_BACKEND, seed=4)
    src = make_src(config, [6, 2, 5])
    kw = dict(beam_size=3, length_penalty=0.6, max_len_a=1.0, max_len_b=2)
    out = model.generate(src, **kw)
    assert isinstance(out, list) and len(out) == 3
    for tokens, hyps in zip(out, model.beam_search(src, **kw)):
        assert isinstance(tokens, list) and all(type(t) is int for t in tokens), tokens
        assert not {config.pad_id, config.bos_id, config.eos_id} & set(tokens), tokens
        assert tokens == hyps[0][0]


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("a,b", [(1.0, 2), (0.5, 3), (2.0, 0), (0.0, 4), (0.0, 1), (0.0, 0)])
def test_generate_stops_at_floor_a_n_plus_b(a, b, beam_size):
    """eos made unreachable (its embedding row constant, so its logit is the sum of the decoder's final
    LayerNorm output: 0 with the LayerNorm's zero bias), so every translation runs to the length limit:
    floor(a * n + b) tokens before the forced eos."""
    config = TransformerConfig.tiny()
    model = varied_model(config, MODEL_BACKEND, seed=4)
    with torch.no_grad():
        model.embed.weight[config.eos_id] = 0.5
    lengths = [5, 2, 7, 1]
    src = make_src(config, lengths)
    out = model.generate(src, beam_size=beam_size, max_len_a=a, max_len_b=b)
    assert [len(t) for t in out] == [max(0, math.floor(a * n + b)) for n in lengths]
    for tokens in out:
        assert config.eos_id not in tokens


def test_beam_search_leaves_training_mode_as_it_was():
    config = TransformerConfig.tiny()
    model = varied_model(config, MODEL_BACKEND, seed=4)
    src = make_src(config, [4, 6])
    expected = model.generate(src, beam_size=2, max_len_b=3)
    model.train()
    assert model.generate(src, beam_size=2, max_len_b=3) == expected  # decoded without dropout
    assert model.training and all(m.training for m in model.modules())


# ------------------------------------------------------------------------------------------------------
# (g) errors


@pytest.mark.parametrize("beam_size", [0, -1])
def test_beam_size_below_one_is_rejected(beam_size):
    config = TransformerConfig.tiny()
    model = varied_model(config, MODEL_BACKEND)
    src = make_src(config, [3])
    with pytest.raises(ValueError, match="beam_size"):
        model.generate(src, beam_size=beam_size)
    with pytest.raises(ValueError, match="beam_size"):
        model.beam_search(src, beam_size=beam_size)


BAD_TOKENS = ["id>=vocab", "negative-id", "int32", "float", "1-d"]


def bad_tokens(config, case):
    """A (2, 4) token batch made invalid in the way ``case`` names."""
    tokens = make_src(config, [4, 3])
    if case == "id>=vocab":
        tokens[0, 1] = config.vocab_size
    elif case == "negative-id":
        tokens[1, 0] = -1
    elif case == "int32":
        tokens = tokens.int()
    elif case == "float":
        tokens = tokens.double()
    else:
        tokens = tokens[0]
    return tokens


@pytest.mark.parametrize("case", BAD_TOKENS)
def test_bad_source_is_rejected(case):
    config = TransformerConfig.tiny()
    model = varied_model(config, MODEL_BACKEND)
    src = bad_tokens(config, case)
    with pytest.raises(ValueError, match="src"):
        model.generate(src, beam_size=2)
    tgt_in = torch.full((2, 3), config.bos_id, dtype=torch.long)
    with pytest.raises(ValueError, match="src"):
        model(src, tgt_in)


@pytest.mark.parametrize("case", BAD_TOKENS)
def test_bad_target_is_rejected(case):
    config = TransformerConfig.tiny()
    model = varied_model(config, MODEL_BACKEND)
    src = make_src(config, [4, 3])
    with pytest.raises(ValueError, match="tgt_in"):
        model(src, bad_tokens(config, case))


def test_batch_size_mismatch_is_rejected():
    config = TransformerConfig.tiny()
    model = varied_model(config, MODEL_BACKEND)
    with pytest.raises(ValueError, match="batch"):
        model(make_src(config, [4, 3]), torch.full((3, 2), config.bos_id, dtype=torch.long))


def test_generate_and_the_clis_share_the_search_defaults():
    """One place for the defaults (fastformer/nn/decoding.py): generate, beam_search, translate() and the
    translate/evaluate/train command lines agree."""
    import inspect

    from fastformer import evaluate, translate, translation
    from fastformer.nn import Transformer, decoding
    from fastformer.train import build_parser as train_parser

    expected = {"beam_size": decoding.BEAM_SIZE, "length_penalty": decoding.LENGTH_PENALTY,
                "max_len_a": decoding.MAX_LEN_A, "max_len_b": decoding.MAX_LEN_B}
    for method in (Transformer.generate, Transformer.beam_search):
        defaults = {k: p.default for k, p in inspect.signature(method).parameters.items() if k in expected}
        assert defaults == expected, method.__name__
    as_flags = {"beam": expected["beam_size"], "lenpen": expected["length_penalty"],
                "max_len_a": expected["max_len_a"], "max_len_b": expected["max_len_b"]}
    defaults = {k: p.default for k, p in inspect.signature(translation.translate).parameters.items() if k in as_flags}
    assert defaults == as_flags
    for parser in (translate.build_parser(), evaluate.build_parser()):
        assert {k: parser.get_default(k) for k in as_flags} == as_flags, parser.prog
    train = train_parser()
    assert (train.get_default("beam"), train.get_default("lenpen")) == (decoding.BEAM_SIZE, decoding.LENGTH_PENALTY)
