"""fastformer.nn.linear: the model's projections take the packed kernel exactly where no gradient can be
wanted (grad disabled, float32 CPU, no autocast) and ``F.linear`` elsewhere; the panels follow in-place
weight updates; the state dict is nn.Linear's. CI runs this file at every CPU instruction-set level."""
import pytest
import torch

from fastformer.nn import linear as linear_module
from fastformer.nn.linear import Linear, packed_panels
from helpers import randn
from tolerances import assert_close


def reference(layer, x):
    return x.double() @ layer.weight.double().t() + layer.bias.double()


@pytest.mark.parametrize("shape", [(1, 37), (7, 37), (3, 113, 37), (37,)])
def test_inference_takes_the_packed_kernel(shape):
    layer = Linear(37, 97)
    x = randn(*shape, dtype=torch.float32)
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (*shape[:-1], 97)
    assert_close(y, reference(layer, x), torch.float32)
    assert linear_module._PANELS.get(layer.weight) is not None, "the packed kernel was not used"


def test_training_takes_f_linear_with_gradients():
    layer = Linear(37, 97)
    x = randn(5, 37, dtype=torch.float32).requires_grad_()
    y = layer(x)
    assert linear_module._PANELS.get(layer.weight) is None
    y.sum().backward()
    assert_close(x.grad, layer.weight.double().sum(0).expand(5, 37), torch.float32)


def test_autocast_and_other_dtypes_take_f_linear():
    layer = Linear(37, 97)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(randn(3, 37, dtype=torch.float32)).dtype == torch.bfloat16
    assert linear_module._PANELS.get(layer.weight) is None
    double = Linear(37, 97).double()
    with torch.no_grad():
        x = randn(3, 37, dtype=torch.float64)
        assert torch.equal(double(x), torch.nn.functional.linear(x, double.weight, double.bias))
    assert packed_panels(double.weight) is None


def test_panels_follow_in_place_updates():
    layer = Linear(37, 97)
    x = randn(4, 37, dtype=torch.float32)
    with torch.no_grad():
        layer(x)
        first = packed_panels(layer.weight)
        assert packed_panels(layer.weight) is first  # cached
        layer.weight.mul_(2.0)  # an optimizer step changes the weight in place
        y = layer(x)
    assert packed_panels(layer.weight) is not first
    assert_close(y, reference(layer, x), torch.float32)


def test_state_dict_is_nn_linears():
    assert Linear(5, 3).state_dict().keys() == torch.nn.Linear(5, 3).state_dict().keys()


def test_the_decoder_shares_the_panels_of_the_models_linear_layers():
    """Decoding packs no second copy: the panels it uses are those ``Linear`` and the logits use, made at
    the model's first inference call and found again by the decoder (one cache, one rule)."""
    from fastformer.nn import Transformer, TransformerConfig
    config = TransformerConfig.tiny()
    model = Transformer(config).eval()
    src = torch.randint(4, config.vocab_size, (2, 5))
    with torch.no_grad():
        model(src, src)  # the model's own Linear layers and output projection pack their weights
    weights = [model.decoder.layers[0].ffn.fc1.weight, model.decoder.layers[1].self_attn.qkv_proj.weight,
               model.embed.weight]
    before = [packed_panels(w) for w in weights]
    model.generate(src, beam_size=2, max_len_b=3)
    assert all(packed_panels(w) is p for w, p in zip(weights, before))


def test_a_model_made_under_inference_mode_translates():
    # Weights made under torch.inference_mode have no version counter (issue 55): the panels are cached by the
    # weight alone, and a model built and run there decodes as one built outside it.
    from fastformer.nn import Transformer, TransformerConfig
    torch.manual_seed(0)
    outside = Transformer(TransformerConfig.tiny(vocab_size=40))
    src = torch.randint(4, 40, (2, 7))
    expected = outside.generate(src, beam_size=2)
    with torch.inference_mode():
        inside = Transformer(TransformerConfig.tiny(vocab_size=40))
        inside.load_state_dict(outside.state_dict())
        layer = inside.encoder.layers[0].ffn.fc1
        assert layer.weight.is_inference()
        assert inside.generate(src, beam_size=2) == expected
        assert linear_module._PANELS.get(layer.weight) is not None, "the packed kernel was not used"
