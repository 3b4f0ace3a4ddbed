"""An independent plain-PyTorch forward of fastformer's Transformer, for the model tests.

Written from the paper and the parameter layout only: torch.nn.functional and tensor ops (F.embedding,
F.linear, F.layer_norm, softmax, matmul, masked_fill), never fastformer.ops or fastformer.nn modules.
``reference_logits`` recomputes ``model(src, tgt_in)`` in eval mode (no dropout) from
``dict(model.named_parameters())``; it is differentiable, so the tests compare parameter gradients too.

Parameter names (``model.named_parameters()``):
  embed.weight                                       (V, d)   shared: source, target and output projection
  encoder.layers.{i}.self_attn.qkv_proj.{weight,bias} (3d, d) q, k, v = the three d-wide chunks of the output
  decoder.layers.{i}.self_attn.qkv_proj.*            (3d, d)
  decoder.layers.{i}.cross_attn.q_proj.*             (d, d)
  decoder.layers.{i}.cross_attn.kv_proj.*            (2d, d)  k, v = the two d-wide chunks
  *.out_proj.*                                       (d, d)
  *.ffn.fc1.* (d_ff, d), *.ffn.fc2.* (d, d_ff)       Linear -> ReLU -> Linear
  *.{self_attn,cross_attn,ffn}_norm.{weight,bias}    (d,)     the LayerNorm of each sublayer
  {encoder,decoder}.final_norm.{weight,bias}         (d,)     only with norm_first
"""
import math

import torch
import torch.nn.functional as F


def sinusoids(length, d_model, dtype=torch.float64):
    """(length, d) with PE(pos, 2i) = sin(pos / 10000^(2i/d)) and PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)[None, :]
    angle = pos / torch.pow(torch.tensor(10000.0, dtype=torch.float64), two_i / d_model)
    table = torch.empty(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.to(dtype)


def embed(params, config, tokens):
    """Shared embedding * sqrt(d) + sinusoids (computed in float64, cast to the model's dtype)."""
    weight = params["embed.weight"]
    x = F.embedding(tokens, weight) * math.sqrt(config.d_model)
    return x + sinusoids(tokens.shape[1], config.d_model, torch.float64).to(x.dtype)


def split_heads(x, n_heads):
    """(B, L, d) -> (B, H, L, d / H)."""
    B, L, d = x.shape
    return x.view(B, L, n_heads, d // n_heads).transpose(1, 2)


def attend(q, k, v, key_padding_mask=None, causal=False):
    """softmax(q k^T / sqrt(Dh)) v over visible keys; q (B, H, Lq, Dh), k, v (B, H, Lk, Dh).

    Key j is visible to query i unless padded, and (causal) iff j <= i + Lk - Lq. A query with no visible
    key gets zeros.
    """
    Lq, Lk = q.shape[2], k.shape[2]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    hidden = torch.zeros(q.shape[0], 1, Lq, Lk, dtype=torch.bool)
    if key_padding_mask is not None:
        hidden = hidden | key_padding_mask[:, None, None, :]
    if causal:
        i = torch.arange(Lq)[:, None]
        j = torch.arange(Lk)[None, :]
        hidden = hidden | (j > i + (Lk - Lq))
    empty = hidden.all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")).masked_fill(empty, 0.0), dim=-1)
    return torch.matmul(probs.masked_fill(hidden, 0.0), v)


def merge_heads(x):
    """(B, H, L, Dh) -> (B, L, H * Dh)."""
    B, H, L, Dh = x.shape
    return x.transpose(1, 2).reshape(B, L, H * Dh)


def linear(params, prefix, x):
    return F.linear(x, params[prefix + ".weight"], params[prefix + ".bias"])


def self_attention(params, prefix, config, x, key_padding_mask=None, causal=False):
    d = config.d_model
    qkv = linear(params, prefix + ".qkv_proj", x)
    q, k, v = (split_heads(qkv[..., i * d:(i + 1) * d], config.n_heads) for i in range(3))
    return linear(params, prefix + ".out_proj", merge_heads(attend(q, k, v, key_padding_mask, causal)))


def cross_attention(params, prefix, config, x, memory, memory_padding_mask):
    d = config.d_model
    q = split_heads(linear(params, prefix + ".q_proj", x), config.n_heads)
    kv = linear(params, prefix + ".kv_proj", memory)
    k, v = (split_heads(kv[..., i * d:(i + 1) * d], config.n_heads) for i in range(2))
    return linear(params, prefix + ".out_proj", merge_heads(attend(q, k, v, memory_padding_mask)))


def feed_forward(params, prefix, x):
    return linear(params, prefix + ".fc2", F.relu(linear(params, prefix + ".fc1", x)))


def layer_norm(params, prefix, config, x):
    return F.layer_norm(x, (config.d_model,), params[prefix + ".weight"], params[prefix + ".bias"],
                        config.layer_norm_eps)


def residual_block(params, norm, config, x, sublayer):
    """Post-norm: LN(x + f(x)); pre-norm: x + f(LN(x))."""
    if config.norm_first:
        return x + sublayer(layer_norm(params, norm, config, x))
    return layer_norm(params, norm, config, x + sublayer(x))


def encoder(params, config, x, src_padding):
    for i in range(config.n_encoder_layers):
        p = f"encoder.layers.{i}"
        x = residual_block(params, p + ".self_attn_norm", config, x,
                           lambda h: self_attention(params, p + ".self_attn", config, h, src_padding))
        x = residual_block(params, p + ".ffn_norm", config, x, lambda h: feed_forward(params, p + ".ffn", h))
    return layer_norm(params, "encoder.final_norm", config, x) if config.norm_first else x


def decoder(params, config, y, memory, src_padding):
    for i in range(config.n_decoder_layers):
        p = f"decoder.layers.{i}"
        y = residual_block(params, p + ".self_attn_norm", config, y,
                           lambda h: self_attention(params, p + ".self_attn", config, h, causal=True))
        y = residual_block(params, p + ".cross_attn_norm", config, y,
                           lambda h: cross_attention(params, p + ".cross_attn", config, h, memory, src_padding))
        y = residual_block(params, p + ".ffn_norm", config, y, lambda h: feed_forward(params, p + ".ffn", h))
    return layer_norm(params, "decoder.final_norm", config, y) if config.norm_first else y


def reference_logits(params, config, src, tgt_in):
    """Logits (B, T, V) of the Transformer with parameters ``params`` (name -> tensor) in eval mode."""
    src_padding = src.eq(config.pad_id)
    memory = encoder(params, config, embed(params, config, src), src_padding)
    hidden = decoder(params, config, embed(params, config, tgt_in), memory, src_padding)
    return F.linear(hidden, params["embed.weight"])


def varied_model(config, backend=None, seed=0, dtype=torch.float64):
    """A randomly initialised Transformer (eval mode) whose translations are not degenerate.

    With tied embeddings a freshly initialised model mostly copies its input: the embedding of the previous
    token dominates the decoder's residual stream, so every sentence gets its first token repeated. Scaling
    the decoder's sublayer outputs (out_proj and fc2 weights) by 3 lets attention to the source move the
    prediction, so translations vary with the source; tripling the eos row of the embedding makes some
    sentences end before the length limit. ``seed`` fixes the weights (the tests check that the seeds they
    use give varied outputs).
    """
    from fastformer.nn import Transformer  # the model under test; the reference above does not use it

    torch.manual_seed(seed)
    model = Transformer(config, backend=backend).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("decoder.") and name.endswith(("out_proj.weight", "fc2.weight")):
                p.mul_(3.0)
        model.embed.weight[config.eos_id] *= 3.0
    return model


@torch.no_grad()
def legacy_beam_search(model, src, K, alpha, a, b):
    """fastformer's beam search as it was before fastformer/nn/decoding.py (commit 0bf9cbd), kept as an
    oracle: float64 log-softmax over every beam's whole vocabulary, the memory copied per beam, and the
    whole prefix recomputed at each step (``Transformer.decode``; the package has no second incremental
    path to lean on). The new search must return the same hypotheses."""
    model.eval()
    cfg = model.config
    B, device, neg_inf = src.shape[0], src.device, float("-inf")
    memory, src_padding = model.encode(src)
    max_len = ((~src_padding).sum(1).double() * a + b).floor().long().clamp(min=0).tolist()
    # Row i * K + k of every per-row tensor is beam k of the i-th still active sentence.
    active = list(range(B))
    rows = torch.arange(B, device=device).repeat_interleave(K)
    memory, src_padding = memory[rows], src_padding[rows]
    tokens = torch.full((B * K, 1), cfg.bos_id, dtype=torch.long, device=device)
    scores = torch.zeros(B, K, dtype=torch.float64, device=device)
    scores[:, 1:] = neg_inf  # at step 0 every beam holds the same prefix: expand only the first
    finished: list[list[tuple[list[int], float]]] = [[] for _ in range(B)]
    for step in range(max(max_len) + 1):
        logits = model.decode(tokens, memory, src_padding)[:, -1]
        lprobs = F.log_softmax(logits.double(), dim=-1)  # (n K, V)
        lprobs[:, cfg.pad_id] = neg_inf
        lprobs[:, cfg.bos_id] = neg_inf
        at_limit = torch.tensor([step >= max_len[s] for s in active], device=device).repeat_interleave(K)
        if bool(at_limit.any()):  # the last allowed position of a sentence: only eos
            eos = lprobs[:, cfg.eos_id].clone()
            lprobs[at_limit] = neg_inf
            lprobs[:, cfg.eos_id] = eos
        n, V = len(active), lprobs.shape[1]
        candidates = (scores.view(n * K, 1) + lprobs).view(n, K * V)
        top_scores, top_index = candidates.topk(min(2 * K, K * V), dim=1)
        top_scores, top_index = top_scores.tolist(), top_index.tolist()
        penalty = ((5.0 + step + 1) / 6.0) ** alpha
        still, next_rows, next_tokens, next_scores = [], [], [], []
        for i, s in enumerate(active):
            beams = []
            for rank, (score, index) in enumerate(zip(top_scores[i], top_index[i])):
                if len(beams) == K or score == neg_inf:
                    break
                beam, token = divmod(index, V)
                row = i * K + beam
                if token == cfg.eos_id:
                    if rank < K:  # an eos among the best K candidates ends a hypothesis
                        finished[s].append((tokens[row, 1:].tolist(), score / penalty))
                    continue
                beams.append((row, token, score))
            if len(finished[s]) >= K or step >= max_len[s] or not beams:
                continue  # the sentence is done: its rows leave the batch
            beams += [(beams[0][0], cfg.eos_id, neg_inf)] * (K - len(beams))  # idle beams
            still.append(s)
            for row, token, score in beams:
                next_rows.append(row)
                next_tokens.append(token)
                next_scores.append(score)
        active = still
        if not active:
            break
        order = torch.tensor(next_rows, dtype=torch.long, device=device)
        tokens = torch.cat([tokens[order], torch.tensor(next_tokens, device=device)[:, None]], dim=1)
        scores = torch.tensor(next_scores, dtype=torch.float64, device=device).view(len(active), K)
        memory, src_padding = memory[order], src_padding[order]
    return [sorted(hyps, key=lambda h: -h[1])[:K] for hyps in finished]
