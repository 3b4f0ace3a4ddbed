"""Padding-free training in transformers models with attn_implementation="fastformer" (issue 53, item 4).

Sentences of spread lengths as one padded batch under "sdpa" (the reference, float64) against the same
sentences flattened into one row (transformers' DataCollatorWithFlattening) under "fastformer", which runs
ops.attention_varlen on the packed tokens: the loss and every parameter's gradient agree, in float32 within
the tolerance table, with the boundaries passed both ways transformers passes them (position_ids that restart,
and the flash-attention keyword arguments cu_seq_lens_q/k, max_length_q/k). Models: a Llama-style decoder with
grouped-query attention (4 query heads over 2 key/value heads, read in place: no repeated K and V) and GPT-2
(learned positions). A packed row under "sdpa" (its block-diagonal mask over the whole row) is checked too.
"""
import copy

import pytest
import torch
import transformers
from transformers import DataCollatorWithFlattening

import fastformer.hf
from helpers import ALL_BACKENDS
from tolerances import assert_close

LENGTHS = (7, 1, 12, 4, 9)


def llama():
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attention_dropout=0.0, initializer_range=0.2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def gpt2():
    config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama-gqa": llama, "gpt2": gpt2}


def sentences(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in LENGTHS]


def padded(sents):
    """input_ids, attention_mask and labels (-100 at padding) of a right-padded batch."""
    L = max(map(len, sents))
    ids = torch.zeros(len(sents), L, dtype=torch.long)
    mask = torch.zeros(len(sents), L, dtype=torch.long)
    for row, s in enumerate(sents):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def flattened(sents, flash_kwargs):
    """One row of every sentence (DataCollatorWithFlattening), position_ids restarting per sentence, and with
    flash_kwargs the cu_seq_lens_q/k and max_length_q/k transformers' flash attention takes."""
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_position_ids=True)
    return collate([{"input_ids": s} for s in sents])


def loss_and_grads(model, attn, batch, dtype, use_cache=False):
    model = copy.deepcopy(model).to(dtype)
    model.set_attn_implementation(attn)
    model.train()
    model.zero_grad()
    loss = model(**batch, use_cache=use_cache).loss
    loss.backward()
    # transformers computes the loss in float32 even for a float64 model (its logits are upcast to float32)
    return loss.detach().double() if dtype == torch.float64 else loss.detach(), {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}


# the tested backends but the Triton interpreter (minutes on these models; its kernels are tested op by op)
@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b != "triton"])
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("name", MODELS)
def test_flattened_batch_equals_padded_batch(name, flash_kwargs, backend):
    model, sents = MODELS[name](), sentences()
    expected_loss, expected = loss_and_grads(model, "sdpa", padded(sents), torch.float64)
    batch = flattened(sents, flash_kwargs)
    assert batch["input_ids"].shape == (1, sum(LENGTHS))
    fastformer.set_backend(backend)
    try:
        loss, grads = loss_and_grads(model, "fastformer", batch, torch.float32)
    finally:
        fastformer.set_backend(None)
    assert_close(loss, expected_loss, torch.float32, "loss")
    assert grads.keys() == expected.keys()
    for n, g in grads.items():
        assert_close(g, expected[n], torch.float32, n)


def test_packed_rows_found_with_a_cache():
    # With use_cache on (a Llama's default, in train mode too) transformers builds no packed mask (it holds a
    # cache); fastformer finds the sequences from the position_ids, as flash attention does.
    model, sents = llama(), sentences()
    expected_loss, expected = loss_and_grads(model, "sdpa", padded(sents), torch.float64)
    loss, grads = loss_and_grads(model, "fastformer", flattened(sents, False), torch.float32, use_cache=True)
    assert_close(loss, expected_loss, torch.float32, "loss")
    for n, g in grads.items():
        assert_close(g, expected[n], torch.float32, n)


@pytest.mark.parametrize("name", MODELS)
def test_sdpa_on_the_packed_row_agrees(name):
    # The comparison the benchmark makes: sdpa on the same packed row (its block-diagonal mask) is the same
    # function, so the three ways differ in cost only.
    model, sents = MODELS[name](), sentences()
    expected_loss, _ = loss_and_grads(model, "sdpa", padded(sents), torch.float64)
    loss, _ = loss_and_grads(model, "sdpa", flattened(sents, False), torch.float64)
    assert_close(loss.float(), expected_loss, torch.float32, "loss")


def test_packed_sequences_found_from_position_ids():
    # The mask transformers builds for fastformer on a packed row is the sequences' boundaries, not a mask.
    model = llama()
    model.set_attn_implementation("fastformer")
    seen = []
    original = fastformer.hf.fastformer_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return original(module, query, key, value, attention_mask, **kwargs)

    transformers.modeling_utils.AttentionInterface.register("fastformer", spy)
    try:
        model(**{k: v for k, v in flattened(sentences(), False).items() if k != "labels"}, use_cache=False)
    finally:
        fastformer.hf.register()
    assert seen and all(isinstance(m, fastformer.hf.PackedSequences) for m in seen)
    expected = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    torch.testing.assert_close(seen[0].cu_seqlens, expected)
    assert seen[0].max_seqlen == max(LENGTHS)


def test_other_mask_patterns_still_refused():
    # A sliding window over a packed row is not packed attention: refused, naming the mask function.
    config = transformers.MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    model = transformers.MistralForCausalLM(config)
    model.set_attn_implementation("fastformer")
    batch = flattened(sentences(), False)
    with pytest.raises(ValueError, match="fastformer"):
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])


@pytest.mark.parametrize("way", ["mask", "position_ids", "cu_seq_lens"])
def test_boundaries_read_once_per_forward(way, monkeypatch):
    # The packed boundaries cost one host read per forward, not one per layer (a sync per layer on a GPU): the
    # mask function builds them once, or the first layer from the keyword arguments (the others find its
    # result again), and the table reaches the device checked on the host, so attention_varlen reads it in no
    # layer, forward or backward (tests/ops/test_deferred_checks.py shows that check).
    built = []
    original = fastformer.hf._on_device
    monkeypatch.setattr(fastformer.hf, "_on_device", lambda *args: built.append(args[0]) or original(*args))
    model = llama()
    model.set_attn_implementation("fastformer")
    model.train()
    expected = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    for forward in range(1, 3):
        batch = flattened(sentences(forward), way == "cu_seq_lens")  # new tensors each forward
        model(**batch, use_cache=way == "position_ids").loss.backward()
        layers = model.config.num_hidden_layers
        assert len(built) == forward, f"{len(built)} tables built in {forward} forwards of {layers} layers"
        torch.testing.assert_close(built[-1], expected)


def test_differing_tables_are_refused():
    model = llama()
    model.set_attn_implementation("fastformer")
    batch = flattened(sentences(), True)
    batch["cu_seq_lens_k"] = batch["cu_seq_lens_k"].flip(0).cumsum(0).to(torch.int32)
    with pytest.raises(ValueError, match="these differ"):
        model(**batch)
    batch["cu_seq_lens_k"] = batch["cu_seq_lens_k"][:-1]
    with pytest.raises(ValueError, match="these differ"):
        model(**batch)
