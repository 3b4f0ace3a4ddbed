// The GEMMs of decoding, y (M, n) = x (M, K) W^T + b for few rows M, with W prepared once in the kernel's
// layout. This folder owns the layouts, the int8 quantization rule and every check of these weights:
//   packed_linear.cpp   (per CPU level) float32: W^T streamed from column panels with at::vec FMAs
//   int8_linear.cpp     (per CPU level) int8: W per output channel, x quantized per row, int32 dot products
//                       (VNNI, AVX2, plain); int8_linear_tile.h: one tile per dot-product instruction
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
//     that pass, and the L1 sets of the odd lines idle: 84 -> 91 GFLOP/s on the output projection's shape
//     at M = 128 in a harness of both layouts, AVX2 EPYC, 1 thread; packed_linear 91 with y's rows aligned)
//   int8 panels    (ceil(n / P), ceil(K / 4), P, 4): panels[p][g][j][i] = Wq[p P + j][4 g + i]
// The int8 rule (CTranslate2's int8 on the CPU), weights once, activations per call:
//   per output channel n: s_w[n] = max_k |W[n, k]| / 127, Wq[n, k] = round-half-even(W[n, k] (127 / max_k
//     |W[n, k]|)) in [-127, 127] (float32 products; a channel of zeros stays zeros): quantize_int8;
//   per row m of x: the same rule over the row, s_x[m] and xq (int8_linear.cpp, vectorized);
//   y[m, n] = float(sum_k xq[m, k] Wq[n, k]) (s_x[m] s_w[n]) + b[n]; colsum[n] = sum_k Wq[n, k] (the VNNI
//   kernels' correction for their unsigned operand). K <= kInt8MaxInputs keeps the int32 sums exact.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace fastformer {

constexpr int kPackedLinearPanel = 32;      // columns per panel, float32 and int8
constexpr int kPackedLinearStrip = 16;      // columns per contiguous strip of a float32 panel (a 64-byte line)
constexpr int64_t kInt8MaxInputs = 65536;   // K: 65,536 x 255 x 127 < 2^31

inline int64_t panel_count(int64_t n) { return (n + kPackedLinearPanel - 1) / kPackedLinearPanel; }
inline std::vector<int64_t> packed_panels_shape(int64_t n, int64_t K) {
  return {panel_count(n), kPackedLinearPanel / kPackedLinearStrip, K, kPackedLinearStrip};
}
// Where column c (< kPackedLinearPanel) of row k = 0 of a float32 panel lies; row k is k S floats further.
inline int64_t packed_column_offset(int64_t c, int64_t K) {
  return (c / kPackedLinearStrip) * K * kPackedLinearStrip + c % kPackedLinearStrip;
}
inline std::vector<int64_t> int8_panels_shape(int64_t n, int64_t K) {
  return {panel_count(n), (K + 3) / 4, kPackedLinearPanel, 4};
}

// The int8 rule of one value: x (127 / amax) rounded half to even and clamped; inv = 127 / amax (0 for a
// zero row or channel). The weights (gemm.cpp) take it as it is; the activations' vectorized form
// (int8_linear.cpp) computes the same.
inline float int8_inverse_step(float amax) { return amax > 0.0f ? 127.0f / amax : 0.0f; }
inline int8_t quantize_int8_value(float x, float inv) {
  return static_cast<int8_t>(std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(x * inv))));
}

// A weight quantized to int8, as the kernels read it.
struct Int8Weight {
  const int8_t* panels;   // int8_panels_shape(n, K)
  const float* scale;     // (n,): s_w
  const int32_t* colsum;  // (n,): sum_k Wq[n, k]
};

// Row `row` of an int8 weight (n, K) as float32, out[k] = Wq[row, k] s_w[row]: dequantize_int8, and the
// embedding lookup of a quantized model, whose embedding is its output projection's int8 weight.
inline void int8_row(const Int8Weight& w, int64_t row, int64_t K, float* out) {
  const int64_t P = kPackedLinearPanel, K4 = (K + 3) / 4;
  const int8_t* first = w.panels + ((row / P) * K4 * P + row % P) * 4;  // Wq[row, 0]; Wq[row, k] 4 P (k / 4) further
  const float step = w.scale[row];
  for (int64_t k = 0; k < K; ++k) out[k] = static_cast<float>(first[(k / 4) * P * 4 + k % 4]) * step;
}

// A projection y = x W^T + b: W as float32 panels, or quantized (int8.panels != nullptr).
struct PackedProjection {
  const float* panels;  // packed_panels_shape(n, K); nullptr when int8
  const float* bias;    // (n,) or nullptr
  Int8Weight int8;
};

}  // namespace fastformer

#ifdef FASTFORMER_GEMM_CHECKS  // fastformer._C only (ATen, pybind11): gemm.cpp and the decoder's binder
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

namespace fastformer {

// ValueError unless t is a contiguous CPU tensor of this dtype and shape: "<who>: <what> must be ...".
void check_tensor(const at::Tensor& t, at::ScalarType dtype, const std::vector<int64_t>& shape, const std::string& who,
                  const std::string& what);
// The weight of a projection K -> n as float32 panels, or as int8 (panels, scale, colsum), checked; K within
// kInt8MaxInputs for int8. `who` names the caller, `name` the weight, in messages.
PackedProjection packed_projection(const at::Tensor& panels, const c10::optional<at::Tensor>& bias, int64_t K,
                                   int64_t n, const std::string& who, const std::string& name);
PackedProjection int8_projection(const at::Tensor& panels, const at::Tensor& scale, const at::Tensor& colsum,
                                 const c10::optional<at::Tensor>& bias, int64_t K, int64_t n, const std::string& who,
                                 const std::string& name);

// Python's entry points (bound in csrc/fastformer.cpp).
at::Tensor pack_linear(const at::Tensor& weight);                                    // (n, K) -> panels
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_int8(const at::Tensor& weight);  // -> panels, scale, colsum
at::Tensor dequantize_int8(const at::Tensor& panels, const at::Tensor& scale, int64_t n, int64_t K);  // -> (n, K)
// Rows ids (any shape, int64 in [0, n)) of the int8 weight (n, K), dequantized: (*ids.shape, K) float32.
at::Tensor int8_embedding(const at::Tensor& ids, const at::Tensor& panels, const at::Tensor& scale, int64_t n,
                          int64_t K);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                         int64_t n);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                       const at::Tensor& colsum, const c10::optional<at::Tensor>& bias, int64_t n,
                       const std::string& variant);
std::vector<std::string> int8_variants();  // this CPU's at the loaded level, best first

}  // namespace fastformer
#endif
