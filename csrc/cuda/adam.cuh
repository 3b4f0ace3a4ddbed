// The fused Adam step's CUDA kernels (csrc/optim/optim.h has the update and the memory traffic; the launcher is
// csrc/cuda/adam.cu). Compiles under nvcc, NVRTC and the CPU SIMT model (compat.h).
//
// One launch updates up to kAdamMaxTensors parameters, whose pointers travel in the kernel's argument (as torch's
// multi_tensor_apply does: no table in device memory, nothing to build or cache, and a captured CUDA graph replays
// the same pointers). Each parameter is cut into chunks of kAdamChunk elements, one block per chunk; blocks
// [first_block[k], first_block[k + 1]) are parameter k's. A thread updates the elements threadIdx.x + j * kAdamThreads
// of its block's chunk (coalesced float32 loads and stores; any alignment, so parameters may be views at any offset).
// The step counts, the learning rate (lr_tensor), grad_scale and found_inf are read on the device: the host never
// reads them, so the step is graph-capturable. adam_count_steps_kernel then adds 1 to each step count (none when
// found_inf is nonzero), in a launch of its own: the update kernel's blocks read the counts before it.
#pragma once
#include "common.cuh"

namespace fastformer {
namespace cuda {

constexpr int kAdamThreads = 256;
constexpr int kAdamChunk = kAdamThreads * 16;  // elements per block
constexpr int kAdamMaxTensors = 32;            // parameters per launch: the argument stays under 4 KiB

struct AdamParams {
  float* param[kAdamMaxTensors];
  const float* grad[kAdamMaxTensors];
  float* exp_avg[kAdamMaxTensors];
  float* exp_avg_sq[kAdamMaxTensors];
  void* copy[kAdamMaxTensors];  // bfloat16 or float16 (copy_kind: 1 bfloat16, 2 float16), or nullptr
  float* step[kAdamMaxTensors];  // the step count before this step (a 0-dim float32 tensor each)
  int64_t numel[kAdamMaxTensors];
  int copy_kind[kAdamMaxTensors];
  int first_block[kAdamMaxTensors + 1];
  int count;
  const float* lr_ptr;  // the learning rate, or nullptr: lr
  float lr;
  const float* grad_scale;  // divides the gradient, or nullptr
  const float* found_inf;   // nonzero: no update, no step; or nullptr
  double beta1, beta2;      // the per-step factors are computed in float64, as on the CPU (optim.h)
  float weight_decay, eps;
};

FF_GLOBAL void FF_LAUNCH_BOUNDS(kAdamThreads) adam_kernel(const AdamParams p) {
  if (p.found_inf != nullptr && *p.found_inf != 0.0f) return;
  const int block = static_cast<int>(blockIdx.x);
  int k = 0;
  while (block >= p.first_block[k + 1]) ++k;
  // The per-step factors of parameter k (csrc/optim/optim.h adam_step_size, adam_bias_correction2_sqrt).
  const double t = static_cast<double>(*p.step[k]) + 1.0;
  const double lr = p.lr_ptr != nullptr ? static_cast<double>(*p.lr_ptr) : static_cast<double>(p.lr);
  const float step_size = static_cast<float>(lr / (1.0 - pow(p.beta1, t)));
  const float bias_correction2_sqrt = static_cast<float>(sqrt(1.0 - pow(p.beta2, t)));
  const float beta1 = static_cast<float>(p.beta1), one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  const float beta2 = static_cast<float>(p.beta2), one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  const bool scaled = p.grad_scale != nullptr;
  const float grad_scale = scaled ? *p.grad_scale : 1.0f;
  float* param = p.param[k];
  const float* grad = p.grad[k];
  float* exp_avg = p.exp_avg[k];
  float* exp_avg_sq = p.exp_avg_sq[k];
  const int copy_kind = p.copy_kind[k];
  const int64_t begin = static_cast<int64_t>(block - p.first_block[k]) * kAdamChunk;
  const int64_t end = begin + kAdamChunk < p.numel[k] ? begin + kAdamChunk : p.numel[k];
  for (int64_t i = begin + threadIdx.x; i < end; i += kAdamThreads) {
    float g = grad[i];
    if (scaled) g = g / grad_scale;
    float w = param[i];
    if (p.weight_decay != 0.0f) g = g + w * p.weight_decay;
    const float m = beta1 * exp_avg[i] + one_minus_beta1 * g;
    const float v = beta2 * exp_avg_sq[i] + one_minus_beta2 * (g * g);
    w = w - step_size * m / (sqrtf(v) / bias_correction2_sqrt + p.eps);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = w;
    if (copy_kind == 1) {
      static_cast<__nv_bfloat16*>(p.copy[k])[i] = __float2bfloat16_rn(w);
    } else if (copy_kind == 2) {
      static_cast<__half*>(p.copy[k])[i] = __float2half_rn(w);
    }
  }
}

// One block of 32 threads: step[k] += 1 for every parameter of the launch, unless found_inf is nonzero.
FF_GLOBAL void FF_LAUNCH_BOUNDS(kWarpSize) adam_count_steps_kernel(const AdamParams p) {
  if (p.found_inf != nullptr && *p.found_inf != 0.0f) return;
  for (int k = static_cast<int>(threadIdx.x); k < p.count; k += kWarpSize) *p.step[k] += 1.0f;
}

}  // namespace cuda
}  // namespace fastformer

// instantiations: adam_kernel adam_count_steps_kernel
