// oneDNN's int8 products, the variant "onednn" of the int8 projections (csrc/gemm/int8_linear.cpp): on a CPU
// with AMX (amx_int8) oneDNN multiplies int8 tiles, several times the rate of fastformer's own VNNI kernels at
// many rows; elsewhere fastformer's own kernels are as fast or faster (docs/cpu-kernels.md has the figures).
// Reached through torch's own oneDNN ops (onednn::qlinear_prepack, onednn::qlinear_pointwise), so no second
// copy of oneDNN is linked.
//
// The same int32 sums as every other variant, by construction:
//   x is quantized by fastformer (int8_linear.cpp quantize_rows, the activations' rule) and handed over as
//   unsigned bytes xq + 128 with zero point 128; oneDNN sums (xq + 128 - 128) Wq in int32 (exact) and returns
//   each sum as float32 with unit scales, exact while |sum| < 2^24, i.e. for K <= kInt8ExactFloatInputs.
//   Longer rows (the feed-forward's second projection, K = 2,048 or 4,096) are split into chunks of at most
//   that many inputs, packed separately; their float sums are converted to int32 and added (exact).
//   The scales and the bias are applied by fastformer's epilogue, the same float operations as its own
//   variants (int8_linear.cpp), so y is bit-identical whichever variant ran.
// Memory: Wq packed once per weight (csrc/gemm/int8_onednn.cpp: a second copy of the int8 weight, n K bytes
// plus oneDNN's compensation, kept while the weight lives); per call x's bytes, oneDNN's (M, n) float32 sums
// written once and read once by the epilogue (one (M, n) pass more than our own kernels), y written once.
//
// On a CPU without VNNI or AMX, oneDNN's int8 kernels sum byte pairs in 16 bits (vpmaddubsw), which can
// saturate for full-range operands: the rule never chooses "onednn" there, and forcing it warns.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <vector>

#include "gemm/gemm.h"

namespace fastformer {

constexpr int64_t kOnednnMinRows = 32;  // the rule: oneDNN's products from M = 32 rows, on a CPU with AMX

// Wq (n, K) as oneDNN's packed weights (csrc/gemm/int8_onednn.cpp onednn_int8_weight).
struct OnednnInt8 {
  std::vector<at::Tensor> chunks;  // per chunk of inputs: onednn::qlinear_prepack of Wq[:, starts[c]:starts[c + 1]]
  std::vector<int64_t> starts;     // chunk c covers inputs [starts[c], starts[c + 1]); starts.back() = K4 4
  at::Tensor ones;                 // (n,) float32: the weight scales oneDNN applies (1: the sums themselves)
  at::Tensor zero_points;          // (n,) int64: the weights' zero points (0)
};

// cpuid (with the OS's support of the tile state): the int8 tiles of AMX; VNNI's byte dot products.
inline bool cpu_has_amx_int8() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("amx-tile");
#else
  return false;
#endif
}
inline bool cpu_has_int8_dot() {  // no 16-bit intermediate sums in oneDNN's int8 kernels
#if defined(__x86_64__)
  __builtin_cpu_init();
  return cpu_has_amx_int8() || __builtin_cpu_supports("avx512vnni") || __builtin_cpu_supports("avxvnni");
#else
  return false;
#endif
}

inline std::optional<c10::OperatorHandle> onednn_op(const char* name) {
  return c10::Dispatcher::singleton().findSchema({name, ""});
}

// Whether torch was built with oneDNN and registers the two ops (x86-64 builds of torch do).
inline bool onednn_int8_runs() {
  static const bool runs = at::hasMKLDNN() && onednn_op("onednn::qlinear_prepack").has_value() &&
                           onednn_op("onednn::qlinear_pointwise").has_value();
  return runs;
}

// The sums (M, n) = sum_k xq[m, k] Wq[n, k] of q (M, K4 4) uint8 = xq + 128 (zero-padded past K with 128):
// float32 for one chunk, int32 for several (each chunk's float32 sums exact, converted and added).
inline at::Tensor onednn_int8_sums(const OnednnInt8& w, const at::Tensor& q) {
  static const c10::OperatorHandle op = *onednn_op("onednn::qlinear_pointwise");
  at::Tensor total;
  for (size_t c = 0; c < w.chunks.size(); ++c) {
    const at::Tensor part = w.chunks.size() == 1 ? q : q.slice(1, w.starts[c], w.starts[c + 1]).contiguous();
    // qlinear_pointwise(qx, x_scale, x_zero_point, qw, w_scale, w_zero_point, bias, output_scale,
    //                   output_zero_point, output_dtype, post_op_name, post_op_args, post_op_algorithm)
    std::vector<c10::IValue> stack{part, 1.0, int64_t{128}, w.chunks[c], w.ones, w.zero_points, c10::IValue(),
                                   1.0, int64_t{0}, c10::IValue(at::kFloat), c10::IValue("none"),
                                   c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue("")};
    op.callBoxed(&stack);
    at::Tensor sums = stack[0].toTensor();
    if (w.chunks.size() == 1) return sums;
    total = c == 0 ? sums.to(at::kInt) : total.add_(sums.to(at::kInt));
  }
  return total;
}

}  // namespace fastformer
