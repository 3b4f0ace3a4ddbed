// Packed sequences in the attention kernels (attention_varlen): where the rows of sequence b are. The kernels
// of csrc/cuda/attention.cuh (SIMT) and attention_mma.cuh (tensor cores) serve dense and packed calls alike;
// the launchers are csrc/cuda/attention.cu (ops.attention) and attention_varlen.cu (ops.attention_varlen).
//
// Dense tensors (cu_seqlens_q null): sequence b is batch b, all Lq query and Lk key rows, and query row i of
// head h is row (b H + h) Lq + i of lse and delta. Packed (T, H, D) tensors are the kernels' (B, H, L, D)
// tensors with batch stride 0: sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q (and out, dout,
// dq) and cu_seqlens_k[b] .. cu_seqlens_k[b + 1] of k (v, dk, dv); lse is (H, Tq), so its row is h Tq +
// cu_seqlens_q[b] + i. The table's entries are clamped into [0, T] (each end no lower than its start): a
// table whose check is deferred or was skipped during CUDA graph capture (csrc/value_checks.h) may give wrong
// rows, never an access outside the tensors. The dropout element of (b, h, i, j) is that lse row times p.Lk
// (Lk, or Tk packed), plus j.
#pragma once
#include "compat.h"

namespace fastformer {
namespace cuda {
namespace attention_detail {

FF_DEVICE int clamp_row(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Where the rows of sequence b are (see the top of the file): dense, all Lq query and Lk key rows of batch
// b; packed, rows cu_seqlens[b] .. cu_seqlens[b + 1] clamped into [0, T].
struct SeqRows {
  int q_start, k_start;  // first row in q (out, dout, dq) and in k (v, dk, dv)
  int Lq, Lk;            // the sequence's lengths Lq_b, Lk_b
  int lse_b;  // query row i of head h is row lse_b + h p.Lq + i of lse and delta (int: the launchers check
              // that lse has fewer than 2^31 rows; 32-bit rows keep the kernels within their registers)
  FF_DEVICE int lse_row(int h, int Lq_total) const { return lse_b + h * Lq_total; }
};

template <typename Params>
FF_DEVICE SeqRows seq_rows(const Params& p, int b) {
  SeqRows s;
  if (p.cu_seqlens_q == nullptr) {
    s.q_start = s.k_start = 0;
    s.Lq = p.Lq;
    s.Lk = p.Lk;
    s.lse_b = b * p.H * p.Lq;  // (b H + h) Lq + i
  } else {
    s.q_start = clamp_row(p.cu_seqlens_q[b], 0, p.Lq);
    s.k_start = clamp_row(p.cu_seqlens_k[b], 0, p.Lk);
    s.Lq = clamp_row(p.cu_seqlens_q[b + 1], s.q_start, p.Lq) - s.q_start;
    s.Lk = clamp_row(p.cu_seqlens_k[b + 1], s.k_start, p.Lk) - s.k_start;
    s.lse_b = s.q_start;  // h Tq + q_start + i
  }
  return s;
}

}  // namespace attention_detail
}  // namespace cuda
}  // namespace fastformer
