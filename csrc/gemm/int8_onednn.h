// oneDNN's int8 products, the variant "onednn" of the int8 projections (csrc/gemm/int8_linear.cpp): on a CPU
// with AMX (amx_int8) oneDNN multiplies int8 tiles, several times the rate of fastformer's own VNNI kernels at
// many rows; elsewhere fastformer's own kernels are as fast or faster (docs/decoding.md, "int8 providers").
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
// plus oneDNN's compensation, owned by the weight's module and freed with it); per call x's bytes, oneDNN's
// (M, n) float32 sums written once and read once by the epilogue, a block of kOnednnBlock columns at a time so
// that they are read from cache (our own kernels keep theirs in registers), y written once.
//
// On a CPU without VNNI or AMX, oneDNN's int8 kernels sum byte pairs in 16 bits (vpmaddubsw), which can
// saturate for full-range operands: the rule never chooses "onednn" there, and forcing it warns.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <vector>

#include "gemm/gemm.h"

namespace fastformer {

// The rule's bounds (int8_linear.cpp int8_choose, onednn_preferred below), on a CPU with AMX: oneDNN's products
// from M = 32 rows, for projections of at least 2^22 multiply-adds (M N K). Below them oneDNN's fixed cost per
// call (its boxed dispatch, primitive lookup and output), which comes before any product, outweighs what its
// tiles could save (measured: docs/decoding.md, "int8 providers").
constexpr int64_t kOnednnMinRows = 32;
constexpr double kOnednnMinProducts = 4194304.0;  // 2^22 multiply-adds a call
// Whether the rule takes oneDNN's products for an M x K by K x N product on a CPU with AMX.
inline bool onednn_rule(int64_t M, int64_t N, int64_t K) {
  return M >= kOnednnMinRows && static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) >=
                                    kOnednnMinProducts;
}
constexpr int64_t kOnednnBlock = 4096;   // at most this many output columns a call: its (M, block) float32 sums
                                         // (2 MB at M = 128) stay in cache for the epilogue, and the freed
                                         // buffer is reused by the next call (a whole vocabulary at once was one
                                         // large allocation a call, page faults included: docs/cpu-kernels.md)

// Wq (n, K) as oneDNN's packed weights (csrc/gemm/int8_onednn.cpp onednn_int8_pack): a grid of blocks of
// output columns by chunks of inputs. Read-only once made; Python holds it as fastformer._C.OnednnInt8 (hidden
// visibility, as pybind11 declares its own types: a binding of a more visible type draws -Wattributes).
struct __attribute__((visibility("hidden"))) OnednnInt8 {
  int64_t n = 0, K = 0;            // the weight's outputs and inputs
  std::vector<at::Tensor> packed;  // [block b, chunk c] at b chunks + c: onednn::qlinear_prepack of
                                   // Wq[columns[b]:columns[b + 1], inputs[c]:inputs[c + 1]] (opaque layout)
  std::vector<int64_t> columns;    // block b covers outputs [columns[b], columns[b + 1]); columns.back() = n
  std::vector<int64_t> inputs;     // chunk c covers inputs [inputs[c], inputs[c + 1]); inputs.back() = K4 4
  at::Tensor ones;                 // (kOnednnBlock,) float32: the weight scales oneDNN applies (1: the sums)
  at::Tensor zero_points;          // (kOnednnBlock,) int64: the weights' zero points (0)
  int64_t blocks() const { return static_cast<int64_t>(columns.size()) - 1; }
  int64_t chunks() const { return static_cast<int64_t>(inputs.size()) - 1; }
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

// The rule's preference (int8_linear.cpp's provider table): oneDNN's products for an M x K by K x N product
// on a CPU with AMX where onednn_rule holds.
inline bool onednn_preferred(int64_t M, int64_t N, int64_t K) { return cpu_has_amx_int8() && onednn_rule(M, N, K); }

inline std::optional<c10::OperatorHandle> onednn_op(const char* name) {
  return c10::Dispatcher::singleton().findSchema({name, ""});
}

// Whether `name` is registered with exactly these arguments (the ones the calls below pass, in order).
inline bool onednn_op_takes(const char* name, const std::vector<std::string>& arguments) {
  const std::optional<c10::OperatorHandle> op = onednn_op(name);
  if (!op.has_value()) return false;
  const auto& args = op->schema().arguments();
  if (args.size() != arguments.size()) return false;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() != arguments[i]) return false;
  }
  return true;
}

// Whether torch was built with oneDNN and registers the two ops as called here (x86-64 builds of torch do).
inline bool onednn_int8_runs() {
  static const bool runs =
      at::hasMKLDNN() && onednn_op_takes("onednn::qlinear_prepack", {"weight", "x_shape"}) &&
      onednn_op_takes("onednn::qlinear_pointwise",
                      {"qx", "x_scale", "x_zero_point", "qw", "w_scale", "w_zero_point", "bias", "output_scale",
                       "output_zero_point", "output_dtype", "post_op_name", "post_op_args", "post_op_algorithm"});
  return runs;
}

// The sums (M, width) of block b, width = columns[b + 1] - columns[b]: sum_k xq[m, k] Wq[columns[b] + j, k] of
// q (M, K4 4) uint8 = xq + 128 (zero-padded past K with 128): float32 for one chunk of inputs, int32 for several
// (each chunk's float32 sums exact, converted and added).
inline at::Tensor onednn_int8_sums(const OnednnInt8& w, int64_t b, const at::Tensor& q) {
  static const c10::OperatorHandle op = *onednn_op("onednn::qlinear_pointwise");
  const int64_t width = w.columns[b + 1] - w.columns[b], chunks = w.chunks();
  const at::Tensor ones = w.ones.slice(0, 0, width), zero_points = w.zero_points.slice(0, 0, width);
  at::Tensor total;
  for (int64_t c = 0; c < chunks; ++c) {
    const at::Tensor part = chunks == 1 ? q : q.slice(1, w.inputs[c], w.inputs[c + 1]).contiguous();
    // qlinear_pointwise(qx, x_scale, x_zero_point, qw, w_scale, w_zero_point, bias, output_scale,
    //                   output_zero_point, output_dtype, post_op_name, post_op_args, post_op_algorithm)
    std::vector<c10::IValue> stack{part, 1.0, int64_t{128}, w.packed[b * chunks + c], ones, zero_points,
                                   c10::IValue(), 1.0, int64_t{0}, c10::IValue(at::kFloat), c10::IValue("none"),
                                   c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue("")};
    op.callBoxed(&stack);
    at::Tensor sums = stack[0].toTensor();
    if (chunks == 1) return sums;
    total = c == 0 ? sums.to(at::kInt) : total.add_(sums.to(at::kInt));
  }
  return total;
}

}  // namespace fastformer
