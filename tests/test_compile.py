"""torch.compile(fullgraph=True) traces through every op (no graph breaks) and matches eager."""
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


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_compiled_feed_forward_matches_eager(backend, dropout_p):
    """The feed-forward as issue 52 wires it: fc1 as a product without bias (bfloat16, a transposed view), then
    bias + gelu + dropout in one op with the float32 master bias, then fc2. Same torch seed, same mask, compiled or
    not (inductor's fallback_random: the compiled seed draw is eager's)."""
    torch._dynamo.reset()
    R, E, F = 14, 16, 40
    x = randn(R, E, dtype=torch.bfloat16)
    w1, b1 = randn(F, E, dtype=torch.bfloat16, scale=0.3), randn(F, dtype=torch.float32)
    w2 = randn(E, F, dtype=torch.bfloat16, scale=0.3)
    upstream = [randn(R, E, dtype=torch.bfloat16)]

    def fn(x, w1, b1, w2):
        h = ops.bias_activation((w1 @ x.t()).t(), b1, activation="gelu", dropout_p=dropout_p, backend=backend)
        return h @ w2.t()

    inputs = [x, w1, b1, w2]
    torch.manual_seed(3)
    eager_outs, eager_grads = forward_backward(fn, inputs, upstream)
    with torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(3)
        compiled_outs, compiled_grads = forward_backward(torch.compile(fn, fullgraph=True), inputs, upstream)
    for c, e in zip(compiled_outs + compiled_grads, eager_outs + eager_grads):
        torch.testing.assert_close(c, e)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("prenorm", [False, True])
def test_compiled_fused_epilogue_matches_eager(backend, prenorm):
    """A sublayer's output projection without its bias, the bias added inside layer_norm_residual (x_bias,
    float32) and the normalized output written in bfloat16 for the next projection (compute_dtype): the fake
    kernel's y_c and dx_bias must be the real ones."""
    torch._dynamo.reset()
    R, E = 14, 24
    h, residual = randn(R, E, dtype=torch.bfloat16), randn(R, E, dtype=torch.float32)
    w_out, w_next = randn(E, E, dtype=torch.bfloat16), randn(E, E, dtype=torch.bfloat16)
    weight, bias = randn(E, dtype=torch.float32, shift=1.0), randn(E, dtype=torch.float32)
    x_bias = randn(E, dtype=torch.float32)
    upstream = [randn(R, E, dtype=torch.bfloat16), randn(R, E, dtype=torch.float32)]

    def fn(h, residual, w_out, w_next, weight, bias, x_bias):
        out = ops.layer_norm_residual(h @ w_out.t(), residual, weight, bias, prenorm=prenorm, x_bias=x_bias,
                                      compute_dtype=torch.bfloat16, backend=backend)
        y_c, stream = (out[0], out[1]) if prenorm else (out[1], out[0])
        return y_c @ w_next.t(), stream

    inputs = [h, residual, w_out, w_next, weight, bias, x_bias]
    eager_outs, eager_grads = forward_backward(fn, inputs, upstream)
    compiled_outs, compiled_grads = forward_backward(torch.compile(fn, fullgraph=True), inputs, upstream)
    for c, e in zip(compiled_outs + compiled_grads, eager_outs + eager_grads):
        torch.testing.assert_close(c, e)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_compiled_cross_entropy_matches_eager(backend, dtype):
    """The output layer and its loss as a training step makes them: logits = hidden @ W^T (B, T, V), a
    transposed (non-contiguous) view; the label-smoothed loss averaged over the non-pad tokens plus the
    nll for perplexity. The fake kernel's float32 losses of target's shape must be the real ones."""
    torch._dynamo.reset()
    B, T, E, V = 2, 7, 16, 97
    target = torch.randint(0, V, (B, T))
    target[1, T // 2:] = 0  # pad id 0
    hidden = randn(B, T, E, dtype=dtype)
    weight = randn(V, E, dtype=dtype, scale=0.5)
    upstream = [torch.tensor(1.0), torch.tensor(0.5)]

    def fn(hidden, weight):
        logits = (weight @ hidden.transpose(1, 2)).transpose(1, 2)  # (B, T, V), classes strided
        loss, nll = ops.cross_entropy(logits, target, label_smoothing=0.1, ignore_index=0, return_nll=True,
                                      backend=backend)
        count = (target != 0).sum()
        return loss.sum() / count, nll.sum()

    eager_outs, eager_grads = forward_backward(fn, [hidden, weight], upstream)
    compiled_outs, compiled_grads = forward_backward(torch.compile(fn, fullgraph=True), [hidden, weight], upstream)
    assert compiled_outs[0].dtype == torch.float32
    for c, e in zip(compiled_outs + compiled_grads, eager_outs + eager_grads):
        torch.testing.assert_close(c, e)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_compiled_cross_entropy_dynamic_shapes(backend):
    """dynamic=True: one graph for several row counts and vocabularies, each equal to eager."""
    torch._dynamo.reset()

    def fn(logits, target):
        return ops.cross_entropy(logits, target, label_smoothing=0.1, backend=backend)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for R, V in ((5, 33), (9, 40), (3, 1000)):
        logits = randn(R, V, dtype=torch.float32)
        target = torch.randint(0, V, (R,))
        target[0] = -100
        upstream = [randn(R, dtype=torch.float32)]
        eager_outs, eager_grads = forward_backward(lambda x: fn(x, target), [logits], upstream)
        compiled_outs, compiled_grads = forward_backward(lambda x: compiled(x, target), [logits], upstream)
        for c, e in zip(compiled_outs + compiled_grads, eager_outs + eager_grads):
            torch.testing.assert_close(c, e)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_attention_varlen_matches_eager(backend, dynamic):
    """Packed sequences as a padding-free layer makes them: q, k, v strided views of one (T, H + 2 H_kv, D)
    projection (grouped-query: 4 query heads, 2 key/value heads), cu_seqlens tables with an empty sequence,
    causal; the output flattened and projected. Forward and backward equal eager, for two packings (under
    dynamic=True one graph for both)."""
    torch._dynamo.reset()
    H, H_kv, D = 4, 2, 8
    weight = randn(H * D, H * D, dtype=torch.float32, scale=0.3)

    def fn(qkv, weight, cu_q, cu_k, max_q, max_k):
        q, k, v = qkv.split([H, H_kv, H_kv], dim=1)  # (T, heads, D) views, rows strided
        a = ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend=backend)
        return a.reshape(a.shape[0], H * D) @ weight

    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    for lens in ((5, 0, 9, 1), (3, 12)):
        T = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        qkv = randn(T, H + 2 * H_kv, D, dtype=torch.float32)
        upstream = [randn(T, H * D, dtype=torch.float32)]
        args = (cu, cu, max(lens), max(lens))
        eager_outs, eager_grads = forward_backward(lambda x, w: fn(x, w, *args), [qkv, weight], upstream)
        compiled_outs, compiled_grads = forward_backward(lambda x, w: compiled(x, w, *args), [qkv, weight], upstream)
        assert eager_grads[0].abs().sum() > 0
        for c, e in zip(compiled_outs + compiled_grads, eager_outs + eager_grads):
            torch.testing.assert_close(c, e)


def test_reference_dropout_mask_compiles_to_the_same_bits():
    """On CUDA tensors the torch backend draws its dropout mask through torch.compile
    (reference._keep_words_fused: one kernel instead of ~250 int64 passes). The compiled graph must give
    the eager bits: here through inductor's CPU code, on a GPU through its Triton code (tests/gpu)."""
    from fastformer.ops import reference

    fused = reference._keep_words_fused()
    p, scale = torch.tensor(0.3), torch.tensor(4.6566127342e-10)
    for seed in (0, 12345678901234, -5, 2**63 - 1):
        for first, n in ((0, 1), (3, 97), (1000, 12345)):
            counter = torch.arange(first, first + n)
            want = reference._keep_words(seed, counter, p, scale)
            if n > 1:
                assert 0.6 < want.double().mean().item() < 0.8  # about 1 - p kept
            assert torch.equal(fused(torch.tensor(seed), counter, p, scale), want), (seed, first, n)
