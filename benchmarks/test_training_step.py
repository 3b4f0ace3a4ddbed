"""A whole training step (forward, backward, Adam step) of the Transformer, in target tokens per second,
beside torch.nn.Transformer of the same size.

The batch: ``train_sentences`` random sentence pairs, source and target lengths uniform in
[max/2, max] tokens, right-padded (the default sizes: 128 pairs of up to 32 tokens, at most 4,096 tokens a
side, as ``python -m fastformer.train --max-tokens 4096`` batches). Both models compute the loss as
fastformer.train does (label-smoothed cross-entropy over every target position, pad targets ignored:
``loss_sums`` with fastformer's fused ``ops.cross_entropy``, ``torch_loss_sums`` with PyTorch's
``F.cross_entropy`` for the baseline), take its mean over the target tokens, back-propagate it
and take one Adam step. tokens/s counts the non-pad target tokens, as fastformer.train's log does.

Precisions (``precision``, see harness.py's Context.train_precisions): on CPU float32 and, where the CPU has
bfloat16 dot products, bfloat16 autocast (fastformer.train's --precision auto there); on a GPU autocast
to the benchmark dtype. Both models run in the same precision; speedups compare within one.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from fastformer.nn import Transformer
from fastformer.nn.transformer import sinusoid_table
from fastformer.training.step import loss_sums

BASELINES = ("nn.Transformer",)


class TorchTransformer(nn.Module):
    """torch.nn.Transformer with fastformer's config, embeddings and output: one embedding matrix for
    source, target and output projection, scaled by sqrt(d_model), plus sinusoidal positions and dropout;
    post-norm layers with the config's attention and activation dropout. (nn.Transformer also normalizes
    each stack's output: two LayerNorms more than fastformer's post-norm model.)"""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_id)
        self.transformer = nn.Transformer(config.d_model, config.n_heads, config.n_encoder_layers,
                                          config.n_decoder_layers, config.d_ff, config.dropout, batch_first=True)
        for layer in (*self.transformer.encoder.layers, *self.transformer.decoder.layers):
            for attention in (layer.self_attn, getattr(layer, "multihead_attn", layer.self_attn)):
                attention.dropout = config.attention_dropout
            layer.dropout = nn.Dropout(config.activation_dropout)  # after the feed-forward ReLU
        self.register_buffer("positions", sinusoid_table(config.max_positions, config.d_model).float(),
                             persistent=False)

    def _embed(self, tokens):
        x = self.embed(tokens) * math.sqrt(self.config.d_model) + self.positions[: tokens.shape[1]]
        return F.dropout(x, self.config.dropout, self.training)

    def forward(self, src, tgt_in):
        """fastformer.nn.Transformer's interface: logits (B, T, vocab)."""
        src_padding = src.eq(self.config.pad_id)
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1], device=src.device)
        h = self.transformer(self._embed(src), self._embed(tgt_in), tgt_mask=causal, tgt_is_causal=True,
                             src_key_padding_mask=src_padding, memory_key_padding_mask=src_padding)
        return F.linear(h, self.embed.weight)


def torch_loss_sums(model, src, tgt_in, tgt_out, pad_id, label_smoothing):
    """The baseline's ``loss_sums``: every position, pad targets ignored, PyTorch's F.cross_entropy (float32
    under autocast); the NLL is not computed (None)."""
    logits = model(src, tgt_in)
    loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=pad_id,
                           label_smoothing=label_smoothing, reduction="sum")
    return loss, None


def test_training_step(bench, ctx, impl, precision):
    config, n, length = ctx.model_config(), ctx.sizes.train_sentences, ctx.sizes.train_max_len
    src = ctx.tokens(n, length // 2, length, config.pad_id, config.vocab_size)
    tgt_in = ctx.tokens(n, length // 2, length, config.pad_id, config.vocab_size)
    tgt_out = torch.where(tgt_in.eq(config.pad_id), config.pad_id, torch.randint_like(tgt_in, 4, config.vocab_size))
    model = TorchTransformer(config) if impl in BASELINES else Transformer(config, backend=impl)
    model.to(ctx.device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)

    tokens = int(tgt_out.ne(config.pad_id).sum())

    def step():
        optimizer.zero_grad(set_to_none=True)
        with ctx.autocast(precision):
            if impl in BASELINES:
                loss, _ = torch_loss_sums(model, src, tgt_in, tgt_out, config.pad_id, config.label_smoothing)
            else:
                loss, _ = loss_sums(model, src, tgt_in, tgt_out, config.pad_id, config.label_smoothing, backend=impl)
            (loss / tokens).backward()
        optimizer.step()

    bench(step, op="training_step", shape=f"{ctx.sizes.model}, {n} pairs <= {length} tokens ({tokens} target)",
          pass_=f"fwd+bwd+adam, {str(precision).removeprefix('torch.')}", impl=impl,
          per_second={"tokens/s": tokens})
