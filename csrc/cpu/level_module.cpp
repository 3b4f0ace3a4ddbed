// The module fastformer._cpu_<level>: the CPU kernels compiled for one instruction-set level (setup.py
// compiles this file with csrc/cpu/<op>.cpp and the level's flags, FASTFORMER_CPU_LEVEL naming it), handed
// to fastformer._C as a capsule holding the table of their entry points (csrc/cpu/kernel_table.h).
#include <ATen/cpu/vec/vec.h>
#include <pybind11/pybind11.h>

#include "cpu/cpu_ops.h"
#include "cpu/kernel_table.h"

#ifndef FASTFORMER_CPU_LEVEL
#error "compile with -DFASTFORMER_CPU_LEVEL=\"default\" (or avx2, avx512) and the level's flags"
#endif

namespace {

const fastformer::CpuKernels kTable = {
    fastformer::kCpuKernelsAbi, FASTFORMER_CPU_LEVEL, static_cast<int>(at::vec::Vectorized<float>::size()),
#define FASTFORMER_CPU_TABLE_INIT(op, ...) &fastformer::cpu::op##_fwd, &fastformer::cpu::op##_bwd,
    FASTFORMER_OPS(FASTFORMER_CPU_TABLE_INIT)
#undef FASTFORMER_CPU_TABLE_INIT
    &fastformer::cpu::packed_linear,
    &fastformer::cpu::decoder_step,
    &fastformer::cpu::search_candidates,
    &fastformer::cpu::int8_linear_rows,
    &fastformer::cpu::int8_variants,
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastformer CPU kernels compiled for one instruction-set level (loaded by fastformer._ext)";
  m.attr("LEVEL") = FASTFORMER_CPU_LEVEL;
  m.attr("VECTOR_FLOATS") = kTable.vector_floats;
  m.attr("kernels") = pybind11::capsule(static_cast<const void*>(&kTable), fastformer::kCpuKernelsCapsule);
}
