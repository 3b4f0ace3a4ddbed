// Launch logic shared by the two attention ops' launchers, csrc/cuda/attention.cu (dense (B, H, L, D)
// tensors, a key padding mask, grouped-query heads) and csrc/cuda/attention_varlen.cu (packed sequences):
// both fill the same parameter structs and launch the same kernels, the tensor-core kernels of
// csrc/cuda/attention_mma.cuh for float16 and bfloat16 on compute capability 8.0 and newer, the SIMT
// kernels of csrc/cuda/attention.cuh for float32 and for older GPUs. Host code (ATen), compiled by nvcc
// (backend "cuda") and as plain C++ against the CPU SIMT model (backend "cuda_sim").
//
// Forward: one launch, grid (ceil(max Lq_b / rows per block), B H). Backward: three launches on the stream,
// in order: delta = rowsum(dO O) into a float32 workspace shaped like lse (grid min(ceil(rows / 8), 2^20)),
// then dK/dV (grid (ceil(max Lk_b / rows per block), B H_kv): a block sums over the group's query heads) and
// dQ (grid (ceil(max Lq_b / rows per block), B H)), which both read delta. Rows per block: the SIMT configs'
// kBlockM / kBlock, the tensor-core configs' kRows; max Lq_b, max Lk_b are Lq, Lk for dense tensors and
// max_seqlen_q, max_seqlen_k for packed ones (blocks past their own sequence return at once). The head dim D
// picks the smallest instantiation D_MAX in {16, 32, 64, 128} that holds it.
#pragma once
#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "attention.cuh"
#include "attention_mma.cuh"
#include "cuda_ops.h"
#include "launch.h"
#include "ops.h"

namespace fastformer::cuda::attention_launch {

constexpr int64_t kMaxHeadDim = kGpuMaxHeadDim;           // csrc/ops.h: the triton kernels' bound too
constexpr int64_t kMaxGridY = 65535;                      // gridDim.y: B H (forward, dQ), B H_kv (dK/dV)
constexpr int64_t kMaxLength = int64_t{1} << 30;          // rows index with int in the kernels
constexpr int64_t kMaxDeltaBlocks = int64_t{1} << 20;     // the delta kernel strides over the rest

// One call's sizes. Dense: B batches, Lq = max_q, Lk = max_k per batch. Packed: B sequences, Lq, Lk the
// totals Tq, Tk (the kernels' p.Lq, p.Lk), max_q, max_k the longest sequence's (the grids' x extent).
struct AttnDims {
  int64_t B, H, H_kv, Lq, Lk, D, max_q, max_k;
};

// This backend's own limits (the caller's errors were checked by csrc/ops.h), and that every tensor the
// kernels index is on the device with its last dim contiguous: a guard against a direct call of a launcher.
// lse_rows: the rows of lse (B H Lq dense, H Tq packed), which the kernels index with int.
inline void check_limits(const AttnDims& s, int64_t lse_rows, const char* op, const Tensor& q, const Tensor& k,
                         const Tensor& v) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  check_dtype(q, "q");
  TORCH_CHECK(s.D <= kMaxHeadDim, "fastformer ", kBackend, " backend: ", op, " head dim D = ", s.D,
              " is not supported; the kernels take D from 1 to ", kMaxHeadDim,
              " (use more heads of a smaller dim, or the cpu/torch backend)");
  TORCH_CHECK(s.B * s.H <= kMaxGridY, "fastformer ", kBackend, " backend: ", op, " B * H = ", s.B, " * ", s.H,
              " = ", s.B * s.H, " exceeds ", kMaxGridY, " (one grid row per (sequence, head)); split the batch");
  TORCH_CHECK(s.Lq <= kMaxLength && s.Lk <= kMaxLength, "fastformer ", kBackend, " backend: ", op,
              " query and key rows must be at most 2^30, got ", s.Lq, " and ", s.Lk);
  TORCH_CHECK(lse_rows <= INT_MAX, "fastformer ", kBackend, " backend: ", op, " has ", lse_rows,
              " query rows over all heads, more than the kernels' limit of 2^31 - 1; split the batch");
}

// fn(std::integral_constant<int, D_MAX>) with the smallest D_MAX in {16, 32, 64, 128} that holds D.
template <typename Fn>
void dispatch_head_dim(int64_t D, Fn&& fn) {
  if (D <= 16) {
    fn(std::integral_constant<int, 16>());
  } else if (D <= 32) {
    fn(std::integral_constant<int, 32>());
  } else if (D <= 64) {
    fn(std::integral_constant<int, 64>());
  } else {
    fn(std::integral_constant<int, 128>());
  }
}

// The kernels' element strides of t, last dim contiguous: dense (B, H, L, D) -> its batch, head and row
// strides; packed (T, H, D) -> batch 0, head stride(1), row stride(0). A dim of size 1 gets stride 0 (it is
// never stepped: an L = 1 view may carry any row stride).
inline RowStrides row_strides(const Tensor& t) {
  const auto stride = [&](int64_t dim) { return t.size(dim) == 1 ? int64_t{0} : t.stride(dim); };
  return t.dim() == 4 ? RowStrides{stride(0), stride(1), stride(2)} : RowStrides{0, stride(1), stride(0)};
}

// D a multiple of `elements`, and every tensor's data and batch, head and row strides `bytes`-aligned:
// `elements` consecutive elements of any row move as one vector (pairs: load2/store2, `vec2`; 16-byte
// chunks: cp.async, `vec8`); else elements move one by one (e.g. rows sliced out of wider ones).
inline bool vector_aligned(int64_t D, int64_t elements, int64_t bytes, std::initializer_list<const Tensor*> tensors) {
  if (D % elements != 0) return false;
  for (const Tensor* t : tensors) {
    if (reinterpret_cast<uintptr_t>(t->const_data_ptr()) % bytes != 0) return false;
    const RowStrides s = row_strides(*t);
    for (const int64_t stride : {s.batch, s.head, s.row}) {
      if (stride * t->element_size() % bytes != 0) return false;
    }
  }
  return true;
}

// The tensor-core kernels serve 16-bit inputs on sm_80 and newer (the callers rule out float32).
inline bool tensor_cores() { return compute_capability() >= 80; }

// Blocks of per_block rows that cover `rows` (at most 2^30: check_limits).
inline unsigned blocks(int64_t rows, int64_t per_block) {
  return static_cast<unsigned>((rows + per_block - 1) / per_block);
}

// A cu_seqlens table's data (nullptr: dense tensors).
inline const int32_t* table(const c10::optional<Tensor>& cu, const char* name) {
  if (!cu.has_value()) return nullptr;
  check_input(*cu, name);
  return cu->const_data_ptr<int32_t>();
}

// Forward: out and lse (dense (B, H, Lq) or packed (H, Tq)) written by one kernel launch. key_padding_mask:
// (B, Lk) bool or none; cu_seqlens_q/k: (B + 1) int32 tables for packed tensors, none for dense ones.
inline void fwd(const AttnDims& s, const Tensor& q, const Tensor& k, const Tensor& v,
                const c10::optional<Tensor>& key_padding_mask, const c10::optional<Tensor>& cu_seqlens_q,
                const c10::optional<Tensor>& cu_seqlens_k, Tensor& out, Tensor& lse, bool causal, double dropout_p,
                double scale, const c10::optional<Tensor>& seed) {
  if (key_padding_mask.has_value()) check_input(*key_padding_mask, "key_padding_mask");
  const DeviceScope scope(q);
  FF_DISPATCH_KERNEL_TYPES(q.scalar_type(), "fastformer_attention_fwd_cuda", [&] {
    using T = typename DeviceType<scalar_t>::type;
    AttentionFwdParams<T> p;
    p.q = device_ptr<scalar_t>(q);
    p.k = device_ptr<scalar_t>(k);
    p.v = device_ptr<scalar_t>(v);
    p.key_padding_mask = key_padding_mask.has_value() ? key_padding_mask->const_data_ptr<bool>() : nullptr;
    p.cu_seqlens_q = table(cu_seqlens_q, "cu_seqlens_q");
    p.cu_seqlens_k = table(cu_seqlens_k, "cu_seqlens_k");
    p.out = device_ptr_mut<scalar_t>(out);
    p.lse = lse.mutable_data_ptr<float>();
    p.q_strides = row_strides(q);
    p.k_strides = row_strides(k);
    p.v_strides = row_strides(v);
    p.out_strides = row_strides(out);
    p.H = static_cast<int>(s.H);
    p.group = static_cast<int>(s.H / s.H_kv);
    p.Lq = static_cast<int>(s.Lq);
    p.Lk = static_cast<int>(s.Lk);
    p.D = static_cast<int>(s.D);
    p.scale = static_cast<float>(scale);
    p.causal = causal;
    p.vec2 = vector_aligned(s.D, 2, 2 * sizeof(T), {&q, &k, &v, &out});
    p.vec8 = vector_aligned(s.D, 8, 16, {&q, &k, &v, &out});
    p.dropout_p = static_cast<float>(dropout_p);
    p.dropout_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
    p.seed = seed_pointer(seed);
    dispatch_head_dim(s.D, [&](auto d_max) {
      constexpr int D_MAX = decltype(d_max)::value;
      const unsigned bh = static_cast<unsigned>(s.B * s.H);
      if constexpr (!std::is_same<T, float>::value) {
        if (tensor_cores()) {
          using Cfg = AttentionFwdMmaConfig<D_MAX>;
          launch(attention_fwd_mma_kernel<T, D_MAX>, dim3(blocks(s.max_q, Cfg::kRows), bh), dim3(Cfg::kThreads), p);
          return;
        }
      }
      using Cfg = AttentionFwdConfig<D_MAX>;
      launch(attention_fwd_kernel<T, D_MAX>, dim3(blocks(s.max_q, Cfg::kBlockM), bh), dim3(Cfg::kThreads), p);
    });
  });
}

// Backward: dq, dk, dv written by the three launches (delta, dK/dV, dQ); lse as the forward wrote it.
inline void bwd(const AttnDims& s, const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& out, const Tensor& lse, const c10::optional<Tensor>& key_padding_mask,
                const c10::optional<Tensor>& cu_seqlens_q, const c10::optional<Tensor>& cu_seqlens_k, Tensor& dq,
                Tensor& dk, Tensor& dv, bool causal, double dropout_p, double scale,
                const c10::optional<Tensor>& seed) {
  if (key_padding_mask.has_value()) check_input(*key_padding_mask, "key_padding_mask");
  check_rows(dout, "dout");
  check_rows(out, "out");
  check_input(lse, "lse");
  Tensor delta = at::empty(lse.sizes(), lse.options());
  const DeviceScope scope(q);
  FF_DISPATCH_KERNEL_TYPES(q.scalar_type(), "fastformer_attention_bwd_cuda", [&] {
    using T = typename DeviceType<scalar_t>::type;
    AttentionBwdParams<T> p;
    p.q = device_ptr<scalar_t>(q);
    p.k = device_ptr<scalar_t>(k);
    p.v = device_ptr<scalar_t>(v);
    p.out = device_ptr<scalar_t>(out);
    p.dout = device_ptr<scalar_t>(dout);
    p.lse = lse.const_data_ptr<float>();
    p.delta = delta.mutable_data_ptr<float>();
    p.key_padding_mask = key_padding_mask.has_value() ? key_padding_mask->const_data_ptr<bool>() : nullptr;
    p.cu_seqlens_q = table(cu_seqlens_q, "cu_seqlens_q");
    p.cu_seqlens_k = table(cu_seqlens_k, "cu_seqlens_k");
    p.dq = device_ptr_mut<scalar_t>(dq);
    p.dk = device_ptr_mut<scalar_t>(dk);
    p.dv = device_ptr_mut<scalar_t>(dv);
    p.q_strides = row_strides(q);
    p.k_strides = row_strides(k);
    p.v_strides = row_strides(v);
    p.out_strides = row_strides(out);
    p.dout_strides = row_strides(dout);
    p.dq_strides = row_strides(dq);
    p.dk_strides = row_strides(dk);
    p.dv_strides = row_strides(dv);
    p.BH = static_cast<int>(p.cu_seqlens_q != nullptr ? s.H : s.B * s.H);  // lse's rows / Lq
    p.H = static_cast<int>(s.H);
    p.group = static_cast<int>(s.H / s.H_kv);
    p.Lq = static_cast<int>(s.Lq);
    p.Lk = static_cast<int>(s.Lk);
    p.D = static_cast<int>(s.D);
    p.scale = static_cast<float>(scale);
    p.causal = causal;
    p.vec2 = vector_aligned(s.D, 2, 2 * sizeof(T), {&q, &k, &v, &out, &dout, &dq, &dk, &dv});
    p.vec8 = vector_aligned(s.D, 8, 16, {&q, &k, &v, &out, &dout, &dq, &dk, &dv});
    p.dropout_p = static_cast<float>(dropout_p);
    p.dropout_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
    p.seed = seed_pointer(seed);
    const int64_t delta_rows_per_block = kDeltaThreads / kWarpSize;
    const int64_t delta_blocks =
        std::min((delta.numel() + delta_rows_per_block - 1) / delta_rows_per_block, kMaxDeltaBlocks);
    launch(attention_bwd_delta_kernel<T>, dim3(static_cast<unsigned>(delta_blocks)), dim3(kDeltaThreads), p);
    dispatch_head_dim(s.D, [&](auto d_max) {
      constexpr int D_MAX = decltype(d_max)::value;
      const unsigned bh = static_cast<unsigned>(s.B * s.H), bh_kv = static_cast<unsigned>(s.B * s.H_kv);
      if constexpr (!std::is_same<T, float>::value) {
        if (tensor_cores()) {
          using Cfg = AttentionBwdMmaConfig<D_MAX>;
          launch(attention_bwd_dkdv_mma_kernel<T, D_MAX>, dim3(blocks(s.max_k, Cfg::kRows), bh_kv),
                 dim3(Cfg::kThreads), p);
          launch(attention_bwd_dq_mma_kernel<T, D_MAX>, dim3(blocks(s.max_q, Cfg::kRows), bh), dim3(Cfg::kThreads), p);
          return;
        }
      }
      using Cfg = AttentionBwdConfig<D_MAX>;
      launch(attention_bwd_dkdv_kernel<T, D_MAX>, dim3(blocks(s.max_k, Cfg::kBlock), bh_kv), dim3(Cfg::kThreads), p);
      launch(attention_bwd_dq_kernel<T, D_MAX>, dim3(blocks(s.max_q, Cfg::kBlock), bh), dim3(Cfg::kThreads), p);
    });
  });
}

}  // namespace fastformer::cuda::attention_launch
