"""The incremental decoder and beam search of fastformer/nn/decoding.py against what they replaced.

- tokens recorded from the beam search of commit 0bf9cbd (``model_reference.legacy_beam_search``, the
  same code) on a tiny model trained for 1,785 updates (about 5 minutes) on the Bible
  (tests/data/tiny-bible-de-en.pt), beam 1 and 4, batch 1 and 32, float32 and float64: ``generate`` must
  reproduce them
  (tests/nn/recorded_decoding.py wrote tests/data/tiny-bible-de-en.tokens.json);
- the same search, live, on random models: tokens and scores of every hypothesis;
- the decoder's logits, step by step with beams reordered and sentences leaving the batch, against a
  full recompute of each prefix with ``Transformer.decode``;
- the prepared weights follow in-place parameter updates (an optimizer step).
"""
import json

import pytest
import torch

from fastformer import checkpoint as ckpt
from fastformer.data import collate
from fastformer.nn import TransformerConfig
from fastformer.nn.decoding import IncrementalDecoder
from fastformer.nn.linear import packed_panels
from model_reference import legacy_beam_search, varied_model
from recorded_decoding import CHECKPOINT, RECORDED, SETTINGS, source_ids
from test_model_decoding import assert_varied, make_src
from tolerances import assert_close

def recorded_cases():
    with open(RECORDED) as f:
        return json.load(f)


@pytest.mark.parametrize("case", recorded_cases()["cases"], ids=lambda c: c["name"])
def test_generate_reproduces_recorded_tokens(case):
    model, tokenizer, _ = ckpt.load_model(CHECKPOINT, backend="cpu")
    model = model.to(getattr(torch, case["dtype"]))
    src = collate(source_ids(tokenizer, case["batch"]))
    out = model.generate(src, beam_size=case["beam"], **SETTINGS)
    assert out == case["tokens"]


def test_recorded_cases_are_not_degenerate():
    """The recorded translations vary, and sentences end at different steps, some by their own eos
    before the length limit."""
    cases = {c["name"]: c for c in recorded_cases()["cases"]}
    tokens = cases["float32-beam4-batch32"]["tokens"]
    assert_varied(tokens)
    assert len({len(t) for t in tokens}) > 10, [len(t) for t in tokens]
    _, tokenizer, _ = ckpt.load_model(CHECKPOINT)
    limits = [int(1.2 * (len(s) + 1) + 10) for s in source_ids(tokenizer, 32)]
    assert sum(len(t) < n for t, n in zip(tokens, limits)) >= 16


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("norm_first", [False, True], ids=["postnorm", "prenorm"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_search_matches_the_legacy_search(backend, norm_first, beam_size, dtype):
    config = TransformerConfig.tiny(norm_first=norm_first)
    model = varied_model(config, backend, seed=4, dtype=dtype)
    torch.manual_seed(1)
    src = make_src(config, torch.randint(1, 12, (32,)).tolist())
    kw = dict(length_penalty=0.6, max_len_a=1.0, max_len_b=3)
    new = model.beam_search(src, beam_size=beam_size, **kw)
    old = legacy_beam_search(model, src, beam_size, kw["length_penalty"], kw["max_len_a"], kw["max_len_b"])
    tolerance = dict(rel=1e-9, abs=1e-12) if dtype == torch.float64 else dict(rel=1e-5, abs=1e-5)
    for i, (n, o) in enumerate(zip(new, old)):
        assert [t for t, _ in n] == [t for t, _ in o], f"sentence {i}"
        assert [s for _, s in n] == pytest.approx([s for _, s in o], **tolerance), f"sentence {i}"
    assert_varied([hyps[0][0] for hyps in new])


@pytest.mark.parametrize("norm_first", [False, True], ids=["postnorm", "prenorm"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_decoder_steps_match_full_recompute_through_reorders(backend, norm_first):
    """Rows are reordered (parents repeat and skip rows, as beams do) and whole sentences leave the
    batch; at every step each row's logits equal those of its whole prefix decoded from scratch."""
    config = TransformerConfig.tiny(norm_first=norm_first)
    model = varied_model(config, backend, seed=4)
    K, lengths = 3, [7, 4, 6, 5]
    src = make_src(config, lengths)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        memory, src_padding = model.encode(src)
        decoder = IncrementalDecoder(model, memory, src_padding, K, steps=6)
        sentences = list(range(len(lengths)))  # batch index of each live sentence
        prefixes = torch.full((len(lengths) * K, 1), config.bos_id)
        for step in range(6):
            logits = decoder.logits(prefixes)
            rows = torch.tensor(sentences).repeat_interleave(K)
            full = model.decode(prefixes, memory[rows], src_padding[rows])[:, -1]
            assert_close(logits, full, torch.float64, f"step {step}")
            keep = list(range(len(sentences)))
            if step in (2, 4):  # a sentence finishes
                keep.pop(step // 2 - 1)
            parents = torch.tensor([i * K + int(torch.randint(0, K, (), generator=generator))
                                    for i in keep for _ in range(K)])
            new_tokens = torch.randint(4, config.vocab_size, (len(parents), 1), generator=generator)
            prefixes = torch.cat([prefixes[parents], new_tokens], dim=1)
            decoder.select(parents, None if len(keep) == len(sentences) else torch.tensor(keep))
            sentences = [sentences[i] for i in keep]


def test_packed_weights_are_reused_and_follow_updates():
    """The decoder's packed panels are those of fastformer/nn/linear.py's one cache: made once per weight,
    reused by the next translation, remade after an in-place update (an optimizer step)."""
    config = TransformerConfig.tiny()
    model = varied_model(config, "cpu", seed=4, dtype=torch.float32)
    src = make_src(config, [5, 7, 3])
    first = model.generate(src, beam_size=2)
    fc1 = model.decoder.layers[0].ffn.fc1.weight
    panels = packed_panels(fc1)
    model.generate(src, beam_size=2)
    assert packed_panels(fc1) is panels  # nothing changed: no new copy
    with torch.no_grad():  # an optimizer step changes the weights in place
        for p in model.decoder.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert packed_panels(fc1) is not panels
    fresh = varied_model(config, "cpu", seed=4)
    fresh.load_state_dict(model.state_dict())
    updated = model.generate(src, beam_size=2)
    assert updated == fresh.generate(src, beam_size=2)
    assert updated != first
