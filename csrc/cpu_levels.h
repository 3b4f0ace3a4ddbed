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

// y (M, n) = x (M, K) W^T + bias with W packed as column panels (csrc/cpu/packed_linear.cpp), through the
// loaded level's table; ValueError on bad arguments.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                         int64_t n);

// y (M, n) = x (M, K) W^T + bias with W quantized to int8 (csrc/cpu/int8_linear.cpp): panels int8
// (ceil(n / 32), ceil(K / 4), 32, 4), scale float32 (n,), colsum int32 (n,); variant: one of int8_variants()
// ("" for the best); ValueError on bad arguments.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                       const at::Tensor& colsum, const c10::optional<at::Tensor>& bias, int64_t n,
                       const std::string& variant);
// The int8 dot-product variants this CPU runs at the loaded level, best first.
std::vector<std::string> int8_variants();

// Binds fastformer._C.CpuDecoder, the incremental decoder's float32 CPU step (csrc/decoder.cpp).
void bind_decoder(pybind11::module_& m);

// Binds fastformer._C.BeamSearch, the beam search's bookkeeping (csrc/beam_search.cpp).
void bind_beam_search(pybind11::module_& m);

}  // namespace fastformer
