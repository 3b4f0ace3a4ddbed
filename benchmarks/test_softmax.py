"""ops.softmax beside masked_fill + softmax, on attention scores with a key padding mask.

x (B, H, L, L) = (tokens / L, 8, L, L), mask (B, 1, 1, L) broadcast over heads and queries, scale 1.

Bytes, e = the element size, N = BHL^2 elements: forward reads x and the bool mask and writes y:
2 N e + BL. Backward reads dy and y and writes dx: 3 N e. Memory-bound: each records its fraction of
the session's copy bandwidth.
"""
import torch

from fastformer import ops

BASELINES = ("masked_fill+softmax",)


def test_softmax(bench, ctx, attention_shape, impl, pass_):
    s = attention_shape
    B, H, L = s.B, s.H, s.L
    x = ctx.randn(B, H, L, L, grad=True)
    mask = s.key_padding_mask[:, None, None, :]
    if impl in BASELINES:
        forward = lambda: torch.softmax(x.masked_fill(mask, float("-inf")), dim=-1)  # noqa: E731
    else:
        forward = lambda: ops.softmax(x, mask=mask, backend=impl)  # noqa: E731
    n = x.numel() * x.element_size()
    bench.op(forward, [x], ctx.randn(B, H, L, L), pass_=pass_, op="softmax", shape=f"B={B} H={H} L={L}",
             impl=impl, length=L, bytes_moved=(2 * n + B * L, 3 * n), memory_bound=True)
