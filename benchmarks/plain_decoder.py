"""A plain-PyTorch incremental decoder over a fastformer Transformer's weights: the yardstick of the
decoding benchmark (benchmarks/test_decoding.py), what a careful PyTorch user would write.

nn.Linear's weight layout through F.linear, F.scaled_dot_product_attention, F.layer_norm; self-attention
keys/values in one preallocated (N, H, steps, Dh) cache per layer written in place (the beam reorder is an
index of the live prefix copied back into the cache); cross-attention keys/values computed once per
sentence, the K beams of a sentence as the K queries of one SDPA call. It plugs into fastformer's own
search (``fastformer.nn.decoding.beam_search(..., stepper=PlainDecoder)``), so both decoders are scored
by the same rules and must give the same tokens.
"""
import math

import torch
import torch.nn.functional as F


class PlainDecoder:
    def __init__(self, model, memory, src_padding, beam_size, steps):
        cfg = model.config
        self.cfg, self.K, self.H, self.Dh, self.d = cfg, beam_size, cfg.n_heads, cfg.head_dim, cfg.d_model
        self.p = {name: t.detach() for name, t in model.state_dict().items()}
        B, S, d = memory.shape
        self.cross = []
        for i in range(cfg.n_decoder_layers):
            kv = F.linear(memory, self.p[f"decoder.layers.{i}.cross_attn.kv_proj.weight"],
                          self.p[f"decoder.layers.{i}.cross_attn.kv_proj.bias"])
            k, v = kv.view(B, S, 2, self.H, self.Dh).permute(2, 0, 3, 1, 4)
            self.cross.append((k, v))
        self.mask = (~src_padding)[:, None, None, :]  # (B, 1, 1, S) True = attend
        self.cache = [memory.new_empty(2, B * beam_size, self.H, steps, self.Dh) for _ in range(cfg.n_decoder_layers)]
        self.positions = model.positions(steps, memory.dtype, memory.device)
        self.t, self.parents = 0, None

    def select(self, parents, sentences):
        self.parents = parents
        if sentences is not None:
            self.cross = [(k[sentences], v[sentences]) for k, v in self.cross]
            self.mask = self.mask[sentences]

    def _linear(self, x, name):
        return F.linear(x, self.p[name + ".weight"], self.p[name + ".bias"])

    def _norm(self, x, name):
        return F.layer_norm(x, (self.d,), self.p[name + ".weight"], self.p[name + ".bias"], self.cfg.layer_norm_eps)

    def logits(self, tokens):
        N, t, H, Dh, d = tokens.shape[0], self.t, self.H, self.Dh, self.d
        n = N // self.K
        x = F.embedding(tokens[:, -1], self.p["embed.weight"]) * math.sqrt(d) + self.positions[t]
        for i, cache in enumerate(self.cache):
            p = f"decoder.layers.{i}"
            if t:  # beam reorder of the live prefix, in place
                cache[:, :N, :, :t] = cache[:, self.parents, :, :t]
            qkv = self._linear(self._pre(x, p + ".self_attn_norm"), p + ".self_attn.qkv_proj")
            q, k, v = qkv.view(N, 3, H, Dh).unbind(1)
            cache[0, :N, :, t], cache[1, :N, :, t] = k, v
            a = F.scaled_dot_product_attention(q[:, :, None], cache[0, :N, :, :t + 1], cache[1, :N, :, :t + 1])
            x = self._sublayer(x, self._linear(a.reshape(N, d), p + ".self_attn.out_proj"), p + ".self_attn_norm")
            q = self._linear(self._pre(x, p + ".cross_attn_norm"), p + ".cross_attn.q_proj")
            k, v = self.cross[i]
            a = F.scaled_dot_product_attention(q.view(n, self.K, H, Dh).transpose(1, 2), k, v, attn_mask=self.mask)
            x = self._sublayer(x, self._linear(a.transpose(1, 2).reshape(N, d), p + ".cross_attn.out_proj"),
                               p + ".cross_attn_norm")
            h = self._linear(F.relu(self._linear(self._pre(x, p + ".ffn_norm"), p + ".ffn.fc1")), p + ".ffn.fc2")
            x = self._sublayer(x, h, p + ".ffn_norm")
        if self.cfg.norm_first:
            x = self._norm(x, "decoder.final_norm")
        self.t += 1
        return F.linear(x, self.p["embed.weight"])

    def _pre(self, x, norm):
        return self._norm(x, norm) if self.cfg.norm_first else x

    def _sublayer(self, x, branch, norm):
        return x + branch if self.cfg.norm_first else self._norm(x + branch, norm)
