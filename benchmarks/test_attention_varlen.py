"""ops.attention_varlen on packed sentences beside attention on the padded batch of the same sentences.

Sentences of lengths drawn uniformly from 8 to 256 (8 to 64 at smoke size), as many as fill the size
profile's token count; 8 heads of 64 (the profile's d_model / n_heads), self-attention, without and with the
causal mask; forward + backward (training). The packed call computes each sentence's own L_b x L_b scores;
the padded ones compute B L_max^2 and mask the padding away:
  varlen     ops.attention_varlen(q, k, v, cu_seqlens, ...) on (T, H, D), backend = the row's impl;
  padded     ops.attention on (B, H, L_max, D) with the key padding mask, the backend the automatic choice;
  sdpa       F.scaled_dot_product_attention on the padded batch with the same mask (issue 53's target:
             varlen >= 1.5x its time on the CPU).
FLOPs counted are the packed call's useful ones: 4 sum(L_b^2) H D forward, 10 sum(L_b^2) H D backward (causal:
half), so the padded rows' TFLOP/s shows how much of their work is padding. tokens/s counts real tokens.
On the CPU the fastformer call and the baselines are timed in alternation, round by round (Bench.turns_with).
"""
import pytest
import torch
import torch.nn.functional as F

from fastformer import ops

BASELINES = ("padded", "sdpa")


def lengths(ctx) -> list[int]:
    longest = 64 if ctx.sizes.name == "smoke" else 256
    out, g = [], torch.Generator().manual_seed(0)
    while sum(out) < ctx.sizes.tokens:
        out.append(int(torch.randint(8, longest + 1, (), generator=g)))
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_varlen(bench, ctx, impl, causal):
    if impl in BASELINES and not ctx.cuda:
        pytest.skip("on the CPU the baselines are timed in alternation with each fastformer backend's row")
    lens = lengths(ctx)
    B, L, T, H, D = len(lens), max(lens), sum(lens), ctx.sizes.n_heads, ctx.sizes.head_dim
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=ctx.device)
    q, k, v = (ctx.randn(T, H, D, grad=True) for _ in range(3))
    dout = ctx.randn(T, H, D)
    pad = torch.arange(L, device=ctx.device)[None, :] >= torch.tensor(lens, device=ctx.device)[:, None]  # (B, L)
    # the padded batch: (B, H, L, D) views of (B, L, H, D) tensors, as a model's projections hand them over
    qp, kp, vp = (ctx.randn(B, L, H, D, grad=True).transpose(1, 2) for _ in range(3))
    dout_p = ctx.randn(B, L, H, D).transpose(1, 2)
    keep = (~pad)[:, None, None, :]
    causal_mask = torch.ones(L, L, dtype=torch.bool, device=ctx.device).tril() if causal else None

    def varlen():
        out = ops.attention_varlen(q, k, v, cu, cu, L, L, causal=causal, backend=impl)
        return torch.autograd.grad(out, (q, k, v), dout)

    def padded():
        out = ops.attention(qp, kp, vp, key_padding_mask=pad, causal=causal)
        return torch.autograd.grad(out, (qp, kp, vp), dout_p)

    def sdpa():
        mask = keep & causal_mask if causal else keep
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)
        return torch.autograd.grad(out, (qp, kp, vp), dout_p)

    useful = sum(n * n for n in lens) * H * D * (0.5 if causal else 1.0)
    fn = {"padded": padded, "sdpa": sdpa}.get(impl, varlen)
    turns = {"padded": padded, "sdpa": sdpa} if fn is varlen and not ctx.cuda else None
    bench(fn, op="attention_varlen", shape=f"{B} sentences of 8-{L}, {T} tokens, H={H} D={D}"
          + (" causal" if causal else ""), pass_="fwd+bwd", impl=impl, flops=14 * useful,
          per_second={"tokens/s": T}, turns_with=turns, min_rounds=3)
