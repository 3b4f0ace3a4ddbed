// The fused Adam of fastformer.training.optim.Adam (issue 52): what crosses from fastformer._C (csrc/optim/adam.cpp:
// the checks, the step counts, the choice of device) to the CPU kernel of the loaded level (csrc/optim/adam_cpu.cpp,
// through the kernel table, csrc/cpu/kernel_table.h) and, on CUDA tensors, to the launcher csrc/cuda/adam.cu.
//
// One pass per element of every parameter: reads param, grad, exp_avg, exp_avg_sq (float32) and writes param,
// exp_avg, exp_avg_sq and, where the parameter has one, its compute-dtype copy (bfloat16 or float16, rounded to
// nearest even: exactly param.to(copy.dtype) of the updated param). 16 bytes read and 12 (+2) written per
// element, against torch's fused Adam's 16 and 12 plus a cast kernel's 4 read and 2 written.
// The update, with t the parameter's step count after this step (torch.optim.Adam's, weight_decay as L2):
//   g = grad / grad_scale (when given) + weight_decay * param
//   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   param -= (lr / (1 - beta1^t)) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// in float32, the per-step factors lr / (1 - beta1^t) and sqrt(1 - beta2^t) in float64 rounded to float32.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace fastformer {

// The compute-dtype copy a parameter's update also writes.
enum AdamCopyKind : int { kAdamNoCopy = 0, kAdamBFloat16Copy = 1, kAdamHalfCopy = 2 };

// One parameter as the CPU kernel takes it: numel contiguous float32 elements each (checked by the caller).
struct AdamTensor {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;     // numel bfloat16 or float16 (copy_kind), or nullptr
  int copy_kind;  // AdamCopyKind
  int64_t numel;
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};

// The hyperparameters shared by the parameters of one call.
struct AdamHyper {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, weight_decay, eps;
  float grad_scale;  // the gradient is divided by it when has_grad_scale
  bool has_grad_scale;
};

// The per-step factors of a parameter at step count t (after this step), in float64 rounded to float32.
inline float adam_step_size(double lr, double beta1, double t) {
  return static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
}
inline float adam_bias_correction2_sqrt(double beta2, double t) {
  return static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
}

// fastformer._C.adam_step (csrc/optim/adam.cpp): one Adam step of every parameter of the lists (all on one device),
// checked (ValueError naming the argument). steps: each parameter's 0-dim float32 step count, on the CPU for CPU
// parameters and on the parameters' device for CUDA ones; lr_tensor, where given (a one-element float32 tensor on
// the parameters' device), is read instead of lr; grad_scale and found_inf (one-element float32, a GradScaler's)
// divide the gradient and, when found_inf is nonzero, skip the whole update, step counts included.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<c10::optional<at::Tensor>>& copies, const std::vector<at::Tensor>& steps, double lr,
               const c10::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double weight_decay, double eps,
               const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf);

namespace cuda {
// The CUDA launcher (csrc/cuda/adam.cu), the same arguments, already checked (cuda_sim: CPU tensors).
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<c10::optional<at::Tensor>>& copies, const std::vector<at::Tensor>& steps, double lr,
               const c10::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double weight_decay, double eps,
               const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf);
}  // namespace cuda

}  // namespace fastformer
