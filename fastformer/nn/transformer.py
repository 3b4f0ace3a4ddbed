"""The encoder-decoder Transformer with shared embeddings, sinusoidal positions, cached incremental
decoding and batched beam search."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastformer.nn.attention import reorder_cache
from fastformer.nn.config import TransformerConfig
from fastformer.nn.layers import Decoder, Encoder


def sinusoid_table(n_positions: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); (n, d) float64."""
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table


class Transformer(nn.Module):
    """``model(src, tgt_in)`` -> logits (B, T, vocab) for int64 src (B, S) and tgt_in (B, T).

    One embedding matrix serves the source, the target and the pre-softmax projection (joint
    vocabulary); embeddings are scaled by sqrt(d_model) and summed with sinusoidal positions.
    Padding (config.pad_id) in src is masked from every attention; target padding must be at the end.
    ``backend`` is passed to every fastformer op (None: the dispatcher's default).
    """

    def __init__(self, config: TransformerConfig, backend: Optional[str] = None):
        super().__init__()
        self.config, self.backend = config, backend
        self.embed = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_id)
        nn.init.normal_(self.embed.weight, mean=0.0, std=config.d_model ** -0.5)
        with torch.no_grad():
            self.embed.weight[config.pad_id].zero_()
        self._position_cache: dict = {}  # (device, dtype) -> sinusoid table, computed in float64 then cast
        self.encoder = Encoder(config, backend)
        self.decoder = Decoder(config, backend)

    # ------------------------------------------------------------------------------------------
    def positions(self, length: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The first ``length`` rows of the sinusoid table (at least config.max_positions are kept)."""
        table = self._position_cache.get((device, dtype))
        if table is None or table.shape[0] < length:
            n = max(length, self.config.max_positions, 0 if table is None else 2 * table.shape[0])
            table = sinusoid_table(n, self.config.d_model).to(device=device, dtype=dtype)
            self._position_cache[(device, dtype)] = table
        return table[:length]

    def _embed(self, tokens: Tensor, offset: int = 0) -> Tensor:
        x = self.embed(tokens) * math.sqrt(self.config.d_model)
        x = x + self.positions(offset + tokens.shape[1], x.dtype, x.device)[offset:]
        return F.dropout(x, self.config.dropout, self.training)

    def _check_tokens(self, tokens: Tensor, name: str) -> None:
        if not isinstance(tokens, Tensor) or tokens.dtype != torch.int64 or tokens.dim() != 2:
            raise ValueError(f"{name} must be an int64 tensor (B, L), got "
                             f"{getattr(tokens, 'dtype', type(tokens))} {tuple(getattr(tokens, 'shape', ()))}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(f"{name} holds token ids outside [0, {self.config.vocab_size})")

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) -> memory (B, S, d) and its padding mask (B, S)."""
        self._check_tokens(src, "src")
        src_padding = src.eq(self.config.pad_id)
        return self.encoder(self._embed(src), src_padding), src_padding

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_padding_mask: Tensor,
               cache: Optional[list] = None, offset: int = 0) -> Tensor:
        """Target prefix (B, T) -> logits (B, T, vocab). With a cache, tgt_in holds only the new
        positions starting at ``offset``; earlier keys/values come from the cache."""
        return self.project(self.decoder(self._embed(tgt_in, offset), memory, memory_padding_mask, cache))

    def hidden(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Decoder output states (B, T, d) before the (shared-embedding) output projection."""
        memory, src_padding = self.encode(src)  # checks src
        self._check_tokens(tgt_in, "tgt_in")
        if src.shape[0] != tgt_in.shape[0]:
            raise ValueError(f"src and tgt_in batch sizes differ: {src.shape[0]} vs {tgt_in.shape[0]}")
        return self.decoder(self._embed(tgt_in), memory, src_padding)

    def project(self, h: Tensor) -> Tensor:
        """Logits (..., vocab) of decoder states (..., d): the embedding matrix, transposed."""
        return F.linear(h, self.embed.weight)

    def forward(self, src: Tensor, tgt_in: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """Logits (B, T, vocab); with a bool ``positions`` mask (B, T), only those positions' logits, (n, vocab)
        (training projects only the non-pad targets: the output projection is the largest matmul)."""
        h = self.hidden(src, tgt_in)
        return self.project(h if positions is None else h[positions])

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def beam_search(self, src: Tensor, beam_size: int = 4, length_penalty: float = 0.6, max_len_a: float = 1.0,
                    max_len_b: int = 50, use_cache: bool = True) -> list[list[tuple[list[int], float]]]:
        """Batched beam search. Returns, per sentence, its finished hypotheses as (tokens, score), best
        first; tokens exclude bos and eos, score = sum of log-probabilities / ((5 + len) / 6) ** alpha
        (GNMT's length penalty, len counting the eos). A sentence of n source tokens (padding excluded)
        gets at most floor(a * n + b) target tokens before its eos (fairseq's rule; eos is forced then). A sentence stops when beam_size
        hypotheses have finished. beam_size=1 is greedy decoding. ``use_cache=False`` recomputes the
        whole prefix at each step (for tests and benchmarks)."""
        if beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {beam_size}")
        was_training = self.training
        self.eval()
        try:
            return self._beam_search(src, beam_size, length_penalty, max_len_a, max_len_b, use_cache)
        finally:
            self.train(was_training)

    def _beam_search(self, src, K, alpha, a, b, use_cache):
        cfg = self.config
        B, device, neg_inf = src.shape[0], src.device, float("-inf")
        memory, src_padding = self.encode(src)
        max_len = ((~src_padding).sum(1).double() * a + b).floor().long().clamp(min=0).tolist()
        # Row i * K + k of every per-row tensor is beam k of the i-th still active sentence.
        active = list(range(B))
        rows = torch.arange(B, device=device).repeat_interleave(K)
        memory, src_padding = memory[rows], src_padding[rows]
        cache = self.decoder.new_cache() if use_cache else None
        tokens = torch.full((B * K, 1), cfg.bos_id, dtype=torch.long, device=device)
        scores = torch.zeros(B, K, dtype=torch.float64, device=device)
        scores[:, 1:] = neg_inf  # at step 0 every beam holds the same prefix: expand only the first
        finished: list[list[tuple[list[int], float]]] = [[] for _ in range(B)]
        for step in range(max(max_len) + 1):
            if use_cache:
                logits = self.decode(tokens[:, -1:], memory, src_padding, cache, offset=step)[:, -1]
            else:
                logits = self.decode(tokens, memory, src_padding)[:, -1]
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
            if use_cache:
                for layer_cache in cache:
                    reorder_cache(layer_cache["self"], order)
                    reorder_cache(layer_cache["cross"], order)
        return [sorted(hyps, key=lambda h: -h[1])[:K] for hyps in finished]

    def generate(self, src: Tensor, beam_size: int = 4, length_penalty: float = 0.6, max_len_a: float = 1.0,
                 max_len_b: int = 50, use_cache: bool = True) -> list[list[int]]:
        """Best translation of each source sentence as a list of token ids (no bos/eos)."""
        return [hyps[0][0] for hyps in self.beam_search(src, beam_size, length_penalty, max_len_a, max_len_b,
                                                        use_cache)]
