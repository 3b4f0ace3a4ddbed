// The fused Adam's CPU kernel (csrc/optim/optim.h has the update and the traffic), compiled once per CPU level
// (setup.py LEVEL_SOURCES) and reached through the kernel table (csrc/cpu/kernel_table.h, group optim).
//
// The parameters are cut into chunks of kAdamChunk elements (the last of each parameter shorter), numbered one
// after the other over all parameters; at::parallel_for spreads the chunk numbers over the threads (below
// kAdamParallelElements elements in all, the calling thread takes them all). Within a chunk
// at::vec runs 2 vectors at a time (two float32 vectors make one vector of 16-bit copies), a scalar loop the rest.
// Which element takes the vector or the scalar path depends only on its index in its parameter, so the results
// are the same for any thread count and any memory offset.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/kernel_table.h"

namespace fastformer::cpu {
namespace {

constexpr int64_t kAdamChunk = 16384;  // elements: 64 KiB of each float32 stream
constexpr int64_t kAdamParallelElements = 2 * kAdamChunk;  // fewer elements in all: one thread

// The update of one element (the scalar path).
inline float adam_element(const AdamTensor& t, const AdamHyper& h, int64_t i) {
  float g = t.grad[i];
  if (h.has_grad_scale) g = g / h.grad_scale;
  float p = t.param[i];
  if (h.weight_decay != 0.0f) g = g + p * h.weight_decay;
  const float m = h.beta1 * t.exp_avg[i] + h.one_minus_beta1 * g;
  const float v = h.beta2 * t.exp_avg_sq[i] + h.one_minus_beta2 * (g * g);
  p = p - t.step_size * m / (std::sqrt(v) / t.bias_correction2_sqrt + h.eps);
  t.exp_avg[i] = m;
  t.exp_avg_sq[i] = v;
  t.param[i] = p;
  return p;
}

using AdamVec = at::vec::Vectorized<float>;

// The same on the AdamVec::size() elements at i, returning the new param.
inline AdamVec adam_vector(const AdamTensor& t, const AdamHyper& h, int64_t i) {
  AdamVec g = AdamVec::loadu(t.grad + i);
  if (h.has_grad_scale) g = g / AdamVec(h.grad_scale);
  AdamVec p = AdamVec::loadu(t.param + i);
  if (h.weight_decay != 0.0f) g = g + p * AdamVec(h.weight_decay);
  const AdamVec m = AdamVec(h.beta1) * AdamVec::loadu(t.exp_avg + i) + AdamVec(h.one_minus_beta1) * g;
  const AdamVec v = AdamVec(h.beta2) * AdamVec::loadu(t.exp_avg_sq + i) + AdamVec(h.one_minus_beta2) * (g * g);
  p = p - AdamVec(t.step_size) * m / (v.sqrt() / AdamVec(t.bias_correction2_sqrt) + AdamVec(h.eps));
  m.store(t.exp_avg + i);
  v.store(t.exp_avg_sq + i);
  p.store(t.param + i);
  return p;
}

// Elements [begin, end) of one parameter.
void adam_chunk(const AdamTensor& t, const AdamHyper& h, int64_t begin, int64_t end) {
  constexpr int64_t W = AdamVec::size();
  int64_t i = begin;
  for (; i + 2 * W <= end; i += 2 * W) {
    const AdamVec p0 = adam_vector(t, h, i), p1 = adam_vector(t, h, i + W);
    if (t.copy_kind == kAdamBFloat16Copy) {
      at::vec::convert_float_bfloat16(p0, p1).store(static_cast<c10::BFloat16*>(t.copy) + i);
    } else if (t.copy_kind == kAdamHalfCopy) {
      at::vec::convert_float_half(p0, p1).store(static_cast<c10::Half*>(t.copy) + i);
    }
  }
  for (; i < end; ++i) {
    const float p = adam_element(t, h, i);
    if (t.copy_kind == kAdamBFloat16Copy) {
      static_cast<c10::BFloat16*>(t.copy)[i] = c10::BFloat16(p);  // round to nearest even, as Tensor.to
    } else if (t.copy_kind == kAdamHalfCopy) {
      static_cast<c10::Half*>(t.copy)[i] = c10::Half(p);
    }
  }
}

}  // namespace

void adam_step(const AdamTensor* tensors, int64_t count, const AdamHyper& hyper) {
  std::vector<int64_t> first(count + 1, 0);  // first[k]: the number of the first chunk of parameter k
  for (int64_t k = 0; k < count; ++k) first[k + 1] = first[k] + (tensors[k].numel + kAdamChunk - 1) / kAdamChunk;
  int64_t elements = 0;
  for (int64_t k = 0; k < count; ++k) elements += tensors[k].numel;
  const auto chunks = [&](int64_t begin, int64_t end) {  // chunk numbers [begin, end)
    int64_t k = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t c = begin; c < end; ++c) {
      while (c >= first[k + 1]) ++k;
      const int64_t start = (c - first[k]) * kAdamChunk;
      adam_chunk(tensors[k], hyper, start, std::min(start + kAdamChunk, tensors[k].numel));
    }
  };
  // Little work (many small parameters make many short chunks): on the calling thread, no parallel region.
  if (elements < kAdamParallelElements) {
    chunks(0, first[count]);
  } else {
    at::parallel_for(0, first[count], 1, chunks);
  }
}

}  // namespace fastformer::cpu
