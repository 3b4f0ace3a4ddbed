// One step of the incremental decoder on the CPU in float32 (csrc/cpu/decoder_step.cpp), the layout of its
// arguments: raw pointers into tensors that fastformer._C's CpuDecoder (csrc/decoder.cpp) owns and checks.
// Plain C++ types only, so the struct crosses from fastformer._C to the level modules as it is.
#pragma once
#include <cstdint>
#include <vector>

namespace fastformer {

// A weight quantized to int8 (csrc/cpu/int8_linear.cpp has the arithmetic and the layout).
struct Int8Weight {
  const int8_t* panels;   // (ceil(out / 32), ceil(in / 4), 32, 4)
  const float* scale;     // (out,): s_w, the step of each output channel
  const int32_t* colsum;  // (out,): the sum of each output channel's int8 weights
};

// A projection y = x W^T + b with W packed as column panels (packed_linear's layout), or quantized.
struct PackedProjection {
  const float* panels;  // (ceil(out / kPackedLinearPanel), in, kPackedLinearPanel); nullptr when int8
  const float* bias;    // (out,) or nullptr
  Int8Weight int8;      // int8.panels == nullptr: float32 (panels above)
};

struct DecoderLayerStep {
  PackedProjection qkv;        // d -> 3 d: q, k, v of the self-attention, each (H, Dh)
  PackedProjection self_out;   // d -> d
  PackedProjection cross_q;    // d -> d
  PackedProjection cross_out;  // d -> d
  PackedProjection fc1;        // d -> d_ff
  PackedProjection fc2;        // d_ff -> d
  const float* norm_weight[3];  // LayerNorms of the self-attention, cross-attention and feed-forward sublayers
  const float* norm_bias[3];
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
  float eps;
  float embed_scale;           // sqrt(d)
  const int64_t* tokens;       // (N,): the token at position t of each row
  const int64_t* slots;        // (N, T): position j < t of row r is in cache row slots[r T + j]
  const float* embed;          // (V, d): the shared embedding
  const float* position_row;   // (d,): the sinusoid of position t
  const bool* src_padding;     // (n, S), true at padding; nullptr when no source has padding
  std::vector<DecoderLayerStep> layers;
  const float* final_norm_weight;  // pre-norm only (nullptr for post-norm)
  const float* final_norm_bias;
  PackedProjection output;     // the embedding as the output projection (no bias): d -> V
  float* logits;               // (N, V), written
  int int8_variant;            // which of int8_variants() the int8 projections use (0: the best)
};

}  // namespace fastformer
