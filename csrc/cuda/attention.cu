// Launchers of the attention kernels: the tensor-core kernels of csrc/cuda/attention_mma.cuh for float16
// and bfloat16 on compute capability 8.0 and newer, the SIMT kernels of csrc/cuda/attention.cuh for
// float32 and for older GPUs; validation, outputs, dtype and head-dim dispatch. Semantics of
// csrc/cpu/attention.cpp; compiled by nvcc (backend "cuda") and as plain C++ against the CPU SIMT model
// (backend "cuda_sim", csrc/cuda_sim/binding.cpp).
//
// Forward: one launch, grid (ceil(Lq / rows per block), B H). Backward: three launches on the stream, in
// order: delta = rowsum(dO O) into a float32 (B, H, Lq) workspace (grid min(ceil(B H Lq / 8), 2^20)), then
// dK/dV (grid (ceil(Lk / rows per block), B H)) and dQ (grid (ceil(Lq / rows per block), B H)), which both
// read delta. Rows per block: the SIMT configs' kBlockM / kBlock, the tensor-core configs' kRows.
// The head dim D picks the smallest instantiation D_MAX in {16, 32, 64, 128} that holds it.
//
// Layout (the rule of csrc/cpu/attention.cpp and the fake kernels, fastformer/ops/attention.py rows_like):
// q, k, v, out and dout are read in place at their batch, head and row strides (last dim contiguous:
// csrc/ops.h attention_layout copies only a tensor whose last dim is not), e.g. views (B, H, L, D) of
// (B, L, H, D) projections; out, dq, dk, dv are written as (B, H, L, D) views of contiguous (B, L, H, D)
// tensors (rows_like), whatever the inputs' layout. lse and the delta workspace are contiguous (B, H, Lq).
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "attention.cuh"
#include "attention_mma.cuh"
#include "cuda_ops.h"
#include "launch.h"
#include "ops.h"

namespace fastformer::cuda {
namespace {

constexpr int64_t kMaxHeadDim = kGpuMaxHeadDim;  // csrc/ops.h: the triton kernels' bound too
constexpr int64_t kMaxBatchHeads = 65535;  // gridDim.y
constexpr int64_t kMaxLength = int64_t{1} << 30;  // sequence lengths index with int in the kernels
constexpr int64_t kMaxDeltaBlocks = int64_t{1} << 20;  // the delta kernel strides over the rest

struct AttnDims {
  int64_t B, H, Lq, Lk, D;
};

// The arguments were checked by csrc/ops.h (check_attention, check_attention_bwd: ranks, shapes, dtypes,
// the mask, dropout_p); here only this backend's own limits, and that every tensor the kernels index is
// on the device, with its last dim contiguous (q, k, v, out, dout) or contiguous (the mask, lse): a cheap
// guard against a direct call of a launcher.
AttnDims check_limits(const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& key_padding_mask) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  if (key_padding_mask.has_value()) check_input(*key_padding_mask, "key_padding_mask");
  check_dtype(q, "q");
  const AttnDims s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  TORCH_CHECK(s.D <= kMaxHeadDim, "fastformer ", kBackend, " backend: attention head dim D = ", s.D,
              " is not supported; the kernels take D from 1 to ", kMaxHeadDim,
              " (use more heads of a smaller dim, or the cpu/torch backend)");
  TORCH_CHECK(s.B * s.H <= kMaxBatchHeads, "fastformer ", kBackend, " backend: attention B * H = ", s.B * s.H,
              " exceeds ", kMaxBatchHeads, " (one grid row per (batch, head)); split the batch");
  TORCH_CHECK(s.Lq <= kMaxLength && s.Lk <= kMaxLength, "fastformer ", kBackend,
              " backend: attention sequence lengths must be at most 2^30, got Lq = ", s.Lq, ", Lk = ", s.Lk);
  return s;
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

// Out, dq, dk, dv shaped like x (B, H, L, D): a view of a contiguous (B, L, H, D) tensor (the CPU kernel's
// rows_like), so the (B, L, H, D) projections of a model take them without a copy.
Tensor rows_like(const Tensor& x) {
  return at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options()).transpose(1, 2);
}

// The kernels' element strides of t (B, H, L, D), last dim contiguous; a dim of size 1 gets stride 0 (it is
// never stepped: an L = 1 view may carry any row stride).
RowStrides row_strides(const Tensor& t) {
  const auto stride = [&](int64_t dim) { return t.size(dim) == 1 ? int64_t{0} : t.stride(dim); };
  return RowStrides{stride(0), stride(1), stride(2)};
}

// D a multiple of `elements`, and every tensor's data and batch, head and row strides `bytes`-aligned:
// `elements` consecutive elements of any row move as one vector (pairs: load2/store2, `vec2`; 16-byte
// chunks: cp.async, `vec8`); else elements move one by one (e.g. rows sliced out of wider ones).
bool vector_aligned(int64_t D, int64_t elements, int64_t bytes, std::initializer_list<const Tensor*> tensors) {
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
bool tensor_cores() { return compute_capability() >= 80; }

int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const c10::optional<Tensor>& key_padding_mask, bool causal,
                                         double dropout_p, double scale, const c10::optional<Tensor>& seed) {
  const AttnDims s = check_limits(q, k, v, key_padding_mask);
  Tensor out = rows_like(q);
  Tensor lse = at::empty({s.B, s.H, s.Lq}, q.options().dtype(at::kFloat));
  if (q.numel() == 0 || s.Lk == 0) {  // nothing to attend to: zeros, lse = -inf
    return {out.zero_(), lse.fill_(-std::numeric_limits<float>::infinity())};
  }
  const DeviceScope scope(q);
  FF_DISPATCH_KERNEL_TYPES(q.scalar_type(), "fastformer_attention_fwd_cuda", [&] {
    using T = typename DeviceType<scalar_t>::type;
    AttentionFwdParams<T> p;
    p.q = device_ptr<scalar_t>(q);
    p.k = device_ptr<scalar_t>(k);
    p.v = device_ptr<scalar_t>(v);
    p.key_padding_mask = key_padding_mask.has_value() ? key_padding_mask->const_data_ptr<bool>() : nullptr;
    p.out = device_ptr_mut<scalar_t>(out);
    p.lse = lse.mutable_data_ptr<float>();
    p.q_strides = row_strides(q);
    p.k_strides = row_strides(k);
    p.v_strides = row_strides(v);
    p.out_strides = row_strides(out);
    p.H = static_cast<int>(s.H);
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
          launch(attention_fwd_mma_kernel<T, D_MAX>, dim3(static_cast<unsigned>(ceil_div64(s.Lq, Cfg::kRows)), bh),
                 dim3(Cfg::kThreads), p);
          return;
        }
      }
      using Cfg = AttentionFwdConfig<D_MAX>;
      launch(attention_fwd_kernel<T, D_MAX>, dim3(static_cast<unsigned>(ceil_div64(s.Lq, Cfg::kBlockM)), bh),
             dim3(Cfg::kThreads), p);
    });
  });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                 const Tensor& v, const Tensor& out, const Tensor& lse,
                                                 const c10::optional<Tensor>& key_padding_mask, bool causal,
                                                 double dropout_p, double scale,
                                                 const c10::optional<Tensor>& seed) {
  const AttnDims s = check_limits(q, k, v, key_padding_mask);
  check_rows(dout, "dout");
  check_rows(out, "out");
  check_input(lse, "lse");
  Tensor dq = rows_like(q), dk = rows_like(k), dv = rows_like(v);
  if (q.numel() == 0 || k.numel() == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  Tensor delta = at::empty({s.B, s.H, s.Lq}, q.options().dtype(at::kFloat));
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
    p.BH = static_cast<int>(s.B * s.H);
    p.H = static_cast<int>(s.H);
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
    const int64_t delta_blocks = std::min(ceil_div64(s.B * s.H * s.Lq, kDeltaThreads / kWarpSize), kMaxDeltaBlocks);
    launch(attention_bwd_delta_kernel<T>, dim3(static_cast<unsigned>(delta_blocks)), dim3(kDeltaThreads), p);
    dispatch_head_dim(s.D, [&](auto d_max) {
      constexpr int D_MAX = decltype(d_max)::value;
      const unsigned bh = static_cast<unsigned>(s.B * s.H);
      if constexpr (!std::is_same<T, float>::value) {
        if (tensor_cores()) {
          using Cfg = AttentionBwdMmaConfig<D_MAX>;
          launch(attention_bwd_dkdv_mma_kernel<T, D_MAX>, dim3(static_cast<unsigned>(ceil_div64(s.Lk, Cfg::kRows)), bh),
                 dim3(Cfg::kThreads), p);
          launch(attention_bwd_dq_mma_kernel<T, D_MAX>, dim3(static_cast<unsigned>(ceil_div64(s.Lq, Cfg::kRows)), bh),
                 dim3(Cfg::kThreads), p);
          return;
        }
      }
      using Cfg = AttentionBwdConfig<D_MAX>;
      launch(attention_bwd_dkdv_kernel<T, D_MAX>, dim3(static_cast<unsigned>(ceil_div64(s.Lk, Cfg::kBlock)), bh),
             dim3(Cfg::kThreads), p);
      launch(attention_bwd_dq_kernel<T, D_MAX>, dim3(static_cast<unsigned>(ceil_div64(s.Lq, Cfg::kBlock)), bh),
             dim3(Cfg::kThreads), p);
    });
  });
  return {dq, dk, dv};
}

}  // namespace fastformer::cuda

#if defined(__CUDACC__)
#include <torch/library.h>

TORCH_LIBRARY_IMPL(fastformer, CUDA, m) { FASTFORMER_IMPL_OP(m, fastformer::cuda, attention); }
#endif
