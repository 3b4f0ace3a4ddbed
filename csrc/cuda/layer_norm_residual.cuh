// y = LayerNorm(residual + dropout(x)) over the last dim on the GPU, forward and backward (kernels;
// launchers in layer_norm_residual.cu).
//
// Rows (R rows of N, contiguous) are handled by groups of kThreadsPerRow threads: a warp per row (32,
// kLnrThreads / 32 rows per block) for N <= kLnrWarpMaxN, the whole block per row (kLnrThreads) above.
// Thread t of a group takes the pairs of columns 2 t + 2 G i, 2 t + 2 G i + 1 (half2/float2 loads, when N is
// even and every row 2-element aligned) or the columns t + G i (scalar), G = kThreadsPerRow; any N >= 1.
//
// Forward, per row (fp32 math):
//   s = residual + x * r   (r = dropout_factor(seed, row * N + col, p, 1/(1-p)) of csrc/philox.h),
//                          rounded to T and stored; the statistics are those of the rounded s, so
//                          backward's xhat, rebuilt from the saved s, matches the forward's exactly;
//   mean, M2 by Welford per thread, merged over the group with the parallel Welford merge (Chan et al.)
//     in a fixed tree order (warp shuffles, then the block's warps through shared memory, 8 x 3 floats);
//   rstd = 1 / sqrt(M2 / N + eps);  y = (s - mean) rstd w + b   (a second sweep rereads s, which this
//   thread wrote, from L1/L2).
// DRAM per row: reads x, residual, writes s, y: 4 N sizeof(T) (+ 8 bytes of mean, rstd; w, b cached).
//
// Backward, per row, with xhat = (s - mean) rstd and g = dy w:
//   ds_total = rstd (g - mean(g) - xhat mean(g xhat)) + ds   (ds: gradient of the s output, optional)
//   dresidual = ds_total, dx = ds_total r
// sweep 1 reads s, dy for the two row sums (group reduction), sweep 2 rereads them (L1/L2) and writes dx,
// dresidual: 4 N sizeof(T) from DRAM (+ N sizeof(T) for ds).
// dweight = sum_rows dy xhat and dbias = sum_rows dy, deterministically and without atomics, in two
// stages: (1) the rows are cut into P contiguous chunks, one per row group of a fixed grid (at most
// kLnrBwdMaxBlocks blocks, independent of the device); a group owns its columns for all the rows of its
// chunk and accumulates dy xhat and dy into its own float32 row of partial_dw / partial_db (P, N), zeroed
// first (a read-modify-write of 2 N floats per row, mostly L2 hits: the workspace is P N 8 bytes);
// (2) layer_norm_residual_bwd_reduce_kernel sums the P partials of each column in a fixed order and writes
// dweight, dbias in T. The summation order depends on R and N only (not on the device or on timing), so
// every run gives the same bits.
#pragma once
#include "common.cuh"

namespace fastformer {
namespace cuda {

constexpr int kLnrThreads = 256;         // threads per block, both layouts
constexpr int kLnrWarpMaxN = 1024;       // a warp per row up to this N, the whole block per row above
constexpr int kLnrBwdMaxBlocks = 128;    // stage-1 backward grid cap (so P <= 128 * rows per block)
constexpr int kLnrReduceStripes = 8;     // stage 2: a block sums 32 columns, each over 8 stripes of partials

template <typename T>
struct LnrFwdParams {
  const T* x;         // (R, N) branch input, dropped out
  const T* residual;  // (R, N)
  const T* weight;    // (N,)
  const T* bias;      // (N,)
  T* y;               // (R, N) output
  T* s;               // (R, N) output: residual + dropout(x)
  float* mean;        // (R,) output
  float* rstd;        // (R,) output: 1 / sqrt(var + eps)
  int64_t rows;       // R
  int cols;           // N
  float eps;
  float dropout_p;    // p in [0, 1); 0 = no dropout
  float inv_keep;     // 1 / (1 - p)
  uint64_t seed;      // dropout seed
  bool vec2;          // N even and every row pointer 2-element aligned: half2/float2 pairs
};

template <typename T>
struct LnrBwdParams {
  const T* dy;          // (R, N) gradient of y
  const T* ds;          // (R, N) gradient of the s output, or nullptr
  const T* s;           // (R, N) saved residual + dropout(x)
  const T* weight;      // (N,)
  const float* mean;    // (R,) saved
  const float* rstd;    // (R,) saved
  T* dx;                // (R, N) output
  T* dresidual;         // (R, N) output
  float* partial_dw;    // (P, N) stage-1 output: row p = sum over chunk p of dy xhat
  float* partial_db;    // (P, N) stage-1 output: row p = sum over chunk p of dy
  int64_t rows;         // R
  int cols;             // N
  int64_t chunk_rows;   // rows per chunk (the last chunk may be shorter)
  int partials;         // P = ceil(R / chunk_rows)
  float dropout_p;
  float inv_keep;
  uint64_t seed;
  bool vec2;            // N even and every row pointer 2-element aligned
};

template <typename T>
struct LnrReduceParams {
  const float* partial_dw;  // (P, N)
  const float* partial_db;  // (P, N)
  T* dweight;               // (N,) output
  T* dbias;                 // (N,) output
  int partials;             // P
  int cols;                 // N
};

// Keep-factors of elements i and i + 1 for an even i (csrc/philox.h dropout_factor of each): both words
// come from the one Philox call of counter i >> 2.
FF_DEVICE float2 dropout_factor2(uint64_t seed, uint64_t i, float p, float inv_keep) {
  const Philox4 r = philox4x32_10(seed, i >> 2);
  const bool high = (i & 2) != 0;
  return float2{philox_uniform(high ? r.w[2] : r.w[0]) >= p ? inv_keep : 0.0f,
                philox_uniform(high ? r.w[3] : r.w[1]) >= p ? inv_keep : 0.0f};
}

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

// Merges the Welford states of a row's group; every thread of the group gets the same result.
// Warp: butterfly where both partners merge (lower lanes, upper lanes), so they agree bit for bit.
// Block (kThreadsPerRow == kLnrThreads): lane 0 of each warp stages its state in shared memory, then every
// thread merges the warps' states in order 0, 1, ...
template <int kThreadsPerRow>
FF_DEVICE Welford lnr_group_welford(Welford w, Welford* stage) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const Welford o{__shfl_xor_sync(kFullMask, w.n, offset), __shfl_xor_sync(kFullMask, w.mean, offset),
                    __shfl_xor_sync(kFullMask, w.m2, offset)};
    w = (lane & offset) != 0 ? welford_merge(o, w) : welford_merge(w, o);
  }
  if (kThreadsPerRow > kWarpSize) {
    if (lane == 0) stage[threadIdx.x / kWarpSize] = w;
    __syncthreads();
    w = stage[0];
#pragma unroll
    for (int k = 1; k < kThreadsPerRow / kWarpSize; ++k) w = welford_merge(w, stage[k]);
  }
  return w;
}

// Sums kValues floats over a row's group (every thread of the group gets the same sums).
template <int kThreadsPerRow, int kValues>
FF_DEVICE void lnr_group_sum(float (&v)[kValues], float (*scratch)[kWarpSize]) {
  if (kThreadsPerRow > kWarpSize) {
    block_sum(v, scratch);
  } else {
#pragma unroll
    for (int i = 0; i < kValues; ++i) v[i] = warp_sum(v[i]);
  }
}

// Forward: one row per group of kThreadsPerRow threads, row = blockIdx.x * (kLnrThreads / kThreadsPerRow) + group.
template <typename T, int kThreadsPerRow>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kLnrThreads) layer_norm_residual_fwd_kernel(const LnrFwdParams<T> p) {
  __shared__ Welford stage[kLnrThreads / kWarpSize];  // block layout: one state per warp
  constexpr int kRowsPerBlock = kLnrThreads / kThreadsPerRow;
  const int t = threadIdx.x % kThreadsPerRow;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreadsPerRow;
  // The whole group leaves together: a warp (no barrier in that layout), or, in the block layout, the
  // whole block (never: the grid has exactly R blocks there).
  if (row >= p.rows) return;
  const int n = p.cols;
  const int64_t base = row * n;
  const T* x = p.x + base;
  const T* res = p.residual + base;
  T* s = p.s + base;
  T* y = p.y + base;
  const bool drop = p.dropout_p > 0.0f;
  // Sweep 1: s = residual + x r, rounded to T and stored; Welford over the rounded values.
  Welford w{0.0f, 0.0f, 0.0f};
  if (p.vec2) {
    for (int col = 2 * t; col < n; col += 2 * kThreadsPerRow) {
      float2 xv = load2(x + col);
      const float2 rv = load2(res + col);
      if (drop) {
        const float2 r = dropout_factor2(p.seed, static_cast<uint64_t>(base + col), p.dropout_p, p.inv_keep);
        xv.x *= r.x;
        xv.y *= r.y;
      }
      const float sa = to_float(from_float<T>(rv.x + xv.x)), sb = to_float(from_float<T>(rv.y + xv.y));
      store2(s + col, float2{sa, sb});  // exact: sa, sb are already values of T
      welford_add(w, sa);
      welford_add(w, sb);
    }
  } else {
    for (int col = t; col < n; col += kThreadsPerRow) {
      float xv = to_float(x[col]);
      if (drop) xv *= dropout_factor(p.seed, static_cast<uint64_t>(base + col), p.dropout_p, p.inv_keep);
      const T sv = from_float<T>(to_float(res[col]) + xv);
      s[col] = sv;
      welford_add(w, to_float(sv));
    }
  }
  w = lnr_group_welford<kThreadsPerRow>(w, stage);
  const float mean = w.mean;
  const float rstd = 1.0f / sqrtf(w.m2 / static_cast<float>(n) + p.eps);
  if (t == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
  // Sweep 2: y = (s - mean) rstd w + b from the stored s.
  if (p.vec2) {
    for (int col = 2 * t; col < n; col += 2 * kThreadsPerRow) {
      const float2 sv = load2(s + col), wv = load2(p.weight + col), bv = load2(p.bias + col);
      store2(y + col, float2{(sv.x - mean) * rstd * wv.x + bv.x, (sv.y - mean) * rstd * wv.y + bv.y});
    }
  } else {
    for (int col = t; col < n; col += kThreadsPerRow) {
      y[col] = from_float<T>((to_float(s[col]) - mean) * rstd * to_float(p.weight[col]) + to_float(p.bias[col]));
    }
  }
}

// Backward stage 1: row group g of block b owns chunk c = b * (kLnrThreads / kThreadsPerRow) + g, the rows
// [c chunk_rows, min(R, (c + 1) chunk_rows)), one after the other; writes their dx, dresidual and row c of
// partial_dw / partial_db.
template <typename T, int kThreadsPerRow>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kLnrThreads) layer_norm_residual_bwd_kernel(const LnrBwdParams<T> p) {
  __shared__ float scratch[2][kWarpSize];  // block layout: the two row sums per warp
  constexpr int kRowsPerBlock = kLnrThreads / kThreadsPerRow;
  const int t = threadIdx.x % kThreadsPerRow;
  const int chunk = blockIdx.x * kRowsPerBlock + threadIdx.x / kThreadsPerRow;
  const int n = p.cols;
  // Groups past the last chunk get no rows (only in the warp layout: the block layout has P blocks).
  const int64_t first = chunk < p.partials ? chunk * p.chunk_rows : p.rows;
  const int64_t last = first + p.chunk_rows < p.rows ? first + p.chunk_rows : p.rows;
  float* part_dw = p.partial_dw + static_cast<int64_t>(chunk) * n;
  float* part_db = p.partial_db + static_cast<int64_t>(chunk) * n;
  const bool drop = p.dropout_p > 0.0f;
  const float inv_n = 1.0f / static_cast<float>(n);
  // The chunk's partial sums start at zero; each thread clears the columns it accumulates below.
  if (first < last && p.vec2) {
    for (int col = 2 * t; col < n; col += 2 * kThreadsPerRow) {
      store2(part_dw + col, float2{0.0f, 0.0f});
      store2(part_db + col, float2{0.0f, 0.0f});
    }
  } else if (first < last) {
    for (int col = t; col < n; col += kThreadsPerRow) {
      part_dw[col] = 0.0f;
      part_db[col] = 0.0f;
    }
  }
  for (int64_t row = first; row < last; ++row) {
    const int64_t base = row * n;
    const T* s = p.s + base;
    const T* dy = p.dy + base;
    const T* ds = p.ds != nullptr ? p.ds + base : nullptr;
    T* dx = p.dx + base;
    T* dres = p.dresidual + base;
    const float mu = p.mean[row], rs = p.rstd[row];
    // Sweep 1: sums of g and g xhat; partial dweight += dy xhat, dbias += dy.
    float sums[2] = {0.0f, 0.0f};
    if (p.vec2) {
      for (int col = 2 * t; col < n; col += 2 * kThreadsPerRow) {
        const float2 sv = load2(s + col), gv = load2(dy + col), wv = load2(p.weight + col);
        const float xa = (sv.x - mu) * rs, xb = (sv.y - mu) * rs;
        const float ga = gv.x * wv.x, gb = gv.y * wv.y;
        sums[0] += ga + gb;
        sums[1] += ga * xa + gb * xb;
        const float2 pw = load2(part_dw + col), pb = load2(part_db + col);
        store2(part_dw + col, float2{pw.x + gv.x * xa, pw.y + gv.y * xb});
        store2(part_db + col, float2{pb.x + gv.x, pb.y + gv.y});
      }
    } else {
      for (int col = t; col < n; col += kThreadsPerRow) {
        const float xhat = (to_float(s[col]) - mu) * rs, gv = to_float(dy[col]);
        const float g = gv * to_float(p.weight[col]);
        sums[0] += g;
        sums[1] += g * xhat;
        part_dw[col] += gv * xhat;
        part_db[col] += gv;
      }
    }
    lnr_group_sum<kThreadsPerRow>(sums, scratch);
    const float mean_g = sums[0] * inv_n, mean_gx = sums[1] * inv_n;
    // Sweep 2: ds_total = rstd (g - mean(g) - xhat mean(g xhat)) + ds; dresidual = ds_total, dx = ds_total r.
    if (p.vec2) {
      for (int col = 2 * t; col < n; col += 2 * kThreadsPerRow) {
        const float2 sv = load2(s + col), gv = load2(dy + col), wv = load2(p.weight + col);
        float d0 = rs * (gv.x * wv.x - mean_g - (sv.x - mu) * rs * mean_gx);
        float d1 = rs * (gv.y * wv.y - mean_g - (sv.y - mu) * rs * mean_gx);
        if (ds != nullptr) {
          const float2 dsv = load2(ds + col);
          d0 += dsv.x;
          d1 += dsv.y;
        }
        store2(dres + col, float2{d0, d1});
        if (drop) {
          const float2 r = dropout_factor2(p.seed, static_cast<uint64_t>(base + col), p.dropout_p, p.inv_keep);
          d0 *= r.x;
          d1 *= r.y;
        }
        store2(dx + col, float2{d0, d1});
      }
    } else {
      for (int col = t; col < n; col += kThreadsPerRow) {
        const float xhat = (to_float(s[col]) - mu) * rs;
        float d = rs * (to_float(dy[col]) * to_float(p.weight[col]) - mean_g - xhat * mean_gx);
        if (ds != nullptr) d += to_float(ds[col]);
        dres[col] = from_float<T>(d);
        if (drop) d *= dropout_factor(p.seed, static_cast<uint64_t>(base + col), p.dropout_p, p.inv_keep);
        dx[col] = from_float<T>(d);
      }
    }
  }
}

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
  float sw = 0.0f, sb = 0.0f;
  if (col < p.cols) {
    for (int c = stripe; c < p.partials; c += kLnrReduceStripes) {
      sw += p.partial_dw[static_cast<int64_t>(c) * p.cols + col];
      sb += p.partial_db[static_cast<int64_t>(c) * p.cols + col];
    }
  }
  stripe_dw[stripe][lane] = sw;
  stripe_db[stripe][lane] = sb;
  __syncthreads();
  if (stripe == 0 && col < p.cols) {
    sw = stripe_dw[0][lane];
    sb = stripe_db[0][lane];
#pragma unroll
    for (int k = 1; k < kLnrReduceStripes; ++k) {
      sw += stripe_dw[k][lane];
      sb += stripe_db[k][lane];
    }
    p.dweight[col] = from_float<T>(sw);
    p.dbias[col] = from_float<T>(sb);
  }
}

}  // namespace cuda
}  // namespace fastformer

// instantiations: layer_norm_residual_fwd_kernel<float, 32> layer_norm_residual_fwd_kernel<__half, 32> layer_norm_residual_fwd_kernel<__nv_bfloat16, 32>
// instantiations: layer_norm_residual_fwd_kernel<float, 256> layer_norm_residual_fwd_kernel<__half, 256> layer_norm_residual_fwd_kernel<__nv_bfloat16, 256>
// instantiations: layer_norm_residual_bwd_kernel<float, 32> layer_norm_residual_bwd_kernel<__half, 32> layer_norm_residual_bwd_kernel<__nv_bfloat16, 32>
// instantiations: layer_norm_residual_bwd_kernel<float, 256> layer_norm_residual_bwd_kernel<__half, 256> layer_norm_residual_bwd_kernel<__nv_bfloat16, 256>
// instantiations: layer_norm_residual_bwd_reduce_kernel<float> layer_norm_residual_bwd_reduce_kernel<__half> layer_norm_residual_bwd_reduce_kernel<__nv_bfloat16>
