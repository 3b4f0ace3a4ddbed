// y = LayerNorm(residual + dropout(x + x_bias)) over the last dim on the GPU, forward and backward (kernels;
// launchers in layer_norm_residual.cu). x, residual, s, y are R contiguous rows of N; fp32 math. residual,
// weight, bias, y and s (and dresidual, dweight, dbias) have the stream's type T; x and dx have TX, T or,
// beside a float32 stream, __half / __nv_bfloat16: autocast's branch is read as it is (2 bytes an element)
// and upcast in registers, and its gradient written in its own type, so no cast runs around the op.
// Optional, chosen at run time (no more instantiations): x_bias (N,) float32, the branch's bias (the
// launcher hands a float32 copy of another dtype's: N elements); y_c, the compute-dtype copy of y (__half
// or __nv_bfloat16 by c_type: the next GEMM's input), and in backward its gradient dy_c.
//
// Forward, per row:
//   s = residual + (x + x_bias) r   (r = dropout_factor(seed, row * N + col, p, 1/(1-p)) of csrc/philox.h),
//                          rounded to T and stored; the statistics are those of the rounded s, so
//                          backward's xhat, rebuilt from the saved s, matches the forward's exactly;
//   mean, rstd = 1 / sqrt(var + eps) (biased variance);  y = (s - mean) rstd w + b;
//   y_c = y rounded to T, then to the compute type (y.to(C)), stored from the same registers.
// Backward, per row, with xhat = (s - mean) rstd and g = (dy + dy_c) w:
//   ds_total = rstd (g - mean(g) - xhat mean(g xhat)) + ds   (ds: gradient of the s output, optional)
//   dresidual = ds_total, dx = ds_total r (rounded to TX)
//   dweight = sum_rows (dy + dy_c) xhat, dbias = sum_rows (dy + dy_c), dx_bias = sum_rows dx (the float dx):
//   deterministic, without atomics, in two stages. (1) The rows are cut into P contiguous chunks, one per
//   block of a grid whose size depends on R and N only (not on the device); each block writes the sums over
//   its chunk as row b of partial_dw / partial_db (/ partial_dxb) (P, N) float32.
//   (2) layer_norm_residual_bwd_reduce_kernel sums the P partials of each column in a fixed order and writes
//   dweight, dbias in T, dx_bias in float32. Every run gives the same bits.
//
// Two layouts:
//   warp per row (N <= kLnrWarpMaxN, the paper's 512 and 1024): the warp-row register layout of common.cuh
//     (lane l keeps kPerLane = ceil(N / 32), rounded up to a power of two, values of the row in registers,
//     in runs of 16-byte packs, half2/float2 pairs or single elements; a TX branch beside a float32
//     stream moves in pairs or elements, so that a lane's runs cover the same columns in both types).
//     Forward: one load of x and residual, the row's sum and then sum (s - mean)^2 from the registers
//     (two-pass variance, no cancellation), one store of s and y (and y_c); Philox once per 4 elements (a
//     run of a pack or 4 elements). DRAM per row 4 N sizeof(T) (3 N sizeof(T) + N sizeof(TX) with a TX
//     branch; + N sizeof(C) with y_c; + 8 bytes of mean, rstd; w, b, x_bias cached), with no second sweep.
//     Packs only where every row of the call has T's element size (x, y_c, dy_c; x_bias beside float T).
//     Backward: block b (kLnrWarpRows warps) owns chunk b; warp w takes its rows w, w + 8, ...: one load
//     of s, dy (and ds), the two row sums by shuffles, one store of dx and dresidual (4 N sizeof(T) per
//     row, + N for ds); each lane accumulates dy xhat and dy for its columns in registers over its rows
//     (dx, with x_bias, in its warp's row of shared memory), and the block's warps add theirs in warp
//     order through shared memory (lnr_block_column_sum) into one partial row: P N 8 (12) bytes written once.
//   block per row (N > kLnrWarpMaxN): kLnrThreads threads stride over the row in pairs (half2/float2, when
//     N is even and the rows 2-element aligned) or elements. Forward: sweep 1 writes s and keeps a Welford
//     (count, mean, M2) per thread, merged over the block in a fixed order (Chan et al.); sweep 2 rereads
//     s (L2) and writes y. Backward: sweep 1 for the two row sums (block_sum), sweep 2 rereads s, dy and
//     writes dx, dresidual; the block's partial row is read-modified-written per row (mostly L2 hits).
#pragma once
#include "common.cuh"

namespace fastformer {
namespace cuda {

constexpr int kLnrThreads = 256;                    // threads per block, both layouts
constexpr int kLnrWarpRows = kLnrThreads / kWarpSize;  // warps (rows at a time) per block, warp layout
constexpr int kLnrWarpMaxN = 1024;                  // a warp per row up to this N (32 values per lane)
constexpr int kLnrBwdWarpMinRows = 4 * kLnrWarpRows;  // backward chunk, warp layout: at least 4 rows a warp
constexpr int kLnrBwdWarpMaxBlocks = 512;           // ... and at most this many chunks (P N 8 bytes of partials)
constexpr int kLnrBwdBlockMaxBlocks = 128;          // backward chunks, block layout
constexpr int kLnrReduceStripes = 8;                // stage 2: a block sums 32 columns, each over 8 stripes

// T: the residual stream's storage type (residual, weight, bias, y, s); TX: the branch x's (and dx's), T or,
// beside a float32 stream, __half / __nv_bfloat16 (autocast's branch, upcast as it is read).
// The compute type of y_c and dy_c, a launch argument (no instantiation per type).
enum LnrComputeType : int { kLnrComputeNone = 0, kLnrComputeHalf = 1, kLnrComputeBFloat16 = 2 };

// Stores a lane's kPerLane values into row `row` of y_c (base: the row's first element) in the compute type.
template <int kPerLane>
FF_DEVICE void lnr_warp_store_c(void* y_c, int c_type, int64_t base, int n, int lane, int width,
                                const float (&v)[kPerLane]) {
  if (c_type == kLnrComputeHalf) {
    warp_row_store(static_cast<__half*>(y_c) + base, n, lane, width, v);
  } else {
    warp_row_store(static_cast<__nv_bfloat16*>(y_c) + base, n, lane, width, v);
  }
}

template <int kPerLane>
FF_DEVICE void lnr_warp_load_c(const void* dy_c, int c_type, int64_t base, int n, int lane, int width,
                               float (&v)[kPerLane]) {
  if (c_type == kLnrComputeHalf) {
    warp_row_load(static_cast<const __half*>(dy_c) + base, n, lane, width, v);
  } else {
    warp_row_load(static_cast<const __nv_bfloat16*>(dy_c) + base, n, lane, width, v);
  }
}

// Element i of y_c / dy_c (pairs: i even, 2-element aligned).
FF_DEVICE void lnr_store_c(void* y_c, int c_type, int64_t i, float v) {
  if (c_type == kLnrComputeHalf) {
    static_cast<__half*>(y_c)[i] = from_float<__half>(v);
  } else {
    static_cast<__nv_bfloat16*>(y_c)[i] = from_float<__nv_bfloat16>(v);
  }
}
FF_DEVICE void lnr_store2_c(void* y_c, int c_type, int64_t i, float2 v) {
  if (c_type == kLnrComputeHalf) {
    store2(static_cast<__half*>(y_c) + i, v);
  } else {
    store2(static_cast<__nv_bfloat16*>(y_c) + i, v);
  }
}
FF_DEVICE float lnr_load_c(const void* dy_c, int c_type, int64_t i) {
  return c_type == kLnrComputeHalf ? to_float(static_cast<const __half*>(dy_c)[i])
                                   : to_float(static_cast<const __nv_bfloat16*>(dy_c)[i]);
}
FF_DEVICE float2 lnr_load2_c(const void* dy_c, int c_type, int64_t i) {
  return c_type == kLnrComputeHalf ? load2(static_cast<const __half*>(dy_c) + i)
                                   : load2(static_cast<const __nv_bfloat16*>(dy_c) + i);
}

template <typename T, typename TX = T>
struct LnrFwdParams {
  const TX* x;        // (R, N) branch input, dropped out
  const T* residual;  // (R, N)
  const T* weight;    // (N,)
  const T* bias;      // (N,)
  const float* x_bias;  // (N,) the branch's bias, added before dropout, or nullptr
  T* y;               // (R, N) output
  T* s;               // (R, N) output: residual + dropout(x + x_bias)
  void* y_c;          // (R, N) output: y in the compute type c_type, or nullptr
  int c_type;         // LnrComputeType of y_c
  float* mean;        // (R,) output
  float* rstd;        // (R,) output: 1 / sqrt(var + eps)
  int64_t rows;       // R
  int cols;           // N
  float eps;
  float dropout_p;    // p in [0, 1); 0 = no dropout
  float inv_keep;     // 1 / (1 - p)
  const int64_t* seed;  // () dropout seed in device memory (load_seed); nullptr without dropout
  bool vec2;          // N even and every row pointer 2-element aligned: half2/float2 pairs
  bool packs;         // N a multiple of kPack<T> and every pointer 16-byte aligned (warp layout, TX = T only)
};

template <typename T, typename TX = T>
struct LnrBwdParams {
  const T* dy;          // (R, N) gradient of y
  const void* dy_c;     // (R, N) gradient of y_c in the compute type c_type, or nullptr
  int c_type;           // LnrComputeType of dy_c
  const T* ds;          // (R, N) gradient of the s output, or nullptr
  const T* s;           // (R, N) saved residual + dropout(x)
  const T* weight;      // (N,)
  const float* mean;    // (R,) saved
  const float* rstd;    // (R,) saved
  TX* dx;               // (R, N) output, in x's type
  T* dresidual;         // (R, N) output
  float* partial_dw;    // (P, N) stage-1 output: row b = sum over chunk b of dy xhat
  float* partial_db;    // (P, N) stage-1 output: row b = sum over chunk b of dy
  float* partial_dxb;   // (P, N) stage-1 output: row b = sum over chunk b of dx, or nullptr (no x_bias)
  int64_t rows;         // R
  int cols;             // N
  int64_t chunk_rows;   // rows per chunk (the last chunk may be shorter); P = gridDim.x chunks
  float dropout_p;
  float inv_keep;
  const int64_t* seed;  // () as in LnrFwdParams
  bool vec2;            // N even and every row pointer 2-element aligned
  bool packs;           // N a multiple of kPack<T> and every pointer 16-byte aligned (warp layout, TX = T only)
};

template <typename T>
struct LnrReduceParams {
  const float* partial_dw;  // (P, N)
  const float* partial_db;  // (P, N)
  const float* partial_dxb;  // (P, N) or nullptr
  T* dweight;               // (N,) output
  T* dbias;                 // (N,) output
  float* dx_bias;           // (N,) output (with partial_dxb)
  int partials;             // P
  int cols;                 // N
};

// ---------------------------------------------------------------------------------------------------
// Warp layout: a warp per row, the row in registers.

// Forward: warp w of block b takes row b * kLnrWarpRows + w.
template <typename T, int kPerLane, typename TX = T>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kLnrThreads) layer_norm_residual_fwd_warp_kernel(const LnrFwdParams<T, TX> p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kLnrWarpRows + threadIdx.x / kWarpSize;
  if (row >= p.rows) return;  // the whole warp: no shuffle is left waiting
  const int n = p.cols;
  const int64_t base = row * n;
  const int width = warp_row_width<T, kPerLane>(p.packs && sizeof(TX) == sizeof(T), p.vec2);  // TX: no packs
  float v[kPerLane], u[kPerLane];
  warp_row_load(p.x + base, n, lane, width, v);
  if (p.x_bias != nullptr) {
    warp_row_load(p.x_bias, n, lane, width, u);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) v[i] += u[i];
  }
  if (p.dropout_p > 0.0f) {
    float r[kPerLane];
    warp_row_dropout(p.seed, base, lane, width, p.dropout_p, p.inv_keep, r);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) v[i] *= r[i];
  }
  warp_row_load(p.residual + base, n, lane, width, u);  // after the mask: r and u are never live together
  // s = residual + x r, rounded to T (columns past the row's end: 0 + 0 = 0).
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    v[i] = to_float(from_float<T>(u[i] + v[i]));
    sum += v[i];
  }
  warp_row_store(p.s + base, n, lane, width, v);  // exact: the values are already values of T
  const float inv_n = 1.0f / static_cast<float>(n);
  const float mean = warp_sum(sum) * inv_n;
  float m2 = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const float d = warp_row_col(i, lane, width) < n ? v[i] - mean : 0.0f;
    m2 += d * d;
  }
  const float rstd = 1.0f / sqrtf(warp_sum(m2) * inv_n + p.eps);
  if (lane == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
  // y = (s - mean) rstd w + b
  warp_row_load(p.weight, n, lane, width, u);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) v[i] = (v[i] - mean) * rstd * u[i];
  warp_row_load(p.bias, n, lane, width, u);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) v[i] += u[i];
  warp_row_store(p.y + base, n, lane, width, v);
  if (p.y_c != nullptr) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) v[i] = to_float(from_float<T>(v[i]));  // y as stored: y_c = y.to(C)
    lnr_warp_store_c(p.y_c, p.c_type, base, n, lane, width, v);
  }
}

// out[col] = sum over the block's warps w = 0, 1, ... (in that order) of stage[w][col], for col < n, once
// every warp has written its row of stage: the caller's __shared__ float[kLnrWarpRows][32 kPerLane]. All
// threads of the block must call it (two __syncthreads).
template <int kPerLane>
FF_DEVICE void lnr_stage_column_sum(float (*stage)[kWarpSize * kPerLane], int n, float* out) {
  __syncthreads();
  for (int col = threadIdx.x; col < n; col += kLnrThreads) {
    float t = stage[0][col];
#pragma unroll
    for (int w = 1; w < kLnrWarpRows; ++w) t += stage[w][col];
    out[col] = t;
  }
  __syncthreads();  // every reader is done: the stage may be refilled
}

// lnr_stage_column_sum of v: a lane's kPerLane values in the warp-row layout, staged first.
template <int kPerLane>
FF_DEVICE void lnr_block_column_sum(const float (&v)[kPerLane], float (*stage)[kWarpSize * kPerLane], int n,
                                    int width, float* out) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) stage[warp][warp_row_col(i, lane, width)] = v[i];
  lnr_stage_column_sum<kPerLane>(stage, n, out);
}

// Backward stage 1: block b owns chunk b, the rows [b chunk_rows, min(R, (b + 1) chunk_rows)); warp w
// takes the chunk's rows w, w + kLnrWarpRows, ...; the block writes row b of partial_dw / partial_db.
template <typename T, int kPerLane, typename TX = T>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kLnrThreads) layer_norm_residual_bwd_warp_kernel(const LnrBwdParams<T, TX> p) {
  __shared__ float stage[kLnrWarpRows][kWarpSize * kPerLane];
  const int lane = threadIdx.x % kWarpSize;
  const int n = p.cols;
  const int width = warp_row_width<T, kPerLane>(p.packs && sizeof(TX) == sizeof(T), p.vec2);  // TX: no packs
  const int64_t first = static_cast<int64_t>(blockIdx.x) * p.chunk_rows;
  const int64_t last = first + p.chunk_rows < p.rows ? first + p.chunk_rows : p.rows;
  const float inv_n = 1.0f / static_cast<float>(n);
  float dw[kPerLane], db[kPerLane];  // this lane's columns of sum dy xhat, sum dy over its rows
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) dw[i] = db[i] = 0.0f;
  // With x_bias, sum dx over the warp's rows accumulates in the warp's row of the stage, each lane in its own
  // columns (no other thread touches them until lnr_stage_column_sum): no registers held over the rows.
  // Columns >= N collect values never stored.
  float* dxb = stage[threadIdx.x / kWarpSize];
  if (p.partial_dxb != nullptr) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) dxb[warp_row_col(i, lane, width)] = 0.0f;
  }
  for (int64_t row = first + threadIdx.x / kWarpSize; row < last; row += kLnrWarpRows) {
    const int64_t base = row * n;
    float x[kPerLane], g[kPerLane], w[kPerLane];  // x: s, then xhat, then ds_total
    warp_row_load(p.s + base, n, lane, width, x);
    warp_row_load(p.dy + base, n, lane, width, g);
    if (p.dy_c != nullptr) {  // the gradient reaching y: dy + dy_c
      lnr_warp_load_c(p.dy_c, p.c_type, base, n, lane, width, w);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) g[i] += w[i];
    }
    warp_row_load(p.weight, n, lane, width, w);
    const float mu = p.mean[row], rs = p.rstd[row];
    // The row sums of g = dy w and g xhat; the partials (columns past the end hold dy = 0: they add 0).
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      x[i] = (x[i] - mu) * rs;
      dw[i] += g[i] * x[i];
      db[i] += g[i];
      g[i] *= w[i];
      sum_g += g[i];
      sum_gx += g[i] * x[i];
    }
    const float mean_g = warp_sum(sum_g) * inv_n, mean_gx = warp_sum(sum_gx) * inv_n;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = rs * (g[i] - mean_g - x[i] * mean_gx);
    if (p.ds != nullptr) {
      warp_row_load(p.ds + base, n, lane, width, g);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) x[i] += g[i];
    }
    warp_row_store(p.dresidual + base, n, lane, width, x);
    if (p.dropout_p > 0.0f) {
      warp_row_dropout(p.seed, base, lane, width, p.dropout_p, p.inv_keep, g);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) x[i] *= g[i];
    }
    warp_row_store(p.dx + base, n, lane, width, x);
    if (p.partial_dxb != nullptr) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) dxb[warp_row_col(i, lane, width)] += x[i];
    }
  }
  const int64_t part = static_cast<int64_t>(blockIdx.x) * n;
  if (p.partial_dxb != nullptr) lnr_stage_column_sum<kPerLane>(stage, n, p.partial_dxb + part);  // uniform
  lnr_block_column_sum(dw, stage, n, width, p.partial_dw + part);
  lnr_block_column_sum(db, stage, n, width, p.partial_db + part);
}

// ---------------------------------------------------------------------------------------------------
// Block layout: a block of kLnrThreads per row, sweeping the row in pairs or elements.

// Welford state: count, mean and sum of squared deviations M2.
struct Welford {
  float n, mean, m2;
};

FF_DEVICE void welford_add(Welford& w, float v) {
  w.n += 1.0f;
  const float d = v - w.mean;
  w.mean += d / w.n;
  w.m2 += d * (v - w.mean);
}

// The parallel merge of two disjoint parts (a before b); either may be empty.
FF_DEVICE Welford welford_merge(const Welford& a, const Welford& b) {
  const float n = a.n + b.n;
  if (n == 0.0f) return a;
  const float d = b.mean - a.mean, fb = b.n / n;
  return Welford{n, a.mean + d * fb, a.m2 + b.m2 + d * d * a.n * fb};
}

// Merges the Welford states of the block's threads; every thread gets the same result. Warp: butterfly
// where both partners merge (lower lanes, upper lanes), so they agree bit for bit; then lane 0 of each
// warp stages its state in shared memory, and every thread merges the warps' states in order 0, 1, ...
FF_DEVICE Welford lnr_block_welford(Welford w, Welford* stage) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const Welford o{__shfl_xor_sync(kFullMask, w.n, offset), __shfl_xor_sync(kFullMask, w.mean, offset),
                    __shfl_xor_sync(kFullMask, w.m2, offset)};
    w = (lane & offset) != 0 ? welford_merge(o, w) : welford_merge(w, o);
  }
  if (lane == 0) stage[threadIdx.x / kWarpSize] = w;
  __syncthreads();
  w = stage[0];
#pragma unroll
  for (int k = 1; k < kLnrThreads / kWarpSize; ++k) w = welford_merge(w, stage[k]);
  return w;
}

// Forward: row blockIdx.x.
template <typename T, typename TX = T>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kLnrThreads) layer_norm_residual_fwd_block_kernel(const LnrFwdParams<T, TX> p) {
  __shared__ Welford stage[kLnrThreads / kWarpSize];  // one state per warp
  const int t = threadIdx.x;
  const int64_t row = blockIdx.x;
  const int n = p.cols;
  const int64_t base = row * n;
  const TX* x = p.x + base;
  const T* res = p.residual + base;
  T* s = p.s + base;
  T* y = p.y + base;
  const bool drop = p.dropout_p > 0.0f;
  // Sweep 1: s = residual + x r, rounded to T and stored; Welford over the rounded values.
  Welford w{0.0f, 0.0f, 0.0f};
  if (p.vec2) {
    for (int col = 2 * t; col < n; col += 2 * kLnrThreads) {
      float2 xv = load2(x + col);
      if (p.x_bias != nullptr) {
        const float2 bv = load2(p.x_bias + col);
        xv.x += bv.x;
        xv.y += bv.y;
      }
      const float2 rv = load2(res + col);
      if (drop) {
        const float2 r =
            dropout_factor2(load_seed(p.seed), static_cast<uint64_t>(base + col), p.dropout_p, p.inv_keep);
        xv.x *= r.x;
        xv.y *= r.y;
      }
      const float sa = to_float(from_float<T>(rv.x + xv.x)), sb = to_float(from_float<T>(rv.y + xv.y));
      store2(s + col, float2{sa, sb});  // exact: sa, sb are already values of T
      welford_add(w, sa);
      welford_add(w, sb);
    }
  } else {
    for (int col = t; col < n; col += kLnrThreads) {
      float xv = to_float(x[col]);
      if (p.x_bias != nullptr) xv += p.x_bias[col];
      if (drop) {
        xv *= dropout_factor(load_seed(p.seed), static_cast<uint64_t>(base + col), p.dropout_p, p.inv_keep);
      }
      const T sv = from_float<T>(to_float(res[col]) + xv);
      s[col] = sv;
      welford_add(w, to_float(sv));
    }
  }
  w = lnr_block_welford(w, stage);
  const float mean = w.mean;
  const float rstd = 1.0f / sqrtf(w.m2 / static_cast<float>(n) + p.eps);
  if (t == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
  // Sweep 2: y = (s - mean) rstd w + b from the stored s.
  if (p.vec2) {
    for (int col = 2 * t; col < n; col += 2 * kLnrThreads) {
      const float2 sv = load2(s + col), wv = load2(p.weight + col), bv = load2(p.bias + col);
      const float2 yv{(sv.x - mean) * rstd * wv.x + bv.x, (sv.y - mean) * rstd * wv.y + bv.y};
      store2(y + col, yv);
      if (p.y_c != nullptr) {  // y as stored, then the compute type: y.to(C)
        lnr_store2_c(p.y_c, p.c_type, base + col,
                     float2{to_float(from_float<T>(yv.x)), to_float(from_float<T>(yv.y))});
      }
    }
  } else {
    for (int col = t; col < n; col += kLnrThreads) {
      const T yv = from_float<T>((to_float(s[col]) - mean) * rstd * to_float(p.weight[col]) + to_float(p.bias[col]));
      y[col] = yv;
      if (p.y_c != nullptr) lnr_store_c(p.y_c, p.c_type, base + col, to_float(yv));
    }
  }
}

// The gradient reaching y at element i (pairs: i even): dy + dy_c.
template <typename T, typename TX>
FF_DEVICE float lnr_dy(const LnrBwdParams<T, TX>& p, int64_t i) {
  const float g = to_float(p.dy[i]);
  return p.dy_c != nullptr ? g + lnr_load_c(p.dy_c, p.c_type, i) : g;
}
template <typename T, typename TX>
FF_DEVICE float2 lnr_dy2(const LnrBwdParams<T, TX>& p, int64_t i) {
  float2 g = load2(p.dy + i);
  if (p.dy_c != nullptr) {
    const float2 c = lnr_load2_c(p.dy_c, p.c_type, i);
    g.x += c.x;
    g.y += c.y;
  }
  return g;
}

// Backward stage 1: block b owns chunk b, the rows [b chunk_rows, min(R, (b + 1) chunk_rows)), one after
// the other; writes their dx, dresidual and row b of partial_dw / partial_db (/ partial_dxb).
template <typename T, typename TX = T>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kLnrThreads) layer_norm_residual_bwd_block_kernel(const LnrBwdParams<T, TX> p) {
  __shared__ float scratch[2][kWarpSize];  // the two row sums per warp
  const int t = threadIdx.x;
  const int n = p.cols;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * p.chunk_rows;
  const int64_t last = first + p.chunk_rows < p.rows ? first + p.chunk_rows : p.rows;
  float* part_dw = p.partial_dw + static_cast<int64_t>(blockIdx.x) * n;
  float* part_db = p.partial_db + static_cast<int64_t>(blockIdx.x) * n;
  float* part_dxb = p.partial_dxb != nullptr ? p.partial_dxb + static_cast<int64_t>(blockIdx.x) * n : nullptr;
  const bool drop = p.dropout_p > 0.0f;
  const float inv_n = 1.0f / static_cast<float>(n);
  // The chunk's partial sums start at zero; each thread clears the columns it accumulates below.
  if (p.vec2) {
    for (int col = 2 * t; col < n; col += 2 * kLnrThreads) {
      store2(part_dw + col, float2{0.0f, 0.0f});
      store2(part_db + col, float2{0.0f, 0.0f});
      if (part_dxb != nullptr) store2(part_dxb + col, float2{0.0f, 0.0f});
    }
  } else {
    for (int col = t; col < n; col += kLnrThreads) {
      part_dw[col] = 0.0f;
      part_db[col] = 0.0f;
      if (part_dxb != nullptr) part_dxb[col] = 0.0f;
    }
  }
  for (int64_t row = first; row < last; ++row) {
    const int64_t base = row * n;
    const T* s = p.s + base;
    const T* ds = p.ds != nullptr ? p.ds + base : nullptr;
    TX* dx = p.dx + base;
    T* dres = p.dresidual + base;
    const float mu = p.mean[row], rs = p.rstd[row];
    // Sweep 1: sums of g and g xhat; partial dweight += dy xhat, dbias += dy.
    float sums[2] = {0.0f, 0.0f};
    if (p.vec2) {
      for (int col = 2 * t; col < n; col += 2 * kLnrThreads) {
        const float2 sv = load2(s + col), wv = load2(p.weight + col);
        const float2 gv = lnr_dy2(p, base + col);
        const float xa = (sv.x - mu) * rs, xb = (sv.y - mu) * rs;
        const float ga = gv.x * wv.x, gb = gv.y * wv.y;
        sums[0] += ga + gb;
        sums[1] += ga * xa + gb * xb;
        const float2 pw = load2(part_dw + col), pb = load2(part_db + col);
        store2(part_dw + col, float2{pw.x + gv.x * xa, pw.y + gv.y * xb});
        store2(part_db + col, float2{pb.x + gv.x, pb.y + gv.y});
      }
    } else {
      for (int col = t; col < n; col += kLnrThreads) {
        const float xhat = (to_float(s[col]) - mu) * rs, gv = lnr_dy(p, base + col);
        const float g = gv * to_float(p.weight[col]);
        sums[0] += g;
        sums[1] += g * xhat;
        part_dw[col] += gv * xhat;
        part_db[col] += gv;
      }
    }
    block_sum(sums, scratch);
    const float mean_g = sums[0] * inv_n, mean_gx = sums[1] * inv_n;
    // Sweep 2: ds_total = rstd (g - mean(g) - xhat mean(g xhat)) + ds; dresidual = ds_total, dx = ds_total r.
    if (p.vec2) {
      for (int col = 2 * t; col < n; col += 2 * kLnrThreads) {
        const float2 sv = load2(s + col), wv = load2(p.weight + col);
        const float2 gv = lnr_dy2(p, base + col);
        float d0 = rs * (gv.x * wv.x - mean_g - (sv.x - mu) * rs * mean_gx);
        float d1 = rs * (gv.y * wv.y - mean_g - (sv.y - mu) * rs * mean_gx);
        if (ds != nullptr) {
          const float2 dsv = load2(ds + col);
          d0 += dsv.x;
          d1 += dsv.y;
        }
        store2(dres + col, float2{d0, d1});
        if (drop) {
          const float2 r =
              dropout_factor2(load_seed(p.seed), static_cast<uint64_t>(base + col), p.dropout_p, p.inv_keep);
          d0 *= r.x;
          d1 *= r.y;
        }
        store2(dx + col, float2{d0, d1});
        if (part_dxb != nullptr) {
          const float2 pxb = load2(part_dxb + col);
          store2(part_dxb + col, float2{pxb.x + d0, pxb.y + d1});
        }
      }
    } else {
      for (int col = t; col < n; col += kLnrThreads) {
        const float xhat = (to_float(s[col]) - mu) * rs;
        float d = rs * (lnr_dy(p, base + col) * to_float(p.weight[col]) - mean_g - xhat * mean_gx);
        if (ds != nullptr) d += to_float(ds[col]);
        dres[col] = from_float<T>(d);
        if (drop) d *= dropout_factor(load_seed(p.seed), static_cast<uint64_t>(base + col), p.dropout_p,
                                      p.inv_keep);
        dx[col] = from_float<TX>(d);
        if (part_dxb != nullptr) part_dxb[col] += d;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Both layouts.

// Backward stage 2: dweight[col] = sum_c partial_dw[c, col] (dbias alike), c in a fixed order.
// Block b (kLnrReduceStripes warps) takes columns 32 b .. 32 b + 31, lane = column: warp k sums the partials
// c = k, k + 8, ... (coalesced 128-byte rows), the 8 stripe sums go through shared memory (2 x 8 x 32
// floats) and warp 0 adds them in stripe order. Reads P N float32 twice (dw, db) and writes 2 N T.
template <typename T>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kLnrReduceStripes * kWarpSize) layer_norm_residual_bwd_reduce_kernel(
    const LnrReduceParams<T> p) {
  __shared__ float stripe_dw[kLnrReduceStripes][kWarpSize], stripe_db[kLnrReduceStripes][kWarpSize];
  const int lane = threadIdx.x % kWarpSize, stripe = threadIdx.x / kWarpSize;
  const int col = blockIdx.x * kWarpSize + lane;
  __shared__ float stripe_dxb[kLnrReduceStripes][kWarpSize];
  float sw = 0.0f, sb = 0.0f, sx = 0.0f;
  if (col < p.cols) {
    for (int c = stripe; c < p.partials; c += kLnrReduceStripes) {
      sw += p.partial_dw[static_cast<int64_t>(c) * p.cols + col];
      sb += p.partial_db[static_cast<int64_t>(c) * p.cols + col];
      if (p.partial_dxb != nullptr) sx += p.partial_dxb[static_cast<int64_t>(c) * p.cols + col];
    }
  }
  stripe_dw[stripe][lane] = sw;
  stripe_db[stripe][lane] = sb;
  stripe_dxb[stripe][lane] = sx;
  __syncthreads();
  if (stripe == 0 && col < p.cols) {
    sw = stripe_dw[0][lane];
    sb = stripe_db[0][lane];
    sx = stripe_dxb[0][lane];
#pragma unroll
    for (int k = 1; k < kLnrReduceStripes; ++k) {
      sw += stripe_dw[k][lane];
      sb += stripe_db[k][lane];
      sx += stripe_dxb[k][lane];
    }
    p.dweight[col] = from_float<T>(sw);
    p.dbias[col] = from_float<T>(sb);
    if (p.partial_dxb != nullptr) p.dx_bias[col] = sx;
  }
}

}  // namespace cuda
}  // namespace fastformer

// instantiations: layer_norm_residual_fwd_warp_kernel<float, 1> layer_norm_residual_fwd_warp_kernel<float, 2> layer_norm_residual_fwd_warp_kernel<float, 4> layer_norm_residual_fwd_warp_kernel<float, 8> layer_norm_residual_fwd_warp_kernel<float, 16> layer_norm_residual_fwd_warp_kernel<float, 32>
// instantiations: layer_norm_residual_fwd_warp_kernel<__half, 1> layer_norm_residual_fwd_warp_kernel<__half, 2> layer_norm_residual_fwd_warp_kernel<__half, 4> layer_norm_residual_fwd_warp_kernel<__half, 8> layer_norm_residual_fwd_warp_kernel<__half, 16> layer_norm_residual_fwd_warp_kernel<__half, 32>
// instantiations: layer_norm_residual_fwd_warp_kernel<__nv_bfloat16, 1> layer_norm_residual_fwd_warp_kernel<__nv_bfloat16, 2> layer_norm_residual_fwd_warp_kernel<__nv_bfloat16, 4> layer_norm_residual_fwd_warp_kernel<__nv_bfloat16, 8> layer_norm_residual_fwd_warp_kernel<__nv_bfloat16, 16> layer_norm_residual_fwd_warp_kernel<__nv_bfloat16, 32>
// instantiations: layer_norm_residual_bwd_warp_kernel<float, 1> layer_norm_residual_bwd_warp_kernel<float, 2> layer_norm_residual_bwd_warp_kernel<float, 4> layer_norm_residual_bwd_warp_kernel<float, 8> layer_norm_residual_bwd_warp_kernel<float, 16> layer_norm_residual_bwd_warp_kernel<float, 32>
// instantiations: layer_norm_residual_bwd_warp_kernel<__half, 1> layer_norm_residual_bwd_warp_kernel<__half, 2> layer_norm_residual_bwd_warp_kernel<__half, 4> layer_norm_residual_bwd_warp_kernel<__half, 8> layer_norm_residual_bwd_warp_kernel<__half, 16> layer_norm_residual_bwd_warp_kernel<__half, 32>
// instantiations: layer_norm_residual_bwd_warp_kernel<__nv_bfloat16, 1> layer_norm_residual_bwd_warp_kernel<__nv_bfloat16, 2> layer_norm_residual_bwd_warp_kernel<__nv_bfloat16, 4> layer_norm_residual_bwd_warp_kernel<__nv_bfloat16, 8> layer_norm_residual_bwd_warp_kernel<__nv_bfloat16, 16> layer_norm_residual_bwd_warp_kernel<__nv_bfloat16, 32>
// instantiations: layer_norm_residual_fwd_block_kernel<float> layer_norm_residual_fwd_block_kernel<__half> layer_norm_residual_fwd_block_kernel<__nv_bfloat16>
// instantiations: layer_norm_residual_bwd_block_kernel<float> layer_norm_residual_bwd_block_kernel<__half> layer_norm_residual_bwd_block_kernel<__nv_bfloat16>
// instantiations: layer_norm_residual_bwd_reduce_kernel<float> layer_norm_residual_bwd_reduce_kernel<__half> layer_norm_residual_bwd_reduce_kernel<__nv_bfloat16>
// instantiations: layer_norm_residual_fwd_warp_kernel<float, 1, __half> layer_norm_residual_fwd_warp_kernel<float, 2, __half> layer_norm_residual_fwd_warp_kernel<float, 4, __half> layer_norm_residual_fwd_warp_kernel<float, 8, __half> layer_norm_residual_fwd_warp_kernel<float, 16, __half> layer_norm_residual_fwd_warp_kernel<float, 32, __half>
// instantiations: layer_norm_residual_fwd_warp_kernel<float, 1, __nv_bfloat16> layer_norm_residual_fwd_warp_kernel<float, 2, __nv_bfloat16> layer_norm_residual_fwd_warp_kernel<float, 4, __nv_bfloat16> layer_norm_residual_fwd_warp_kernel<float, 8, __nv_bfloat16> layer_norm_residual_fwd_warp_kernel<float, 16, __nv_bfloat16> layer_norm_residual_fwd_warp_kernel<float, 32, __nv_bfloat16>
// instantiations: layer_norm_residual_bwd_warp_kernel<float, 1, __half> layer_norm_residual_bwd_warp_kernel<float, 2, __half> layer_norm_residual_bwd_warp_kernel<float, 4, __half> layer_norm_residual_bwd_warp_kernel<float, 8, __half> layer_norm_residual_bwd_warp_kernel<float, 16, __half> layer_norm_residual_bwd_warp_kernel<float, 32, __half>
// instantiations: layer_norm_residual_bwd_warp_kernel<float, 1, __nv_bfloat16> layer_norm_residual_bwd_warp_kernel<float, 2, __nv_bfloat16> layer_norm_residual_bwd_warp_kernel<float, 4, __nv_bfloat16> layer_norm_residual_bwd_warp_kernel<float, 8, __nv_bfloat16> layer_norm_residual_bwd_warp_kernel<float, 16, __nv_bfloat16> layer_norm_residual_bwd_warp_kernel<float, 32, __nv_bfloat16>
// instantiations: layer_norm_residual_fwd_block_kernel<float, __half> layer_norm_residual_fwd_block_kernel<float, __nv_bfloat16>
// instantiations: layer_norm_residual_bwd_block_kernel<float, __half> layer_norm_residual_bwd_block_kernel<float, __nv_bfloat16>
