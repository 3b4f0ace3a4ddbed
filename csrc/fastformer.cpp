// fastformer._C: the operator library (schemas of csrc/ops.h, registered with the dispatcher) and the
// pybind11 module. Kernels register for their dispatch keys in their own files: csrc/cpu_levels.cpp (CPU:
// the kernels of csrc/cpu/<op>.cpp, of the instruction-set level chosen at import), csrc/cuda/<op>.cu
// (CUDA), csrc/autograd/<op>.cpp (Autograd); the *_py ops get their implementations and every op its fake
// kernel from Python (fastformer/ops/<op>.py).
#include <torch/extension.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "cpu/kernel_table.h"
#include "cpu_levels.h"
#include "ops.h"

#ifndef FASTFORMER_TORCH_VERSION
#define FASTFORMER_TORCH_VERSION "unknown"
#endif

TORCH_LIBRARY(fastformer, m) {
#define FASTFORMER_DEFINE(op, fwd_args, fwd_returns, bwd_args, bwd_returns)                    \
  m.def(#op "_fwd(" fwd_args ") -> " fwd_returns);                                            \
  m.def(#op "_bwd(" bwd_args ") -> " bwd_returns);                                            \
  m.def(#op "_fwd_py(" fwd_args ", str backend) -> " fwd_returns);                            \
  m.def(#op "_bwd_py(" bwd_args ", str backend) -> " bwd_returns);
  FASTFORMER_OPS(FASTFORMER_DEFINE)
#undef FASTFORMER_DEFINE
}

namespace {

std::vector<std::string> op_names() {
  std::vector<std::string> names;
#define FASTFORMER_NAME(op, ...) names.emplace_back(#op);
  FASTFORMER_OPS(FASTFORMER_NAME)
#undef FASTFORMER_NAME
  return names;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastformer fused kernels: attention, softmax, layer_norm_residual, cross_entropy (C++ CPU and CUDA)";
  m.attr("TORCH_VERSION") = FASTFORMER_TORCH_VERSION;
  m.attr("OPS") = py::tuple(py::cast(op_names()));
  m.def("best_cpu_level", &fastformer::best_cpu_level,
        "the highest CPU kernel level this CPU supports: avx512, avx2 or default");
  m.def("set_cpu_kernels", &fastformer::set_cpu_kernels, "installs a fastformer._cpu_<level> module's kernel table");
  m.attr("PACKED_LINEAR_PANEL") = fastformer::kPackedLinearPanel;
  m.def("packed_linear", &fastformer::packed_linear, py::arg("x"), py::arg("panels"), py::arg("bias"), py::arg("n"),
        "y (M, n) = x (M, K) W^T + bias, float32 on the CPU, W packed as panels (ceil(n / PACKED_LINEAR_PANEL), K, "
        "PACKED_LINEAR_PANEL) of W^T's columns (zeros past n): the model's projections at inference");
  fastformer::bind_decoder(m);
  fastformer::bind_beam_search(m);
#ifdef FASTFORMER_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  // The argument checks of csrc/ops.h, for the ops implemented in Python (ValueError on bad input).
  m.def("check_attention",
        [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
           double dropout_p, std::optional<double> scale) {
          fastformer::check_attention(q, k, v, mask, dropout_p);
          return fastformer::attention_scale(scale, q);
        },
        "checks ops.attention's arguments; returns the scale (1/sqrt(D) when None)");
  m.def("check_softmax", &fastformer::check_softmax, "checks ops.softmax's arguments");
  m.def("check_layer_norm_residual", &fastformer::check_layer_norm_residual,
        "checks ops.layer_norm_residual's arguments");
  m.def("check_cross_entropy", &fastformer::check_cross_entropy, "checks ops.cross_entropy's arguments");
}
