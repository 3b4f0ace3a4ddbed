// Label-smoothed cross-entropy over the last dim on the GPU, forward and backward (kernels; launchers in
// cross_entropy.cu): the training loss over the vocabulary, with no log-probabilities in memory.
//
// logits are R contiguous rows of V; target (R) int64; e = label smoothing. A block of
// kCrossEntropyThreads threads per row (row = blockIdx.x); the threads stride over the row in 16-byte packs
// (kPack<T> elements: 4 floats, 8 halves) when V is a multiple of the pack and the rows 16-byte aligned,
// else element by element.
// Forward: each thread keeps an online (max m, sum l of e^(x - m)) pair (SoftmaxOnline, common.cuh) and
// the sum sx of its logits; the pairs merge over the warp (shuffles) and the block (shared memory, staged
// before block_sum's barriers, which sums sx); thread 0 then reads x[t] and writes
//   lse = m + log l,  nll = lse - x[t],  loss = (1 - e) nll + e (lse - sx / V)  (= nll when e = 0),
// loss = nll = 0 where t == ignore_index. DRAM per row: V sizeof(T) read once, 12 bytes written.
// Non-finite logits (as on every backend): a NaN or +inf logit makes lse NaN (a NaN x makes l NaN; m =
// +inf is poisoned by poison_unbounded); a row of only -inf has m = -inf, l = 0 and lse = -inf (nll NaN).
// Backward: dx = g e^(x - lse) - e dloss / V - [col == t] ((1 - e) dloss + dnll), g = dloss + dnll; zeros
// where t == ignore_index. No reduction, no shared memory: V sizeof(T) read and V sizeof(T) written per row.
// The launcher's caller checked the targets' range (csrc/ops.h), but not before these kernels run when the
// check is deferred or skipped under graph capture (csrc/value_checks.h): so an out-of-range target reads
// nothing (its nll and loss are NaN; backward has no one-hot column for it, since no column equals it).
#pragma once
#include "common.cuh"

namespace fastformer {
namespace cuda {

constexpr int kCrossEntropyThreads = 256;  // threads per block (one row)

template <typename T>
struct CrossEntropyFwdParams {
  const T* logits;         // (R, V) input
  const int64_t* target;   // (R) class indices, or ignore_index
  float* loss;             // (R) label-smoothed loss, written
  float* nll;              // (R) negative log-likelihood, written
  float* lse;              // (R) logsumexp of the row, written (backward's softmax)
  int64_t rows;            // R
  int cols;                // V
  float smoothing;         // e in [0, 1]
  int64_t ignore_index;    // target value of a row without loss
  bool packs;              // V a multiple of kPack<T> and logits 16-byte aligned
};

template <typename T>
struct CrossEntropyBwdParams {
  const float* dloss;      // (R) gradient of loss
  const float* dnll;       // (R) gradient of nll
  const T* logits;         // (R, V) forward input
  const int64_t* target;   // (R)
  const float* lse;        // (R) forward logsumexp
  T* dlogits;              // (R, V) gradient of logits, written
  int64_t rows;            // R
  int cols;                // V
  float smoothing;         // e
  int64_t ignore_index;
  bool packs;              // V a multiple of kPack<T> and logits, dlogits 16-byte aligned
};

// Forward, block per row: online (m, l) and sx per thread, merged over the block; thread 0 writes the row.
template <typename T>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kCrossEntropyThreads) cross_entropy_fwd_kernel(const CrossEntropyFwdParams<T> p) {
  __shared__ float stage_m[kWarpSize], stage_l[kWarpSize];  // one (m, l) per warp
  __shared__ float scratch[1][kWarpSize];                   // block_sum's
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  const int64_t row = blockIdx.x;
  const int n = p.cols;
  const T* x = p.logits + row * n;
  SoftmaxOnline s{-ff_inf(), 0.0f};
  float sx[1] = {0.0f};
  if (p.packs) {
    for (int col = kPack<T> * threadIdx.x; col < n; col += kPack<T> * blockDim.x) {
      float v[kPack<T>];
      load_pack(x + col, v);
#pragma unroll
      for (int i = 0; i < kPack<T>; ++i) {
        softmax_online_add(s, v[i]);
        sx[0] += v[i];
      }
    }
  } else {
    for (int col = threadIdx.x; col < n; col += blockDim.x) {
      const float v = to_float(x[col]);
      softmax_online_add(s, v);
      sx[0] += v;
    }
  }
  s = softmax_warp_merge(s);
  if (lane == 0) {
    stage_m[warp] = s.m;
    stage_l[warp] = s.l;
  }
  block_sum(sx, scratch);  // its barriers also publish the staged pairs
  s = lane < warps ? SoftmaxOnline{stage_m[lane], stage_l[lane]} : SoftmaxOnline{-ff_inf(), 0.0f};
  s = softmax_warp_merge(s);
  if (threadIdx.x != 0) return;
  // m = -inf: l is 0 (lse = -inf) or NaN (a NaN logit, lse NaN); m = +inf: NaN.
  const float lse = poison_unbounded(s.m) + logf(s.l);
  const int64_t t = p.target[row];
  float loss = 0.0f, nll = 0.0f;
  if (t != p.ignore_index) {
    nll = t >= 0 && t < n ? lse - to_float(x[t]) : ff_nan();
    loss = p.smoothing == 0.0f ? nll : (1.0f - p.smoothing) * nll + p.smoothing * (lse - sx[0] / n);
  }
  p.loss[row] = loss;
  p.nll[row] = nll;
  p.lse[row] = lse;
}

// One element of the backward: g e^(x - lse) - c, minus hot in the target's column.
FF_DEVICE float cross_entropy_grad(float x, int64_t col, int64_t t, float g, float c, float hot, float lse) {
  return g * expf(x - lse) - c - (col == t ? hot : 0.0f);
}

// Backward, block per row: one read of x, one write of dx.
template <typename T>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kCrossEntropyThreads) cross_entropy_bwd_kernel(const CrossEntropyBwdParams<T> p) {
  const int64_t row = blockIdx.x;
  const int n = p.cols;
  const T* x = p.logits + row * n;
  T* dx = p.dlogits + row * n;
  const int64_t t = p.target[row];
  const bool ignored = t == p.ignore_index;
  const float dloss = p.dloss[row], dnll = p.dnll[row], lse = p.lse[row];
  const float g = dloss + dnll, c = p.smoothing * dloss / n, hot = (1.0f - p.smoothing) * dloss + dnll;
  if (p.packs) {
    for (int col = kPack<T> * threadIdx.x; col < n; col += kPack<T> * blockDim.x) {
      float v[kPack<T>];
      load_pack(x + col, v);
#pragma unroll
      for (int i = 0; i < kPack<T>; ++i) v[i] = ignored ? 0.0f : cross_entropy_grad(v[i], col + i, t, g, c, hot, lse);
      store_pack(dx + col, v);
    }
  } else {
    for (int col = threadIdx.x; col < n; col += blockDim.x) {
      dx[col] = from_float<T>(ignored ? 0.0f : cross_entropy_grad(to_float(x[col]), col, t, g, c, hot, lse));
    }
  }
}

}  // namespace cuda
}  // namespace fastformer

// instantiations: cross_entropy_fwd_kernel<float> cross_entropy_fwd_kernel<__half> cross_entropy_fwd_kernel<__nv_bfloat16>
// instantiations: cross_entropy_bwd_kernel<float> cross_entropy_bwd_kernel<__half> cross_entropy_bwd_kernel<__nv_bfloat16>
