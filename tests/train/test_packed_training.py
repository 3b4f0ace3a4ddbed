"""Padding-free training (--batching packed, issue 53): a packed batch is the same computation as the
padded batch of the same sentences, and python -m fastformer.train trains on packed batches.

- The model's packed path (Transformer(packed=...): encoder, causal self-attention and cross-attention on
  ops.attention_varlen, positions restarting per sentence) gives the padded path's logits at every real target
  position, and the same loss and parameter gradients (float64, dropout off), on every backend that runs on
  CPU tensors.
- Packed batches hold each side's real tokens within --max-tokens, every pair exactly once per epoch.
- A tiny run with --batching packed: the loss falls, and --resume continues it exactly.
"""
import shutil

import pytest
import torch

import fastformer
from fastformer import checkpoint as ckpt
from fastformer.data import collate, collate_packed, token_batches
from fastformer.nn import Transformer, TransformerConfig
from fastformer.train import main
from fastformer.training.step import loss_sums, packed_loss_sums
from helpers import ALL_BACKENDS, SLOW_BACKENDS
from train_helpers import tiny_run_args


def pairs(seed=1, vocab=50):
    g = torch.Generator().manual_seed(seed)
    src = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (5, 1, 12, 3, 7)]
    tgt = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (4, 9, 2, 0, 6)]
    return src, tgt


@pytest.mark.parametrize("backend", [b for b in ALL_BACKENDS if b not in SLOW_BACKENDS])
def test_packed_batch_is_the_padded_batch(backend):
    torch.manual_seed(0)
    config = TransformerConfig.tiny(vocab_size=50, dropout=0.0)  # train mode, dropout off: one function
    model = Transformer(config, backend=backend).double().train()
    src, tgt = pairs()
    padded, packed = collate(src, tgt), collate_packed(src, tgt)
    logits = model(padded[0], padded[1])
    real = padded[2].ne(config.pad_id)
    torch.testing.assert_close(model(packed=packed), logits[real], rtol=1e-12, atol=1e-12)

    def grads(fn):
        model.zero_grad()
        loss, nll = fn()
        loss.backward()
        return loss.detach(), nll, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, nll, g = grads(lambda: loss_sums(model, *padded, config.pad_id, 0.1, backend=backend))
    ploss, pnll, pg = grads(lambda: packed_loss_sums(model, packed, 0.1, backend=backend))
    torch.testing.assert_close(ploss, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pnll, nll, rtol=1e-12, atol=1e-12)
    assert g.keys() == pg.keys()
    for name in g:
        torch.testing.assert_close(pg[name], g[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_packed_batches_hold_real_tokens_within_the_budget():
    g = torch.Generator().manual_seed(3)
    src = [torch.randint(4, 50, (int(n),), generator=g).tolist() for n in torch.randint(0, 40, (300,), generator=g)]
    tgt = [torch.randint(4, 50, (int(n),), generator=g).tolist() for n in torch.randint(0, 40, (300,), generator=g)]
    batches = token_batches(src, tgt, 256, shuffle=True, seed=5, packed=True)
    assert sorted(i for b in batches for i in b) == list(range(300))
    for b in batches:
        assert sum(len(src[i]) + 1 for i in b) <= 256 and sum(len(tgt[i]) + 1 for i in b) <= 256
    # fuller than padded batches of the same budget: no padding counted
    assert len(batches) < len(token_batches(src, tgt, 256, shuffle=True, seed=5))
    batch = collate_packed([src[i] for i in batches[0]], [tgt[i] for i in batches[0]])
    assert batch.src.dim() == 1 and batch.tgt_in.shape == batch.tgt_out.shape
    assert int(batch.src_seqs.cu_seqlens[-1]) == batch.src.numel()
    assert (batch.tgt_seqs.positions[batch.tgt_seqs.cu_seqlens[:-1].long()] == 0).all()


def test_packed_run_trains_and_resumes_exactly(tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    result = main(tiny_run_args(straight, "--max-steps", "30", "--keep", "40", "--batching", "packed",
                                "--precision", "fp32"))
    assert result["steps"] == 30
    interrupted.mkdir()
    shutil.copy(straight / "spm.model", interrupted / "spm.model")
    main(tiny_run_args(interrupted, "--max-steps", "10", "--batching", "packed", "--precision", "fp32"))
    main(tiny_run_args(interrupted, "--max-steps", "30", "--batching", "packed", "--precision", "fp32", "--resume"))
    a, b = ckpt.load(str(straight / "checkpoint_30.pt")), ckpt.load(str(interrupted / "checkpoint_30.pt"))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs after resuming"
    import json
    with open(straight / "log.jsonl") as f:
        train = [json.loads(line)["loss"] for line in f if '"kind": "train"' in line]
    assert sum(train[-5:]) / 5 < sum(train[:5]) / 5 - 0.5


def test_packed_batching_refuses_cuda_graphs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(tiny_run_args(tmp_path / "run", "--max-steps", "1", "--batching", "packed", "--cuda-graphs"))
    assert "--cuda-graphs" in capsys.readouterr().err
