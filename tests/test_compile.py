"""torch.compile(fullgraph=True) traces through all three ops (no graph breaks) and matches eager."""
import pytest
import torch

from fastformer import ops
from helpers import forward_backward, randn


def block(q, k, v, x, residual, weight, bias, mask, row_mask):
    # A miniature transformer sublayer: attention, a masked softmax over its output, a residual layer norm.
    a = ops.attention(q, k, v, key_padding_mask=mask, causal=True, backend="cpu")  # (B, H, L, D)
    p = ops.softmax(a, mask=row_mask, scale=0.5, backend="cpu")  # (B, H, L, D)
    y, s = ops.layer_norm_residual(p + x, residual, weight, bias, prenorm=True, backend="cpu")
    return y, s


def test_compiled_block_matches_eager():
    torch._dynamo.reset()
    B, H, L, D = 2, 2, 7, 16
    mask = torch.rand(B, L) < 0.3
    row_mask = torch.rand(B, 1, 1, D) < 0.2
    inputs = [randn(B, H, L, D, dtype=torch.float32) for _ in range(5)]
    inputs += [randn(D, dtype=torch.float32, shift=1.0), randn(D, dtype=torch.float32)]
    upstream = [randn(B, H, L, D, dtype=torch.float32) for _ in range(2)]

    def run(fn):
        return forward_backward(lambda *t: fn(*t, mask, row_mask), inputs, upstream)

    eager_outs, eager_grads = run(block)
    compiled_outs, compiled_grads = run(torch.compile(block, fullgraph=True))
    for c, e in zip(compiled_outs + compiled_grads, eager_outs + eager_grads):
        torch.testing.assert_close(c, e)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_compiled_ops_take_permuted_inputs(backend):
    """Inputs as the model makes them (q, k, v permuted out of one (B, L, 3, H, D) projection; a transposed
    residual stream): the fake kernels must give the real outputs' strides (contiguous), or the compiled
    code's output checks fail (found by compiling the encoder and decoder stacks)."""
    torch._dynamo.reset()
    B, H, L, D = 2, 2, 7, 8
    mask = torch.rand(B, L) < 0.3
    qkv = randn(B, L, 3, H, D, dtype=torch.float32)
    x, residual = randn(H * D, B * L, dtype=torch.float32), randn(H * D, B * L, dtype=torch.float32)
    weight, bias = randn(H * D, dtype=torch.float32, shift=1.0), randn(H * D, dtype=torch.float32)
    upstream = [randn(B, H, L, D, dtype=torch.float32), randn(B * L, H * D, dtype=torch.float32)]

    def fn(qkv, x, residual, weight, bias):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, D) views, not contiguous
        a = ops.attention(q, k, v, key_padding_mask=mask, backend=backend)
        a = ops.softmax(a.transpose(-1, -2), scale=0.5, backend=backend).transpose(-1, -2)
        y = ops.layer_norm_residual(x.t(), residual.t(), weight, bias, backend=backend)
        return a, y

    inputs = [qkv, x, residual, weight, bias]
    eager_outs, eager_grads = forward_backward(fn, inputs, upstream)
    compiled_outs, compiled_grads = forward_backward(torch.compile(fn, fullgraph=True, dynamic=True), inputs, upstream)
    for c, e in zip(compiled_outs + compiled_grads, eager_outs + eager_grads):
        torch.testing.assert_close(c, e)
