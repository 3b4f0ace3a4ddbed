// ops.attention_varlen on the CPU: packed sequences through the kernels of csrc/cpu/attention_kernels.h, the
// same as ops.attention's (the algorithm, shapes, memory traffic and dropout rule are described there).
// q (Tq, H, D), k and v (Tk, H_kv, D), sequence b at rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and
// cu_seqlens_k[b] .. of k and v. Forward items are (sequence, head, query tile): one long sequence among short
// ones is many items, so every thread has work; backward items (sequence, key/value head) are split by cost.
#include "cpu/attention_kernels.h"

namespace fastformer::cpu {
namespace {

using namespace attention_kernels;

// The arguments were checked by csrc/ops.h (the caller's errors, the tables' values included); the tensors' last
// dims are contiguous (csrc/ops.h attention_varlen_layout).
Seqs packed_seqs(const Tensor& q, const Tensor& k, const Tensor& cu_q, const Tensor& cu_k, bool causal) {
  return Seqs{cu_q.size(0) - 1, q.size(1), k.size(1), q.size(2), q.size(0), k.size(0),
              cu_q.data_ptr<int32_t>(), cu_k.data_ptr<int32_t>(), causal};
}

}  // namespace

// attention_varlen: outputs contiguous, out and dq (Tq, H, D), dk and dv (Tk, H_kv, D), lse (H, Tq).
// max_seqlen_q and max_seqlen_k were checked against the tables (csrc/ops.h); the CPU kernels do not need them.
std::tuple<Tensor, Tensor> attention_varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                int64_t /*max_seqlen_q*/, int64_t /*max_seqlen_k*/, bool causal,
                                                double dropout_p, double scale, const c10::optional<Tensor>& seed) {
  const Seqs s = packed_seqs(q, k, cu_seqlens_q, cu_seqlens_k, causal);
  Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor lse = at::empty({s.H, s.Lq}, q.options().dtype(at::toOpMathType(q.scalar_type())));
  if (q.numel() == 0) return {out, lse.fill_(-std::numeric_limits<double>::infinity())};
  run_fwd<true>(q, k, v, nullptr, out, lse, s, dropout_p, scale, seed);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_varlen_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                        const Tensor& v, const Tensor& out, const Tensor& lse,
                                                        const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                        int64_t /*max_seqlen_q*/, int64_t /*max_seqlen_k*/,
                                                        bool causal, double dropout_p, double scale,
                                                        const c10::optional<Tensor>& seed) {
  const Seqs s = packed_seqs(q, k, cu_seqlens_q, cu_seqlens_k, causal);
  Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor dk = at::empty_like(k, at::MemoryFormat::Contiguous), dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  if (q.numel() == 0 || k.numel() == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  run_bwd<true>(dout, q, k, v, out, lse, nullptr, dq, dk, dv, s, dropout_p, scale, seed);
  return {dq, dk, dv};
}

}  // namespace fastformer::cpu
