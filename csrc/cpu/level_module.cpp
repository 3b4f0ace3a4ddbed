// The module fastformer._cpu_<level>: the CPU kernels compiled for one instruction-set level (setup.py
// compiles this file with the level sources and the level's flags, FASTFORMER_CPU_LEVEL naming it), handed
// to fastformer._C as a capsule holding the table of their entry points (csrc/cpu/kernel_table.h).
#include <ATen/cpu/vec/vec.h>
#include <pybind11/pybind11.h>

#include "cpu/cpu_ops.h"
#include "cpu/kernel_table.h"

#ifndef FASTFORMER_CPU_LEVEL
#error "compile with -DFASTFORMER_CPU_LEVEL=\"default\" (or avx2, avx512) and the level's flags"
#endif

namespace {

#define FASTFORMER_CPU_TABLE_INIT(name) &fastformer::cpu::name,
const fastformer::CpuKernels kTable = {
    FASTFORMER_KERNEL_TABLE, FASTFORMER_CPU_LEVEL, static_cast<int>(at::vec::Vectorized<float>::size()),
#define FASTFORMER_CPU_TABLE_OP(op, ...) &fastformer::cpu::op##_fwd, &fastformer::cpu::op##_bwd,
    FASTFORMER_OPS(FASTFORMER_CPU_TABLE_OP)
#undef FASTFORMER_CPU_TABLE_OP
    {FASTFORMER_GEMM_KERNELS(FASTFORMER_CPU_TABLE_INIT)},
    {FASTFORMER_INFERENCE_KERNELS(FASTFORMER_CPU_TABLE_INIT)},
    {FASTFORMER_OPTIM_KERNELS(FASTFORMER_CPU_TABLE_INIT)},
};
#undef FASTFORMER_CPU_TABLE_INIT

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastformer CPU kernels compiled for one instruction-set level (loaded by fastformer._ext)";
  m.attr("LEVEL") = FASTFORMER_CPU_LEVEL;
  m.attr("KERNEL_TABLE") = FASTFORMER_KERNEL_TABLE;
  m.attr("VECTOR_FLOATS") = kTable.vector_floats;
  m.attr("kernels") = pybind11::capsule(static_cast<const void*>(&kTable), fastformer::kCpuKernelsCapsule);
}
