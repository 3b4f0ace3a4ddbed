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
    ploss, pnll, pg = grads(lambda: packed_loss_sums(model, packed, config.pad_id, 0.1, backend=backend))
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


def test_fixed_shape_packed_batches_have_one_shape_and_the_same_loss():
    """--batching packed with --cuda-graphs: every batch of every epoch padded to one shape (packed_shape, of
    the whole data), the padding cut into pad-token sentences of at most max_len and the tables filled with
    empty sentences; the real sentences' logits, the loss and every gradient are the unpadded batch's (the
    padding attends only to itself and its pad targets are ignored)."""
    from fastformer.data.batching import packed_shape
    g = torch.Generator().manual_seed(4)
    src = [torch.randint(4, 50, (int(n),), generator=g).tolist() for n in torch.randint(0, 30, (200,), generator=g)]
    tgt = [torch.randint(4, 50, (int(n),), generator=g).tolist() for n in torch.randint(0, 30, (200,), generator=g)]
    shape = packed_shape(src, tgt, 128)
    assert shape.tokens == 128 and shape.max_len == max(len(r) + 1 for r in src + tgt) and shape.sentences % 8 == 0
    shapes = set()
    for seed in range(3):
        for b in token_batches(src, tgt, 128, shuffle=True, seed=seed, packed=True):
            fixed = collate_packed([src[i] for i in b], [tgt[i] for i in b], shape=shape)
            shapes.add((*(t.shape for t in fixed[:3]), *(s.cu_seqlens.shape for s in fixed[3:]),
                        fixed.src_seqs.max_len, fixed.tgt_seqs.max_len))
            for seqs, tokens in ((fixed.src_seqs, fixed.src), (fixed.tgt_seqs, fixed.tgt_in)):
                lengths = seqs.cu_seqlens.diff()
                assert int(seqs.cu_seqlens[-1]) == tokens.numel() == 128 and int(lengths.max()) <= shape.max_len
            assert int(fixed.tgt_out.ne(0).sum()) == sum(len(tgt[i]) + 1 for i in b)  # pad targets: the tail only
    assert len(shapes) == 1, shapes

    torch.manual_seed(0)
    config = TransformerConfig.tiny(vocab_size=50, dropout=0.0)
    model = Transformer(config, backend="cpu").double().train()
    b = token_batches(src, tgt, 128, shuffle=True, seed=0, packed=True)[0]
    plain = collate_packed([src[i] for i in b], [tgt[i] for i in b])
    fixed = collate_packed([src[i] for i in b], [tgt[i] for i in b], shape=shape)
    real = plain.tgt_out.numel()
    torch.testing.assert_close(model(packed=fixed)[:real], model(packed=plain), rtol=1e-12, atol=1e-12)
    results = []
    for batch in (plain, fixed):
        model.zero_grad()
        loss, nll = packed_loss_sums(model, batch, config.pad_id, 0.1, backend="cpu")
        loss.backward()
        results.append((loss.detach(), nll, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-12, atol=1e-12)
    for got, expected in zip(results[1][2], results[0][2]):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_a_packed_batch_that_does_not_fit_its_shape_is_refused():
    from fastformer.data.batching import PackedShape
    with pytest.raises(ValueError, match="does not fit the shape"):
        collate_packed([[5] * 9], [[6] * 3], shape=PackedShape(8, 8, 10))
    with pytest.raises(ValueError, match="needs 4 sentences, more than the shape's 2"):
        collate_packed([[5], [5], [5]], [[6], [6], [6]], shape=PackedShape(8, 2, 4))


def test_packed_run_trains_and_resumes_exactly(tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    result = main(tiny_run_args(straight, "--max-steps", "30", "--keep", "40", "--batching", "packed",
                                "--precision", "fp32"))
    assert result["steps"] == 30
    interrupted.mkdir()
    shutil.copy(straight / "spm.model", interrupted / "spm.model")
    main(tiny_run_args(interrupted, "--max-steps", "10", "--batching", "packed", "--precision", "fp32"))
    # the other batching would cut other batches: a batch position of one means nothing in the other
    with pytest.raises(SystemExit, match="was trained with --batching packed: resume with --batching packed"):
        main(tiny_run_args(interrupted, "--max-steps", "30", "--batching", "padded", "--precision", "fp32",
                           "--resume"))
    main(tiny_run_args(interrupted, "--max-steps", "30", "--batching", "packed", "--precision", "fp32", "--resume"))
    a, b = ckpt.load(str(straight / "checkpoint_30.pt")), ckpt.load(str(interrupted / "checkpoint_30.pt"))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs after resuming"
    import json
    with open(straight / "log.jsonl") as f:
        train = [json.loads(line)["loss"] for line in f if '"kind": "train"' in line]
    assert sum(train[-5:]) / 5 < sum(train[:5]) / 5 - 0.5


def test_packed_batching_takes_cuda_graphs():
    """--batching packed with --cuda-graphs: one shape of batch (above), nothing to refuse (on a GPU)."""
    from fastformer.training.graphs import refusal
    args = __import__("fastformer.train", fromlist=["build_parser"]).build_parser().parse_args(
        ["--batching", "packed", "--cuda-graphs", "--precision", "bf16"])
    assert refusal(args, torch.device("cuda"), 1) is None
    assert "needs a CUDA device" in refusal(args, torch.device("cpu"), 1)
