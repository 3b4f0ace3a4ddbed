// Which CPU kernels fastformer._C calls (csrc/cpu_levels.cpp): bound in csrc/fastformer.cpp.
#pragma once
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

namespace fastformer {

// The highest instruction-set level this CPU (and its OS) supports: "avx512", "avx2" or "default".
std::string best_cpu_level();

struct CpuKernels;
// The kernel table of the loaded level (an error before fastformer/_ext.py installed one).
const CpuKernels& cpu_kernels();

// Installs the kernel table of a fastformer._cpu_<level> module (its `kernels` capsule); returns its level.
std::string set_cpu_kernels(const pybind11::capsule& kernels);

// Binds fastformer._C.CpuDecoder, the incremental decoder's CPU step (csrc/inference/decoder.cpp).
void bind_decoder(pybind11::module_& m);

// Binds fastformer._C.BeamSearch, the beam search's bookkeeping (csrc/inference/beam_search.cpp).
void bind_beam_search(pybind11::module_& m);

}  // namespace fastformer
