// One step of the incremental decoder, all layers in one call: float32 on the CPU, for the N = n K live
// rows of a beam search (fastformer/nn/decoding.py; the caller, csrc/inference/decoder.cpp, owns the caches
// and reorders them between steps). The same computation as Transformer.decode at one position with the
// cpu ops, without the ~70 Python-level calls a step it took there (the whole of the step at a few rows).
//
// Driven by the decoder layer's description (csrc/inference/inference.h: each layer's sublayers, in the
// order fastformer/nn/layers.py DECODER_SUBLAYERS gives; the norm placement and the activation). Per step,
// with x (N, d) the residual stream in a scratch buffer:
//   x = embed[token] * embed_scale + position[t]   (a quantized model: its int8 embedding's row, dequantized)
//   per sublayer f of every layer, in order, post-norm
//       x = LayerNorm_f(x + f(x)),
//   or pre-norm (h = LayerNorm_first(x) first)
//       x = x + f(h), h = LayerNorm_next(x)   (the next sublayer's norm, the final norm after the last)
//   logits = out W_out^T, out = x (post-norm) or h (pre-norm).
// Sublayer kinds:
//   self-attention: qkv = in W_qkv^T + b (N, 3 d); k, v of position t go to cache row r (N0, H, T, Dh)
//     at t; per (row, head) one query against its own t + 1 keys (nothing masked), position j of row r
//     read from cache row slots[r T + j] (the row that computed it: beams share their history without
//     copying it); out projection.
//   cross-attention: q = in W_q^T + b; per (row, head) one query against the S keys of its sentence
//     (row / K), padding masked (a fully masked row gives zeros); out projection.
//   feed-forward: activation(in W_1^T + b_1) W_2^T + b_2.
// Every projection is packed_linear_rows (the weight streamed once from its panels), or int8_linear_rows in a
// quantized model (a quarter of the bytes): at a few rows the step is a stream of the decoder's weights and
// of the output projection. The attentions read the caches once.
// Attention math per (row, head), scale = 1/sqrt(Dh): s_j = (q . k_j) scale, m = max_j s_j,
// out = sum_j e^(s_j - m) v_j / sum_j e^(s_j - m), in float, over rows x heads split across threads; the
// cache reads are t + 1 keys and values of Dh floats a (row, head), each contiguous.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "cpu/cpu_ops.h"
#include "cpu/kernel_table.h"
#include "inference/inference.h"

namespace fastformer::cpu {
namespace {

// y (M, n) = x (M, K) W^T + b, y's rows y_stride floats apart (n unless given): float32 panels, or the int8
// weight (activations quantized per row).
void project(const float* x, int64_t M, int64_t K, const PackedProjection& w, float* y, int64_t n, int variant,
             int64_t y_stride = -1) {
  if (y_stride < 0) y_stride = n;
  if (w.int8.weight != nullptr) return int8_linear_rows(x, M, K, w.int8, w.bias, y, n, y_stride, variant);
  packed_linear_rows(x, M, K, w.panels, w.bias, y, n, y_stride);
}

// out (Dh) = softmax(q . keys^T scale, masked) values for one query against L keys/values of Dh floats,
// key j at key(j) and its value at value(j); mask (L,) true = ignored, or nullptr. scores: room for L
// floats. A fully masked row gives zeros. The output accumulates in registers (NV vectors, NV Vec::size()
// == Dh) or, for other head sizes, in out.
template <int NV, typename KeyAt, typename ValueAt>
void attend(const float* q, KeyAt key, ValueAt value, const bool* mask, int64_t L, int64_t Dh, float scale,
            float* scores, float* out) {
  using Vec = at::vec::Vectorized<float>;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float m = kNegInf;
  for (int64_t j = 0; j < L; ++j) {
    scores[j] = mask != nullptr && mask[j] ? kNegInf : vec_dot(q, key(j), Dh) * scale;
    m = nan_max(m, scores[j]);
  }
  if (m == kNegInf) {  // every key masked
    std::fill(out, out + Dh, 0.0f);
    return;
  }
  at::vec::map([m](Vec v) { return (v - Vec(m)).exp(); }, scores, scores, L);  // e^(-inf) = 0: masked keys drop
  const float inv = 1.0f / vec_sum(scores, L);
  if constexpr (NV > 0) {
    Vec acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = Vec(0.0f);
    for (int64_t j = 0; j < L; ++j) {
      const Vec p(scores[j]);
      const float* vj = value(j);
      for (int v = 0; v < NV; ++v) acc[v] = at::vec::fmadd(p, Vec::loadu(vj + v * Vec::size()), acc[v]);
    }
    for (int v = 0; v < NV; ++v) (acc[v] * Vec(inv)).store(out + v * Vec::size());
  } else {
    std::fill(out, out + Dh, 0.0f);
    for (int64_t j = 0; j < L; ++j) vec_axpy(scores[j], value(j), out, Dh);
    vec_scale(inv, out, Dh);
  }
}

// attend<NV> for the head size: registers for Dh = 1 .. 8 vectors, the generic loop otherwise.
template <typename KeyAt, typename ValueAt>
void attend_head(const float* q, KeyAt key, ValueAt value, const bool* mask, int64_t L, int64_t Dh, float scale,
                 float* scores, float* out) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t nv = Dh % Vec::size() == 0 ? Dh / Vec::size() : 0;
  switch (nv) {
    case 1: return attend<1>(q, key, value, mask, L, Dh, scale, scores, out);
    case 2: return attend<2>(q, key, value, mask, L, Dh, scale, scores, out);
    case 4: return attend<4>(q, key, value, mask, L, Dh, scale, scores, out);
    case 8: return attend<8>(q, key, value, mask, L, Dh, scale, scores, out);
    default: return attend<0>(q, key, value, mask, L, Dh, scale, scores, out);
  }
}

// A work buffer of the step, left uninitialized: every element is written before it is read (a std::vector
// would zero it, megabytes a step at batch 32, on one thread).
struct Scratch {
  explicit Scratch(int64_t n) : p(new float[n]) {}
  float* data() { return p.get(); }
  float& operator[](int64_t i) { return p[i]; }
  std::unique_ptr<float[]> p;
};

// The grain of a parallel loop over (row, head) pairs that each attend to L keys of Dh: at least 16 pairs,
// and at least 64K multiply-adds (2 L Dh a pair) a task.
int64_t attention_grain(int64_t L, int64_t Dh) { return std::max<int64_t>(16, 32768 / std::max<int64_t>(1, L * Dh)); }


// The feed-forward's activation over u (rows x width floats), in place, in vectors (at::vec's exp and erf,
// Sleef's); rows split over threads.
void activate(Activation activation, float* u, int64_t rows, int64_t width) {
  using Vec = at::vec::Vectorized<float>;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    float* const v = u + r0 * width;
    const int64_t n = (r1 - r0) * width;
    switch (activation) {
      case Activation::kRelu:
        at::vec::map([](Vec x) { return at::vec::maximum(x, Vec(0.0f)); }, v, v, n);  // (NaN stays NaN)
        break;
      case Activation::kGelu:  // exact: x Phi(x)
        at::vec::map([](Vec x) { return Vec(0.5f) * x * (Vec(1.0f) + (x * Vec(0.70710678118654752f)).erf()); }, v,
                     v, n);
        break;
      case Activation::kSilu:  // x sigmoid(x)
        at::vec::map([](Vec x) { return x / (Vec(1.0f) + x.neg().exp()); }, v, v, n);
        break;
    }
  });
}

}  // namespace

void decoder_step(const DecoderStep& s) {
  const int64_t N = s.rows, d = s.d_model, H = s.heads, Dh = s.head_dim, t = s.position, T = s.cache_len,
                S = s.src_len, K = s.beams;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  Scratch x(N * d), h(s.norm_first ? N * d : 0), qkv(N * 3 * d), a(N * d), y(N * d), u(N * s.d_ff);
  Scratch stats(2 * N), scratch(s.norm_first ? 0 : N * d);  // mean, rstd; post-norm's s
  if (s.norm_first) std::fill_n(y.data(), N * d, 0.0f);    // the first LayerNorm's zero branch

  at::parallel_for(0, N, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* xr = x.data() + r * d;
      const float* e = xr;  // a quantized model's row, dequantized into x first (gemm.h int8_row)
      if (s.embed != nullptr) {
        e = s.embed + s.tokens[r] * d;
      } else {
        int8_row(s.output.int8, s.tokens[r], d, xr);
      }
      for (int64_t j = 0; j < d; ++j) xr[j] = e[j] * s.embed_scale + s.position_row[j];
    }
  });
  // Every sublayer of every layer, in order, with its layer.
  std::vector<std::pair<const DecoderLayerStep*, const SublayerStep*>> order;
  for (const DecoderLayerStep& layer : s.layers) {
    for (const SublayerStep& sub : layer.sublayers) order.emplace_back(&layer, &sub);
  }
  // The LayerNorms are layer_norm_residual's kernel: LayerNorm(residual + branch).
  auto layer_norm = [&](const float* branch, const float* weight, const float* bias, float* out, float* sum) {
    layer_norm_residual_rows(branch, x.data(), weight, bias, out, sum, stats.data(), stats.data() + N, N, d, s.eps);
  };
  if (s.norm_first) {  // h = LayerNorm_first(x): the residual plus a zero branch (y, zeroed)
    layer_norm(y.data(), order.front().second->norm_weight, order.front().second->norm_bias, h.data(), x.data());
  }
  float* in = s.norm_first ? h.data() : x.data();  // what each sublayer reads

  for (size_t i = 0; i < order.size(); ++i) {
    const DecoderLayerStep& layer = *order[i].first;
    const SublayerStep& sub = *order[i].second;
    switch (sub.kind) {
      case SublayerKind::kSelfAttention: {
        // This position's k, v into cache row r, then one query per (row, head) against the row's t + 1
        // keys: position j < t of row r lives in cache row slots[r T + j], position t in row r.
        project(in, N, d, sub.in, qkv.data(), 3 * d, s.int8_variant);
        at::parallel_for(0, N, 32, [&](int64_t r0, int64_t r1) {  // rows split over threads, as everything a step does
          for (int64_t r = r0; r < r1; ++r) {
            for (int64_t hd = 0; hd < H; ++hd) {
              const int64_t cell = ((r * H + hd) * T + t) * Dh;
              std::copy_n(qkv.data() + r * 3 * d + d + hd * Dh, Dh, layer.k_cache + cell);
              std::copy_n(qkv.data() + r * 3 * d + 2 * d + hd * Dh, Dh, layer.v_cache + cell);
            }
          }
        });
        // (row, head) pairs split over threads once there are about 64K multiply-adds of keys and values per
        // task (below that, waking a second thread costs more than it saves: batch 1)
        at::parallel_for(0, N * H, attention_grain(t + 1, Dh), [&](int64_t begin, int64_t end) {
          std::vector<float> scores(t + 1);
          for (int64_t i = begin; i < end; ++i) {
            const int64_t r = i / H, hd = i % H;
            const int64_t* slot = s.slots + r * T;
            auto offset = [&](int64_t j) { return (((j < t ? slot[j] : r) * H + hd) * T + j) * Dh; };
            attend_head(qkv.data() + r * 3 * d + hd * Dh, [&](int64_t j) { return layer.k_cache + offset(j); },
                        [&](int64_t j) { return layer.v_cache + offset(j); }, nullptr, t + 1, Dh, scale,
                        scores.data(), a.data() + r * d + hd * Dh);
          }
        });
        project(a.data(), N, d, sub.out, y.data(), d, s.int8_variant);
        break;
      }
      case SublayerKind::kCrossAttention: {  // the K beams of sentence r / K against that sentence's S keys
        project(in, N, d, sub.in, qkv.data(), d, s.int8_variant);
        at::parallel_for(0, N * H, attention_grain(S, Dh), [&](int64_t begin, int64_t end) {
          std::vector<float> scores(S);
          for (int64_t i = begin; i < end; ++i) {
            const int64_t r = i / H, hd = i % H, sentence = r / K;
            const float* keys = layer.cross_k + (sentence * H + hd) * S * Dh;
            const float* values = layer.cross_v + (sentence * H + hd) * S * Dh;
            attend_head(qkv.data() + r * d + hd * Dh, [&](int64_t j) { return keys + j * Dh; },
                        [&](int64_t j) { return values + j * Dh; },
                        s.src_padding != nullptr ? s.src_padding + sentence * S : nullptr, S, Dh, scale,
                        scores.data(), a.data() + r * d + hd * Dh);
          }
        });
        project(a.data(), N, d, sub.out, y.data(), d, s.int8_variant);
        break;
      }
      case SublayerKind::kFeedForward:
        project(in, N, d, sub.in, u.data(), s.d_ff, s.int8_variant);
        activate(s.activation, u.data(), N, s.d_ff);
        project(u.data(), N, s.d_ff, sub.out, y.data(), d, s.int8_variant);
        break;
    }
    // The residual and the LayerNorm. Post-norm: x = LayerNorm_i(x + y). Pre-norm: x = x + y,
    // h = LayerNorm_next(x) (the final norm after the last sublayer).
    if (!s.norm_first) {
      layer_norm(y.data(), sub.norm_weight, sub.norm_bias, x.data(), scratch.data());
    } else if (i + 1 < order.size()) {
      layer_norm(y.data(), order[i + 1].second->norm_weight, order[i + 1].second->norm_bias, h.data(), x.data());
    } else {
      layer_norm(y.data(), s.final_norm_weight, s.final_norm_bias, h.data(), x.data());
    }
  }
  project(in, N, d, s.output, s.logits, s.vocab, s.int8_variant, s.logits_stride);
}

}  // namespace fastformer::cpu
