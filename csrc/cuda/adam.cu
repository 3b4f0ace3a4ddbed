// Launcher of the fused Adam step's kernels (csrc/cuda/adam.cuh) on CUDA tensors (cuda_sim: CPU tensors). Called by
// fastformer._C.adam_step (csrc/optim/adam.cpp), which has checked the arguments; here only that every tensor the
// kernels touch is on this backend's device and contiguous, a guard against a direct call.
// The parameters go kAdamMaxTensors at a time: per group one adam_kernel launch (one block per kAdamChunk elements)
// and one adam_count_steps_kernel launch. Host work per step: filling the kernel argument, no allocation, no copy,
// no synchronization.
#include <vector>

#include "adam.cuh"
#include "launch.h"
#include "optim/optim.h"

namespace fastformer::cuda {

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<c10::optional<at::Tensor>>& copies, const std::vector<at::Tensor>& steps, double lr,
               const c10::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double weight_decay, double eps,
               const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && copies.size() == n &&
                  steps.size() == n,
              "fastformer ", kBackend, " adam_step: the lists must have one entry per parameter");
  if (n == 0) return;
  DeviceScope scope(params[0]);
  AdamParams p{};
  p.lr = static_cast<float>(lr);
  if (lr_tensor.has_value()) {
    check_input(*lr_tensor, "lr_tensor");
    p.lr_ptr = lr_tensor->const_data_ptr<float>();
  }
  if (grad_scale.has_value()) {
    check_input(*grad_scale, "grad_scale");
    p.grad_scale = grad_scale->const_data_ptr<float>();
  }
  if (found_inf.has_value()) {
    check_input(*found_inf, "found_inf");
    p.found_inf = found_inf->const_data_ptr<float>();
  }
  p.beta1 = beta1;
  p.beta2 = beta2;
  p.weight_decay = static_cast<float>(weight_decay);
  p.eps = static_cast<float>(eps);
  for (size_t start = 0; start < n; start += kAdamMaxTensors) {
    const size_t count = n - start < static_cast<size_t>(kAdamMaxTensors) ? n - start : kAdamMaxTensors;
    int64_t blocks = 0;
    p.count = static_cast<int>(count);
    for (size_t j = 0; j < count; ++j) {
      const size_t k = start + j;
      check_input(params[k], "params");
      check_input(grads[k], "grads");
      check_input(exp_avgs[k], "exp_avgs");
      check_input(exp_avg_sqs[k], "exp_avg_sqs");
      check_input(steps[k], "steps");
      p.param[j] = params[k].mutable_data_ptr<float>();
      p.grad[j] = grads[k].const_data_ptr<float>();
      p.exp_avg[j] = exp_avgs[k].mutable_data_ptr<float>();
      p.exp_avg_sq[j] = exp_avg_sqs[k].mutable_data_ptr<float>();
      p.step[j] = steps[k].mutable_data_ptr<float>();
      p.numel[j] = params[k].numel();
      p.copy[j] = nullptr;
      p.copy_kind[j] = kAdamNoCopy;
      if (copies[k].has_value()) {
        check_input(*copies[k], "copies");
        p.copy[j] = copies[k]->mutable_data_ptr();
        p.copy_kind[j] = copies[k]->scalar_type() == at::kBFloat16 ? kAdamBFloat16Copy : kAdamHalfCopy;
      }
      p.first_block[j] = static_cast<int>(blocks);
      blocks += (p.numel[j] + kAdamChunk - 1) / kAdamChunk;
      TORCH_CHECK(blocks <= INT_MAX, "fastformer ", kBackend, " adam_step: ", blocks,
                  " blocks exceed the launch limit");
    }
    p.first_block[count] = static_cast<int>(blocks);
    launch(adam_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kAdamThreads), p);
    launch(adam_count_steps_kernel, dim3(1), dim3(kWarpSize), p);
  }
}

}  // namespace fastformer::cuda
