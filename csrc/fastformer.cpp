// The one pybind11 binding file of fastformer._C. Entry points are named <op>_<fwd|bwd>_<backend>;
// fastformer/_dispatch.py finds them by that name.
#include <torch/extension.h>

#include <ATen/cpu/vec/vec.h>

#include "cpu/cpu_ops.h"
#ifdef FASTFORMER_WITH_CUDA
#include "cuda/cuda_ops.h"
#endif

#ifndef FASTFORMER_TORCH_VERSION
#define FASTFORMER_TORCH_VERSION "unknown"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastformer fused kernels: attention, softmax, layer_norm_residual (C++ CPU and CUDA)";
  m.attr("TORCH_VERSION") = FASTFORMER_TORCH_VERSION;
  // SIMD width the CPU kernels were compiled for (floats per at::vec::Vectorized<float>).
  m.attr("CPU_VECTOR_FLOATS") = static_cast<int>(at::vec::Vectorized<float>::size());
#ifdef FASTFORMER_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  namespace cpu = fastformer::cpu;
  m.def("attention_fwd_cpu", &cpu::attention_fwd, "attention forward (CPU)");
  m.def("attention_bwd_cpu", &cpu::attention_bwd, "attention backward (CPU)");
  m.def("softmax_fwd_cpu", &cpu::softmax_fwd, "softmax forward (CPU)");
  m.def("softmax_bwd_cpu", &cpu::softmax_bwd, "softmax backward (CPU)");
  m.def("layer_norm_residual_fwd_cpu", &cpu::layer_norm_residual_fwd, "layer_norm_residual forward (CPU)");
  m.def("layer_norm_residual_bwd_cpu", &cpu::layer_norm_residual_bwd, "layer_norm_residual backward (CPU)");
#ifdef FASTFORMER_WITH_CUDA
  namespace cuda = fastformer::cuda;
  m.def("attention_fwd_cuda", &cuda::attention_fwd, "attention forward (CUDA)");
  m.def("attention_bwd_cuda", &cuda::attention_bwd, "attention backward (CUDA)");
  m.def("softmax_fwd_cuda", &cuda::softmax_fwd, "softmax forward (CUDA)");
  m.def("softmax_bwd_cuda", &cuda::softmax_bwd, "softmax backward (CUDA)");
  m.def("layer_norm_residual_fwd_cuda", &cuda::layer_norm_residual_fwd, "layer_norm_residual forward (CUDA)");
  m.def("layer_norm_residual_bwd_cuda", &cuda::layer_norm_residual_bwd, "layer_norm_residual backward (CUDA)");
#endif
}
