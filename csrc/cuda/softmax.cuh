// Masked, scaled softmax over the last dim on the GPU, forward and backward (kernels; launchers in softmax.cu).
//
// x is viewed as R contiguous rows of N. Forward, per row, in float32:
//   a = scale * x, -inf where masked;  m = max a;  l = sum e^(a - m);  y = e^(a - m) / l.
// Non-finite logits (the rule of every backend): a row whose a are all -inf (fully masked, or -inf
// logits) has m = -inf and gives zeros (m is replaced by 0 and 1/l by 0, so e^(-inf) * 0 = 0, no NaN).
// Otherwise a NaN or +inf a (unmasked; masked entries are -inf whatever x holds) makes the WHOLE row of y
// NaN, masked columns included: m = +inf is turned into NaN (poison_unbounded, common.cuh), and a NaN a,
// which fmaxf drops from m, makes its e^(a - m) and so l NaN; 1/l (NaN) then reaches every column. The
// block layout's merges keep a NaN l (also one summed while m was still -inf). No extra pass, one select
// per row. Backward: dx = scale * y * (dy - sum(dy * y)) (a NaN row of y gives a NaN row of dx).
// The mask is bool, expanded to x's shape as a strided view (stride 0 on broadcast dims): a row's mask
// starts at the offset found by unravelling the row index over x's leading dims (SoftmaxMask), its
// entries are col_stride apart.
//
// Two layouts:
//   warp per row (N <= 1024): blocks of kSoftmaxWarpRows warps, warp w of block b takes row
//     b * kSoftmaxWarpRows + w. Lane l keeps kPerLane = ceil(N / 32) (rounded up to a power of two)
//     values of the row in registers in the warp-row layout of common.cuh (warp_row_col: runs of 16-byte
//     packs, half2/float2 pairs or single elements, chosen by N and alignment); max and sums by butterfly
//     shuffles. No shared memory. DRAM per row: forward reads x and writes y once (2 N sizeof(T), + N mask
//     bytes), backward reads y and dy and writes dx once (3 N sizeof(T)).
//   block per row (N > 1024): kSoftmaxBlockThreads threads stride over the row. Forward keeps an online
//     (max m, sum l of e^(a - m)) pair per thread (l = l e^(m - m') + e^(a - m') when the max grows),
//     merges the pairs across the warp (shuffles) and the block (shared memory, 2 x 32 floats), then a
//     second sweep rereads x (mostly from L2) and writes y: 3 N sizeof(T) (+ 2 N mask bytes). Backward:
//     a sweep for sum(dy * y) (block_sum), a sweep writing dx: 5 N sizeof(T), the second reads from L2.
#pragma once
#include "common.cuh"

namespace fastformer {
namespace cuda {

constexpr int kSoftmaxMaxDims = 8;        // leading dims of x (after merging) the mask may vary along
constexpr int kSoftmaxWarpMaxN = 1024;    // warp per row up to this N, block per row above
constexpr int kSoftmaxWarpRows = 4;       // rows (warps) per block in the warp layout
constexpr int kSoftmaxBlockThreads = 256; // threads per block (one row) in the block layout

// The mask, expanded to x's shape (any strides). x's leading dims are given merged where the mask's
// strides allow (size-1 dims dropped), so dims <= kSoftmaxMaxDims.
struct SoftmaxMask {
  const bool* base;                  // first element, or nullptr: no mask
  int dims;                          // leading dims described
  int64_t sizes[kSoftmaxMaxDims];    // their sizes (product = R)
  int64_t strides[kSoftmaxMaxDims];  // the mask's strides along them, in elements (0 where broadcast)
  int64_t col_stride;                // the mask's stride along the last dim
};

template <typename T>
struct SoftmaxFwdParams {
  const T* x;        // (R, N) input
  T* y;              // (R, N) output
  SoftmaxMask mask;  // mask of x's shape (True = masked), or mask.base == nullptr
  int64_t rows;      // R
  int cols;          // N
  float scale;       // multiplier applied to x before the softmax
  bool vec2;         // N even and x, y aligned to 2 elements: pairs are loaded/stored as half2/float2
  bool packs;        // N a multiple of kPack<T> and x, y 16-byte aligned: the warp layout's 16-byte runs
};

template <typename T>
struct SoftmaxBwdParams {
  const T* dy;  // (R, N) gradient of y
  const T* y;   // (R, N) forward output
  T* dx;        // (R, N) gradient of x, written
  int64_t rows; // R
  int cols;     // N
  float scale;  // the forward's scale
  bool vec2;    // N even and dy, y, dx aligned to 2 elements
  bool packs;   // N a multiple of kPack<T> and dy, y, dx 16-byte aligned
};

// Row r's mask: base + sum_d (index of r along leading dim d) * strides[d].
FF_DEVICE const bool* softmax_mask_row(const SoftmaxMask& m, int64_t r) {
  int64_t offset = 0;
#pragma unroll
  for (int d = kSoftmaxMaxDims - 1; d >= 0; --d) {
    if (d < m.dims) {
      offset += (r % m.sizes[d]) * m.strides[d];
      r /= m.sizes[d];
    }
  }
  return m.base + offset;
}

// Forward, warp per row: 32 kPerLane >= N values in registers, one read of x, one write of y.
template <typename T, int kPerLane>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kSoftmaxWarpRows * kWarpSize) softmax_fwd_warp_kernel(const SoftmaxFwdParams<T> p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSoftmaxWarpRows + threadIdx.x / kWarpSize;
  if (row >= p.rows) return;  // the whole warp: no shuffle is left waiting
  const int n = p.cols;
  const int width = warp_row_width<T, kPerLane>(p.packs, p.vec2);
  const float neg_inf = -ff_inf();
  float v[kPerLane];
  warp_row_load(p.x + row * n, n, lane, width, v);
  const bool* mask = p.mask.base != nullptr ? softmax_mask_row(p.mask, row) : nullptr;
  float m = neg_inf;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {  // a = scale x, -inf where masked or past the row's end
    const int col = warp_row_col(i, lane, width);
    const bool dead = col >= n || (mask != nullptr && mask[col * p.mask.col_stride]);
    v[i] = dead ? neg_inf : v[i] * p.scale;
    m = fmaxf(m, v[i]);
  }
  m = warp_max(m);
  // Fully masked row: every e^(a - m) is 0, zeros. A NaN or +inf a: NaN row (poison_unbounded).
  m = m == neg_inf ? 0.0f : poison_unbounded(m);
  float l = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    v[i] = expf(v[i] - m);
    l += v[i];
  }
  l = warp_sum(l);
  const float inv = l == 0.0f ? 0.0f : 1.0f / l;  // l NaN: inv NaN, and so is every y
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) v[i] *= inv;
  warp_row_store(p.y + row * n, n, lane, width, v);
}

// Backward, warp per row: y and dy in registers, dx = scale y (dy - sum(dy y)).
template <typename T, int kPerLane>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kSoftmaxWarpRows * kWarpSize) softmax_bwd_warp_kernel(const SoftmaxBwdParams<T> p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSoftmaxWarpRows + threadIdx.x / kWarpSize;
  if (row >= p.rows) return;  // the whole warp
  const int n = p.cols;
  const int width = warp_row_width<T, kPerLane>(p.packs, p.vec2);
  float y[kPerLane], g[kPerLane];
  warp_row_load(p.y + row * n, n, lane, width, y);
  warp_row_load(p.dy + row * n, n, lane, width, g);
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) dot += y[i] * g[i];
  dot = warp_sum(dot);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) g[i] = p.scale * y[i] * (g[i] - dot);
  warp_row_store(p.dx + row * n, n, lane, width, g);
}

// a = scale * x, -inf where masked (block layout, one element).
FF_DEVICE float softmax_masked(float x, const bool* mask, int64_t col_stride, int col, float scale) {
  return mask != nullptr && mask[col * col_stride] ? -ff_inf() : x * scale;
}

// Forward, block per row (row = blockIdx.x): online max/sum sweep, block merge, write sweep.
template <typename T>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kSoftmaxBlockThreads) softmax_fwd_block_kernel(const SoftmaxFwdParams<T> p) {
  __shared__ float stage_m[kWarpSize], stage_l[kWarpSize];  // one (m, l) per warp
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  const int64_t row = blockIdx.x;
  const int n = p.cols;
  const T* x = p.x + row * n;
  T* y = p.y + row * n;
  const bool* mask = p.mask.base != nullptr ? softmax_mask_row(p.mask, row) : nullptr;
  const int64_t cs = p.mask.col_stride;
  const float neg_inf = -ff_inf();
  // Sweep 1: this thread's online (m, l).
  SoftmaxOnline s{neg_inf, 0.0f};
  if (p.vec2) {
    for (int col = 2 * threadIdx.x; col < n; col += 2 * blockDim.x) {
      const float2 t = load2(x + col);
      softmax_online_add(s, softmax_masked(t.x, mask, cs, col, p.scale));
      softmax_online_add(s, softmax_masked(t.y, mask, cs, col + 1, p.scale));
    }
  } else {
    for (int col = threadIdx.x; col < n; col += blockDim.x) {
      softmax_online_add(s, softmax_masked(to_float(x[col]), mask, cs, col, p.scale));
    }
  }
  // Merge over the warp, then over the block's warps (every warp merges the staged pairs alike).
  s = softmax_warp_merge(s);
  if (lane == 0) {
    stage_m[warp] = s.m;
    stage_l[warp] = s.l;
  }
  __syncthreads();
  s = lane < warps ? SoftmaxOnline{stage_m[lane], stage_l[lane]} : SoftmaxOnline{neg_inf, 0.0f};
  s = softmax_warp_merge(s);
  // Fully masked row: zeros. A NaN or +inf a: m or l is NaN, and so is every y.
  const float m = s.m == neg_inf ? 0.0f : poison_unbounded(s.m);
  const float inv = s.l == 0.0f ? 0.0f : 1.0f / s.l;
  // Sweep 2: y = e^(a - m) / l.
  if (p.vec2) {
    for (int col = 2 * threadIdx.x; col < n; col += 2 * blockDim.x) {
      const float2 t = load2(x + col);
      store2(y + col, float2{expf(softmax_masked(t.x, mask, cs, col, p.scale) - m) * inv,
                             expf(softmax_masked(t.y, mask, cs, col + 1, p.scale) - m) * inv});
    }
  } else {
    for (int col = threadIdx.x; col < n; col += blockDim.x) {
      y[col] = from_float<T>(expf(softmax_masked(to_float(x[col]), mask, cs, col, p.scale) - m) * inv);
    }
  }
}

// Backward, block per row (row = blockIdx.x): sum(dy y) by block_sum, then dx.
template <typename T>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kSoftmaxBlockThreads) softmax_bwd_block_kernel(const SoftmaxBwdParams<T> p) {
  __shared__ float scratch[1][kWarpSize];
  const int64_t row = blockIdx.x;
  const int n = p.cols;
  const T* y = p.y + row * n;
  const T* dy = p.dy + row * n;
  T* dx = p.dx + row * n;
  float dot[1] = {0.0f};
  if (p.vec2) {
    for (int col = 2 * threadIdx.x; col < n; col += 2 * blockDim.x) {
      const float2 a = load2(y + col), b = load2(dy + col);
      dot[0] += a.x * b.x + a.y * b.y;
    }
  } else {
    for (int col = threadIdx.x; col < n; col += blockDim.x) dot[0] += to_float(y[col]) * to_float(dy[col]);
  }
  block_sum(dot, scratch);
  if (p.vec2) {
    for (int col = 2 * threadIdx.x; col < n; col += 2 * blockDim.x) {
      const float2 a = load2(y + col), b = load2(dy + col);
      store2(dx + col, float2{p.scale * a.x * (b.x - dot[0]), p.scale * a.y * (b.y - dot[0])});
    }
  } else {
    for (int col = threadIdx.x; col < n; col += blockDim.x) {
      dx[col] = from_float<T>(p.scale * to_float(y[col]) * (to_float(dy[col]) - dot[0]));
    }
  }
}

}  // namespace cuda
}  // namespace fastformer

// instantiations: softmax_fwd_warp_kernel<float, 1> softmax_fwd_warp_kernel<float, 2> softmax_fwd_warp_kernel<float, 4> softmax_fwd_warp_kernel<float, 8> softmax_fwd_warp_kernel<float, 16> softmax_fwd_warp_kernel<float, 32>
// instantiations: softmax_fwd_warp_kernel<__half, 1> softmax_fwd_warp_kernel<__half, 2> softmax_fwd_warp_kernel<__half, 4> softmax_fwd_warp_kernel<__half, 8> softmax_fwd_warp_kernel<__half, 16> softmax_fwd_warp_kernel<__half, 32>
// instantiations: softmax_fwd_warp_kernel<__nv_bfloat16, 1> softmax_fwd_warp_kernel<__nv_bfloat16, 2> softmax_fwd_warp_kernel<__nv_bfloat16, 4> softmax_fwd_warp_kernel<__nv_bfloat16, 8> softmax_fwd_warp_kernel<__nv_bfloat16, 16> softmax_fwd_warp_kernel<__nv_bfloat16, 32>
// instantiations: softmax_bwd_warp_kernel<float, 1> softmax_bwd_warp_kernel<float, 2> softmax_bwd_warp_kernel<float, 4> softmax_bwd_warp_kernel<float, 8> softmax_bwd_warp_kernel<float, 16> softmax_bwd_warp_kernel<float, 32>
// instantiations: softmax_bwd_warp_kernel<__half, 1> softmax_bwd_warp_kernel<__half, 2> softmax_bwd_warp_kernel<__half, 4> softmax_bwd_warp_kernel<__half, 8> softmax_bwd_warp_kernel<__half, 16> softmax_bwd_warp_kernel<__half, 32>
// instantiations: softmax_bwd_warp_kernel<__nv_bfloat16, 1> softmax_bwd_warp_kernel<__nv_bfloat16, 2> softmax_bwd_warp_kernel<__nv_bfloat16, 4> softmax_bwd_warp_kernel<__nv_bfloat16, 8> softmax_bwd_warp_kernel<__nv_bfloat16, 16> softmax_bwd_warp_kernel<__nv_bfloat16, 32>
// instantiations: softmax_fwd_block_kernel<float> softmax_fwd_block_kernel<__half> softmax_fwd_block_kernel<__nv_bfloat16>
// instantiations: softmax_bwd_block_kernel<float> softmax_bwd_block_kernel<__half> softmax_bwd_block_kernel<__nv_bfloat16>
