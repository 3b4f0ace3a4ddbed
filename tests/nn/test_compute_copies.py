"""Compute-dtype copies of the projections' weights (fastformer/nn/linear.py set_compute_dtype, issue 52): under
autocast the model multiplies the copies instead of casting each weight in each forward, with the same results
as plain autocast, gradients into the float32 parameters, and copies that follow their parameters."""
import copy

import pytest
import torch

from fastformer.nn import Transformer, TransformerConfig
from fastformer.nn.linear import Linear, compute_copy, set_compute_dtype
from fastformer.training.copies import CopyCounter

from tolerances import TOLERANCES


def tiny_pair():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(vocab_size=97))
    model.train()
    return model, copy.deepcopy(model)


def step(model, src, tgt, dtype):
    torch.manual_seed(1)  # the same dropout masks in both models
    with torch.autocast("cpu", dtype=dtype):
        logits = model(src, tgt)
    logits.float().square().mean().backward()
    return logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_same_logits_and_gradients_as_plain_autocast(dtype):
    plain, copied = tiny_pair()
    copies = set_compute_dtype(copied, dtype)
    linears = [m for m in copied.modules() if isinstance(m, Linear)]
    assert len(copies) == 2 * len(linears) + 1  # every weight and bias, and the embedding table
    assert all(c.dtype == dtype for c in copies.values())
    src, tgt = torch.randint(4, 97, (3, 11)), torch.randint(4, 97, (3, 7))
    expected, got = step(plain, src, tgt, dtype), step(copied, src, tgt, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=0, rtol=0)  # the same products on the same rounded values
    for (name, p), q in zip(plain.named_parameters(), copied.parameters()):
        assert q.grad is not None and q.grad.dtype == torch.float32, name
        # Plain autocast rounds a weight's gradient to the compute dtype before casting it; the copies' product
        # is the same, so the two agree within that dtype's tolerance (the table's, scaled by the magnitude).
        tol = TOLERANCES[dtype]
        torch.testing.assert_close(q.grad, p.grad, atol=tol["atol"] * max(1.0, p.grad.abs().max().item()),
                                   rtol=tol["rtol"], msg=name)


def test_the_forward_casts_no_weight():
    _, model = tiny_pair()
    set_compute_dtype(model, torch.bfloat16)
    src, tgt = torch.randint(4, 97, (3, 11)), torch.randint(4, 97, (3, 7))
    weights = {p.data_ptr() for p in model.parameters() if p.dim() == 2}
    casts = []

    class Casts(CopyCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in weights:
                casts.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    with Casts(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(src, tgt)
    assert casts == []
    # Without copies, autocast casts each weight it multiplies.
    set_compute_dtype(model, None)
    with Casts(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(src, tgt)
    assert len(casts) >= sum(isinstance(m, Linear) for m in model.modules())


def test_a_copy_follows_its_parameter_changed_in_place():
    _, model = tiny_pair()
    set_compute_dtype(model, torch.bfloat16)
    weight = model.decoder.layers[0].ffn.fc1.weight
    fresh = Transformer(TransformerConfig.tiny(vocab_size=97))
    model.load_state_dict(fresh.state_dict())  # copy_ into every parameter: versions move
    assert torch.equal(compute_copy(weight, torch.bfloat16), weight.detach().bfloat16())
    with torch.no_grad():
        weight.mul_(2)
    assert torch.equal(compute_copy(weight, torch.bfloat16), weight.detach().bfloat16())
    assert compute_copy(weight, torch.float16) is None  # only the dtype asked for


def test_without_autocast_or_copies_the_plain_path_runs():
    _, model = tiny_pair()
    set_compute_dtype(model, torch.bfloat16)
    src, tgt = torch.randint(4, 97, (2, 5)), torch.randint(4, 97, (2, 4))
    assert model(src, tgt).dtype == torch.float32  # no autocast: float32 weights
    set_compute_dtype(model, None)
    assert compute_copy(model.decoder.layers[0].ffn.fc1.weight, torch.bfloat16) is None


def test_bad_dtype():
    _, model = tiny_pair()
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16, torch.float16 or None"):
        set_compute_dtype(model, torch.float64)
