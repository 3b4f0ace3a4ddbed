"""The encoder-decoder Transformer with shared embeddings, sinusoidal positions, cached incremental
decoding and batched beam search."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastformer.data.batching import PackedBatch, Sequences
from fastformer.nn import decoding
from fastformer.nn.config import TransformerConfig
from fastformer.nn.layers import Decoder, Encoder
from fastformer.nn.linear import Embedding


def sinusoid_table(n_positions: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); (n, d) float64."""
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table


def position_table(n_positions: int, config: TransformerConfig) -> Tensor:
    """Rows of positions 0 .. n - 1 of ``config.positions``' table, each read at p + ``config.position_offset``
    (the layouts: fastformer/nn/config.py POSITION_TABLES); (n, d) float64."""
    d, offset = config.d_model, config.position_offset
    if config.positions == "paper":
        return sinusoid_table(n_positions + offset, d)[offset:]
    position = torch.arange(offset, offset + n_positions, dtype=torch.float64)[:, None]
    half = d // 2
    if config.positions == "marian":  # transformers' MarianSinusoidalPositionalEmbedding: angle p / 10000^(2(j//2)/d)
        inv_freq = torch.pow(10000.0, -torch.arange(0, d, 2, dtype=torch.float64) / d)  # 10000^(-2i/d)
        return torch.cat([torch.sin(position * inv_freq), torch.cos(position * inv_freq[: d // 2])], dim=1)
    # "fairseq" (transformers' M2M100SinusoidalPositionalEmbedding); an odd d's last column is zero
    inv_freq = torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000.0) / max(half - 1, 1)))
    table = torch.cat([torch.sin(position * inv_freq), torch.cos(position * inv_freq)], dim=1)
    return torch.cat([table, table.new_zeros(n_positions, d - 2 * half)], dim=1)


class Transformer(nn.Module):
    """``model(src, tgt_in)`` -> logits (B, T, vocab) for int64 src (B, S) and tgt_in (B, T).

    One embedding matrix serves the source, the target and the pre-softmax projection (joint
    vocabulary); embeddings are scaled by sqrt(d_model) and summed with sinusoidal positions. A model with
    config.src_vocab_size (converted Marian models with separate vocabularies) embeds the source with its own
    matrix, ``src_embed``; the target's stays tied to the projection.
    A quantized model (``fastformer.quantize``) is this class with int8 modules in place of the float ones
    (fastformer/nn/quantize.py): its tables are ``Int8Embedding``s, its projections ``Int8Linear``s.
    Padding (config.pad_id) in src is masked from every attention; target padding must be at the end.
    ``backend`` is passed to every fastformer op (None: the dispatcher's default).
    Token ids are checked against the vocabularies on every call (a host synchronization on a GPU);
    ``check_token_values = False`` leaves that to the caller, as the trainer does: it checks each batch on
    the host before the batch moves (``check_tokens``), so that its step never waits for the device.
    """

    def __init__(self, config: TransformerConfig, backend: Optional[str] = None):
        super().__init__()
        self.config, self.backend = config, backend
        self.check_token_values = True
        # The target's table, also the output projection (``project``): an Embedding, in a quantized model an
        # Int8Embedding; the source's own table where config.src_vocab_size, else None.
        self.embed: nn.Module = Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_id)
        nn.init.normal_(self.embed.weight, mean=0.0, std=config.d_model ** -0.5)
        self.src_embed: Optional[nn.Module] = None
        if config.src_vocab_size is not None:
            self.src_embed = Embedding(config.src_vocab_size, config.d_model, padding_idx=config.pad_id)
            nn.init.normal_(self.src_embed.weight, mean=0.0, std=config.d_model ** -0.5)
        with torch.no_grad():
            for table in (self.embed, self.src_embed):
                if table is not None:
                    table.weight[config.pad_id].zero_()
        self._position_cache: dict = {}  # (device, dtype) -> position table, computed in float64 then cast
        # Marian's final_logits_bias (config.output_bias), float32 in a quantized model too.
        self.output_bias = nn.Parameter(torch.zeros(config.vocab_size)) if config.output_bias else None
        self.encoder = Encoder(config, backend)
        self.decoder = Decoder(config, backend)

    # The int8 checkpoints of 9aea6a7's code held the target table's int8 form as an Int8Linear,
    # output_projection, whose bias was the output bias: their names today.
    _RENAMED = {"output_projection.weight": "embed.weight", "output_projection.weight_scale": "embed.weight_scale",
                "output_projection.weight_colsum": "embed.weight_colsum", "output_projection.bias": "output_bias"}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for old, new in self._RENAMED.items():
            if prefix + old in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------------------------------
    def positions(self, length: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The position encodings of positions 0 .. length - 1 (config.positions' table; at least
        config.max_positions rows are kept)."""
        table = self._position_cache.get((device, dtype))
        if table is None or table.shape[0] < length:
            n = max(length, self.config.max_positions, 0 if table is None else 2 * table.shape[0])
            table = position_table(n, self.config).to(device=device, dtype=dtype)
            self._position_cache[(device, dtype)] = table
        return table[:length]

    def _embed(self, tokens: Tensor, offset: int = 0, source: bool = False, seqs: Optional[Sequences] = None) -> Tensor:
        """The scaled embeddings of tokens (B, L) plus the positions offset .. offset + L - 1; the source's
        table where it has its own (source=True and config.src_vocab_size). Packed tokens (T,) with ``seqs``:
        each token's position in its sentence (seqs.positions)."""
        rows = (self.src_embed if source and self.src_embed is not None else self.embed)(tokens)
        x = rows * math.sqrt(self.config.d_model) if self.config.scale_embedding else rows
        if seqs is not None:
            x = x + self.positions(seqs.max_len, x.dtype, x.device)[seqs.positions]
        else:
            x = x + self.positions(offset + tokens.shape[1], x.dtype, x.device)[offset:]
        return F.dropout(x, self.config.dropout, self.training)

    def _check_tokens(self, tokens: Tensor, name: str, vocab_size: int, values: bool = True) -> None:
        if not isinstance(tokens, Tensor) or tokens.dtype != torch.int64 or tokens.dim() != 2:
            raise ValueError(f"{name} must be an int64 tensor (B, L), got "
                             f"{getattr(tokens, 'dtype', type(tokens))} {tuple(getattr(tokens, 'shape', ()))}")
        if values and tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
            raise ValueError(f"{name} holds token ids outside [0, {vocab_size})")

    def check_tokens(self, src: Tensor, tgt: Tensor) -> None:
        """ValueError unless src (B, S) and tgt (B, T) are int64 token ids of the source and target
        vocabularies (a batch checked where it lies, e.g. on the host before it moves to a GPU)."""
        self._check_tokens(src, "src", self.config.source_vocab_size)
        self._check_tokens(tgt, "tgt_in", self.config.vocab_size)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) -> memory (B, S, d) and its padding mask (B, S)."""
        self._check_tokens(src, "src", self.config.source_vocab_size, self.check_token_values)
        src_padding = src.eq(self.config.pad_id)
        return self.encoder(self._embed(src, source=True), src_padding), src_padding

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_padding_mask: Tensor) -> Tensor:
        """Target prefix (B, T) -> logits (B, T, vocab), every position recomputed (the incremental decoder
        of fastformer/nn/decoding.py decodes one position a step)."""
        return self.project(self.decoder(self._embed(tgt_in), memory, memory_padding_mask))

    def hidden(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Decoder output states (B, T, d) before the (shared-embedding) output projection."""
        memory, src_padding = self.encode(src)  # checks src
        self._check_tokens(tgt_in, "tgt_in", self.config.vocab_size, self.check_token_values)
        if src.shape[0] != tgt_in.shape[0]:
            raise ValueError(f"src and tgt_in batch sizes differ: {src.shape[0]} vs {tgt_in.shape[0]}")
        return self.decoder(self._embed(tgt_in), memory, src_padding)

    @property
    def quantization(self) -> Optional[str]:
        """"int8" for a model of ``fastformer.quantize`` (or ``fastformer.nn.quantize.prepare``), else None: its
        embedding's."""
        return self.embed.quantization

    def project(self, h: Tensor) -> Tensor:
        """Logits (..., vocab) of decoder states (..., d): the embedding matrix, transposed (int8 in a quantized
        model), plus the output bias (config.output_bias)."""
        return self.embed.project(h, self.output_bias)

    def hidden_packed(self, batch: PackedBatch) -> Tensor:
        """Decoder output states (Tt, d) of a padding-free batch (fastformer.data.collate_packed): the encoder,
        the decoder's causal self-attention and the cross-attention (target sentence i reads source sentence i)
        on the packed tokens through ops.attention_varlen; no (B, L) tensor, no padding computed."""
        for tokens, name, vocab in ((batch.src, "src", self.config.source_vocab_size),
                                    (batch.tgt_in, "tgt_in", self.config.vocab_size)):
            if not isinstance(tokens, Tensor) or tokens.dim() != 1:
                raise ValueError(f"a packed batch's {name} must be 1-D (T,), got {tuple(getattr(tokens, 'shape', ()))}")
            self._check_tokens(tokens[None], name, vocab, self.check_token_values)
        if batch.src_seqs.cu_seqlens.shape != batch.tgt_seqs.cu_seqlens.shape:
            raise ValueError(f"a packed batch holds {batch.src_seqs.cu_seqlens.shape[0] - 1} source and "
                             f"{batch.tgt_seqs.cu_seqlens.shape[0] - 1} target sentences")
        memory = self.encoder(self._embed(batch.src, source=True, seqs=batch.src_seqs), None, batch.src_seqs)
        return self.decoder(self._embed(batch.tgt_in, seqs=batch.tgt_seqs), memory, None, batch.tgt_seqs,
                            batch.src_seqs)

    def forward(self, src: Optional[Tensor] = None, tgt_in: Optional[Tensor] = None,
                positions: Optional[Tensor] = None, *, packed: Optional[PackedBatch] = None) -> Tensor:
        """Logits (B, T, vocab); with a bool ``positions`` mask (B, T), only those positions' logits, (n, vocab)
        (training projects only the non-pad targets: the output projection is the largest matmul). A
        padding-free batch instead (``packed``, fastformer.data.collate_packed): logits (Tt, vocab) of its
        packed targets (hidden_packed)."""
        if packed is not None:
            return self.project(self.hidden_packed(packed))
        h = self.hidden(src, tgt_in)
        return self.project(h if positions is None else h[positions])

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def beam_search(self, src: Tensor, beam_size: int = decoding.BEAM_SIZE,
                    length_penalty: float = decoding.LENGTH_PENALTY, max_len_a: float = decoding.MAX_LEN_A,
                    max_len_b: int = decoding.MAX_LEN_B, use_cache: bool = True,
                    forced_tokens: Optional[list[int]] = None) -> list[list[tuple[list[int], float]]]:
        """Batched beam search. Returns, per sentence, its finished hypotheses as (tokens, score), best
        first; tokens exclude bos and eos, score = sum of log-probabilities / ((5 + len) / 6) ** alpha
        (GNMT's length penalty, len counting the eos). A sentence of n source tokens (padding excluded)
        gets at most ``decoding.length_limit(n, a, b)`` = floor(a n + b) target tokens before its eos (eos is
        forced then); the defaults are ``decoding``'s, shared with the CLIs. A sentence stops when beam_size
        hypotheses have finished. beam_size=1 is greedy decoding. ``use_cache=False`` recomputes the
        whole prefix at each step (for tests and benchmarks). The decoder starts from config.start_id;
        ``forced_tokens`` (a converted NLLB or M2M-100 model's target-language token) are the first tokens
        of every hypothesis, with log-probability 0, on top of the length limit. A sentence whose logits are
        all NaN before any hypothesis finished (NaN weights) gets one empty hypothesis, ([], -inf); the other
        sentences are decoded as without it."""
        if beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {beam_size}")
        was_training = self.training
        self.eval()
        try:
            return decoding.beam_search(self, src, beam_size, length_penalty, max_len_a, max_len_b, use_cache,
                                        forced=forced_tokens)
        finally:
            self.train(was_training)

    def generate(self, src: Tensor, beam_size: int = decoding.BEAM_SIZE, length_penalty: float = decoding.LENGTH_PENALTY,
                 max_len_a: float = decoding.MAX_LEN_A, max_len_b: int = decoding.MAX_LEN_B,
                 use_cache: bool = True, forced_tokens: Optional[list[int]] = None) -> list[list[int]]:
        """Best translation of each source sentence as a list of token ids (no bos/eos)."""
        return [hyps[0][0] for hyps in self.beam_search(src, beam_size, length_penalty, max_len_a, max_len_b,
                                                        use_cache, forced_tokens)]
