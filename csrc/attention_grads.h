// The layout of attention's gradients dq, dk, dv, one rule for every kernel backend: the CPU kernels
// (csrc/cpu/attention.cpp), the CUDA launcher (csrc/cuda/attention.cu, and so cuda_sim), and in Python the
// Triton backend and the fake kernels (fastformer/ops/attention.py grads_like), so compiled code sees the
// strides it gets.
//
// Each gradient is shaped like its input x (B, H, L, D) and is a view of a contiguous (B, L, H, D) tensor
// (rows_like), as torch's CPU sdpa writes them: the model's (B, L, H, D) projections take them without a copy.
// Where the inputs are the parts of one packed projection, the gradients are the same parts of one packed
// gradient: q, k, v the three adjacent parts of a (B, L, 3, H, D) tensor (the model's self-attention: its
// qkv projection viewed as (B, L, 3, H, D), each part transposed to (B, H, L, D): strides (3 L H D, D, 3 H D, 1),
// storage offsets o, o + H D, o + 2 H D), or k, v the two of a (B, L, 2, H, D) one (cross-attention's kv
// projection): dq, dk, dv are then views of one (B, L, 3, H, D) (or dk, dv of one (B, L, 2, H, D)) tensor,
// which the model's split hands back as the projection's gradient without stacking the parts
// (fastformer/nn/attention.py SplitHeads). Memory: the same bytes either way, written once by the kernels.
// The backward op's argument packed_grads says which layout (attention_packed_kind below); the op returns a
// packed gradient whole and attention's autograd takes the parts out (AttentionGrads, attention_grad_parts).
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <initializer_list>
#include <tuple>

namespace fastformer {

// An output shaped like x (B, H, L, D): a view of a contiguous (B, L, H, D) tensor.
inline at::Tensor attention_rows_like(const at::Tensor& x) {
  return at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options()).transpose(1, 2);
}

// Whether parts[0..n) are the n adjacent parts of one packed (B, L, n, H, D) tensor, in order.
inline bool attention_packed_parts(std::initializer_list<const at::Tensor*> parts) {
  const at::Tensor& a = **parts.begin();
  for (const at::Tensor* t : parts) {  // traced by torch.compile (symbolic shapes): no packed layout
    if (t->unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
  }
  if (a.dim() != 4 || a.numel() == 0) return false;
  const int64_t n = static_cast<int64_t>(parts.size()), H = a.size(1), L = a.size(2), D = a.size(3);
  const std::array<int64_t, 4> strides{L * n * H * D, D, n * H * D, 1};
  int64_t i = 0;
  for (const at::Tensor* t : parts) {
    if (t->sizes() != a.sizes() || t->scalar_type() != a.scalar_type() || !t->is_alias_of(a) ||
        t->storage_offset() != a.storage_offset() + i * H * D) {
      return false;
    }
    for (int d = 0; d < 4; ++d) {
      if (t->size(d) > 1 && t->stride(d) != strides[d]) return false;
    }
    ++i;
  }
  return true;
}

// Which of q, k, v are the parts of one packed projection, by the rule above: 3 (q, k, v), 2 (k, v) or 0.
// Decided where the inputs are seen as they are (attention's autograd, csrc/autograd/attention.cpp, at the
// forward) and handed to the backward op as its argument packed_grads, which the fake kernels read too: under
// torch.compile the backward's inputs are separate tensors, whatever they were in the forward.
inline int64_t attention_packed_kind(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (attention_packed_parts({&q, &k, &v})) return 3;
  return attention_packed_parts({&k, &v}) ? 2 : 0;
}

// attention_bwd's gradients: the views the kernels write (dq, dk, dv, each shaped like its input) and the op's
// outputs. An op's outputs may not share memory (its schema says they are fresh tensors), so a packed gradient
// is returned whole, in place of its parts, and the parts' outputs are empty: packed_grads 3: (dqkv (B, L, 3, H,
// D), {}, {}); 2: (dq, dkv (B, L, 2, H, D), {}); 0: (dq, dk, dv). attention's autograd takes the parts back out
// (attention_grad_parts).
struct AttentionGrads {
  at::Tensor dq, dk, dv;
  std::tuple<at::Tensor, at::Tensor, at::Tensor> outputs;
};

inline AttentionGrads attention_grads_like(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           int64_t packed_grads) {
  auto packed = [](const at::Tensor& x, int64_t n) {
    return at::empty({x.size(0), x.size(2), n, x.size(1), x.size(3)}, x.options());
  };
  auto part = [](const at::Tensor& p, int64_t i) { return p.select(2, i).transpose(1, 2); };
  if (packed_grads == 3) {
    const at::Tensor dqkv = packed(q, 3);
    return {part(dqkv, 0), part(dqkv, 1), part(dqkv, 2), {dqkv, q.new_empty({0}), q.new_empty({0})}};
  }
  if (packed_grads == 2) {
    const at::Tensor dq = attention_rows_like(q), dkv = packed(k, 2);
    return {dq, part(dkv, 0), part(dkv, 1), {dq, dkv, q.new_empty({0})}};
  }
  const at::Tensor dq = attention_rows_like(q), dk = attention_rows_like(k), dv = attention_rows_like(v);
  return {dq, dk, dv, {dq, dk, dv}};
}

// dq, dk, dv from attention_bwd's outputs (the inverse of AttentionGrads::outputs).
inline std::array<at::Tensor, 3> attention_grad_parts(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                                                      int64_t packed_grads) {
  auto part = [](const at::Tensor& p, int64_t i) { return p.select(2, i).transpose(1, 2); };
  if (packed_grads == 3) return {part(a, 0), part(a, 1), part(a, 2)};
  if (packed_grads == 2) return {a, part(b, 0), part(b, 1)};
  return {a, b, c};
}

}  // namespace fastformer
