"""Beam search and the incremental decoder it runs on (``Transformer.beam_search`` and ``generate``).

One search loop (``beam_search``) serves greedy (beam 1) and beam decoding; it asks a *stepper* for the
next-token logits of every live row and tells it which rows survive. Two steppers:

- ``IncrementalDecoder`` (``use_cache=True``, the default), built for decoding the way CTranslate2's
  decoder is:
  * projection weights prepared once per set of weights (``PreparedWeights``, cached on the model until
    a parameter changes): on the CPU in float32, packed into the column panels that fastformer's own
    GEMM kernel streams (``fastformer._C.packed_linear``; fastformer/nn/linear.py keeps them, shared with
    the model's own ``Linear`` layers);
  * cross-attention K/V computed once per sentence and shared by its beams: the K beams of a sentence
    are the K query rows of one attention call against that sentence's keys, never copied per beam and
    never reordered (only narrowed when sentences finish);
  * (the Python step) self-attention K/V in two preallocated buffers per layer that take turns: step t writes the cache
    of the rows that survived (gathered by their parents, one pass) plus this step's key into the other
    buffer, whose first N H (t + 1) Dh elements are then a contiguous (N, H, t + 1, Dh) tensor: the
    beam reorder is one gather of the self-attention caches per step, with no allocation and no cat;
  * in float32 on the CPU through the cpu backend, the whole step is one C++ call
    (``fastformer._C.CpuDecoder``, csrc/decoder.cpp, with the kernel csrc/cpu/decoder_step.cpp), which
    keeps each layer's cache in one (N0, H, T, Dh) buffer whose entries never move (a table of slots says
    which cache row holds each earlier position of a live row, so a beam reorder copies no key); elsewhere
    (other dtypes, autocast, CUDA, the torch or triton backends) about 12 PyTorch calls per layer a step,
    through the same fused ops as training.
- ``FullRecompute`` (``use_cache=False``) recomputes the whole prefix with ``Transformer.decode`` at
  every step: the slow, obviously right path that tests and benchmarks compare against.

The search (``fastformer._C.BeamSearch``, csrc/beam_search.cpp: its bookkeeping on the host, one call a
step) works on the live rows only (rows of finished sentences leave the batch) and in the model's dtype:
per row, the top 2K logits are taken first (log-softmax is monotonic in each row), then only those become
log-probabilities, lp = logit - logsumexp(row), with the logsumexp's sum of exponentials and the
hypothesis scores accumulated in float64: the same scores as a float64 log-softmax over the whole
vocabulary, without converting (N, V) logits to float64. That pass over the vocabulary is one C++ kernel
for float32 CPU logits (csrc/cpu/search_candidates.cpp) and ``search_candidates``'s torch ops elsewhere.

Rules (pinned by tests/nn/test_model_decoding.py): a sentence of n source tokens may produce at most
floor(a n + b) tokens before its eos, which is forced at the position after them; pad and bos are never
produced; score = sum of log-probabilities (eos included) / ((5 + len) / 6) ** alpha with len counting
the eos (GNMT's length penalty); an eos among the best K of the 2K candidates of a sentence ends a
hypothesis; a sentence stops when K hypotheses have finished or at its length limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastformer import _dispatch, ops
from fastformer._ext import C
from fastformer.nn.layers import run_sublayers
from fastformer.nn.linear import packed_panels

Hypotheses = list[tuple[list[int], float]]


# ----------------------------------------------------------------------------------------------------
# Weights in the layout the decoder step wants


@dataclass
class Projection:
    """y = x W^T + b. On the CPU in float32 through ``fastformer._C.packed_linear`` on W packed once into
    column panels (fastformer/nn/linear.py, which keeps them; against torch's BLAS GEMM see README
    "Decoding"). Other dtypes and devices take ``F.linear`` on the module's own weight (no copy)."""
    weight: Tensor  # (out, in), the nn.Linear's
    bias: Optional[Tensor]  # (out,)
    panels: Optional[Tensor]  # packed_panels(weight), or None where the packed kernel does not apply

    @classmethod
    def of(cls, linear: nn.Linear) -> "Projection":
        return cls.of_weight(linear.weight, linear.bias)

    @classmethod
    def of_weight(cls, weight: Tensor, bias: Optional[Tensor]) -> "Projection":
        """``weight`` the parameter itself: its panels are the ones its ``Linear`` uses (one copy)."""
        return cls(weight.detach(), None if bias is None else bias.detach(), packed_panels(weight))

    def __call__(self, x: Tensor) -> Tensor:  # (N, in) -> (N, out)
        if self.panels is not None and x.dtype == torch.float32:
            return C.packed_linear(x, self.panels, self.bias, self.weight.shape[0])
        return F.linear(x, self.weight, self.bias)


@dataclass
class PreparedLayer:
    qkv: Projection  # self-attention q, k, v: d -> 3d
    self_out: Projection
    cross_q: Projection
    cross_kv: Projection  # memory -> cross-attention k, v: d -> 2d (once per sentence)
    cross_out: Projection
    fc1: Projection
    fc2: Projection
    norms: tuple[nn.LayerNorm, nn.LayerNorm, nn.LayerNorm]  # self-attention, cross-attention, feed-forward


@dataclass
class PreparedWeights:
    layers: list[PreparedLayer]
    output: Projection  # the shared embedding (V, d) as the output projection, no bias
    key: tuple


def _weights_key(model) -> tuple:
    """Identifies the decoder's current weights: storage, version counter (bumped by every in-place
    update, optimizer steps included), dtype and device of each parameter."""
    params = [model.embed.weight, *model.decoder.parameters()]
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)


def prepared_weights(model) -> PreparedWeights:
    """The decoder's projections in GEMM layout, made once and reused until a parameter changes (kept in
    ``model.__dict__``, outside the state dict; on the CPU in float32 the packed panels of
    fastformer/nn/linear.py, one more copy of the decoder's weights and of the embedding matrix)."""
    key = _weights_key(model)
    prepared = model.__dict__.get("_prepared_decoder")
    if prepared is not None and prepared.key == key:
        return prepared
    with torch.no_grad():
        layers = [PreparedLayer(Projection.of(layer.self_attn.qkv_proj), Projection.of(layer.self_attn.out_proj),
                                Projection.of(layer.cross_attn.q_proj), Projection.of(layer.cross_attn.kv_proj),
                                Projection.of(layer.cross_attn.out_proj), Projection.of(layer.ffn.fc1),
                                Projection.of(layer.ffn.fc2),
                                (layer.self_attn_norm, layer.cross_attn_norm, layer.ffn_norm))
                  for layer in model.decoder.layers]
        prepared = PreparedWeights(layers, Projection.of_weight(model.embed.weight, None), key)
    model.__dict__["_prepared_decoder"] = prepared
    return prepared


# ----------------------------------------------------------------------------------------------------
# Steppers: next-token logits of the live rows


class IncrementalDecoder:
    """Decodes one position per call for N = n K live rows (row i K + k is beam k of the i-th live
    sentence); see the module docstring for the layout of its caches.

    memory (B, S, d) and src_padding (B, S) are the encoder's; ``steps`` bounds the positions decoded.
    """

    def __init__(self, model, memory: Tensor, src_padding: Tensor, beam_size: int, steps: int):
        cfg = model.config
        self.model, self.K, self.backend = model, beam_size, model.backend
        self.H, self.Dh, self.d = cfg.n_heads, cfg.head_dim, cfg.d_model
        self.weights = prepared_weights(model)
        B, S, d = memory.shape
        # Cross-attention keys/values, once per sentence: (B, S, 2d) -> k, v (B, H, S, Dh).
        self.cross = []
        for layer in self.weights.layers:
            kv = layer.cross_kv(memory.reshape(B * S, d)).view(B, S, 2, self.H, self.Dh).permute(2, 0, 3, 1, 4)
            self.cross.append((kv[0].contiguous(), kv[1].contiguous()))
        self.src_padding = src_padding if bool(src_padding.any()) else None
        self.turn, self.step_index = 0, 0
        self.native = self._native(steps)
        if self.native is not None:
            return
        # Self-attention caches: per layer, two flat buffers for keys and two for values (B K H steps Dh
        # elements each), allocated at the first step in the dtype of the projections (autocast's).
        self.cache_size = B * beam_size * self.H * steps * self.Dh
        self.buffers: list[list[Tensor]] = [[] for _ in self.weights.layers]
        self.caches: list[Optional[tuple[Tensor, Tensor]]] = [None] * len(self.weights.layers)
        self.parents: Optional[Tensor] = None  # rows of the last step that the live rows continue

    def _native(self, steps: int):
        """The whole step in C++ (``fastformer._C.CpuDecoder``, csrc/decoder.cpp) where it applies: float32
        on the CPU through the cpu backend, no autocast, every projection packed; else None."""
        model, cross_k = self.model, self.cross[0][0]
        if (cross_k.device.type != "cpu" or cross_k.dtype != torch.float32 or torch.is_autocast_enabled("cpu")
                or _dispatch.resolve("attention", model.backend, cross_k.device, torch.float32) != "cpu"):
            return None
        projections = [[p.qkv, p.self_out, p.cross_q, p.cross_out, p.fc1, p.fc2] for p in self.weights.layers]
        if any(p.panels is None or p.bias is None for layer in projections for p in layer):
            return None
        layers = []
        for prepared, layer in zip(self.weights.layers, projections):
            layers += [t for p in layer for t in (p.panels, p.bias)]
            layers += [t.detach() for norm in prepared.norms for t in (norm.weight, norm.bias)]
        cfg, final = model.config, model.decoder.final_norm
        return C.CpuDecoder(
            layers, [t for kv in self.cross for t in kv], self.src_padding, model.embed.weight.detach(),
            model.positions(steps, torch.float32, cross_k.device).contiguous(),
            [final.weight.detach(), final.bias.detach()] if cfg.norm_first else [], self.weights.output.panels,
            self.K, self.H, cfg.d_ff, cfg.norm_first, self.weights.layers[0].norms[0].eps, steps)

    def select(self, parents: Tensor, sentences: Optional[Tensor]) -> None:
        """The next step's live rows continue rows ``parents`` (N',) of this step; ``sentences`` (n',)
        are the indices, among this step's live sentences, of those still decoding (None: all)."""
        if self.native is not None:
            return self.native.select(parents, sentences)
        self.parents = parents
        if sentences is not None:
            self.cross = [(k.index_select(0, sentences), v.index_select(0, sentences)) for k, v in self.cross]
            if self.src_padding is not None:
                self.src_padding = self.src_padding.index_select(0, sentences)

    def _append(self, index: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Layer ``index``'s self-attention cache for this step: the parents' t keys/values gathered and
        this step's appended, written into the buffer not read (N, H, t + 1, Dh), contiguous."""
        N, t = k_new.shape[0], self.step_index
        if not self.buffers[index]:
            self.buffers[index] = [k_new.new_empty(self.cache_size) for _ in range(4)]  # k, k, v, v
        out = []
        for j, (new, old) in enumerate(zip((k_new, v_new), self.caches[index] or (None, None))):
            cache = self.buffers[index][2 * j + self.turn][: N * self.H * (t + 1) * self.Dh]
            cache = cache.view(N, self.H, t + 1, self.Dh)
            if t:
                torch.index_select(old, 0, self.parents, out=cache[:, :, :t])
            cache[:, :, t] = new
            out.append(cache)
        self.caches[index] = (out[0], out[1])
        return out[0], out[1]

    def logits(self, tokens: Tensor) -> Tensor:
        """tokens (N, t + 1), bos first -> next-token logits (N, V) for position t."""
        if self.native is not None:
            self.step_index += 1
            return self.native.logits(tokens[:, -1])
        N, t, H, Dh, d = tokens.shape[0], self.step_index, self.H, self.Dh, self.d
        n = N // self.K
        x = self.model._embed(tokens[:, -1:], offset=t).view(N, d)  # scaled embedding + position t

        def self_attention(index, layer):
            def run(h):  # (N, d) -> (N, d)
                qkv = layer.qkv(h).view(N, 3, H, Dh)
                k, v = self._append(index, qkv[:, 1], qkv[:, 2])
                # one query per row against its own t + 1 keys: nothing to mask
                a = ops.attention(qkv[:, 0, :, None], k, v, backend=self.backend)  # (N, H, 1, Dh)
                return layer.self_out(a.reshape(N, d))
            return run

        def cross_attention(index, layer):
            def run(h):  # (N, d) -> (N, d): the K beams of a sentence are the K queries of one attention call
                q = layer.cross_q(h).view(n, self.K, H, Dh).transpose(1, 2)  # (n, H, K, Dh)
                k, v = self.cross[index]
                a = ops.attention(q, k, v, key_padding_mask=self.src_padding, backend=self.backend)
                return layer.cross_out(a.transpose(1, 2).reshape(N, d))
            return run

        def feed_forward(layer):
            return lambda h: layer.fc2(torch.relu_(layer.fc1(h)))

        sublayers = []
        for index, layer in enumerate(self.weights.layers):
            sublayers += [(layer.norms[0], self_attention(index, layer)),
                          (layer.norms[1], cross_attention(index, layer)),
                          (layer.norms[2], feed_forward(layer))]
        decoder = self.model.decoder
        h = run_sublayers(x, sublayers, decoder.final_norm, decoder.config.norm_first, 0.0, self.backend)
        self.turn, self.step_index = 1 - self.turn, t + 1
        return self.weights.output(h)


class FullRecompute:
    """Recomputes the whole prefix with ``Transformer.decode`` at each step (``use_cache=False``)."""

    def __init__(self, model, memory: Tensor, src_padding: Tensor, beam_size: int):
        rows = torch.arange(memory.shape[0], device=memory.device).repeat_interleave(beam_size)
        self.model, self.memory, self.src_padding = model, memory[rows], src_padding[rows]

    def select(self, parents: Tensor, sentences: Optional[Tensor]) -> None:
        self.memory, self.src_padding = self.memory[parents], self.src_padding[parents]

    def logits(self, tokens: Tensor) -> Tensor:
        return self.model.decode(tokens, self.memory, self.src_padding)[:, -1]


# ----------------------------------------------------------------------------------------------------
# The search


def search_candidates(logits: Tensor, at_limit: Tensor, config, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """The search's view of logits (N, V) on any device and dtype, with torch ops (float32 CPU logits take
    the C++ kernel of csrc/cpu/search_candidates.cpp instead, the same rule): per row the log-sum-exp over
    the whole vocabulary (pad and bos included, as a log-softmax; exponentials in the logits' dtype, float32
    for half precision, their sum in float64) and the best ``width`` logits among the tokens the search may
    produce (never pad or bos; only eos in rows ``at_limit``), with their tokens. Overwrites float32 and
    float64 logits (the search's own, a fresh tensor each step)."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # half-precision logits (autocast): exponentials in float32
    row_max = logits.amax(dim=1, keepdim=True)
    lse = row_max.double().squeeze(1) + torch.exp(logits - row_max).sum(dim=1, dtype=torch.float64).log_()
    logits[:, config.pad_id] = float("-inf")
    logits[:, config.bos_id] = float("-inf")
    if bool(at_limit.any()):  # the last allowed position of a sentence: only eos
        eos = logits[at_limit, config.eos_id]
        logits[at_limit] = float("-inf")
        logits[at_limit, config.eos_id] = eos
    top_logits, top_tokens = logits.topk(width, dim=1)
    return lse, top_logits, top_tokens


def beam_search(model, src: Tensor, K: int, alpha: float, a: float, b: float, use_cache: bool,
                stepper=None) -> list[Hypotheses]:
    """Per sentence of src (B, S), its finished hypotheses (tokens without bos/eos, score), best first.
    The model must be in eval mode and grad disabled (``Transformer.beam_search`` sees to both).
    ``stepper(model, memory, src_padding, K, steps)`` may supply another decoder with the interface of
    ``IncrementalDecoder`` (``logits``, ``select``): the benchmarks run a plain-PyTorch one this way.
    The rules and the bookkeeping are ``fastformer._C.BeamSearch`` (csrc/beam_search.cpp); this loop asks
    the stepper for logits and tells it which rows survive."""
    cfg = model.config
    device = src.device
    memory, src_padding = model.encode(src)
    max_len = ((~src_padding).sum(1).double() * a + b).floor().long().clamp(min=0).tolist()
    steps = max(max_len) + 1
    if stepper is not None:
        stepper = stepper(model, memory, src_padding, K, steps)
    elif use_cache:
        stepper = IncrementalDecoder(model, memory, src_padding, K, steps)
    else:
        stepper = FullRecompute(model, memory, src_padding, K)
    search = C.BeamSearch(max_len, K, alpha, cfg.vocab_size, cfg.pad_id, cfg.bos_id, cfg.eos_id)
    for _ in range(steps):
        logits = stepper.logits(search.tokens().to(device))  # (N, V)
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            going = search.step_logits(logits)
        else:
            going = search.step_candidates(*search_candidates(logits, search.at_limit().to(device), cfg, search.width))
        if not going:
            break
        sentences = search.sentences
        stepper.select(search.parents.to(device), None if sentences is None else sentences.to(device))
    return search.hypotheses()
