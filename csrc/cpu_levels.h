// Which CPU kernels fastformer._C calls (csrc/cpu_levels.cpp): bound in csrc/fastformer.cpp.
#pragma once
#include <pybind11/pybind11.h>

#include <string>

namespace fastformer {

// The highest instruction-set level this CPU (and its OS) supports: "avx512", "avx2" or "default".
std::string best_cpu_level();

// Installs the kernel table of a fastformer._cpu_<level> module (its `kernels` capsule); returns its level.
std::string set_cpu_kernels(const pybind11::capsule& kernels);

}  // namespace fastformer
