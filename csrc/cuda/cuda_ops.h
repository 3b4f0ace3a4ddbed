// Entry points of the CUDA kernels: the launchers in csrc/cuda/<op>.cu. Same signatures and semantics as
// the CPU entry points (csrc/cpu/cpu_ops.h). Bound as <op>_<fwd|bwd>_cuda in fastformer._C (nvcc build)
// and as <op>_<fwd|bwd> in the cuda_sim extension (the same sources compiled against the CPU SIMT model).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace fastformer::cuda {

using at::Tensor;

// attention: q (B, H, Lq, D), k/v (B, H, Lk, D), key_padding_mask (B, Lk) bool (True = padding).
// Returns out (B, H, Lq, D) and the row logsumexp lse (B, H, Lq) float32 (-inf for rows that see no key).
std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const c10::optional<Tensor>& key_padding_mask, bool causal,
                                         double dropout_p, double scale, int64_t seed);
std::tuple<Tensor, Tensor, Tensor> attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                 const Tensor& v, const Tensor& out, const Tensor& lse,
                                                 const c10::optional<Tensor>& key_padding_mask, bool causal,
                                                 double dropout_p, double scale, int64_t seed);

// softmax over the last dim of x (..., N); mask is bool, already expanded to x's shape (any strides).
Tensor softmax_fwd(const Tensor& x, const c10::optional<Tensor>& mask, double scale);
Tensor softmax_bwd(const Tensor& dy, const Tensor& y, double scale);

// layer_norm_residual over the last dim of (..., N): returns y, s = residual + dropout(x), mean, rstd
// (mean, rstd float32 of shape (...)).
std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_residual_fwd(const Tensor& x, const Tensor& residual,
                                                                   const Tensor& weight, const Tensor& bias,
                                                                   double eps, double dropout_p, int64_t seed);
std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_residual_bwd(const Tensor& dy, const c10::optional<Tensor>& ds,
                                                                   const Tensor& s, const Tensor& weight,
                                                                   const Tensor& mean, const Tensor& rstd,
                                                                   double dropout_p, int64_t seed);

}  // namespace fastformer::cuda
