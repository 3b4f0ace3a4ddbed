// Launchers of the attention kernels for dense tensors: q (B, H, Lq, D), k and v (B, H_kv, Lk, D) (grouped-query
// attention when H_kv < H), key_padding_mask (B, Lk). Validation and outputs here; the parameters, dtype and
// head-dim dispatch and the launches are shared with attention_varlen (csrc/cuda/attention_launch.h).
// Semantics of csrc/cpu/attention.cpp; compiled by nvcc (backend "cuda") and as plain C++ against the CPU SIMT
// model (backend "cuda_sim", csrc/cuda_sim/binding.cpp).
//
// Layout (the rule of csrc/cpu/attention.cpp and the fake kernels, fastformer/ops/attention.py rows_like):
// q, k, v, out and dout are read in place at their batch, head and row strides (last dim contiguous:
// csrc/ops.h attention_layout copies only a tensor whose last dim is not), e.g. views (B, H, L, D) of
// (B, L, H, D) projections; out, dq (B, H, L, D) and dk, dv (B, H_kv, L, D) are written as views of contiguous
// (B, L, H, D) tensors (rows_like), whatever the inputs' layout; the gradients of a packed projection's parts
// are the parts of one packed gradient (csrc/attention_grads.h). lse and the delta workspace are contiguous
// (B, H, Lq).
#include <limits>

#include "attention_grads.h"
#include "attention_launch.h"

namespace fastformer::cuda {
namespace {

// The arguments were checked by csrc/ops.h (check_attention, check_attention_bwd: ranks, shapes, dtypes,
// the mask, dropout_p, H a multiple of H_kv).
attention_launch::AttnDims dense_dims(const Tensor& q, const Tensor& k, const Tensor& v) {
  const attention_launch::AttnDims s{q.size(0), q.size(1), k.size(1), q.size(2),
                                     k.size(2), q.size(3), q.size(2), k.size(2)};
  attention_launch::check_limits(s, s.B * s.H * s.Lq, "attention", q, k, v);
  return s;
}

// Out, dq, dk, dv shaped like x (B, H, L, D): a view of a contiguous (B, L, H, D) tensor (the CPU kernel's
// rule), so the (B, L, H, D) projections of a model take them without a copy; the gradients of the parts of one
// packed projection are the parts of one packed gradient (csrc/attention_grads.h).
using fastformer::attention_grads_like;
using fastformer::attention_rows_like;

}  // namespace

std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const c10::optional<Tensor>& key_padding_mask, bool causal,
                                         double dropout_p, double scale, const c10::optional<Tensor>& seed) {
  const attention_launch::AttnDims s = dense_dims(q, k, v);
  Tensor out = attention_rows_like(q);
  Tensor lse = at::empty({s.B, s.H, s.Lq}, q.options().dtype(at::kFloat));
  if (q.numel() == 0 || s.Lk == 0) {  // nothing to attend to: zeros, lse = -inf
    return {out.zero_(), lse.fill_(-std::numeric_limits<float>::infinity())};
  }
  attention_launch::fwd(s, q, k, v, key_padding_mask, c10::nullopt, c10::nullopt, out, lse, causal, dropout_p, scale,
                        seed);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                 const Tensor& v, const Tensor& out, const Tensor& lse,
                                                 const c10::optional<Tensor>& key_padding_mask, bool causal,
                                                 double dropout_p, double scale,
                                                 const c10::optional<Tensor>& seed, int64_t packed_grads) {
  const attention_launch::AttnDims s = dense_dims(q, k, v);
  fastformer::AttentionGrads grads = attention_grads_like(q, k, v, packed_grads);
  Tensor &dq = grads.dq, &dk = grads.dk, &dv = grads.dv;
  if (q.numel() == 0 || k.numel() == 0) {
    dq.zero_(), dk.zero_(), dv.zero_();
    return grads.outputs;
  }
  attention_launch::bwd(s, dout, q, k, v, out, lse, key_padding_mask, c10::nullopt, c10::nullopt, dq, dk, dv, causal,
                        dropout_p, scale, seed);
  return grads.outputs;  // the packed gradient whole, in place of its parts (csrc/attention_grads.h)
}

}  // namespace fastformer::cuda

#if defined(__CUDACC__)
#include <torch/library.h>

TORCH_LIBRARY_IMPL(fastformer, CUDA, m) { FASTFORMER_IMPL_OP(m, fastformer::cuda, attention); }
#endif
