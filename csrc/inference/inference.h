// The inference room: decoding on the CPU, beside the ops (fastformer/nn/decoding.py drives it).
//   decoder.cpp            (fastformer._C) CpuDecoder: built from one named structure (the decoder layer's
//                          description and its weights by name, fastformer/nn/layers.py), owns what lives
//                          across the steps (weights, cross-attention keys/values, self-attention caches)
//   decoder_step.cpp       (per CPU level) one step of every layer in one call, driven by the description
//   beam_search.cpp        (fastformer._C) BeamSearch: the search's bookkeeping, one call a step
//   search_candidates.cpp  (per CPU level) the search's pass over the vocabulary (lse and the best logits)
// The projections are csrc/gemm's (packed float32 or int8), attention, LayerNorm and the search in float32.
//
// Why the step has its own attention (not the attention op's kernel, csrc/cpu/attention.cpp): the op takes
// keys and values as (B, H, L, D) tensors, while the step reads each earlier position of a row from the
// cache row that computed it (a table of slots), so that a beam reorder copies no key. One query a (row,
// head) against the row's keys, with no autograd state, dropout or log-sum-exp to keep.
//
// Plain C++ types only below: the structs cross from fastformer._C to the level modules as they are.
#pragma once
#include <cstdint>
#include <vector>

#include "gemm/gemm.h"

namespace fastformer {

// What a sublayer computes; the order of a layer's sublayers is the description's (DECODER_SUBLAYERS).
enum class SublayerKind : int32_t {
  kSelfAttention,   // in: q | k | v (d -> 3 d); causal over the row's cache; out: d -> d
  kCrossAttention,  // in: q (d -> d) against the sentence's encoder keys/values; out: d -> d
  kFeedForward,     // in: fc1 (d -> d_ff), the activation; out: fc2 (d_ff -> d)
};

// The feed-forward's activation (config.activation).
enum class Activation : int32_t { kRelu, kGelu, kSilu };

struct SublayerStep {
  SublayerKind kind;
  const float* norm_weight;  // its LayerNorm (d,)
  const float* norm_bias;
  PackedProjection in;
  PackedProjection out;
};

struct DecoderLayerStep {
  std::vector<SublayerStep> sublayers;  // in the description's order
  const float* cross_k;  // (n, H, S, Dh): the encoder memory's keys, once per sentence
  const float* cross_v;  // (n, H, S, Dh)
  float* k_cache;        // (N0, H, T, Dh): cache row c holds at position j what row c computed at step j;
  float* v_cache;        // this step writes position t of rows 0 .. N - 1
};

struct DecoderStep {
  int64_t rows;       // N = n K: beam k of live sentence i is row i K + k
  int64_t beams;      // K
  int64_t heads;      // H
  int64_t head_dim;   // Dh
  int64_t d_model;    // d = H Dh
  int64_t d_ff;
  int64_t vocab;      // V
  int64_t src_len;    // S
  int64_t position;   // t: the position decoded (the cache holds t earlier ones)
  int64_t cache_len;  // T: positions a row of the cache has room for (> t)
  bool norm_first;
  Activation activation;
  float eps;
  float embed_scale;           // the embedding's factor (sqrt(d) for the paper's model)
  const int64_t* tokens;       // (N,): the token at position t of each row
  const int64_t* slots;        // (N, T): position j < t of row r is in cache row slots[r T + j]
  const float* embed;          // (V, d): the target embedding; nullptr in a quantized model, whose rows are
                               // read from the int8 weight of the tied output projection (output.int8, int8_row)
  const float* position_row;   // (d,): the position encoding of position t
  const bool* src_padding;     // (n, S), true at padding; nullptr when no source has padding
  std::vector<DecoderLayerStep> layers;
  const float* final_norm_weight;  // pre-norm only (nullptr for post-norm)
  const float* final_norm_bias;
  PackedProjection output;     // the output projection d -> V: the target embedding, tied
  float* logits;               // (N, V), written; rows logits_stride (>= V) floats apart
  int64_t logits_stride;
  int int8_variant;            // which of int8_variants() the int8 projections use (-1: the rule, int8_choose)
};

}  // namespace fastformer
