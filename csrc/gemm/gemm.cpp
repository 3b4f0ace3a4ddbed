// fastformer._C's side of the decoding GEMMs (csrc/gemm/gemm.h has the layouts and the int8 rule): the
// weight preparation, the one copy of every check of these weights, and the entry points Python calls,
// which run the loaded CPU level's kernels through its table (csrc/cpu/kernel_table.h).
#define FASTFORMER_GEMM_CHECKS
#include "gemm/gemm.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
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

const float* bias_of(const c10::optional<at::Tensor>& bias, int64_t n, const std::string& who, const std::string& name) {
  if (!bias.has_value()) return nullptr;
  check_tensor(*bias, at::kFloat, {n}, who, name + ".bias");
  return bias->const_data_ptr<float>();
}

}  // namespace

PackedProjection packed_projection(const at::Tensor& panels, const c10::optional<at::Tensor>& bias, int64_t K,
                                   int64_t n, const std::string& who, const std::string& name) {
  TORCH_CHECK_VALUE(n >= 0 && K >= 0, who, ": ", name, ": n and K must be >= 0, got ", n, " and ", K);
  check_tensor(panels, at::kFloat, packed_panels_shape(n, K), who, name + ".panels");
  PackedProjection w{};
  w.panels = panels.const_data_ptr<float>();
  w.bias = bias_of(bias, n, who, name);
  return w;
}

PackedProjection int8_projection(const at::Tensor& panels, const at::Tensor& scale, const at::Tensor& colsum,
                                 const c10::optional<at::Tensor>& bias, int64_t K, int64_t n, const std::string& who,
                                 const std::string& name) {
  TORCH_CHECK_VALUE(n >= 0 && K >= 0, who, ": ", name, ": n and K must be >= 0, got ", n, " and ", K);
  TORCH_CHECK_VALUE(K <= kInt8MaxInputs, who, ": ", name, ": int8 projections take at most 65,536 inputs (the int32 "
                    "accumulator's range), got ", K);
  check_tensor(panels, at::kChar, int8_panels_shape(n, K), who, name + ".int8_panels");
  check_tensor(scale, at::kFloat, {n}, who, name + ".int8_scale");
  check_tensor(colsum, at::kInt, {n}, who, name + ".int8_colsum");
  PackedProjection w{};
  w.int8 = {panels.const_data_ptr<int8_t>(), scale.const_data_ptr<float>(), colsum.const_data_ptr<int32_t>()};
  w.bias = bias_of(bias, n, who, name);
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

// The weight rule of gemm.h: per output channel its step and its int8 values, packed; colsum on the way.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_int8(const at::Tensor& weight) {
  check_weight(weight, "quantize_int8");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), K = w.size(1), P = kPackedLinearPanel, K4 = (K + 3) / 4;
  TORCH_CHECK_VALUE(K <= kInt8MaxInputs, "fastformer quantize_int8: int8 projections take at most 65,536 inputs (the "
                    "int32 accumulator's range), got ", K);
  at::Tensor panels = at::zeros(int8_panels_shape(n, K), w.options().dtype(at::kChar));
  at::Tensor scale = at::empty({n}, w.options());
  at::Tensor colsum = at::empty({n}, w.options().dtype(at::kInt));
  const float* src = w.const_data_ptr<float>();
  int8_t* dst = panels.mutable_data_ptr<int8_t>();
  for (int64_t row = 0; row < n; ++row) {
    const float* r = src + row * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(r[k]));
    const float inv = int8_inverse_step(amax);
    const int64_t p = row / P, j = row % P;
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int8_t q = quantize_int8_value(r[k], inv);
      dst[((p * K4 + k / 4) * P + j) * 4 + k % 4] = q;
      sum += q;
    }
    scale.mutable_data_ptr<float>()[row] = amax / 127.0f;
    colsum.mutable_data_ptr<int32_t>()[row] = sum;
  }
  return {panels, scale, colsum};
}

// Wq s_w as float32 (n, K): the quantized model's weight where the int8 kernel does not apply.
at::Tensor dequantize_int8(const at::Tensor& panels, const at::Tensor& scale, int64_t n, int64_t K) {
  const std::string who = "fastformer dequantize_int8";
  check_tensor(panels, at::kChar, int8_panels_shape(n, K), who, "panels");
  check_tensor(scale, at::kFloat, {n}, who, "scale");
  at::Tensor out = at::empty({n, K}, scale.options());
  const Int8Weight w{panels.const_data_ptr<int8_t>(), scale.const_data_ptr<float>(), nullptr};
  float* dst = out.mutable_data_ptr<float>();
  for (int64_t row = 0; row < n; ++row) int8_row(w, row, K, dst + row * K);
  return out;
}

// Memory: K int8 values and a scale read, K floats written, per id.
at::Tensor int8_embedding(const at::Tensor& ids, const at::Tensor& panels, const at::Tensor& scale, int64_t n,
                          int64_t K) {
  const std::string who = "fastformer int8_embedding";
  check_tensor(panels, at::kChar, int8_panels_shape(n, K), who, "panels");
  check_tensor(scale, at::kFloat, {n}, who, "scale");
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong && ids.device().is_cpu(), who, ": ids must be an int64 CPU tensor, "
                    "got ", dtype_name(ids.scalar_type()), " on ", ids.device());
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t* id = flat.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    TORCH_CHECK_VALUE(id[i] >= 0 && id[i] < n, who, ": id ", id[i], " is outside [0, ", n, ")");
  }
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(K);
  at::Tensor out = at::empty(shape, scale.options());
  const Int8Weight w{panels.const_data_ptr<int8_t>(), scale.const_data_ptr<float>(), nullptr};
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
  packed_projection(panels, b, x.size(1), n, "fastformer packed_linear", "weight");
  return cpu_kernels().gemm.packed_linear(x.contiguous(), panels, b, n);
}

std::vector<std::string> int8_variants() {
  std::vector<std::string> names;
  for (const char* const* v = cpu_kernels().gemm.int8_variants(); *v != nullptr; ++v) names.emplace_back(*v);
  return names;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                       const at::Tensor& colsum, const c10::optional<at::Tensor>& bias, int64_t n,
                       const std::string& variant) {
  check_x(x, "int8_linear");
  const std::optional<at::Tensor> b = contiguous(bias);  // ops.h
  const PackedProjection w = int8_projection(panels, scale, colsum, b, x.size(1), n, "fastformer int8_linear", "weight");
  int index = 0;
  if (!variant.empty()) {
    const std::vector<std::string> names = int8_variants();
    const auto it = std::find(names.begin(), names.end(), variant);
    TORCH_CHECK_VALUE(it != names.end(), "fastformer int8_linear: variant \"", variant, "\" does not run here (",
                      cpu_kernels().level, " level on this CPU: ", c10::Join(", ", names), ")");
    index = static_cast<int>(it - names.begin());
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  cpu_kernels().gemm.int8_linear_rows(xc.const_data_ptr<float>(), x.size(0), x.size(1), w.int8, w.bias,
                                      y.mutable_data_ptr<float>(), n, n, index);
  return y;
}

}  // namespace fastformer
