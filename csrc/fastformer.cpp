// fastformer._C: the operator library (schemas of csrc/ops.h, registered with the dispatcher) and the
// pybind11 module. Kernels register for their dispatch keys in their own files: csrc/cpu_levels.cpp (CPU:
// the kernels of csrc/cpu/<op>.cpp, of the instruction-set level chosen at import), csrc/cuda/<op>.cu
// (CUDA), csrc/autograd/<op>.cpp (Autograd); the *_py ops get their implementations and every op its fake
// kernel from Python (fastformer/ops/<op>.py).
#include <torch/extension.h>
#include <torch/library.h>

#include <string>
#include <vector>

#define FASTFORMER_GEMM_CHECKS
#include "cpu/kernel_table.h"
#include "cpu_levels.h"
#include "gemm/gemm.h"
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
  m.attr("KERNEL_TABLE") = FASTFORMER_KERNEL_TABLE;
  // The decoding GEMMs (csrc/gemm/gemm.h: the layouts, the int8 rule, the checks).
  m.attr("PACKED_LINEAR_PANEL") = fastformer::kPackedLinearPanel;
  m.def("pack_linear", &fastformer::pack_linear, py::arg("weight"),
        "a float32 weight (n, K) as the panels packed_linear streams: (ceil(n / PACKED_LINEAR_PANEL), K, "
        "PACKED_LINEAR_PANEL), W^T's columns, zeros past n");
  m.def("quantize_int8", &fastformer::quantize_int8, py::arg("weight"),
        "a float32 weight (n, K) quantized per output channel (csrc/gemm/gemm.h's rule) -> (panels int8 "
        "(ceil(n / 32), ceil(K / 4), 32, 4), scale float32 (n,), colsum int32 (n,))");
  m.def("dequantize_int8", &fastformer::dequantize_int8, py::arg("panels"), py::arg("scale"), py::arg("n"),
        py::arg("K"), "Wq s_w as a float32 (n, K) weight, from quantize_int8's panels and scale");
  m.def("packed_linear", &fastformer::packed_linear, py::arg("x"), py::arg("panels"), py::arg("bias"), py::arg("n"),
        "y (M, n) = x (M, K) W^T + bias, float32 on the CPU, W packed by pack_linear: the model's projections at "
        "inference");
  m.def("int8_linear", &fastformer::int8_linear, py::arg("x"), py::arg("panels"), py::arg("scale"),
        py::arg("colsum"), py::arg("bias"), py::arg("n"), py::arg("variant") = "",
        "y (M, n) = x (M, K) W^T + bias with W quantized by quantize_int8 and x per row "
        "(csrc/gemm/int8_linear.cpp): a quantized model's projections; variant: one of int8_variants() (\"\": the best)");
  m.def("int8_variants", &fastformer::int8_variants,
        "the int8 dot-product variants this CPU runs at the loaded level, best first");
  // The inference room (csrc/inference/inference.h).
  fastformer::bind_decoder(m);
  fastformer::bind_beam_search(m);
#ifdef FASTFORMER_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  // The argument checks of csrc/ops.h, for the ops implemented in Python (ValueError on bad input). Tensor
  // arguments come in as optional, so that None reaches the checks (and their "must be a torch.Tensor, got
  // None") as it reaches them through the registered ops, instead of pybind11's TypeError.
  using OptTensor = std::optional<at::Tensor>;
  const auto given = [](const OptTensor& t) { return t.value_or(at::Tensor()); };
  m.def("check_attention",
        [given](const OptTensor& q, const OptTensor& k, const OptTensor& v, const OptTensor& mask, double dropout_p,
                std::optional<double> scale) {
          fastformer::check_attention(given(q), given(k), given(v), mask, dropout_p);
          return fastformer::attention_scale(scale, *q);
        },
        "checks ops.attention's arguments; returns the scale (1/sqrt(D) when None)");
  m.def("check_softmax",
        [given](const OptTensor& x, const OptTensor& mask, double scale) {
          fastformer::check_softmax(given(x), mask, scale);
        },
        "checks ops.softmax's arguments");
  m.def("check_layer_norm_residual",
        [given](const OptTensor& x, const OptTensor& residual, const OptTensor& weight, const OptTensor& bias,
                double eps, double dropout_p) {
          fastformer::check_layer_norm_residual(given(x), given(residual), given(weight), given(bias), eps, dropout_p);
        },
        "checks ops.layer_norm_residual's arguments");
  m.def("check_cross_entropy",
        [given](const OptTensor& logits, const OptTensor& target, double label_smoothing, int64_t ignore_index) {
          fastformer::check_cross_entropy(given(logits), given(target), label_smoothing, ignore_index);
        },
        "checks ops.cross_entropy's arguments");
  m.def("check_attention_bwd", &fastformer::check_attention_bwd, "checks attention_bwd's arguments");
  m.def("check_softmax_bwd", &fastformer::check_softmax_bwd, "checks softmax_bwd's arguments");
  m.def("check_layer_norm_residual_bwd", &fastformer::check_layer_norm_residual_bwd,
        "checks layer_norm_residual_bwd's arguments");
  m.def("check_cross_entropy_bwd", &fastformer::check_cross_entropy_bwd, "checks cross_entropy_bwd's arguments");
  m.attr("GPU_MAX_HEAD_DIM") = fastformer::kGpuMaxHeadDim;
}
