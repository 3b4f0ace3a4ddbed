"""attn_implementation="fastformer" (fastformer/hf.py) inside transformers models, against "sdpa":

- BERT (bidirectional self-attention) and Marian (causal self-attention, cross attention, swish), tiny random
  models with padding in the batch: the float32 model with fastformer's attention against the same model in
  float64 with "sdpa" (the reference), logits and every parameter's gradient, within the tolerance table,
  on every backend that runs on CPU tensors;
- Marian's generate() with the cache: the same tokens as "sdpa";
- what the kernel cannot express is refused with a ValueError naming it;
- `import fastformer` does not import transformers.
"""
import copy
import subprocess
import sys

import pytest
import torch
import transformers
from transformers import masking_utils

import fastformer
import fastformer.hf
from helpers import ALL_BACKENDS
from tolerances import assert_close


def bert(attn):
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    model.set_attn_implementation(attn)
    return model.eval()


def marian(attn, init_std=0.02):
    config = transformers.MarianConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2,
                                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                       decoder_ffn_dim=64, max_position_embeddings=64, activation_function="swish",
                                       dropout=0.0, attention_dropout=0.0, init_std=init_std, pad_token_id=96,
                                       decoder_start_token_id=96, eos_token_id=0, forced_eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config)
    model.set_attn_implementation(attn)
    return model.eval()


def padded_batch(lengths, total, vocab=90, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), total), generator=g)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return ids * mask, mask  # pad id 0 on padded places (the mask decides what is attended)


def outputs_and_grads(model, forward, dtype):
    model = copy.deepcopy(model).to(dtype)
    model.zero_grad()
    out = forward(model)
    upstream = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape).to(dtype)
    (out * upstream).sum().backward()
    return out.detach(), {name: p.grad.detach() for name, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of fastformer's attention op from fastformer/hf.py (so a pass cannot come from sdpa)."""
    counted = []
    op = fastformer.hf.attention

    def counting(*args, **kwargs):
        counted.append(kwargs.get("causal"))
        return op(*args, **kwargs)

    monkeypatch.setattr(fastformer.hf, "attention", counting)
    return counted


def check_against_sdpa(make, forward, backend):
    """The float32 model on fastformer's attention (``backend``) against the float64 model on sdpa."""
    ours_model, reference_model = make("fastformer"), make("sdpa")
    assert ours_model.config._attn_implementation == "fastformer"
    reference_model.load_state_dict(ours_model.state_dict())
    fastformer.set_backend(backend)
    try:
        out, grads = outputs_and_grads(ours_model, forward, torch.float32)
    finally:
        fastformer.set_backend(None)
    ref_out, ref_grads = outputs_and_grads(reference_model, forward, torch.float64)
    assert_close(out, ref_out, torch.float32, "output")
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], torch.float32, name)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_bert_matches_sdpa_with_padding(backend, calls):
    ids, mask = padded_batch([13, 7, 1], 13)
    check_against_sdpa(bert, lambda m: m(input_ids=ids, attention_mask=mask).last_hidden_state, backend)
    assert calls == [False, False]  # two layers of bidirectional self-attention


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_marian_matches_sdpa_with_padding(backend, calls):
    src, src_mask = padded_batch([11, 4, 9], 11, seed=2)
    tgt, tgt_mask = padded_batch([9, 9, 3], 9, seed=3)
    check_against_sdpa(marian, lambda m: m(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt,
                                           decoder_attention_mask=tgt_mask).logits, backend)
    # two encoder layers, then per decoder layer causal self-attention and cross attention
    assert calls == [False, False, True, False, True, False]


def test_marian_generate_with_the_cache_gives_sdpas_tokens(calls):
    ours, reference = marian("fastformer", init_std=0.5), marian("sdpa", init_std=0.5)
    reference.load_state_dict(ours.state_dict())
    src, src_mask = padded_batch([11, 4, 9], 11, seed=4)
    kwargs = dict(input_ids=src, attention_mask=src_mask, max_new_tokens=12, num_beams=1, do_sample=False)
    got, want = ours.generate(**kwargs), reference.generate(**kwargs)
    assert torch.equal(got, want)
    assert len(calls) >= 2 + 11 * 4  # the encoder, then each step's self and cross attention in both layers
    assert len(set(want[:, 1:].flatten().tolist())) > 3, "the random model emits too few distinct tokens to tell"


def test_training_mode_uses_fastformers_attention_dropout():
    model = bert("fastformer")
    model.config.attention_probs_dropout_prob = 0.5
    for layer in model.encoder.layer:
        layer.attention.self.dropout.p = 0.5
        layer.attention.self.dropout_prob = 0.5
    model.train()
    ids, mask = padded_batch([9, 5], 9)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(model(input_ids=ids, attention_mask=mask).last_hidden_state)
    evaluated = model.eval()(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(runs[0], runs[1])
    assert not torch.allclose(runs[0], evaluated, atol=1e-3)


def test_what_the_kernel_cannot_express_is_refused():
    module = torch.nn.Module()
    module.is_causal = False
    q = torch.randn(2, 4, 5, 8)
    for name, value in [("position_bias", torch.zeros(1, 4, 5, 5)), ("sliding_window", 3), ("softcap", 30.0)]:
        with pytest.raises(ValueError, match=name):
            fastformer.hf.fastformer_attention_forward(module, q, q, q, None, **{name: value})
    with pytest.raises(ValueError, match="4-D"):
        fastformer.hf.fastformer_attention_forward(module, q, q, q, torch.ones(2, 1, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="output_attentions"):
        fastformer.hf.fastformer_attention_forward(module, q, q, q, None, output_attentions=True)
    window = masking_utils.sliding_window_causal_mask_function(4)
    with pytest.raises(ValueError, match="mask function"):
        fastformer.hf.fastformer_mask(2, 5, 5, mask_function=window, attention_mask=torch.ones(2, 5, dtype=torch.bool))


def test_the_mask_is_key_padding_or_none():
    keep = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert fastformer.hf.fastformer_mask(2, 4, 4, attention_mask=keep).equal(keep)
    assert fastformer.hf.fastformer_mask(2, 1, 4, attention_mask=torch.ones(2, 4, dtype=torch.bool)) is None
    assert fastformer.hf.fastformer_mask(2, 4, 4, attention_mask=None) is None


def test_import_fastformer_does_not_import_transformers():
    code = "import sys, fastformer; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
