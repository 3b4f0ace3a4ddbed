// The CPU dispatch key of every op: the adapters of csrc/ops.h (argument checks, contiguous tensors,
// defaults), then the entry points of the CPU kernels of the instruction-set level chosen at import,
// through their table (csrc/cpu/kernel_table.h). fastformer/_ext.py picks the level (the best this CPU
// supports, or a lower one from FASTFORMER_CPU_CAPABILITY) and installs its module's table once, before
// any op can run; a call through the table is one indirect call.
#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "cpu/kernel_table.h"
#include "cpu_levels.h"
#include "ops.h"

namespace fastformer {
namespace {

const CpuKernels* g_kernels = nullptr;

}  // namespace

const CpuKernels& cpu_kernels() {
  TORCH_CHECK(g_kernels != nullptr, "fastformer: no CPU kernels are loaded (fastformer/_ext.py installs them at "
              "import; import fastformer before calling torch.ops.fastformer)");
  return *g_kernels;
}

namespace {

// ThroughTable<&CpuKernels::softmax_fwd>::call has softmax_fwd's signature and calls the loaded level's.
template <auto Member>
struct ThroughTable;

template <typename R, typename... Args, R (*CpuKernels::*Member)(Args...)>
struct ThroughTable<Member> {
  static R call(Args... args) { return (cpu_kernels().*Member)(args...); }
};

}  // namespace

std::string best_cpu_level() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();  // cpuid, and XGETBV for the OS's support of the AVX and AVX-512 register state
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    return "avx512";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return "avx2";
  }
#endif
  return "default";
}

Tensor packed_linear(const Tensor& x, const Tensor& panels, const c10::optional<Tensor>& bias, int64_t n) {
  constexpr int64_t P = kPackedLinearPanel;
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                    "fastformer packed_linear: x must be a 2-D float32 CPU tensor (M, K), got ", x.scalar_type(), " ",
                    x.sizes(), " on ", x.device());
  TORCH_CHECK_VALUE(n >= 0, "fastformer packed_linear: n must be >= 0, got ", n);
  TORCH_CHECK_VALUE(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.device().is_cpu() &&
                        panels.size(0) == (n + P - 1) / P && panels.size(1) == x.size(1) && panels.size(2) == P,
                    "fastformer packed_linear: panels must be float32 (ceil(n / ", P, "), K, ", P, ") = (",
                    (n + P - 1) / P, ", ", x.size(1), ", ", P, ") on the CPU, got ", panels.scalar_type(), " ",
                    panels.sizes());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat &&
                          bias->device().is_cpu(),
                      "fastformer packed_linear: bias must be a float32 CPU tensor of shape (", n, "), got ",
                      bias->scalar_type(), " ", bias->sizes());
  }
  const c10::optional<Tensor> b = bias.has_value() ? c10::optional<Tensor>(bias->contiguous()) : c10::nullopt;
  return cpu_kernels().packed_linear(x.contiguous(), panels.contiguous(), b, n);
}

std::vector<std::string> int8_variants() {
  std::vector<std::string> names;
  for (const char* const* v = cpu_kernels().int8_variants(); *v != nullptr; ++v) names.emplace_back(*v);
  return names;
}

Tensor int8_linear(const Tensor& x, const Tensor& panels, const Tensor& scale, const Tensor& colsum,
                   const c10::optional<Tensor>& bias, int64_t n, const std::string& variant) {
  constexpr int64_t P = kPackedLinearPanel;
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                    "fastformer int8_linear: x must be a 2-D float32 CPU tensor (M, K), got ", x.scalar_type(), " ",
                    x.sizes(), " on ", x.device());
  const int64_t K = x.size(1);
  TORCH_CHECK_VALUE(n >= 0, "fastformer int8_linear: n must be >= 0, got ", n);
  TORCH_CHECK_VALUE(K <= 65536, "fastformer int8_linear: at most 65,536 inputs (the int32 accumulator's range), got ",
                    K);
  TORCH_CHECK_VALUE(panels.scalar_type() == at::kChar && panels.device().is_cpu() &&
                        panels.sizes().vec() == std::vector<int64_t>({(n + P - 1) / P, (K + 3) / 4, P, 4}),
                    "fastformer int8_linear: panels must be int8 (ceil(n / ", P, "), ceil(K / 4), ", P, ", 4) = (",
                    (n + P - 1) / P, ", ", (K + 3) / 4, ", ", P, ", 4) on the CPU, got ", panels.scalar_type(), " ",
                    panels.sizes());
  TORCH_CHECK_VALUE(scale.scalar_type() == at::kFloat && scale.device().is_cpu() && scale.dim() == 1 &&
                        scale.size(0) == n,
                    "fastformer int8_linear: scale must be a float32 CPU tensor of shape (", n, "), got ",
                    scale.scalar_type(), " ", scale.sizes());
  TORCH_CHECK_VALUE(colsum.scalar_type() == at::kInt && colsum.device().is_cpu() && colsum.dim() == 1 &&
                        colsum.size(0) == n,
                    "fastformer int8_linear: colsum must be an int32 CPU tensor of shape (", n, "), got ",
                    colsum.scalar_type(), " ", colsum.sizes());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat &&
                          bias->device().is_cpu(),
                      "fastformer int8_linear: bias must be a float32 CPU tensor of shape (", n, "), got ",
                      bias->scalar_type(), " ", bias->sizes());
  }
  int index = 0;
  if (!variant.empty()) {
    const std::vector<std::string> names = int8_variants();
    const auto it = std::find(names.begin(), names.end(), variant);
    TORCH_CHECK_VALUE(it != names.end(), "fastformer int8_linear: variant \"", variant, "\" does not run here (",
                      cpu_kernels().level, " level on this CPU: ", c10::Join(", ", names), ")");
    index = static_cast<int>(it - names.begin());
  }
  const Tensor xc = x.contiguous(), pc = panels.contiguous(), sc = scale.contiguous(), cc = colsum.contiguous();
  const c10::optional<Tensor> b = bias.has_value() ? c10::optional<Tensor>(bias->contiguous()) : c10::nullopt;
  Tensor y = at::empty({x.size(0), n}, x.options());
  const Int8Weight w{pc.const_data_ptr<int8_t>(), sc.const_data_ptr<float>(), cc.const_data_ptr<int32_t>()};
  cpu_kernels().int8_linear_rows(xc.const_data_ptr<float>(), x.size(0), K, w,
                                 b.has_value() ? b->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), n,
                                 index);
  return y;
}

std::string set_cpu_kernels(const pybind11::capsule& kernels) {
  TORCH_CHECK_VALUE(kernels.name() != nullptr && std::strcmp(kernels.name(), kCpuKernelsCapsule) == 0,
                    "fastformer: not a CPU kernel table (expected the `kernels` capsule of fastformer._cpu_<level>)");
  const auto* table = static_cast<const CpuKernels*>(kernels.get_pointer());
  TORCH_CHECK(table->abi == kCpuKernelsAbi, "fastformer: the CPU kernel module of level ", table->level,
              " has table layout ", table->abi, ", fastformer._C expects ", kCpuKernelsAbi,
              "; rebuild fastformer (pip install --no-build-isolation .)");
  g_kernels = table;
  return table->level;
}

}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
#define FASTFORMER_IMPL_CPU(op, ...)                                                                   \
  m.impl(#op "_fwd", &::fastformer::op##_fwd_op<&::fastformer::ThroughTable<&::fastformer::CpuKernels::op##_fwd>::call>); \
  m.impl(#op "_bwd", &::fastformer::op##_bwd_op<&::fastformer::ThroughTable<&::fastformer::CpuKernels::op##_bwd>::call>);
  FASTFORMER_OPS(FASTFORMER_IMPL_CPU)
#undef FASTFORMER_IMPL_CPU
}
