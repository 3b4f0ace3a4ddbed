// The CPU dispatch key of every op: the adapters of csrc/ops.h (argument checks, contiguous tensors,
// defaults), then the entry points of the CPU kernels of the instruction-set level chosen at import,
// through their table (csrc/cpu/kernel_table.h). fastformer/_ext.py picks the level (the best this CPU
// supports, or a lower one from FASTFORMER_CPU_CAPABILITY) and installs its module's table once, before
// any op can run; a call through the table is one indirect call.
#include <torch/library.h>

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

std::string set_cpu_kernels(const pybind11::capsule& kernels) {
  TORCH_CHECK_VALUE(kernels.name() != nullptr && std::strcmp(kernels.name(), kCpuKernelsCapsule) == 0,
                    "fastformer: not a CPU kernel table (expected the `kernels` capsule of fastformer._cpu_<level>)");
  const auto* table = static_cast<const CpuKernels*>(kernels.get_pointer());
  TORCH_CHECK(std::strcmp(table->layout, FASTFORMER_KERNEL_TABLE) == 0, "fastformer: the CPU kernel module of level ",
              table->level, " was built from other kernel-table headers (digest ", table->layout,
              ") than fastformer._C (", FASTFORMER_KERNEL_TABLE,
              "); rebuild fastformer (pip install --no-build-isolation .)");
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
