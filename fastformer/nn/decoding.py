"""Beam search and the incremental decoder it runs on (``Transformer.beam_search`` and ``generate``).

One search loop (``beam_search``) serves greedy (beam 1) and beam decoding; it asks a *stepper* for the
next-token logits of every live row and tells it which rows survive. Two steppers:

- ``IncrementalDecoder`` (``use_cache=True``, the default), built for decoding the way CTranslate2's
  decoder is:
  * driven by the decoder layer's one description (fastformer/nn/layers.py: ``DECODER_SUBLAYERS`` gives the
    sublayers' order, kinds and weight names, ``run_sublayers`` the norm placement, ``config.activation``
    the feed-forward's activation), the weights bound by name (``DECODER_LAYER``), its projections
    through ``fastformer.nn.linear.linear``: on the CPU in float32 at inference the column panels that
    fastformer's own GEMM kernel streams (``fastformer._C.packed_linear``), packed once per weight and kept
    by fastformer/nn/linear.py (one cache and one rule, shared with the model's layers);
  * cross-attention K/V computed once per sentence and shared by its beams: the K beams of a sentence
    are the K query rows of one attention call against that sentence's keys, never copied per beam and
    never reordered (only narrowed when sentences finish);
  * (the Python step) self-attention K/V in two preallocated buffers per layer that take turns: step t
    writes the cache of the rows that survived (gathered by their parents, one pass) plus this step's key into the other
    buffer, whose first N H (t + 1) Dh elements are then a contiguous (N, H, t + 1, Dh) tensor: the
    beam reorder is one gather of the self-attention caches per step, with no allocation and no cat;
  * in float32 on the CPU through the cpu backend, the whole step is one C++ call
    (``fastformer._C.CpuDecoder``, csrc/inference/decoder.cpp, with the kernel csrc/inference/decoder_step.cpp),
    built from the same description (sent to it with the weights, by name) and keeping each layer's cache
    in one (N0, H, T, Dh) buffer whose entries never move (a table of slots says which cache row holds
    each earlier position of a live row, so a beam reorder copies no key); elsewhere
    (other dtypes, autocast, CUDA, the torch or triton backends) about 12 PyTorch calls per layer a step,
    through the same fused ops as training.
- ``FullRecompute`` (``use_cache=False``) recomputes the whole prefix with ``Transformer.decode`` at
  every step: the slow, obviously right path that tests and benchmarks compare against.

The search (``fastformer._C.BeamSearch``, csrc/inference/beam_search.cpp: its bookkeeping on the host, one call
a step) works on the live rows only (rows of finished sentences leave the batch) and in the model's dtype:
per row, the top 2K logits are taken first (log-softmax is monotonic in each row), then only those become
log-probabilities, lp = logit - logsumexp(row), with the logsumexp's sum of exponentials and the
hypothesis scores accumulated in float64: the same scores as a float64 log-softmax over the whole
vocabulary, without converting (N, V) logits to float64. That pass over the vocabulary is one C++ kernel
for float32 CPU logits (csrc/inference/search_candidates.cpp) and ``search_candidates``'s torch ops elsewhere.

Rules (pinned by tests/nn/test_model_decoding.py): a sentence of n source tokens may produce at most
``length_limit(n, a, b)`` tokens before its eos, which is forced at the position after them; pad and bos are never
produced; score = sum of log-probabilities (eos included) / ((5 + len) / 6) ** alpha with len counting
the eos (GNMT's length penalty); an eos among the best K of the 2K candidates of a sentence ends a
hypothesis; a sentence stops when K hypotheses have finished or at its length limit; a NaN logit is a
token that cannot be produced (as -inf), on both candidate paths; a sentence left with no finite candidate
before any hypothesis finished (all its logits NaN, e.g. a model with NaN weights) ends with one empty
hypothesis, ([], -inf), and the other sentences of the batch are decoded as without it.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from fastformer import _dispatch, ops
from fastformer._ext import C
from fastformer.nn.layers import (ACTIVATIONS, DECODER_LAYER, DECODER_SUBLAYERS, decoder_layer_weights,
                                  run_sublayers)
from fastformer.nn.linear import packed_applies

Hypotheses = list[tuple[list[int], float]]

# The search's defaults, shared by Transformer.generate/beam_search and every CLI that translates.
BEAM_SIZE = 4
LENGTH_PENALTY = 0.6  # GNMT's alpha
MAX_LEN_A, MAX_LEN_B = 1.2, 10  # a sentence of n source tokens gets length_limit(n, a, b) target tokens


def length_limit(n: int, a: float, b: float) -> int:
    """The target tokens a sentence of ``n`` source tokens (its eos included, padding not) may produce
    before its eos: floor(a n + b), at least 0. The one place this rule is written (the search, the
    CTranslate2 comparison in fastformer/export.py)."""
    return max(0, math.floor(a * n + b))


# The cross-attention's k|v projection: applied here to the encoder memory once per sentence, not in a step.
CROSS_KV = next(s.weights["kv"] for s in DECODER_SUBLAYERS if s.kind == "cross_attention")


class _Norm(NamedTuple):
    """A LayerNorm's parameters as ``run_sublayers`` reads them."""
    weight: Tensor
    bias: Tensor
    eps: float
    normalized_shape: tuple[int, ...]


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
        # Each layer's weights by name (fastformer/nn/layers.py DECODER_LAYER), shapes checked.
        self.weights = [decoder_layer_weights(layer, cfg) for layer in model.decoder.layers]
        B, S, d = memory.shape
        # Cross-attention keys/values, once per sentence: (B, S, 2d) -> k, v (B, H, S, Dh).
        self.cross = []
        for weights in self.weights:
            kv = weights[CROSS_KV](memory.reshape(B * S, d))
            kv = kv.view(B, S, 2, self.H, self.Dh).permute(2, 0, 3, 1, 4)
            self.cross.append((kv[0].contiguous(), kv[1].contiguous()))
        self.src_padding = src_padding if bool(src_padding.any()) else None
        self.turn, self.step_index = 0, 0
        self.native = self._native(steps)
        if self.native is not None:
            return
        # Self-attention caches: per layer, two flat buffers for keys and two for values (B K H steps Dh
        # elements each), allocated at the first step in the dtype of the projections (autocast's).
        self.cache_size = B * beam_size * self.H * steps * self.Dh
        self.buffers: list[list[Tensor]] = [[] for _ in self.weights]
        self.caches: list[Optional[tuple[Tensor, Tensor]]] = [None] * len(self.weights)
        self.parents: Optional[Tensor] = None  # rows of the last step that the live rows continue

    def _native(self, steps: int):
        """The whole step in C++ (``fastformer._C.CpuDecoder``, csrc/inference/decoder.cpp) where it applies:
        where the projections take the packed kernel (float32 on the CPU, no autocast: ``packed_applies``) and
        attention resolves to the cpu backend; else None. The C++ decoder is built from one named structure:
        the layer's description (DECODER_SUBLAYERS: each sublayer's kind, norm and weight names, in order;
        norm placement and activation from the config) and per layer a dict of the weights by those names (a
        linear's packed panels or int8 form and its bias, a LayerNorm's weight and bias), which the C++ side
        looks up and checks; the cross-attention's k|v projection stays here (done above)."""
        model, cross_k = self.model, self.cross[0][0]
        if (not packed_applies(cross_k)
                or _dispatch.resolve("attention", model.backend, cross_k.device, torch.float32) != "cpu"):
            return None
        layers = []
        for weights in self.weights:
            named = {}
            for w in DECODER_LAYER:
                module = weights[w.name]
                if w.kind == "norm":
                    named[w.name + ".weight"], named[w.name + ".bias"] = module.weight, module.bias
                elif w.name != CROSS_KV:
                    named.update(module.bind(w.name))  # its packed panels or int8 form, and its bias
            layers.append(named)
        cfg, final = model.config, model.decoder.final_norm
        return C.CpuDecoder({
            "sublayers": [(s.kind, s.norm, {role: name for role, name in s.weights.items() if role != "kv"})
                          for s in DECODER_SUBLAYERS],
            "activation": cfg.activation,
            "norm_first": cfg.norm_first,
            "eps": cfg.layer_norm_eps,
            "heads": self.H,
            "d_ff": cfg.d_ff,
            "layers": layers,
            "final_norm": {"final_norm.weight": final.weight, "final_norm.bias": final.bias} if cfg.norm_first else {},
            "embed": self._embedding(),
            "embed_scale": math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0,
            "positions": model.positions(steps, torch.float32, cross_k.device).contiguous(),
            "cross": self.cross,
            "src_padding": self.src_padding,
            "beams": self.K,
            "steps": steps,
        })

    def _embedding(self) -> dict[str, object]:
        """The target embedding, also the output projection, as the C++ step binds it: "embed.weight" (V, d)
        and its panels, or the int8 weight; and the output bias if the model has one (config.output_bias)."""
        embed, bias = self.model.embed, self.model.output_bias
        named = embed.bind("embed")
        if bias is not None:
            named["output_bias"] = bias.detach()
        return named

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

        def self_attention(index, spec, w):
            def run(h):  # (N, d) -> (N, d)
                qkv = w[spec.weights["qkv"]](h).view(N, 3, H, Dh)
                k, v = self._append(index, qkv[:, 1], qkv[:, 2])
                # one query per row against its own t + 1 keys: nothing to mask
                a = ops.attention(qkv[:, 0, :, None], k, v, backend=self.backend)  # (N, H, 1, Dh)
                return w[spec.weights["out"]](a.reshape(N, d))
            return run

        def cross_attention(index, spec, w):
            def run(h):  # (N, d) -> (N, d): the K beams of a sentence are the K queries of one attention call
                q = w[spec.weights["q"]](h).view(n, self.K, H, Dh).transpose(1, 2)  # (n, H, K, Dh)
                k, v = self.cross[index]
                a = ops.attention(q, k, v, key_padding_mask=self.src_padding, backend=self.backend)
                return w[spec.weights["out"]](a.transpose(1, 2).reshape(N, d))
            return run

        act = ACTIVATIONS[self.model.config.activation]

        def feed_forward(index, spec, w):
            return lambda h: w[spec.weights["fc2"]](act(w[spec.weights["fc1"]](h), True))

        run = {"self_attention": self_attention, "cross_attention": cross_attention, "feed_forward": feed_forward}
        eps = self.model.config.layer_norm_eps
        sublayers = [(_Norm(w[s.norm].weight, w[s.norm].bias, eps, (d,)), run[s.kind](index, s, w))
                     for index, w in enumerate(self.weights) for s in DECODER_SUBLAYERS]
        decoder = self.model.decoder
        h = run_sublayers(x, sublayers, decoder.final_norm, decoder.config.norm_first, 0.0, self.backend)
        self.turn, self.step_index = 1 - self.turn, t + 1
        return self.model.project(h)  # the embedding, transposed (int8 in a quantized model)


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
    the C++ kernel of csrc/inference/search_candidates.cpp instead, the same rule): per row the log-sum-exp over
    the whole vocabulary (pad and bos included, as a log-softmax; exponentials in the logits' dtype, float32
    for half precision, their sum in float64) and the best ``width`` logits among the tokens the search may
    produce (never pad or bos; only eos in rows ``at_limit``), with their tokens, best first, tied logits
    to the lower token id, then -inf entries on the lowest ids not listed: the kernel's order exactly (a
    stable descending sort; torch.topk orders ties as it likes). A NaN logit counts as -inf: never a
    candidate, not in the log-sum-exp (the kernel's rule too). Overwrites float32 and float64 logits
    (the search's own, a fresh tensor each step).

    Cost: a sort of each row, O(V log V), where topk would be O(V): on a GPU a segmented sort of (N, V),
    tens of microseconds; on the CPU this path serves only half precision (autocast) and the non-cpu
    backends, float32 takes the kernel."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # half-precision logits (autocast): exponentials in float32
    logits.masked_fill_(logits.isnan(), float("-inf"))  # a NaN logit: a token that cannot be produced
    row_max = logits.amax(dim=1, keepdim=True)
    shift = torch.where(row_max.isfinite(), row_max, 0.0)  # an all -inf row: lse -inf (not -inf - -inf = NaN)
    lse = shift.double().squeeze(1) + torch.exp(logits - shift).sum(dim=1, dtype=torch.float64).log_()
    logits[:, config.pad_id] = float("-inf")
    logits[:, config.bos_id] = float("-inf")
    if bool(at_limit.any()):  # the last allowed position of a sentence: only eos
        eos = logits[at_limit, config.eos_id]
        logits[at_limit] = float("-inf")
        logits[at_limit, config.eos_id] = eos
    top_logits, top_tokens = logits.sort(dim=1, descending=True, stable=True)
    return lse, top_logits[:, :width], top_tokens[:, :width]


def beam_search(model, src: Tensor, K: int, alpha: float, a: float, b: float, use_cache: bool,
                stepper=None, forced: Optional[list[int]] = None) -> list[Hypotheses]:
    """Per sentence of src (B, S), its finished hypotheses (tokens without bos/eos, score), best first.
    The model must be in eval mode and grad disabled (``Transformer.beam_search`` sees to both).
    ``stepper(model, memory, src_padding, K, steps)`` may supply another decoder with the interface of
    ``IncrementalDecoder`` (``logits``, ``select``): the benchmarks run a plain-PyTorch one this way.
    The rules and the bookkeeping are ``fastformer._C.BeamSearch`` (csrc/inference/beam_search.cpp); this loop asks
    the stepper for logits and tells it which rows survive. The decoder starts from ``config.start_id``;
    ``forced`` tokens (e.g. NLLB's target-language code) follow it at the first steps, each with
    log-probability 0 (transformers' forced_bos_token_id), and stay in the returned tokens."""
    cfg = model.config
    device = src.device
    memory, src_padding = model.encode(src)
    # the forced tokens come on top of each sentence's limit
    max_len = [length_limit(n, a, b) + len(forced or ()) for n in (~src_padding).sum(1).tolist()]
    steps = max(max_len) + 1
    if stepper is not None:
        stepper = stepper(model, memory, src_padding, K, steps)
    elif use_cache:
        stepper = IncrementalDecoder(model, memory, src_padding, K, steps)
    else:
        stepper = FullRecompute(model, memory, src_padding, K)
    search = C.BeamSearch(max_len, K, alpha, cfg.vocab_size, cfg.pad_id, cfg.bos_id, cfg.eos_id, start=cfg.start_id,
                          forced=list(forced or []))
    for _ in range(steps):
        logits = stepper.logits(search.tokens().to(device))  # (N, V)
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            going = search.step_logits(logits)
        else:
            going = search.step_candidates(*search_candidates(logits, search.at_limit().to(device), cfg, search.width))
        del logits  # the C++ decoder writes the next step's logits into the same buffer when none holds it
        if not going:
            break
        sentences = search.sentences
        stepper.select(search.parents.to(device), None if sentences is None else sentences.to(device))
    return search.hypotheses()
