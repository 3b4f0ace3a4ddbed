"""The Transformer against an independent plain-PyTorch forward (tests/nn/model_reference.py).

For every backend this build runs on CPU tensors, in float64 and float32, post-norm and pre-norm: the logits
of ``model(src, tgt_in)`` and the gradients of every parameter under a cross-entropy loss equal the
reference's (its autograd gradients). The reference always runs in float64, on float64 copies of the
model's parameters, so the error measured is the model's own (tests/tolerances.py). Sources are padded at
the end of some rows, targets are right-padded; the loss ignores padded targets.
"""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer.nn import Transformer, TransformerConfig
from model_reference import reference_logits, sinusoids
from tolerances import assert_close

# Backends that execute GPU kernels on the CPU (a SIMT fiber model, the Triton interpreter) are slow and
# run float32 and float16 only: they get the float32 cases.
SLOW_BACKENDS = [b for b in ("cuda_sim", "triton") if fastformer.backends().get(b)]
CASES = [(b, d) for b in ("torch", "cpu") for d in (torch.float64, torch.float32)]
CASES += [(b, torch.float32) for b in SLOW_BACKENDS]
CASE_IDS = [f"{b}-{str(d).removeprefix('torch.')}" for b, d in CASES]


def make_batch(config, B=3, S=7, T=6):
    """src (B, S) with rows 1 and 2 padded at the end; tgt_in and tgt_out (B, T) right-padded.

    The target sequence is bos, tokens, eos, padding; tgt_in drops its last position, tgt_out its first.
    """
    V, pad = config.vocab_size, config.pad_id
    src = torch.randint(pad + 1, V, (B, S))
    src_lengths = [S, S - 3, S - 1][:B]
    tgt_lengths = [T - 1, T - 3, T - 4][:B]  # real tokens before eos
    seq = torch.full((B, T + 1), pad, dtype=torch.long)
    for i in range(B):
        src[i, src_lengths[i]:] = pad
        seq[i, 0] = config.bos_id
        seq[i, 1:1 + tgt_lengths[i]] = torch.randint(4, V, (tgt_lengths[i],))
        seq[i, 1 + tgt_lengths[i]] = config.eos_id
    return src, seq[:, :-1], seq[:, 1:]


def loss_fn(logits, tgt_out, config):
    """Mean label-smoothed cross-entropy over the real (non-pad) target tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1), ignore_index=config.pad_id,
                           label_smoothing=config.label_smoothing)


def check_against_reference(model, config, dtype, src, tgt_in, tgt_out):
    """Forward + backward of ``model`` and of the float64 reference; compares logits, loss and every gradient."""
    model.zero_grad(set_to_none=True)
    logits = model(src, tgt_in)
    loss = loss_fn(logits, tgt_out, config)
    loss.backward()

    params = {name: p.detach().double().requires_grad_(True) for name, p in model.named_parameters()}
    ref_logits = reference_logits(params, config, src, tgt_in)
    ref_loss = loss_fn(ref_logits, tgt_out, config)
    ref_loss.backward()

    assert_close(logits.detach(), ref_logits.detach(), dtype, "logits")
    assert_close(loss.detach(), ref_loss.detach(), dtype, "loss")
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} received no gradient"
        assert_close(p.grad, params[name].grad, dtype, f"grad of {name}")
    # The gradients are not trivially zero: every parameter influences the loss.
    zero = [name for name, p in params.items() if not p.grad.abs().max() > 0]
    assert not zero, f"parameters with an all-zero reference gradient: {zero}"


@pytest.mark.parametrize("norm_first", [False, True], ids=["postnorm", "prenorm"])
@pytest.mark.parametrize("backend,dtype", CASES, ids=CASE_IDS)
def test_logits_and_gradients_match_reference(backend, dtype, norm_first):
    # Every dropout is nonzero in the config: eval() must turn all of them off.
    config = TransformerConfig.tiny(norm_first=norm_first, attention_dropout=0.1, activation_dropout=0.1)
    model = Transformer(config, backend=backend).to(dtype).eval()
    src, tgt_in, tgt_out = make_batch(config)
    check_against_reference(model, config, dtype, src, tgt_in, tgt_out)


@pytest.mark.parametrize("norm_first", [False, True], ids=["postnorm", "prenorm"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_training_mode_without_dropout_matches_reference(backend, norm_first):
    """The training path (train() mode, the fused ops' dropout branches with p = 0) computes the same model."""
    config = TransformerConfig.tiny(norm_first=norm_first, dropout=0.0)
    model = Transformer(config, backend=backend).double().train()
    src, tgt_in, tgt_out = make_batch(config)
    check_against_reference(model, config, torch.float64, src, tgt_in, tgt_out)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_sequences_longer_than_the_position_table(backend):
    """max_positions is only the initial table size: longer inputs extend it with the same sinusoids."""
    config = TransformerConfig.tiny(max_positions=4)
    model = Transformer(config, backend=backend).double().eval()
    src, tgt_in, tgt_out = make_batch(config, S=11, T=9)
    check_against_reference(model, config, torch.float64, src, tgt_in, tgt_out)
    assert model.positions(11, torch.float64, torch.device("cpu")).shape == (11, config.d_model)


def test_positions_are_the_papers_sinusoids():
    """The model's table is PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), exact in
    float64 and rounded once to float32."""
    config = TransformerConfig.tiny(d_model=24, n_heads=4, max_positions=300)
    model = Transformer(config)
    exact = sinusoids(300, 24)
    cpu = torch.device("cpu")
    assert_close(model.positions(300, torch.float32, cpu), exact, torch.float32, "positions")
    table = model.positions(300, torch.float64, cpu)
    # Column 0 is sin(pos), column 1 cos(pos); the last pair has the longest wavelength, 10000^(22/24).
    pos = torch.arange(300, dtype=torch.float64)
    torch.testing.assert_close(table[:, 0], torch.sin(pos), atol=1e-12, rtol=0)
    torch.testing.assert_close(table[:, 1], torch.cos(pos), atol=1e-12, rtol=0)
    torch.testing.assert_close(table[:, 23], torch.cos(pos / 10000 ** (22 / 24)), atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_padding_does_not_leak(backend):
    """A sentence gives the same logits alone (unpadded) as inside a batch where it is padded: source padding
    is masked from every attention, and right padding of the target is invisible to the real positions."""
    config = TransformerConfig.tiny()
    model = Transformer(config, backend=backend).double().eval()
    src, tgt_in, _ = make_batch(config)
    batch_logits = model(src, tgt_in)
    for i in range(src.shape[0]):
        s = src[i][src[i] != config.pad_id][None]
        t = tgt_in[i][tgt_in[i] != config.pad_id][None]
        alone = model(s, t)
        assert_close(batch_logits[i, :t.shape[1]][None], alone, torch.float64, f"sentence {i}")


@pytest.mark.parametrize("norm_first", [False, True], ids=["postnorm", "prenorm"])
def test_autocast_mixed_precision_trains(norm_first):
    """Mixed precision as training uses it on GPUs, exercised on the CPU with bfloat16 autocast: the
    matmuls run in bfloat16, the fused residual + LayerNorm in the float32 residual stream; the loss and
    every gradient are finite and close to the float32 model's."""
    config = TransformerConfig.tiny(norm_first=norm_first, dropout=0.0)
    model = Transformer(config, backend="cpu")
    src, tgt_in, tgt_out = make_batch(config)
    ref_logits = model(src, tgt_in)
    ref_loss = F.cross_entropy(ref_logits.transpose(1, 2), tgt_out, ignore_index=config.pad_id)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.float().transpose(1, 2), tgt_out, ignore_index=config.pad_id)
    loss.backward()
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(loss) and abs(loss.item() - ref_loss.item()) < 0.05 * ref_loss.item()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
