// The GEMMs of decoding, y (M, n) = x (M, K) W^T + b for few rows M, with W prepared once in the kernel's
// layout. This folder owns the layouts, the int8 quantization rule and every check of these weights:
//   packed_linear.cpp   (per CPU level) float32: W^T streamed from column panels with at::vec FMAs
//   int8_linear.cpp     (per CPU level) int8: W per output channel, x quantized per row, int32 dot products
//                       (VNNI, AVX2, plain; or oneDNN's: int8_onednn.h); int8_linear_tile.h: one tile per
//                       dot-product instruction
//   int8_onednn.cpp     (fastformer._C) W packed for oneDNN's int8 products (the variant "onednn"), once per
//                       weight, the pack held by the weight's owner
//   gemm.cpp            (fastformer._C) the weight preparation (pack_linear, quantize_int8, dequantize_int8,
//                       int8_embedding),
//                       the checks, and the entry points Python calls (packed_linear, int8_linear)
// Their users: the model's projections at inference (fastformer/nn/linear.py) and the decoder step
// (csrc/inference/decoder_step.cpp).
//
// Layouts (P = kPackedLinearPanel columns of W^T, i.e. rows of W, per panel; zeros past n and past K):
//   float32 panels (ceil(n / P), P / S, K, S):     panels[p][s][k][j] = W[p P + s S + j][k]
//     S = kPackedLinearStrip: a panel is P / S strips of S columns, each K x S contiguous floats, so that a
//     kernel reading S columns at a time (AVX2: two vectors) streams whole cache lines, one after the other
//     (with the strips interleaved, K x 32, it read every other line: half of each line fetched unused by
//     that pass, and the L1 sets of the odd lines idle; measured: docs/cpu-kernels.md, "Measured")
//   int8 weight    (ceil(n / P), ceil(K / 4), P, 4): weight[p][g][j][i] = Wq[p P + j][4 g + i] (int8_index)
// An int8 weight is three tensors, named as in the state dict (fastformer/nn/linear.py Int8Linear), in Python
// (Int8Weight), here (Int8Weight) and in the C++ decoder's dict ("<name>.weight", ...): weight (Wq, packed),
// weight_scale (s_w) and weight_colsum (sum_k Wq[n, k], the VNNI kernels' correction for their unsigned operand).
// The int8 rule (CTranslate2's int8 on the CPU), one rule for the weights (once, per output channel:
// quantize_int8) and the activations (per call, per row of x: int8_linear.cpp, vectorized, the same results):
//   a row r of K floats: amax = max_k |r[k]|, NaN if some r[k] is NaN;
//   amax finite: s = amax / 127 and q[k] = round-half-even(r[k] (127 / amax)) in [-127, 127] (float32 products;
//     a row of zeros: s = 0, q = 0);
//   amax not finite (a NaN or an infinity in the row): s = NaN and q = 0, so every output that row meets is NaN,
//     as in float32 (where it would be NaN or an infinity): a non-finite value is never quantized to +-127;
//   y[m, n] = float(sum_k xq[m, k] Wq[n, k]) (s_x[m] s_w[n]) + b[n]. K <= kInt8MaxInputs keeps the int32 sums
//   exact.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace fastformer {

constexpr int kPackedLinearPanel = 32;      // columns per panel, float32 and int8
constexpr int kPackedLinearStrip = 16;      // columns per contiguous strip of a float32 panel (a 64-byte line)
constexpr int64_t kInt8MaxInputs = 65536;   // K: 65,536 x 255 x 127 < 2^31
constexpr int64_t kInt8ExactFloatInputs = 1040;  // K: 1,040 x 127 x 127 < 2^24, so a float32 holds the sum exactly

inline int64_t panel_count(int64_t n) { return (n + kPackedLinearPanel - 1) / kPackedLinearPanel; }
inline std::vector<int64_t> packed_panels_shape(int64_t n, int64_t K) {
  return {panel_count(n), kPackedLinearPanel / kPackedLinearStrip, K, kPackedLinearStrip};
}
// Where column c (< kPackedLinearPanel) of row k = 0 of a float32 panel lies; row k is k S floats further.
inline int64_t packed_column_offset(int64_t c, int64_t K) {
  return (c / kPackedLinearStrip) * K * kPackedLinearStrip + c % kPackedLinearStrip;
}
inline std::vector<int64_t> int8_weight_shape(int64_t n, int64_t K) {
  return {panel_count(n), (K + 3) / 4, kPackedLinearPanel, 4};
}
// Where Wq[row, k] lies in an int8 weight of K4 = ceil(K / 4) groups: the one place the layout's index is
// written (quantize_int8, int8_row, and the int8 kernel's panels and tiles).
inline int64_t int8_index(int64_t row, int64_t k, int64_t K4) {
  return (((row / kPackedLinearPanel) * K4 + k / 4) * kPackedLinearPanel + row % kPackedLinearPanel) * 4 + k % 4;
}

// The int8 rule (above) of a row whose amax is known, as the scale s and the factor of its values: inv =
// 127 / amax, or 0 where q is 0 (a row of zeros, a non-finite row). quantize_int8_value applies it to a
// value of a row with inv > 0 (finite values only: it would clamp a NaN to -127).
struct Int8Step {
  float scale;
  float inv;
};
inline Int8Step int8_step(float amax) {
  if (!std::isfinite(amax)) return {std::numeric_limits<float>::quiet_NaN(), 0.0f};
  return {amax / 127.0f, amax > 0.0f ? 127.0f / amax : 0.0f};
}
inline int8_t quantize_int8_value(float x, float inv) {
  return static_cast<int8_t>(std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(x * inv))));
}
// The rule over one row r of K floats: store(k, q[k]) for every k; returns s. The weights' form
// (quantize_int8); the activations' vectorized form (int8_linear.cpp quantize_rows) gives the same.
template <typename Store>
inline float quantize_int8_row(const float* r, int64_t K, Store&& store) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float a = std::fabs(r[k]);
    amax = a > amax || std::isnan(a) ? a : amax;  // a NaN stays: nothing compares greater
  }
  const Int8Step step = int8_step(amax);
  for (int64_t k = 0; k < K; ++k) store(k, step.inv > 0.0f ? quantize_int8_value(r[k], step.inv) : int8_t{0});
  return step.scale;
}

struct OnednnInt8;  // csrc/gemm/int8_onednn.h

// A weight quantized to int8, as the kernels read it (the state dict's names).
struct Int8Weight {
  const int8_t* weight;          // int8_weight_shape(n, K): Wq, packed
  const float* weight_scale;     // (n,): s_w
  const int32_t* weight_colsum;  // (n,): sum_k Wq[n, k]
  const OnednnInt8* onednn;      // the same Wq packed for oneDNN (the variant "onednn"), or nullptr: not packed;
                                 // owned by the weight's owner (int8_onednn.cpp)
};

// Row `row` of an int8 weight (n, K) as float32, out[k] = Wq[row, k] s_w[row]: dequantize_int8, and the
// embedding lookup of a quantized model (int8_embedding; the C++ decoder step).
inline void int8_row(const Int8Weight& w, int64_t row, int64_t K, float* out) {
  const int64_t K4 = (K + 3) / 4;
  const float step = w.weight_scale[row];
  for (int64_t k = 0; k < K; ++k) out[k] = static_cast<float>(w.weight[int8_index(row, k, K4)]) * step;
}

// A projection y = x W^T + b: W as float32 panels, or quantized (int8.weight != nullptr).
struct PackedProjection {
  const float* panels;  // packed_panels_shape(n, K); nullptr when int8
  const float* bias;    // (n,) or nullptr
  Int8Weight int8;
};

}  // namespace fastformer

#ifdef FASTFORMER_GEMM_CHECKS  // fastformer._C only (ATen, pybind11): gemm.cpp and the decoder's binder
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <memory>
#include <tuple>

namespace fastformer {

// ValueError unless t is a contiguous CPU tensor of this dtype and shape: "<who>: <what> must be ...".
void check_tensor(const at::Tensor& t, at::ScalarType dtype, const std::vector<int64_t>& shape, const std::string& who,
                  const std::string& what);
// The weight of a projection K -> n as float32 panels, or as int8 (weight, weight_scale, weight_colsum), checked;
// K within kInt8MaxInputs for int8. `who` names the caller in messages, `name` the projection: its tensors are
// "<name>.panels", "<name>.weight", ... and the bias `bias_name` (the bare names when name is empty).
PackedProjection packed_projection(const at::Tensor& panels, const c10::optional<at::Tensor>& bias, int64_t K,
                                   int64_t n, const std::string& who, const std::string& name,
                                   const std::string& bias_name);
// `onednn`: the same weight packed for oneDNN (onednn_int8_pack; "<name>.onednn" in messages), or nullptr;
// checked to be of (n, K).
PackedProjection int8_projection(const at::Tensor& weight, const at::Tensor& weight_scale,
                                 const at::Tensor& weight_colsum, const c10::optional<at::Tensor>& bias, int64_t K,
                                 int64_t n, const std::string& who, const std::string& name,
                                 const std::string& bias_name, const OnednnInt8* onednn);

// Python's entry points (bound in csrc/fastformer.cpp).
at::Tensor pack_linear(const at::Tensor& weight);                                    // (n, K) -> panels
// -> weight, weight_scale, weight_colsum
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_int8(const at::Tensor& weight);
at::Tensor dequantize_int8(const at::Tensor& weight, const at::Tensor& weight_scale, int64_t n, int64_t K);  // (n, K)
// Rows ids (any shape, int64 in [0, n)) of the int8 weight (n, K), dequantized: (*ids.shape, K) float32.
at::Tensor int8_embedding(const at::Tensor& ids, const at::Tensor& weight, const at::Tensor& weight_scale, int64_t n,
                          int64_t K);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                         int64_t n);
// `onednn`: the weight packed for oneDNN (int8_prepare's); none where the variant run is oneDNN's: packed for
// this call.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const at::Tensor& weight_colsum, const c10::optional<at::Tensor>& bias, int64_t n,
                       const std::string& variant, const std::shared_ptr<OnednnInt8>& onednn);
// The int8 variants this CPU runs at the loaded level: fastformer's own, best first, then "onednn" where
// oneDNN's int8 products may run (csrc/gemm/int8_onednn.h).
std::vector<std::string> int8_variants();
// The variant a caller asked for as an index into int8_variants(): `variant` if not empty, else the environment's
// FASTFORMER_INT8_PROVIDER (a variant's name, "fastformer": the best of our own, or "auto"/unset); -1: auto, the
// rule of int8_choose per call. A name this CPU does not run is a ValueError naming `who` and the list. The one
// place the environment variable is read: the int8 modules (fastformer/nn/linear.py) and the C++ decoder read it
// once, when they bind their weights (int8_provider, the decoder's constructor), and keep what it said.
int int8_variant_index(const std::string& variant, const std::string& who);
// int8_variant_index's answer as a name: a variant of int8_variants(), or "auto".
std::string int8_provider(const std::string& variant);
// The variant int8_linear_rows takes for an M x K by K x N product under int8_variant_index("") (the
// environment, else the rule).
std::string int8_variant_for(int64_t M, int64_t N, int64_t K);
// Whether a projection bound for `variant` (an index as above) needs its weight prepared (oneDNN's pack): the
// provider table's answer (int8_linear.cpp int8_packs).
bool int8_needs_pack(int variant);
// An int8 weight (n, K) packed for oneDNN where int8_needs_pack(int8_variant_index(variant)), else nullptr (also
// for n or K 0): the int8 modules call it at quantization and load and keep the pack, so that no decoding call
// packs.
std::shared_ptr<OnednnInt8> int8_prepare(const at::Tensor& weight, const at::Tensor& weight_scale,
                                         const at::Tensor& weight_colsum, int64_t n, int64_t K,
                                         const std::string& variant);
// Wq (checked by the caller) packed for oneDNN (csrc/gemm/int8_onednn.cpp), owned by the pointer's holders.
std::shared_ptr<OnednnInt8> onednn_int8_pack(const at::Tensor& weight, int64_t n, int64_t K);
// The tile products' variants this CPU runs (csrc/gemm/products.h), and C = A B by one of them: a test's hook
// on the micro-kernel (tests/ops/test_products.py). a (m, k), b (k, n): 2-D CPU tensors with unit column stride,
// float32 or float64 for "fma", bfloat16 for the bf16 variants (C float32).
std::vector<std::string> product_variants();
at::Tensor tile_product(const at::Tensor& a, const at::Tensor& b, const std::string& variant);
// A projection's gradients in bf16 training on the CPU, (dW (N, K), db (N)) float32: dy (M, N)^T x (M, K) and the
// column sums of dy, dy and x bfloat16 (csrc/gemm/weight_grad.cpp). variant: "" (bf16_dot where it runs, else
// bf16_emulated) or one of the bf16 product_variants() (the tests').
std::tuple<at::Tensor, at::Tensor> weight_grad(const at::Tensor& dy, const at::Tensor& x, const std::string& variant);
// The packs made and not yet freed, in this process (a test's check that they are freed with their owner).
int64_t onednn_int8_live();

}  // namespace fastformer
#endif
