// fastformer._C's side of the decoding GEMMs (csrc/gemm/gemm.h has the layouts and the int8 rule): the
// weight preparation, the one copy of every check of these weights, and the entry points Python calls,
// which run the loaded CPU level's kernels through its table (csrc/cpu/kernel_table.h).
#define FASTFORMER_GEMM_CHECKS
#include "gemm/gemm.h"
#include "gemm/int8_onednn.h"

#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <tuple>

#include "cpu/kernel_table.h"
#include "cpu_levels.h"

namespace fastformer {
namespace {

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kChar: return "int8";
    case at::kInt: return "int32";
    default: return c10::toString(t);
  }
}

}  // namespace

void check_tensor(const at::Tensor& t, at::ScalarType dtype, const std::vector<int64_t>& shape, const std::string& who,
                  const std::string& what) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.sizes().vec() == shape,
                    who, ": ", what, " must be a contiguous ", dtype_name(dtype), " CPU tensor of shape ",
                    c10::IntArrayRef(shape), ", got ", dtype_name(t.scalar_type()), " ", t.sizes(), " on ",
                    t.device(), t.is_contiguous() ? "" : " (not contiguous)");
}

namespace {

const float* bias_of(const c10::optional<at::Tensor>& bias, int64_t n, const std::string& who,
                     const std::string& bias_name) {
  if (!bias.has_value()) return nullptr;
  check_tensor(*bias, at::kFloat, {n}, who, bias_name);
  return bias->const_data_ptr<float>();
}

// "<name>.<part>", or the part alone for an unnamed projection (an entry point's arguments).
std::string part_name(const std::string& name, const char* part) { return name.empty() ? part : name + "." + part; }

void check_sizes(int64_t K, int64_t n, const std::string& who, const std::string& name) {
  TORCH_CHECK_VALUE(n >= 0 && K >= 0, who, ": ", name.empty() ? "" : name + ": ", "n and K must be >= 0, got ", n,
                    " and ", K);
}

}  // namespace

PackedProjection packed_projection(const at::Tensor& panels, const c10::optional<at::Tensor>& bias, int64_t K,
                                   int64_t n, const std::string& who, const std::string& name,
                                   const std::string& bias_name) {
  check_sizes(K, n, who, name);
  check_tensor(panels, at::kFloat, packed_panels_shape(n, K), who, part_name(name, "panels"));
  PackedProjection w{};
  w.panels = panels.const_data_ptr<float>();
  w.bias = bias_of(bias, n, who, bias_name);
  return w;
}

PackedProjection int8_projection(const at::Tensor& weight, const at::Tensor& weight_scale,
                                 const at::Tensor& weight_colsum, const c10::optional<at::Tensor>& bias, int64_t K,
                                 int64_t n, const std::string& who, const std::string& name,
                                 const std::string& bias_name, const OnednnInt8* onednn) {
  check_sizes(K, n, who, name);
  TORCH_CHECK_VALUE(K <= kInt8MaxInputs, who, ": ", name.empty() ? "" : name + ": ", "int8 projections take at "
                    "most 65,536 inputs (the int32 accumulator's range), got ", K);
  check_tensor(weight, at::kChar, int8_weight_shape(n, K), who, part_name(name, "weight"));
  check_tensor(weight_scale, at::kFloat, {n}, who, part_name(name, "weight_scale"));
  check_tensor(weight_colsum, at::kInt, {n}, who, part_name(name, "weight_colsum"));
  TORCH_CHECK_VALUE(onednn == nullptr || (onednn->n == n && onednn->K == K), who, ": ", part_name(name, "onednn"),
                    " is the packing of a (", onednn == nullptr ? 0 : onednn->n, ", ",
                    onednn == nullptr ? 0 : onednn->K, ") weight, not of this (", n, ", ", K, ") one");
  PackedProjection w{};
  w.int8 = {weight.const_data_ptr<int8_t>(), weight_scale.const_data_ptr<float>(),
            weight_colsum.const_data_ptr<int32_t>(), onednn};
  w.bias = bias_of(bias, n, who, bias_name);
  return w;
}

namespace {

void check_weight(const at::Tensor& weight, const char* who) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
                    "fastformer ", who, ": expected a 2-D float32 CPU weight (n, K), got ",
                    dtype_name(weight.scalar_type()), " ", weight.sizes(), " on ", weight.device());
}

}  // namespace

// Memory: the weight read once, the panels (same bytes, zero-padded to whole panels) written once.
at::Tensor pack_linear(const at::Tensor& weight) {
  check_weight(weight, "pack_linear");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), K = w.size(1), P = kPackedLinearPanel;
  at::Tensor panels = at::zeros(packed_panels_shape(n, K), w.options());
  const float* src = w.const_data_ptr<float>();
  float* dst = panels.mutable_data_ptr<float>();
  for (int64_t row = 0; row < n; ++row) {
    float* column = dst + (row / P) * K * P + packed_column_offset(row % P, K);  // row k: k strip widths on
    for (int64_t k = 0; k < K; ++k) column[k * kPackedLinearStrip] = src[row * K + k];
  }
  return panels;
}

// The int8 rule of gemm.h per output channel, packed (int8_index); weight_colsum on the way.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_int8(const at::Tensor& weight) {
  check_weight(weight, "quantize_int8");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), K = w.size(1), K4 = (K + 3) / 4;
  TORCH_CHECK_VALUE(K <= kInt8MaxInputs, "fastformer quantize_int8: int8 projections take at most 65,536 inputs (the "
                    "int32 accumulator's range), got ", K);
  at::Tensor packed = at::zeros(int8_weight_shape(n, K), w.options().dtype(at::kChar));
  at::Tensor scale = at::empty({n}, w.options());
  at::Tensor colsum = at::empty({n}, w.options().dtype(at::kInt));
  const float* src = w.const_data_ptr<float>();
  int8_t* dst = packed.mutable_data_ptr<int8_t>();
  for (int64_t row = 0; row < n; ++row) {
    int32_t sum = 0;
    scale.mutable_data_ptr<float>()[row] = quantize_int8_row(src + row * K, K, [&](int64_t k, int8_t q) {
      dst[int8_index(row, k, K4)] = q;
      sum += q;
    });
    colsum.mutable_data_ptr<int32_t>()[row] = sum;
  }
  return {packed, scale, colsum};
}

// Wq s_w as float32 (n, K): the quantized model's weight where the int8 kernel does not apply.
at::Tensor dequantize_int8(const at::Tensor& weight, const at::Tensor& weight_scale, int64_t n, int64_t K) {
  const std::string who = "fastformer dequantize_int8";
  check_tensor(weight, at::kChar, int8_weight_shape(n, K), who, "weight");
  check_tensor(weight_scale, at::kFloat, {n}, who, "weight_scale");
  at::Tensor out = at::empty({n, K}, weight_scale.options());
  const Int8Weight w{weight.const_data_ptr<int8_t>(), weight_scale.const_data_ptr<float>(), nullptr};
  float* dst = out.mutable_data_ptr<float>();
  for (int64_t row = 0; row < n; ++row) int8_row(w, row, K, dst + row * K);
  return out;
}

// Memory: K int8 values and a scale read, K floats written, per id.
at::Tensor int8_embedding(const at::Tensor& ids, const at::Tensor& weight, const at::Tensor& weight_scale, int64_t n,
                          int64_t K) {
  const std::string who = "fastformer int8_embedding";
  check_tensor(weight, at::kChar, int8_weight_shape(n, K), who, "weight");
  check_tensor(weight_scale, at::kFloat, {n}, who, "weight_scale");
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong && ids.device().is_cpu(), who, ": ids must be an int64 CPU tensor, "
                    "got ", dtype_name(ids.scalar_type()), " on ", ids.device());
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t* id = flat.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    TORCH_CHECK_VALUE(id[i] >= 0 && id[i] < n, who, ": id ", id[i], " is outside [0, ", n, ")");
  }
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(K);
  at::Tensor out = at::empty(shape, weight_scale.options());
  const Int8Weight w{weight.const_data_ptr<int8_t>(), weight_scale.const_data_ptr<float>(), nullptr};
  float* dst = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < flat.numel(); ++i) int8_row(w, id[i], K, dst + i * K);
  return out;
}

namespace {

void check_x(const at::Tensor& x, const char* who) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "fastformer ", who,
                    ": x must be a 2-D float32 CPU tensor (M, K), got ", dtype_name(x.scalar_type()), " ", x.sizes(),
                    " on ", x.device());
}

}  // namespace

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  check_x(x, "packed_linear");
  const std::optional<at::Tensor> b = contiguous(bias);  // ops.h
  packed_projection(panels, b, x.size(1), n, "fastformer packed_linear", "", "bias");
  return cpu_kernels().gemm.packed_linear(x.contiguous(), panels, b, n);
}

namespace {

// A level's null-terminated list of names (int8_variants, product_variants) as strings.
std::vector<std::string> names_of(const char* const* list) {
  std::vector<std::string> names;
  for (const char* const* v = list; *v != nullptr; ++v) names.emplace_back(*v);
  return names;
}

}  // namespace

std::vector<std::string> product_variants() { return names_of(cpu_kernels().gemm.product_variants()); }

at::Tensor tile_product(const at::Tensor& a, const at::Tensor& b, const std::string& variant) {
  const std::string who = "fastformer tile_product";
  const std::vector<std::string> names = product_variants();
  TORCH_CHECK_VALUE(std::find(names.begin(), names.end(), variant) != names.end(), who, ": variant \"", variant,
                    "\" does not run here (", cpu_kernels().level, " level on this CPU: ", c10::Join(", ", names), ")");
  const bool bf16 = variant != "fma";
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), who, ": expected a (m, k) and b (k, n), "
                    "got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK_VALUE(a.device().is_cpu() && b.device().is_cpu() && a.scalar_type() == b.scalar_type() &&
                        (bf16 ? a.scalar_type() == at::kBFloat16
                              : a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble),
                    who, ": ", variant, " takes two CPU tensors of ", bf16 ? "bfloat16" : "float32 or float64",
                    ", got ", dtype_name(a.scalar_type()), " and ", dtype_name(b.scalar_type()));
  TORCH_CHECK_VALUE((a.size(1) <= 1 || a.stride(1) == 1) && (b.size(1) <= 1 || b.stride(1) == 1) &&
                        a.stride(0) >= a.size(1) && b.stride(0) >= b.size(1),
                    who, ": a and b must have unit column strides and rows that do not overlap");
  return cpu_kernels().gemm.tile_product(a, b, variant);
}

std::tuple<at::Tensor, at::Tensor> weight_grad(const at::Tensor& dy, const at::Tensor& x, const std::string& variant) {
  const std::string who = "fastformer weight_grad";
  const std::vector<std::string> names = product_variants();
  TORCH_CHECK_VALUE(variant.empty() || (variant != "fma" && std::find(names.begin(), names.end(), variant) !=
                                                                 names.end()),
                    who, ": variant \"", variant, "\" is not a bfloat16 product that runs here (", cpu_kernels().level,
                    " level on this CPU: ", c10::Join(", ", names), "; or \"\", the best)");
  TORCH_CHECK_VALUE(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0), who, ": expected dy (M, N) and x "
                    "(M, K) with the same rows, got ", dy.sizes(), " and ", x.sizes());
  TORCH_CHECK_VALUE(dy.device().is_cpu() && x.device().is_cpu() && dy.scalar_type() == at::kBFloat16 &&
                        x.scalar_type() == at::kBFloat16,
                    who, ": dy and x must be bfloat16 CPU tensors, got ", dtype_name(dy.scalar_type()), " on ",
                    dy.device(), " and ", dtype_name(x.scalar_type()), " on ", x.device());
  // Rows of unit column stride, read as they lie (a transposed or column-sliced view is copied first).
  const auto rows = [](const at::Tensor& t) {
    return (t.size(1) <= 1 || t.stride(1) == 1) && t.stride(0) >= t.size(1) ? t : t.contiguous();
  };
  return cpu_kernels().gemm.weight_grad(rows(dy), rows(x), variant == "bf16_emulated");
}

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("weight_grad", [](const at::Tensor& dy, const at::Tensor& x) { return weight_grad(dy, x, ""); });
}

std::vector<std::string> int8_variants() { return names_of(cpu_kernels().gemm.int8_variants()); }

int int8_variant_index(const std::string& variant, const std::string& who) {
  std::string name = variant;
  const char* source = "variant";
  if (name.empty()) {  // the one place FASTFORMER_INT8_PROVIDER is read
    const char* env = std::getenv("FASTFORMER_INT8_PROVIDER");
    name = env != nullptr ? env : "";
    source = "FASTFORMER_INT8_PROVIDER";
  }
  if (name.empty() || name == "auto") return -1;
  if (name == "fastformer") return 0;  // the best of our own
  const std::vector<std::string> names = int8_variants();
  const auto it = std::find(names.begin(), names.end(), name);
  TORCH_CHECK_VALUE(it != names.end(), who, ": ", source, " \"", name, "\" does not run here (", cpu_kernels().level,
                    " level on this CPU: ", c10::Join(", ", names), "; or \"fastformer\", the first of them, or "
                    "\"auto\")");
  if (name == "onednn" && !cpu_has_int8_dot()) {
    TORCH_WARN_ONCE("fastformer: oneDNN's int8 products forced on a CPU without VNNI or AMX, where they sum byte "
                    "pairs in 16 bits and can saturate: int8 results may differ from every other variant");
  }
  return static_cast<int>(it - names.begin());
}

std::string int8_provider(const std::string& variant) {
  const int index = int8_variant_index(variant, "fastformer int8_provider");
  return index >= 0 ? int8_variants()[index] : "auto";
}

std::string int8_variant_for(int64_t M, int64_t N, int64_t K) {
  TORCH_CHECK_VALUE(M >= 1 && N >= 1 && K >= 0, "fastformer int8_variant_for: M and N must be >= 1 and K >= 0, "
                    "got ", M, ", ", N, " and ", K);
  const int forced = int8_variant_index("", "fastformer int8_variant_for");
  return int8_variants()[forced >= 0 ? forced : cpu_kernels().gemm.int8_choose(M, N, K)];
}

bool int8_needs_pack(int variant) { return cpu_kernels().gemm.int8_packs(variant); }

std::shared_ptr<OnednnInt8> int8_prepare(const at::Tensor& weight, const at::Tensor& weight_scale,
                                         const at::Tensor& weight_colsum, int64_t n, int64_t K,
                                         const std::string& variant) {
  const int index = int8_variant_index(variant, "fastformer int8_prepare");
  int8_projection(weight, weight_scale, weight_colsum, c10::nullopt, K, n, "fastformer int8_prepare", "", "", nullptr);
  if (n == 0 || K == 0 || !int8_needs_pack(index)) return nullptr;
  return onednn_int8_pack(weight, n, K);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const at::Tensor& weight_colsum, const c10::optional<at::Tensor>& bias, int64_t n,
                       const std::string& variant, const std::shared_ptr<OnednnInt8>& onednn) {
  check_x(x, "int8_linear");
  const std::optional<at::Tensor> b = contiguous(bias);  // ops.h
  const int64_t M = x.size(0), K = x.size(1);
  PackedProjection w = int8_projection(weight, weight_scale, weight_colsum, b, K, n, "fastformer int8_linear", "",
                                       "bias", onednn.get());
  // The variant this call runs (auto: the rule's for M x K by K x n); oneDNN's without a pack given: W packed
  // for this call alone (correct, and as slow as packing: the int8 modules hold theirs).
  const int index = int8_variant_index(variant, "fastformer int8_linear");
  const int chosen = index >= 0 || M == 0 || n == 0 ? index : cpu_kernels().gemm.int8_choose(M, n, K);
  std::shared_ptr<OnednnInt8> for_this_call;
  if (w.int8.onednn == nullptr && M > 0 && n > 0 && K > 0 && chosen >= 0 && int8_needs_pack(chosen)) {
    for_this_call = onednn_int8_pack(weight, n, K);
    w.int8.onednn = for_this_call.get();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, n}, x.options());
  cpu_kernels().gemm.int8_linear_rows(xc.const_data_ptr<float>(), M, K, w.int8, w.bias, y.mutable_data_ptr<float>(),
                                      n, n, chosen);
  return y;
}

}  // namespace fastformer
