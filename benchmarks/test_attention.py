"""ops.attention beside PyTorch's eager attention and F.scaled_dot_product_attention.

q, k, v (B, H, L, D) = (tokens / L, 8, L, 64) with a key padding mask (B, L), no dropout, not causal
(the encoder's self-attention).

Bytes, e = the element size: forward reads q, k, v and the bool mask and writes out and the float32
row logsumexp that backward needs: 4 BHLD e + BL + 4 BHL. Backward reads q, k, v, out, dout, the
logsumexp and the mask and writes dq, dk, dv: 8 BHLD e + BL + 4 BHL.
FLOPs, dense (padded keys counted, as FlashAttention counts them): forward S = Q K^T and O = P V, 2 BHL^2 D
each, 4 BHL^2 D in all; backward recomputes S and forms dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q:
five products, 10 BHL^2 D = 2.5x the forward. The softmax's exponentials are not counted.
"""
import torch
import torch.nn.functional as F

from fastformer import ops

# "sdpa_nomask" is an upper bound rather than a replacement: SDPA on the same tensors with no mask, so it
# may take its fastest path (FlashAttention on a GPU, which takes no padding mask); the fused masked
# kernels are judged by how close they come to it, and against "sdpa" (the same mask) for the target.
BASELINES = ("eager", "sdpa", "sdpa_nomask")


def eager(q, k, v, key_padding_mask):
    """matmul, masked_fill, softmax, matmul: the attention fastformer replaces."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf")), dim=-1) @ v


def sdpa(q, k, v, key_padding_mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~key_padding_mask[:, None, None, :])


def sdpa_nomask(q, k, v, key_padding_mask):
    return F.scaled_dot_product_attention(q, k, v)


def test_attention(bench, ctx, attention_shape, impl, pass_):
    s = attention_shape
    B, H, L, D = s.B, s.H, s.L, s.D
    q, k, v = (ctx.randn(B, H, L, D, grad=True) for _ in range(3))
    if impl in BASELINES:
        baseline = {"eager": eager, "sdpa": sdpa, "sdpa_nomask": sdpa_nomask}[impl]
        forward = lambda: baseline(q, k, v, s.key_padding_mask)  # noqa: E731
    else:
        forward = lambda: ops.attention(q, k, v, key_padding_mask=s.key_padding_mask, backend=impl)  # noqa: E731
    e, side = q.element_size(), B * L + 4 * B * H * L  # side: the mask and the logsumexp
    bench.op(forward, [q, k, v], ctx.randn(B, H, L, D), pass_=pass_, op="attention",
             shape=f"B={B} H={H} L={L} D={D}", impl=impl, length=L,
             bytes_moved=(4 * B * H * L * D * e + side, 8 * B * H * L * D * e + side),
             flops=(4 * B * H * L * L * D, 10 * B * H * L * L * D))
