// ops.attention on the CPU: dense (B, H, L, D) tensors through the kernels of csrc/cpu/attention_kernels.h
// (FlashAttention-2 on tiles; the algorithm, shapes, memory traffic and dropout rule are described there).
// q (B, H, Lq, D), k and v (B, H_kv, Lk, D) with H a multiple of H_kv, key_padding_mask (B, Lk); out and the
// gradients are written as (B, H, L, D) views of contiguous (B, L, H, D) tensors, or of one packed gradient
// (csrc/attention_grads.h).
#include "attention_grads.h"
#include "cpu/attention_kernels.h"

namespace fastformer::cpu {
namespace {

using namespace attention_kernels;

// Outputs shaped like x (B, H, L, D), always a view of a contiguous (B, L, H, D) tensor, whatever x's strides,
// as torch's CPU sdpa writes its output and its gradients: out goes back to the output projection without a
// copy, and so do dq, dk, dv, even for a k or v that the model made contiguous (B, H, L, D) (transformers'
// key/value cache concatenates them: gradients in that layout cost its decoder a copy of each per layer; with
// (B, L, H, D) ones the Marian training step's 24 copies of 2 MiB a step are gone); the gradients of the parts
// of one packed projection are the parts of one packed gradient (csrc/attention_grads.h). The fake kernels
// (fastformer/ops/attention.py rows_like, grads_like) state the same rule: compiled code checks the strides.
using fastformer::attention_grads_like;
using fastformer::attention_rows_like;

// The arguments were checked by csrc/ops.h (the caller's errors); their last dims are contiguous (csrc/ops.h
// attention_layout).
Seqs dense_seqs(const Tensor& q, const Tensor& k, bool causal) {
  return Seqs{q.size(0), q.size(1), k.size(1), q.size(3), q.size(2), k.size(2), nullptr, nullptr, causal};
}

}  // namespace

std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const c10::optional<Tensor>& key_padding_mask, bool causal,
                                         double dropout_p, double scale, const c10::optional<Tensor>& seed) {
  const Seqs s = dense_seqs(q, k, causal);
  Tensor out = attention_rows_like(q);
  Tensor lse = at::empty({s.B, s.H, s.Lq}, q.options().dtype(at::toOpMathType(q.scalar_type())));
  if (q.numel() == 0 || s.Lk == 0) {
    return {out.zero_(), lse.fill_(-std::numeric_limits<double>::infinity())};
  }
  const bool* kpm = key_padding_mask.has_value() ? key_padding_mask->data_ptr<bool>() : nullptr;
  run_fwd<false>(q, k, v, kpm, out, lse, s, dropout_p, scale, seed);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                 const Tensor& v, const Tensor& out, const Tensor& lse,
                                                 const c10::optional<Tensor>& key_padding_mask, bool causal,
                                                 double dropout_p, double scale,
                                                 const c10::optional<Tensor>& seed, int64_t packed_grads) {
  const Seqs s = dense_seqs(q, k, causal);
  fastformer::AttentionGrads grads = attention_grads_like(q, k, v, packed_grads);
  Tensor &dq = grads.dq, &dk = grads.dk, &dv = grads.dv;
  if (q.numel() == 0 || k.numel() == 0) {
    dq.zero_(), dk.zero_(), dv.zero_();
    return grads.outputs;
  }
  const bool* kpm = key_padding_mask.has_value() ? key_padding_mask->data_ptr<bool>() : nullptr;
  run_bwd<false>(dout, q, k, v, out, lse, kpm, dq, dk, dv, s, dropout_p, scale, seed);
  return grads.outputs;  // the packed gradient whole, in place of its parts (csrc/attention_grads.h)
}

}  // namespace fastformer::cpu
