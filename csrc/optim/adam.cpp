// fastformer._C.adam_step: the fused Adam step of fastformer.training.optim.Adam (csrc/optim/optim.h has the update
// and its memory traffic). Checks every argument (ValueError naming it), then
//   CPU tensors:  reads found_inf (nonzero: returns) and grad_scale, counts the steps, computes each parameter's
//                 per-step factors and calls the loaded level's kernel (csrc/optim/adam_cpu.cpp) once for all;
//   CUDA tensors: the launcher csrc/cuda/adam.cu, which reads the step counts, the learning rate, grad_scale and
//                 found_inf on the device (no host synchronization: the step is graph-capturable);
// then every tensor written gets a new version (bump_versions).
#include "optim/optim.h"

#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>

#include "cpu/kernel_table.h"
#include "cpu_levels.h"

namespace fastformer {
namespace {

// "params[3]" for the messages.
std::string adam_item(const char* list, size_t k) { return std::string(list) + "[" + std::to_string(k) + "]"; }

// A tensor of parameter k's list: the param's shape, float32 (or `dtype`), contiguous, on the param's device.
void adam_check_like(const at::Tensor& t, const at::Tensor& param, const char* list, size_t k) {
  const std::string name = adam_item(list, k);
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "fastformer adam_step: ", name, " must be a dense tensor, got ",
                    t.layout(), " (sparse gradients are not supported)");
  TORCH_CHECK_VALUE(t.sizes() == param.sizes(), "fastformer adam_step: ", name, " has shape ", t.sizes(),
                    ", its parameter ", param.sizes());
  TORCH_CHECK_VALUE(t.device() == param.device(), "fastformer adam_step: ", name, " is on ", t.device(),
                    ", its parameter on ", param.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), "fastformer adam_step: ", name, " must be contiguous");
}

// A one-element float32 tensor on `device` (grad_scale, found_inf, lr_tensor).
void adam_check_scalar(const c10::optional<at::Tensor>& t, const char* name, const at::Device& device) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->numel() == 1 && t->scalar_type() == at::kFloat, "fastformer adam_step: ", name,
                    " must be a one-element float32 tensor, got ", t->scalar_type(), " of shape ", t->sizes());
  TORCH_CHECK_VALUE(t->device() == device, "fastformer adam_step: ", name, " is on ", t->device(),
                    ", the parameters on ", device);
}

void adam_check_args(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<c10::optional<at::Tensor>>& copies, const std::vector<at::Tensor>& steps, double lr,
                const c10::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double weight_decay,
                double eps, const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  const std::initializer_list<std::pair<size_t, const char*>> sizes = {
      {grads.size(), "grads"}, {exp_avgs.size(), "exp_avgs"}, {exp_avg_sqs.size(), "exp_avg_sqs"},
      {copies.size(), "copies"}, {steps.size(), "steps"}};
  for (const auto& [size, name] : sizes) {
    TORCH_CHECK_VALUE(size == n, "fastformer adam_step: ", name, " holds ", size, " tensors, params ", n);
  }
  TORCH_CHECK_VALUE(std::isfinite(lr) && lr >= 0.0, "fastformer adam_step: lr must be finite and >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "fastformer adam_step: beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "fastformer adam_step: beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(std::isfinite(weight_decay) && weight_decay >= 0.0,
                    "fastformer adam_step: weight_decay must be finite and >= 0, got ", weight_decay);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, "fastformer adam_step: eps must be finite and >= 0, got ", eps);
  if (n == 0) return;
  const at::Device device = params[0].device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), "fastformer adam_step: the parameters must be CPU or CUDA "
                    "tensors, got ", device);
  for (size_t k = 0; k < n; ++k) {
    const at::Tensor& p = params[k];
    TORCH_CHECK_VALUE(p.device() == device, "fastformer adam_step: ", adam_item("params", k), " is on ", p.device(),
                      ", params[0] on ", device, " (one call takes the parameters of one device)");
    TORCH_CHECK_VALUE(p.layout() == at::kStrided && p.scalar_type() == at::kFloat, "fastformer adam_step: ",
                      adam_item("params", k), " must be a dense float32 tensor, got ", p.scalar_type());
    TORCH_CHECK_VALUE(p.is_contiguous(), "fastformer adam_step: ", adam_item("params", k), " must be contiguous");
    adam_check_like(grads[k], p, "grads", k);
    adam_check_like(exp_avgs[k], p, "exp_avgs", k);
    adam_check_like(exp_avg_sqs[k], p, "exp_avg_sqs", k);
    const std::initializer_list<std::pair<const at::Tensor*, const char*>> states = {
        {&grads[k], "grads"}, {&exp_avgs[k], "exp_avgs"}, {&exp_avg_sqs[k], "exp_avg_sqs"}};
    for (const auto& [t, name] : states) {
      TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat, "fastformer adam_step: ", adam_item(name, k),
                        " must be float32, got ", t->scalar_type());
    }
    if (copies[k].has_value()) {
      const at::Tensor& c = *copies[k];
      adam_check_like(c, p, "copies", k);
      TORCH_CHECK_VALUE(c.scalar_type() == at::kBFloat16 || c.scalar_type() == at::kHalf, "fastformer adam_step: ",
                        adam_item("copies", k), " must be bfloat16 or float16, got ", c.scalar_type());
    }
    const at::Tensor& s = steps[k];
    TORCH_CHECK_VALUE(s.numel() == 1 && s.scalar_type() == at::kFloat, "fastformer adam_step: ",
                      adam_item("steps", k), " must be a one-element float32 tensor, got ", s.scalar_type(),
                      " of shape ", s.sizes());
    TORCH_CHECK_VALUE(s.device() == device, "fastformer adam_step: ", adam_item("steps", k), " is on ", s.device(),
                      ", the parameters on ", device);
  }
  adam_check_scalar(lr_tensor, "lr_tensor", device);
  adam_check_scalar(grad_scale, "grad_scale", device);
  adam_check_scalar(found_inf, "found_inf", device);
}

void adam_step_cpu(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                   const std::vector<c10::optional<at::Tensor>>& copies, const std::vector<at::Tensor>& steps,
                   double lr, const c10::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                   double weight_decay, double eps, const c10::optional<at::Tensor>& grad_scale) {
  if (lr_tensor.has_value()) lr = lr_tensor->item<float>();
  AdamHyper hyper{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                  static_cast<float>(1.0 - beta2), static_cast<float>(weight_decay), static_cast<float>(eps),
                  1.0f, grad_scale.has_value()};
  if (grad_scale.has_value()) hyper.grad_scale = grad_scale->item<float>();
  std::vector<AdamTensor> table(params.size());
  for (size_t k = 0; k < params.size(); ++k) {
    float* step = steps[k].mutable_data_ptr<float>();
    const double t = static_cast<double>(++*step);
    AdamTensor& e = table[k];
    e.param = params[k].mutable_data_ptr<float>();
    e.grad = grads[k].const_data_ptr<float>();
    e.exp_avg = exp_avgs[k].mutable_data_ptr<float>();
    e.exp_avg_sq = exp_avg_sqs[k].mutable_data_ptr<float>();
    e.copy = copies[k].has_value() ? copies[k]->mutable_data_ptr() : nullptr;
    e.copy_kind = !copies[k].has_value()                          ? kAdamNoCopy
                  : copies[k]->scalar_type() == at::kBFloat16 ? kAdamBFloat16Copy
                                                                  : kAdamHalfCopy;
    e.numel = params[k].numel();
    e.step_size = adam_step_size(lr, beta1, t);
    e.bias_correction2_sqrt = adam_bias_correction2_sqrt(beta2, t);
  }
  cpu_kernels().optim.adam_step(table.data(), static_cast<int64_t>(table.size()), hyper);
}

// Every tensor the step writes gets a new version, as an in-place op's outputs do: caches keyed by a weight's
// version (fastformer/nn/linear.py's packed weights) see the update, and autograd refuses a graph that saved a
// parameter before it (the kernels write through raw pointers, past the dispatcher that would bump them).
void bump_versions(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& exp_avgs,
                   const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<c10::optional<at::Tensor>>& copies,
                   const std::vector<at::Tensor>& steps) {
  for (const auto* list : {&params, &exp_avgs, &exp_avg_sqs, &steps}) {
    for (const at::Tensor& t : *list) t.unsafeGetTensorImpl()->bump_version();
  }
  for (const auto& c : copies) {
    if (c.has_value()) c->unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<c10::optional<at::Tensor>>& copies, const std::vector<at::Tensor>& steps, double lr,
               const c10::optional<at::Tensor>& lr_tensor, double beta1, double beta2, double weight_decay, double eps,
               const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf) {
  adam_check_args(params, grads, exp_avgs, exp_avg_sqs, copies, steps, lr, lr_tensor, beta1, beta2, weight_decay, eps,
             grad_scale, found_inf);
  if (params.empty()) return;
  if (params[0].is_cpu()) {
    if (found_inf.has_value() && found_inf->item<float>() != 0.0f) return;  // an overflow: no update, no step
    adam_step_cpu(params, grads, exp_avgs, exp_avg_sqs, copies, steps, lr, lr_tensor, beta1, beta2, weight_decay, eps,
                  grad_scale);
    bump_versions(params, exp_avgs, exp_avg_sqs, copies, steps);
    return;
  }
#ifdef FASTFORMER_WITH_CUDA
  // found_inf is read on the device: the versions are bumped whether or not the kernels skip the update
  cuda::adam_step(params, grads, exp_avgs, exp_avg_sqs, copies, steps, lr, lr_tensor, beta1, beta2, weight_decay, eps,
                  grad_scale, found_inf);
  bump_versions(params, exp_avgs, exp_avg_sqs, copies, steps);
#else
  TORCH_CHECK_VALUE(false, "fastformer adam_step: this fastformer._C was built without CUDA kernels "
                    "(fastformer._C.WITH_CUDA is False); params are on ", params[0].device());
#endif
}

}  // namespace fastformer
