"""TransformerConfig presets, parameter counts, shared embeddings, config validation and dropout modes.

Preset sizes are those of the docs/training.md and of "Attention Is All You Need" (Vaswani et al., 2017, table 3):
base N=6, d_model 512, d_ff 2048, h 8, P_drop 0.1, eps_ls 0.1 (65M parameters); big d_model 1024,
d_ff 4096, h 16, P_drop 0.3 (213M); small 3+3 layers, d_model 256, 4 heads, d_ff 1024 with an 8,000-piece
vocabulary; tiny 2+2 layers, d_model 32, 4 heads, d_ff 64 for tests.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fastformer.nn import Transformer, TransformerConfig


def count_parameters(config):
    """Parameters of a Transformer built on the meta device (no memory, no initialisation cost)."""
    with torch.device("meta"):
        model = Transformer(config)
    return sum(p.numel() for p in model.parameters())


def expected_parameters(config):
    """Shared (V, d) embedding; per encoder layer self-attention (4 d^2 + 4 d), FFN (2 d d_ff + d_ff + d) and
    two LayerNorms; per decoder layer self- and cross-attention, FFN and three LayerNorms; with norm_first
    a final LayerNorm after each stack. No output projection of its own, no output bias."""
    d, f = config.d_model, config.d_ff
    attention, ffn, norm = 4 * d * d + 4 * d, 2 * d * f + f + d, 2 * d
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    final = 2 * norm if config.norm_first else 0
    return (config.vocab_size * d + config.n_encoder_layers * encoder_layer
            + config.n_decoder_layers * decoder_layer + final)


# ------------------------------------------------------------------------------------------------------
# presets


def test_base_preset():
    c = TransformerConfig.base(vocab_size=37000)
    assert (c.vocab_size, c.n_encoder_layers, c.n_decoder_layers) == (37000, 6, 6)
    assert (c.d_model, c.d_ff, c.n_heads, c.head_dim) == (512, 2048, 8, 64)
    assert (c.dropout, c.label_smoothing) == (0.1, 0.1)
    assert c.norm_first is False  # the paper's post-norm


def test_big_preset():
    c = TransformerConfig.big(vocab_size=37000)
    assert (c.n_encoder_layers, c.n_decoder_layers) == (6, 6)
    assert (c.d_model, c.d_ff, c.n_heads, c.head_dim) == (1024, 4096, 16, 64)
    assert (c.dropout, c.label_smoothing) == (0.3, 0.1)
    assert c.norm_first is False


def test_small_preset():
    c = TransformerConfig.small()
    assert c.vocab_size == 8000  # the joint sentencepiece vocabulary of the small preset
    assert (c.n_encoder_layers, c.n_decoder_layers) == (3, 3)
    assert (c.d_model, c.d_ff, c.n_heads) == (256, 1024, 4)
    assert TransformerConfig.small(vocab_size=1234).vocab_size == 1234


def test_tiny_preset():
    c = TransformerConfig.tiny()
    assert (c.n_encoder_layers, c.n_decoder_layers) == (2, 2)
    assert (c.d_model, c.d_ff, c.n_heads) == (32, 64, 4)


@pytest.mark.parametrize("preset", ["base", "big", "small", "tiny"])
def test_presets_take_overrides(preset):
    c = getattr(TransformerConfig, preset)(vocab_size=100, dropout=0.2, n_heads=2, norm_first=True)
    assert (c.vocab_size, c.dropout, c.n_heads, c.norm_first) == (100, 0.2, 2, True)


def test_config_round_trips_through_a_dict_and_is_frozen():
    c = TransformerConfig.small(norm_first=True, attention_dropout=0.1)
    assert TransformerConfig.from_dict(c.to_dict()) == c
    assert c.replace(d_ff=512).d_ff == 512 and c.d_ff == 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_model = 128


# ------------------------------------------------------------------------------------------------------
# parameter counts


def test_base_has_the_papers_parameter_count():
    n = count_parameters(TransformerConfig.base(vocab_size=37000))
    assert n == expected_parameters(TransformerConfig.base(vocab_size=37000)) == 63_082_496
    assert abs(n - 63.1e6) <= 0.01 * 63.1e6
    assert abs(n - 65e6) <= 0.05 * 65e6  # the paper's "65M" (its vocabulary and counting differ slightly)


def test_big_has_the_papers_parameter_count():
    n = count_parameters(TransformerConfig.big(vocab_size=37000))
    assert n == expected_parameters(TransformerConfig.big(vocab_size=37000)) == 214_245_376
    assert abs(n - 214.2e6) <= 0.01 * 214.2e6
    assert abs(n - 213e6) <= 0.01 * 213e6  # the paper's "213M"


@pytest.mark.parametrize("norm_first", [False, True], ids=["postnorm", "prenorm"])
@pytest.mark.parametrize("preset", ["small", "tiny"])
def test_parameter_count_formula(preset, norm_first):
    """Pre-norm adds exactly the two final LayerNorms; nothing else depends on the norm placement."""
    config = getattr(TransformerConfig, preset)(norm_first=norm_first)
    assert count_parameters(config) == expected_parameters(config)


# ------------------------------------------------------------------------------------------------------
# shared embeddings


def test_one_embedding_matrix_serves_source_target_and_output():
    config = TransformerConfig.tiny(vocab_size=50, norm_first=True)
    model = Transformer(config).double().eval()
    vocab_shaped = [name for name, p in model.named_parameters() if config.vocab_size in p.shape]
    assert vocab_shaped == ["embed.weight"]
    assert model.embed.weight.shape == (config.vocab_size, config.d_model)

    # The output projection is the embedding matrix, with no bias: logits = decoder output @ E^T.
    captured = {}
    model.decoder.register_forward_hook(lambda module, args, output: captured.update(h=output))
    src = torch.randint(4, config.vocab_size, (2, 5))
    tgt_in = torch.randint(4, config.vocab_size, (2, 4))
    logits = model(src, tgt_in)
    torch.testing.assert_close(logits, F.linear(captured["h"], model.embed.weight), atol=1e-12, rtol=0)

    # Changing the embedding row of a token that appears only in the source changes the logits (the
    # encoder reads the same matrix), and so does a row that appears only in the target. The change is a
    # random direction: a constant shift of a row would vanish in the LayerNorms.
    for token_row, where in ((src, "source"), (tgt_in, "target")):
        other = tgt_in if where == "source" else src
        token = next(int(t) for t in token_row.flatten() if int(t) not in other.flatten().tolist())
        with torch.no_grad():
            saved = model.embed.weight[token].clone()
            model.embed.weight[token] += torch.randn(config.d_model, dtype=torch.float64)
            changed = model(src, tgt_in)
            model.embed.weight[token] = saved
        # Column `token` moves because it is an output row too; the other columns move only through
        # the hidden states, i.e. because the embedding is also the input embedding of the `where` side.
        others = [j for j in range(config.vocab_size) if j != token]
        assert not torch.allclose(changed[..., others], logits[..., others]), where


def test_padding_embedding_is_zero_at_initialisation():
    config = TransformerConfig.tiny()
    model = Transformer(config)
    assert torch.equal(model.embed.weight[config.pad_id], torch.zeros(config.d_model))
    assert model.embed.weight[4:].std().item() == pytest.approx(config.d_model ** -0.5, rel=0.2)


# ------------------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("changes", [
    dict(d_model=30, n_heads=4),
    dict(d_model=32, n_heads=5),
    dict(dropout=1.0),
    dict(dropout=-0.1),
    dict(attention_dropout=1.0),
    dict(activation_dropout=1.5),
    dict(label_smoothing=1.0),
    dict(vocab_size=3),  # must exceed the special ids pad 0, unk 1, bos 2, eos 3
    dict(activation="tanh"),  # relu, gelu, silu
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_bad_config_is_rejected(changes):
    with pytest.raises(ValueError):
        TransformerConfig(**{"vocab_size": 64, **changes})
    with pytest.raises(ValueError):
        TransformerConfig.tiny(**changes)


# ------------------------------------------------------------------------------------------------------
# dropout: random in training mode, off in eval mode


@pytest.mark.parametrize("which", ["dropout", "attention_dropout", "activation_dropout"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_dropout_is_random_in_training_and_off_in_eval(backend, which):
    config = TransformerConfig.tiny(**{"dropout": 0.0, which: 0.3})
    model = Transformer(config, backend=backend)
    src = torch.randint(4, config.vocab_size, (2, 6))
    tgt_in = torch.randint(4, config.vocab_size, (2, 5))

    model.eval()
    with torch.no_grad():
        first, second = model(src, tgt_in), model(src, tgt_in)
    assert torch.equal(first, second)
    reference = Transformer(config.replace(**{which: 0.0}), backend=backend).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(first, reference(src, tgt_in), atol=0, rtol=0)

    model.train()
    one, two = model(src, tgt_in), model(src, tgt_in)
    assert not torch.allclose(one, two), f"{which} changed nothing between two training-mode calls"
    assert not torch.allclose(one, first), f"{which} changed nothing in training mode"
    loss = one.logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
