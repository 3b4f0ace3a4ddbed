"""ops.cross_entropy beside PyTorch's losses, on the training step's logits over the vocabulary.

logits (M, V) = (tokens, vocab) (4,096 x 8,000 by default; 25,000 x 37,000 at paper sizes), int64 targets,
label smoothing 0.1 (the paper's), per-token losses (M,) in float32. Baselines: ``F.cross_entropy``
(PyTorch's fused log_softmax + nll_loss, label smoothing included) and "log_softmax+gather", the
composition fastformer.train used before the op (float32 log-probabilities, gather, mean).

Bytes, e = the logits' element size: forward reads the logits and targets and writes loss, nll and lse:
M V e + 8 M + 12 M. Backward reads the logits, targets, lse and the two upstream gradients and writes
dlogits: 2 M V e + 20 M. Memory-bound: each records its fraction of the session's copy bandwidth.
"""
import torch
import torch.nn.functional as F

from fastformer import ops

BASELINES = ("F.cross_entropy", "log_softmax+gather")
SMOOTHING = 0.1


def composition(logits, target):
    """fastformer.train's loss before ops.cross_entropy: (1 - e) nll - e mean(log p), in float32."""
    lprobs = F.log_softmax(logits.float(), dim=-1)
    nll = -lprobs.gather(1, target[:, None])[:, 0]
    return (1.0 - SMOOTHING) * nll - SMOOTHING * lprobs.mean(dim=-1)


def test_cross_entropy(bench, ctx, impl, pass_):
    M, V = ctx.sizes.tokens, ctx.sizes.vocab_size
    logits = ctx.randn(M, V, grad=True)
    target = torch.randint(0, V, (M,), device=ctx.device)
    if impl == "F.cross_entropy":
        forward = lambda: F.cross_entropy(logits, target, label_smoothing=SMOOTHING, reduction="none").float()  # noqa: E731
    elif impl == "log_softmax+gather":
        forward = lambda: composition(logits, target)  # noqa: E731
    else:
        forward = lambda: ops.cross_entropy(logits, target, label_smoothing=SMOOTHING, backend=impl)  # noqa: E731
    n = M * V * logits.element_size()
    bench.op(forward, [logits], ctx.randn(M).float(), pass_=pass_, op="cross_entropy", shape=f"{M}x{V}",
             impl=impl, bytes_moved=(n + 20 * M, 2 * n + 20 * M), memory_bound=True)
