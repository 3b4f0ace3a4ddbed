// Launchers of the attention kernels for packed sequences (flash-attn's varlen convention): q (Tq, H, D), k and
// v (Tk, H_kv, D), sequence b at rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and cu_seqlens_k[b] ..
// cu_seqlens_k[b + 1] of k and v. The same kernels as attention (csrc/cuda/attention.cuh, attention_mma.cuh),
// given the tables and batch stride 0, launched by the code both ops share (csrc/cuda/attention_launch.h);
// the grids cover max_seqlen_q (max_seqlen_k) rows per sequence. Semantics of csrc/cpu/attention.cpp
// (attention_varlen_fwd/bwd); compiled by nvcc (backend "cuda") and as plain C++ against the CPU SIMT model
// (backend "cuda_sim", csrc/cuda_sim/binding.cpp with FF_SIM_OP=attention_varlen).
//
// Layout: q, k, v, out and dout are read in place at their row and head strides (last dim contiguous, e.g. the
// heads of a packed (T, 3, H, D) projection: csrc/ops.h attention_varlen_layout); out, dq (Tq, H, D) and dk,
// dv (Tk, H_kv, D) are contiguous; lse and the delta workspace are (H, Tq) float32 (flash-attn's layout).
// The tables were checked by csrc/ops.h (check_cu_seqlens) on the host, or on the device with the result
// deferred, or not at all during CUDA graph capture (csrc/value_checks.h); the kernels clamp every sequence
// into [0, T], so a bad table never reads or writes outside the tensors (a sequence longer than max_seqlen
// is cut to the grid's rows: its other rows are left unwritten, never written out of place).
#include <algorithm>
#include <limits>

#include "attention_launch.h"

namespace fastformer::cuda {
namespace {

// The arguments were checked by csrc/ops.h (check_attention_varlen: shapes, dtypes, the tables' dtype, size and
// device, every sequence no longer than max_seqlen). A max_seqlen beyond the total is an upper bound too: the
// grids take the smaller.
attention_launch::AttnDims packed_dims(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                                       int64_t max_seqlen_q, int64_t max_seqlen_k) {
  const attention_launch::AttnDims s{cu_seqlens_q.size(0) - 1,
                                     q.size(1),
                                     k.size(1),
                                     q.size(0),
                                     k.size(0),
                                     q.size(2),
                                     std::min(max_seqlen_q, q.size(0)),
                                     std::min(max_seqlen_k, k.size(0))};
  attention_launch::check_limits(s, s.H * s.Lq, "attention_varlen", q, k, v);
  return s;
}

}  // namespace

std::tuple<Tensor, Tensor> attention_varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                                double dropout_p, double scale, const c10::optional<Tensor>& seed) {
  const attention_launch::AttnDims s = packed_dims(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k);
  Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor lse = at::empty({s.H, s.Lq}, q.options().dtype(at::kFloat));
  if (q.numel() == 0 || s.Lk == 0) {  // nothing to attend to: zeros, lse = -inf
    return {out.zero_(), lse.fill_(-std::numeric_limits<float>::infinity())};
  }
  attention_launch::fwd(s, q, k, v, c10::nullopt, cu_seqlens_q, cu_seqlens_k, out, lse, causal, dropout_p, scale,
                        seed);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_varlen_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                        const Tensor& v, const Tensor& out, const Tensor& lse,
                                                        const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                        int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                                        double dropout_p, double scale,
                                                        const c10::optional<Tensor>& seed) {
  const attention_launch::AttnDims s = packed_dims(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k);
  Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor dk = at::empty_like(k, at::MemoryFormat::Contiguous), dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  if (q.numel() == 0 || k.numel() == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  attention_launch::bwd(s, dout, q, k, v, out, lse, c10::nullopt, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, causal,
                        dropout_p, scale, seed);
  return {dq, dk, dv};
}

}  // namespace fastformer::cuda

#if defined(__CUDACC__)
#include <torch/library.h>

TORCH_LIBRARY_IMPL(fastformer, CUDA, m) { FASTFORMER_IMPL_OP(m, fastformer::cuda, attention_varlen); }
#endif
