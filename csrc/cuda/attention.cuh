// Fused masked scaled dot-product attention for P100-class GPUs, forward and backward: FlashAttention-2's
// algorithm in SIMT code (fp32 math and accumulation, no tensor cores, no atomics). The launchers are in
// csrc/cuda/attention.cu; the semantics are those of csrc/cpu/attention.cpp.
//
// Shapes: q (B, H, Lq, D), k and v (B, H_kv, Lk, D) at any batch, head and row strides (RowStrides) with the
// last dim contiguous, e.g. views of (B, L, H, D) projections, read in place; out (B, H, Lq, D) likewise
// (the launchers write a view of a contiguous (B, Lq, H, D) tensor); key_padding_mask (B, Lk) bool (True =
// padding) or none, contiguous; lse (B, H, Lq) float32, contiguous. Query i sees key j iff j < Lk, the key
// is not padding, and (causal, bottom-right aligned) j <= i + Lk - Lq.
// Grouped-query attention: H is a multiple of H_kv and query head h reads key/value head h / group
// (group = H / H_kv) in place. Packed sequences (attention_varlen, cu_seqlens_q/k given): q, out (Tq, H, D)
// and k, v (Tk, H_kv, D) are the same kernels' tensors with batch stride 0, and sequence b is rows
// cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q (its Lq_b) and the like of k, v (Lk_b), clamped into [0, T]
// (a bad table, unchecked during CUDA graph capture, never reads or writes outside the tensors); lse is
// (H, Tq). Every rule above holds per sequence with Lq_b, Lk_b (seq_rows: SeqRows); the grids cover the
// longest sequence, and a block past its own sequence's rows returns at once. The head dim D (1..D_MAX) is a runtime
// size; D_MAX in {16, 32, 64, 128} is a template parameter fixing the shared tiles and the columns each
// lane owns. Columns D..D_MAX-1 of every shared tile are zeros, so they add nothing to dot products.
// Storage is float, __half or __nv_bfloat16; every tile is converted to float when it is staged in
// shared memory. Element pairs move with one load2/store2 when `vec2` (D even; pointers and strides
// 2-element aligned).
//
// Common mapping: a warp owns kRowsPerWarp = 4 rows of the "owned" side (query rows in the forward and
// the dQ kernel, keys in the dK/dV kernel) and walks tiles of 32 rows of the other side, lane t taking
// row t of the tile. Phase 1 (scores): lane t forms the 4 dot products of its tile row (from a shared
// tile padded to D_MAX + 4 floats per row, so the float4 reads of 8 lanes hit 32 distinct banks) with
// the warp's 4 owned rows (broadcast float4 reads). Phase 2 (accumulation): the lanes write their 4
// results as one float4 into a per-warp shared buffer, and then each lane accumulates its own output
// columns over the 32 tile rows: lane l owns the kPerLane consecutive columns (l % kLanesPerRow) kPerLane..
// (kPerLane = D_MAX / 32, or 1 for D_MAX = 16 where two lane groups split the tile rows and combine
// with one shuffle at the end), read from the tile rows as one float4/float2/float.
//
// Forward, attention_fwd_kernel: block (query tile of kBlockM = 4 kWarps rows, b h); for each key tile of
// 32 up to the query tile's causal limit:
//   s = (scale q_i) . k_j (invisible -> -inf); per row online softmax: m' = max(m, warp_max s),
//   l = l e^(m - m') + e^(s - m')  (lane-partial l, summed over the warp at the end),
//   acc = acc e^(m - m') + (e^(s - m') r) V   with r the dropout factor of element (b, h, i, j)
// then out = acc / l, lse = m + log l; a row with no visible key (or only -inf scores) gets l = 0: out = 0
// and lse = -inf. Non-finite scores (the rule of every backend): invisible keys never count, whatever K
// holds (their s is replaced by -inf before the max); a NaN or +inf visible score makes the row's out all
// NaN and lse = NaN: m' = +inf is turned into NaN (poison_unbounded, common.cuh), a NaN s (dropped by
// fmaxf) makes its own e^(s - m') NaN, and the NaN reaches l and every column of acc (no extra pass).
// Bytes moved per (b, h): Q and O once, K and V once per query tile:
//   (2 Lq + 2 Lk ceil(Lq / kBlockM)) D sizeof(T) + 4 Lq (lse) (+ the mask, Lk bytes per tile and warp).
//
// Backward (dO given; P = e^(scale q k^T - lse) recomputed, masked -> 0; r the forward's dropout factors):
//   dV = (P r)^T dO,  dP = dO V^T,  dS = P (dP r - delta) with delta_i = dO_i . O_i,
//   dQ = scale dS K,  dK = scale dS^T Q.
// Both kernels recompute s as the forward did: (scale q_i) . k_j from a staged scale Q tile (rounded
// once, like the forward's), the same products summed by the same dot_rows4 in the same column order
// (an operand rounded differently errs by |s| 2^-24 relatively, which e^(s - lse) amplifies at large
// logits). So dK = dS^T (scale Q) needs no further factor. Rows with lse = -inf get no gradient;
// lse = NaN (a poisoned row) counts as visible, so its dQ row and dK, dV of the keys it sees turn NaN;
// an invisible (i, j) gives P = dS = 0 by a select (not a product with a NaN delta or dP), so the
// other rows' dQ and the keys it does not see stay exact. (A NaN or inf entry of q, k or v itself still
// reaches other rows through 0 * inf in the dS K, dS^T Q, P V products, as in every backend.)
// Three kernels, each output written by exactly one block (deterministic, no atomics):
//   attention_bwd_delta_kernel: one warp per query row, delta (B, H, Lq) float32; reads O and dO once.
//   attention_bwd_dkdv_kernel: block (key block of kBlock = 4 kWarps keys, b h_kv), owned rows = keys, tiles
//     of 32 queries from the first query that can see the block, for each of the group's query heads in
//     turn; reads K, V once and Q, dO of the group once per key block, per kv head:
//     (2 Lk + 2 group Lq ceil(Lk / kBlock)) D sizeof(T) + 8 group Lq ceil(Lk / kBlock) (lse, delta);
//     writes dK, dV.
//   attention_bwd_dq_kernel: block (query tile of kBlock rows, b h), owned rows = queries, key tiles of
//     32 up to the causal limit; reads Q, dO once and K, V once per query tile:
//     (2 Lq + 2 Lk ceil(Lq / kBlock)) D sizeof(T) + 8 Lq; writes dQ.
//
// Shared memory (static, float tiles; kWarps from the configs below), per block:
//   forward:  Q (kBlockM, D_MAX) + K (32, D_MAX + 4) + V (32, D_MAX) + P (kWarps, 32, 4)
//             D_MAX 16, 32, 64 (8 warps): 10.5, 16.5, 28.5 KB; D_MAX 128 (4 warps): 42.5 KB
//   dK/dV:    K, V (kBlock, D_MAX) + scale Q, dO (32, D_MAX + 4) + P r, dS (kWarps, 32, 4)
//             D_MAX 16, 32, 64 (8 warps): 17, 25, 41 KB; D_MAX 128 (3 warps): 48 KB
//   dQ:       Q, dO (kBlock, D_MAX) + K, V (32, D_MAX + 4) + dS (kWarps, 32, 4)
//             D_MAX 16, 32, 64 (8 warps): 13, 21, 37 KB; D_MAX 128 (3 warps): 46.5 KB
// Registers (ptxas, sm_60 and sm_80): at most ~140 per thread, no spills (docs/kernels.md).
//
// Dropout: element (b, h, i, j) of the probability matrix is kept iff the Philox draw of flat index
// r Lk + j (csrc/philox.h) is >= p, r the query row's index in lse ((b H + h) Lq + i dense, h the query
// head; h Tq + cu_seqlens_q[b] + i packed, with the totals Tq, Tk as Lq, Lk), the same stream as every other
// backend, regenerated in the backward; the seed is read from device memory at each Philox call (common.cuh
// load_seed). Kept probabilities are scaled by 1/(1-p); l (and so lse) uses the undropped ones.
#pragma once
#include "attention_varlen.cuh"
#include "common.cuh"

namespace fastformer {
namespace cuda {

// Element strides of a (B, H, L, D) tensor whose last dim is contiguous: element (b, h, i, d) is at
// b batch + h head + i row + d (flash-attention's q_batch_stride, q_head_stride, q_row_stride). int64: a
// batch of a large tensor spans more than 2^31 elements. The launchers give a dim of size 1 stride 0 (it is
// never stepped, and so never breaks vector alignment).
struct RowStrides {
  int64_t batch, head, row;
};

// Offset of row `row` of (b, h) (packed tensors: batch stride 0, `row` the packed row).
FF_DEVICE int64_t slice_offset(const RowStrides& s, int b, int h, int row) {
  return b * s.batch + h * s.head + row * s.row;
}

// Forward: pointers, strides and sizes of one launch.
template <typename T>
struct AttentionFwdParams {
  const T* q;                    // (B, H, Lq, D) at q_strides; packed (Tq, H, D)
  const T* k;                    // (B, H_kv, Lk, D) at k_strides; packed (Tk, H_kv, D)
  const T* v;                    // (B, H_kv, Lk, D) at v_strides; packed (Tk, H_kv, D)
  const bool* key_padding_mask;  // (B, Lk), True = padding; nullptr for none (always for packed)
  const int32_t* cu_seqlens_q;   // (B + 1) packed: sequence b is rows cu_seqlens_q[b] .. [b + 1] of q; nullptr: dense
  const int32_t* cu_seqlens_k;   // (B + 1) packed: the same of k and v; nullptr: dense
  T* out;                        // (B, H, Lq, D) at out_strides, output; packed (Tq, H, D)
  float* lse;                    // (B, H, Lq), output: m + log l of the scaled visible scores (-inf: none);
                                 // packed (H, Tq)
  RowStrides q_strides, k_strides, v_strides, out_strides;
  int H, group, Lq, Lk, D;       // group = H / H_kv; packed: Lq, Lk are the totals Tq, Tk
  float scale;                   // scores are scale q . k
  bool causal;                   // bottom-right aligned: query i sees keys j <= i + Lk - Lq
  bool vec2;                     // D even, pointers and strides 2-element aligned: pairs move as load2/store2
  bool vec8;                     // D % 8 == 0, pointers and strides 16-byte aligned: 16-byte cp.async chunks
                                 // (read by the tensor-core kernels of attention_mma.cuh only)
  float dropout_p;               // probability of dropping an attention probability (0: no dropout)
  float dropout_scale;           // 1 / (1 - dropout_p)
  const int64_t* seed;           // () Philox key of the dropout stream, in device memory (load_seed);
                                 // nullptr without dropout
};

// Backward: pointers, strides and sizes shared by the three backward kernels of one call.
template <typename T>
struct AttentionBwdParams {
  const T* q;                    // (B, H, Lq, D) at q_strides (packed: as AttentionFwdParams)
  const T* k;                    // (B, H_kv, Lk, D) at k_strides
  const T* v;                    // (B, H_kv, Lk, D) at v_strides
  const T* out;                  // (B, H, Lq, D) at out_strides, the forward's output
  const T* dout;                 // (B, H, Lq, D) at dout_strides, gradient of out
  const float* lse;              // (B, H, Lq), the forward's logsumexp; packed (H, Tq)
  float* delta;                  // lse's shape, workspace: written by the delta kernel, read by the others
  const bool* key_padding_mask;  // (B, Lk), True = padding; nullptr for none
  const int32_t* cu_seqlens_q;   // (B + 1) packed sequences' rows in q; nullptr: dense
  const int32_t* cu_seqlens_k;   // (B + 1) packed sequences' rows in k, v; nullptr: dense
  T* dq;                         // (B, H, Lq, D) at dq_strides, output
  T* dk;                         // (B, H_kv, Lk, D) at dk_strides, output
  T* dv;                         // (B, H_kv, Lk, D) at dv_strides, output
  RowStrides q_strides, k_strides, v_strides, out_strides, dout_strides, dq_strides, dk_strides, dv_strides;
  int BH, H, group, Lq, Lk, D;   // BH Lq = the rows of lse: BH = B H dense, H packed; group = H / H_kv
  float scale;
  bool causal;
  bool vec2;
  bool vec8;
  float dropout_p;
  float dropout_scale;
  const int64_t* seed;
};

constexpr int kRowsPerWarp = 4;        // owned rows per warp: the 4 components of the float4 buffers
constexpr int kTileRows = kWarpSize;   // rows per walked tile: one per lane
constexpr int kDeltaThreads = 256;     // the delta kernel: one warp per query row

// Forward block: 8 warps (32 query rows) up to D_MAX 64, 4 warps at D_MAX 128 (shared memory <= 48 KB).
template <int D_MAX>
struct AttentionFwdConfig {
  static constexpr int kWarps = D_MAX == 128 ? 4 : 8;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlockM = kWarps * kRowsPerWarp;
};

// Backward blocks (dK/dV and dQ): 8 warps (32 owned rows) up to D_MAX 64, 3 warps at D_MAX 128.
template <int D_MAX>
struct AttentionBwdConfig {
  static constexpr int kWarps = D_MAX == 128 ? 3 : 8;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlock = kWarps * kRowsPerWarp;
};

namespace attention_detail {

FF_DEVICE int imin(int a, int b) { return a < b ? a : b; }
FF_DEVICE int imax(int a, int b) { return a > b ? a : b; }

// Component r (0..3) of a float4 (r is a constant after unrolling).
FF_DEVICE float component(const float4& v, int r) { return r == 0 ? v.x : r == 1 ? v.y : r == 2 ? v.z : v.w; }
FF_DEVICE uint32_t word(const Philox4& x, int r) { return r == 0 ? x.w[0] : r == 1 ? x.w[1] : r == 2 ? x.w[2] : x.w[3]; }

FF_DEVICE float4 make4(float a, float b, float c, float d) {
  float4 v;
  v.x = a;
  v.y = b;
  v.z = c;
  v.w = d;
  return v;
}

// Which output columns a lane owns: kPerLane consecutive columns starting at (lane % kLanesPerRow) kPerLane;
// the kGroups lane groups (2 for D_MAX = 16, else 1) split the summed tile rows between them.
template <int D_MAX>
struct LaneCols {
  static constexpr int kPerLane = D_MAX >= kWarpSize ? D_MAX / kWarpSize : 1;
  static constexpr int kLanesPerRow = D_MAX / kPerLane;
  static constexpr int kGroups = kWarpSize / kLanesPerRow;
};

// Copies rows [0, rows) of a (rows, D) slice of global memory at row stride `ld` elements (last dim
// contiguous) into a float tile of kRows rows with a row stride of kStride floats, times `mult`; rows >=
// `rows` and columns >= D become zeros. One element pair per thread and step (a load2 when vec2); all
// kThreads threads of the block take part.
template <int kRows, int D_MAX, int kStride, int kThreads, typename T>
FF_DEVICE void load_tile(float* tile, const T* src, int64_t ld, int rows, int D, bool vec2, float mult) {
  constexpr int kPairs = D_MAX / 2;
  constexpr int kSteps = (kRows * kPairs + kThreads - 1) / kThreads;
#pragma unroll 4
  for (int step = 0; step < kSteps; ++step) {
    const int idx = step * kThreads + static_cast<int>(threadIdx.x);
    if (idx < kRows * kPairs) {
      const int r = idx / kPairs, c = (idx % kPairs) * 2;
      float2 x;
      x.x = 0.0f;
      x.y = 0.0f;
      if (r < rows && c < D) {
        const T* s = src + r * ld + c;
        if (vec2) {
          x = load2(s);
        } else {
          x.x = to_float(s[0]);
          if (c + 1 < D) x.y = to_float(s[1]);
        }
      }
      x.x *= mult;
      x.y *= mult;
      *reinterpret_cast<float2*>(tile + r * kStride + c) = x;
    }
  }
}

// out[r] = x . y_r for the lane's row x and 4 rows y_r = y + r y_stride (broadcast), over the first n4
// groups of 4 columns; all rows are 16-byte aligned shared memory.
FF_DEVICE void dot_rows4(const float* x, const float* y, int y_stride, int n4, float (&out)[kRowsPerWarp]) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) out[r] = 0.0f;
#pragma unroll 2
  for (int d4 = 0; d4 < n4; ++d4) {
    const float4 a = x4[d4];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float4 b = reinterpret_cast<const float4*>(y + r * y_stride)[d4];
      out[r] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
  }
}

// The lane's N consecutive columns of a shared tile row (src 4N-byte aligned).
template <int N>
FF_DEVICE void load_cols(const float* src, float (&x)[N]) {
  if constexpr (N == 4) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  } else if constexpr (N == 2) {
    const float2 v = *reinterpret_cast<const float2*>(src);
    x[0] = v.x;
    x[1] = v.y;
  } else {
    static_assert(N == 1, "a lane owns 1, 2 or 4 columns");
    x[0] = src[0];
  }
}

// acc[r][c] += w[r] x[c] over the tile rows t of this lane's group (t < n): the phase-2 product of a
// per-warp weight buffer w (32 float4, one per tile row) and a shared tile (row stride kStride).
template <int D_MAX, int kStride>
FF_DEVICE void accumulate(float (&acc)[kRowsPerWarp][LaneCols<D_MAX>::kPerLane], const float4* w,
                          const float* tile, int c0, int group, int n) {
  using Cols = LaneCols<D_MAX>;
#pragma unroll 2
  for (int t = group; t < n; t += Cols::kGroups) {
    const float4 wt = w[t];
    float x[Cols::kPerLane];
    load_cols<Cols::kPerLane>(tile + t * kStride + c0, x);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int c = 0; c < Cols::kPerLane; ++c) acc[r][c] += component(wt, r) * x[c];
    }
  }
}

// Adds the partial sums of the two lane groups of D_MAX = 16 (a no-op otherwise); all lanes call it.
template <int D_MAX>
FF_DEVICE void combine_groups(float (&acc)[kRowsPerWarp][LaneCols<D_MAX>::kPerLane]) {
  if constexpr (LaneCols<D_MAX>::kGroups == 2) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) acc[r][0] += __shfl_xor_sync(kFullMask, acc[r][0], kWarpSize / 2);
  }
}

// dst[c0 + c] = mult x[c] for the columns c0 + c < D of one global row (pairs as store2 when vec2).
template <int N, typename T>
FF_DEVICE void store_cols(T* dst, int c0, int D, bool vec2, const float (&x)[N], float mult) {
  if constexpr (N >= 2) {
    if (vec2) {
#pragma unroll
      for (int c = 0; c < N; c += 2) {
        if (c0 + c < D) {
          float2 y;
          y.x = x[c] * mult;
          y.y = x[c + 1] * mult;
          store2(dst + c0 + c, y);
        }
      }
      return;
    }
  }
#pragma unroll
  for (int c = 0; c < N; ++c) {
    if (c0 + c < D) dst[c0 + c] = from_float<T>(x[c] * mult);
  }
}

// Dropout factors (1/(1-p) kept, 0 dropped) of the 4 consecutive flat indices first..first+3: they span
// at most two Philox counters, so two Philox calls instead of four.
FF_DEVICE float4 dropout_factors4(uint64_t seed, uint64_t first, float p, float inv_keep) {
  const Philox4 lo = philox4x32_10(seed, first >> 2);
  const Philox4 hi = philox4x32_10(seed, (first >> 2) + 1);
  const int w0 = static_cast<int>(first & 3);
  float f[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int w = w0 + r;
    const uint32_t bits = w < 4 ? word(lo, w) : word(hi, w - 4);
    f[r] = philox_uniform(bits) >= p ? inv_keep : 0.0f;
  }
  return make4(f[0], f[1], f[2], f[3]);
}

// Keys [0, key_end) can be visible to query rows [i0, i_end) (causal: up to the last row's diagonal).
FF_DEVICE int causal_key_end(bool causal, int i_end, int Lq, int Lk) {
  return causal ? imin(Lk, imax(0, i_end - 1 + Lk - Lq + 1)) : Lk;
}

}  // namespace attention_detail

// Forward. Grid (ceil(max Lq_b / kBlockM), B H), block kThreads: warp w owns query rows i0 + 4w .. i0 + 4w + 3
// of sequence b, head h, lane j takes key j0 + j of each key tile of kv head h / group.
template <typename T, int D_MAX>
FF_GLOBAL void FF_LAUNCH_BOUNDS_BLOCKS(AttentionFwdConfig<D_MAX>::kThreads, 1)
    attention_fwd_kernel(const AttentionFwdParams<T> p) {
  using namespace attention_detail;
  using Cfg = AttentionFwdConfig<D_MAX>;
  using Cols = LaneCols<D_MAX>;
  constexpr int kKStride = D_MAX + 4;
  constexpr int kCols = Cols::kPerLane;
  __shared__ float4 q_s4[Cfg::kBlockM * D_MAX / 4];   // scale Q, (kBlockM, D_MAX)
  __shared__ float4 k_s4[kTileRows * kKStride / 4];   // K tile, (32, D_MAX + 4)
  __shared__ float4 v_s4[kTileRows * D_MAX / 4];      // V tile, (32, D_MAX)
  __shared__ float4 p_s[Cfg::kWarps * kTileRows];     // dropped probabilities, (kWarps, 32 keys, 4 rows)
  float* q_s = reinterpret_cast<float*>(q_s4);
  float* k_s = reinterpret_cast<float*>(k_s4);
  float* v_s = reinterpret_cast<float*>(v_s4);

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int c0 = (lane % Cols::kLanesPerRow) * kCols, group = lane / Cols::kLanesPerRow;
  const int bh = blockIdx.y, b = bh / p.H, head = bh - b * p.H;
  const SeqRows sq = seq_rows(p, b);
  const int i0 = blockIdx.x * Cfg::kBlockM, row0 = i0 + warp * kRowsPerWarp;
  if (i0 >= sq.Lq) return;  // past this sequence's queries
  const int n4 = (p.D + 3) / 4;
  const bool* kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(b) * p.Lk : nullptr;
  const T* k_bh = p.k + slice_offset(p.k_strides, b, head / p.group, sq.k_start);  // the sequence's rows
  const T* v_bh = p.v + slice_offset(p.v_strides, b, head / p.group, sq.k_start);
  T* out_bh = p.out + slice_offset(p.out_strides, b, head, sq.q_start);
  const int lse_h = sq.lse_row(head, p.Lq);
  const float neg_inf = -ff_inf();

  load_tile<Cfg::kBlockM, D_MAX, D_MAX, Cfg::kThreads>(q_s, p.q + slice_offset(p.q_strides, b, head, sq.q_start + i0),
                                                       p.q_strides.row, sq.Lq - i0, p.D, p.vec2, p.scale);
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kCols];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = neg_inf;
    l[r] = 0.0f;  // this lane's share; summed over the warp at the end
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;
  }

  const int key_end = causal_key_end(p.causal, imin(i0 + Cfg::kBlockM, sq.Lq), sq.Lq, sq.Lk);
  for (int j0 = 0; j0 < key_end; j0 += kTileRows) {
    const int nk = imin(kTileRows, key_end - j0);
    __syncthreads();  // every warp is done with the previous K, V and P (and Q is written, first time)
    load_tile<kTileRows, D_MAX, kKStride, Cfg::kThreads>(k_s, k_bh + j0 * p.k_strides.row, p.k_strides.row, nk, p.D,
                                                         p.vec2, 1.0f);
    load_tile<kTileRows, D_MAX, D_MAX, Cfg::kThreads>(v_s, v_bh + j0 * p.v_strides.row, p.v_strides.row, nk, p.D,
                                                      p.vec2, 1.0f);
    __syncthreads();

    const int j = j0 + lane;
    const bool key_ok = j < j0 + nk && !(kpm != nullptr && kpm[j]);
    float s[kRowsPerWarp], pd[kRowsPerWarp];
    dot_rows4(k_s + lane * kKStride, q_s + warp * kRowsPerWarp * D_MAX, D_MAX, n4, s);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = row0 + r;
      const bool visible = key_ok && i < sq.Lq && (!p.causal || j <= i + sq.Lk - sq.Lq);
      const float sr = visible ? s[r] : neg_inf;
      // +inf -> NaN: e^(s - m) and so l, acc and lse turn NaN (a NaN s does that through its own e^(s - m)).
      const float m_new = poison_unbounded(fmaxf(m[r], warp_max(sr)));
      const float m_use = m_new == neg_inf ? 0.0f : m_new;  // a row with nothing visible yet stays at 0
      const float corr = expf(m[r] - m_use);
      const float pr = expf(sr - m_use);
      l[r] = l[r] * corr + pr;
      m[r] = m_new;
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[r][c] *= corr;
      pd[r] = pr;
      if (p.dropout_p > 0.0f) {
        const uint64_t idx = static_cast<uint64_t>(lse_h + i) * p.Lk + j;
        pd[r] *= dropout_factor(load_seed(p.seed), idx, p.dropout_p, p.dropout_scale);
      }
    }
    p_s[warp * kTileRows + lane] = make4(pd[0], pd[1], pd[2], pd[3]);
    __syncwarp();
    accumulate<D_MAX, D_MAX>(acc, p_s + warp * kTileRows, v_s, c0, group, nk);
  }

  combine_groups<D_MAX>(acc);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int i = row0 + r;
    const float l_row = warp_sum(l[r]);
    if (i < sq.Lq) {
      const int row = lse_h + i;
      // l = 0: no visible key (or only -inf scores) -> zeros and lse = -inf. l = NaN (a NaN or +inf
      // visible score): out and lse NaN.
      if (group == 0) {
        store_cols<kCols>(out_bh + i * p.out_strides.row, c0, p.D, p.vec2, acc[r], l_row == 0.0f ? 0.0f : 1.0f / l_row);
      }
      if (lane == 0) p.lse[row] = l_row == 0.0f ? neg_inf : m[r] + logf(l_row);
    }
  }
}

// delta_i = dO_i . O_i for the BH Lq rows of lse's layout (row = (b H + h) Lq + i of delta; packed, with B = 1
// and batch stride 0: h Tq + t, t the packed row; O and dO at their strides).
// Block 256: one warp per row, the lanes over its column pairs (one load2 each when vec2); the grid's
// 8 gridDim.x warps stride over the rows.
template <typename T>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kDeltaThreads) attention_bwd_delta_kernel(const AttentionBwdParams<T> p) {
  constexpr int kWarps = kDeltaThreads / kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t rows = static_cast<int64_t>(p.BH) * p.Lq;
  // The row is uniform over the warp: all lanes reach warp_sum.
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int i = static_cast<int>(row % p.Lq), bh = static_cast<int>(row / p.Lq), b = bh / p.H, head = bh - b * p.H;
    const T* o = p.out + slice_offset(p.out_strides, b, head, i);
    const T* g = p.dout + slice_offset(p.dout_strides, b, head, i);
    // Lane l sums columns 2l, 2l + 1, then 64 further on: the same products in the same order whether the
    // pairs load as one vector or element by element (a strided view gives the contiguous copy's delta).
    float sum = 0.0f;
    for (int c = 2 * lane; c < p.D; c += 2 * kWarpSize) {
      float2 a, d;
      if (p.vec2) {
        a = load2(o + c);
        d = load2(g + c);
      } else {
        const bool second = c + 1 < p.D;
        a.x = to_float(o[c]);
        a.y = second ? to_float(o[c + 1]) : 0.0f;
        d.x = to_float(g[c]);
        d.y = second ? to_float(g[c + 1]) : 0.0f;
      }
      sum += a.x * d.x + a.y * d.y;
    }
    sum = warp_sum(sum);
    if (lane == 0) p.delta[row] = sum;
  }
}

// dK and dV. Grid (ceil(max Lk_b / kBlock), B H_kv), block kThreads: warp w owns keys j_blk + 4w .. j_blk + 4w + 3
// of sequence b, kv head h_kv, and sums their gradients over the group's query heads h_kv group ..
// (h_kv + 1) group - 1 in turn (no atomics); lane i takes query i0 + i of each query tile.
template <typename T, int D_MAX>
FF_GLOBAL void FF_LAUNCH_BOUNDS_BLOCKS(AttentionBwdConfig<D_MAX>::kThreads, 1)
    attention_bwd_dkdv_kernel(const AttentionBwdParams<T> p) {
  using namespace attention_detail;
  using Cfg = AttentionBwdConfig<D_MAX>;
  using Cols = LaneCols<D_MAX>;
  constexpr int kQStride = D_MAX + 4;
  constexpr int kCols = Cols::kPerLane;
  __shared__ float4 k_s4[Cfg::kBlock * D_MAX / 4];   // K, (kBlock, D_MAX)
  __shared__ float4 v_s4[Cfg::kBlock * D_MAX / 4];   // V, (kBlock, D_MAX)
  __shared__ float4 q_s4[kTileRows * kQStride / 4];   // scale Q tile, (32, D_MAX + 4)
  __shared__ float4 do_s4[kTileRows * kQStride / 4];  // dO tile, (32, D_MAX + 4)
  __shared__ float4 p_s[Cfg::kWarps * kTileRows];     // P r, (kWarps, 32 queries, 4 keys)
  __shared__ float4 ds_s[Cfg::kWarps * kTileRows];    // dS, (kWarps, 32 queries, 4 keys)
  float* k_s = reinterpret_cast<float*>(k_s4);
  float* v_s = reinterpret_cast<float*>(v_s4);
  float* q_s = reinterpret_cast<float*>(q_s4);
  float* do_s = reinterpret_cast<float*>(do_s4);

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int c0 = (lane % Cols::kLanesPerRow) * kCols, group = lane / Cols::kLanesPerRow;
  const int H_kv = p.H / p.group;
  const int bh = blockIdx.y, b = bh / H_kv, head_kv = bh - b * H_kv;
  const SeqRows sq = seq_rows(p, b);
  const int j_blk = blockIdx.x * Cfg::kBlock, jw = j_blk + warp * kRowsPerWarp;
  if (j_blk >= sq.Lk) return;  // past this sequence's keys
  const int n4 = (p.D + 3) / 4;
  const float neg_inf = -ff_inf();
  const bool* kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(b) * p.Lk : nullptr;

  load_tile<Cfg::kBlock, D_MAX, D_MAX, Cfg::kThreads>(
      k_s, p.k + slice_offset(p.k_strides, b, head_kv, sq.k_start + j_blk), p.k_strides.row, sq.Lk - j_blk, p.D,
      p.vec2, 1.0f);
  load_tile<Cfg::kBlock, D_MAX, D_MAX, Cfg::kThreads>(
      v_s, p.v + slice_offset(p.v_strides, b, head_kv, sq.k_start + j_blk), p.v_strides.row, sq.Lk - j_blk, p.D,
      p.vec2, 1.0f);
  bool key_ok[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int j = jw + r;
    key_ok[r] = j < sq.Lk && !(kpm != nullptr && kpm[j]);
  }
  float dk[kRowsPerWarp][kCols], dv[kRowsPerWarp][kCols];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) dk[r][c] = dv[r][c] = 0.0f;
  }

  // Queries before the diagonal of the block's first key see none of its keys.
  const int first = p.causal ? imax(0, j_blk - (sq.Lk - sq.Lq)) / kTileRows * kTileRows : 0;
  for (int head = head_kv * p.group; head < (head_kv + 1) * p.group; ++head) {
    const int lse_h = sq.lse_row(head, p.Lq);
    for (int i0 = first; i0 < sq.Lq; i0 += kTileRows) {
      const int nq = imin(kTileRows, sq.Lq - i0);
      __syncthreads();  // every warp is done with the previous Q, dO, P r, dS (and K, V are written)
      load_tile<kTileRows, D_MAX, kQStride, Cfg::kThreads>(
          do_s, p.dout + slice_offset(p.dout_strides, b, head, sq.q_start + i0), p.dout_strides.row, nq, p.D, p.vec2,
          1.0f);
      // scale Q, as the forward stages it: s = (scale q_i) . k_j rounds exactly as the forward's scores did.
      load_tile<kTileRows, D_MAX, kQStride, Cfg::kThreads>(q_s, p.q + slice_offset(p.q_strides, b, head, sq.q_start + i0),
                                                           p.q_strides.row, nq, p.D, p.vec2, p.scale);
      __syncthreads();

      const int i = i0 + lane;
      const int row = lse_h + i;
      const float lse_i = i < sq.Lq ? p.lse[row] : neg_inf;
      const float delta_i = i < sq.Lq ? p.delta[row] : 0.0f;
      float s[kRowsPerWarp], dp[kRowsPerWarp];
      dot_rows4(q_s + lane * kQStride, k_s + warp * kRowsPerWarp * D_MAX, D_MAX, n4, s);
      dot_rows4(do_s + lane * kQStride, v_s + warp * kRowsPerWarp * D_MAX, D_MAX, n4, dp);
      float4 f = make4(1.0f, 1.0f, 1.0f, 1.0f);
      if (p.dropout_p > 0.0f) {
        f = dropout_factors4(load_seed(p.seed), static_cast<uint64_t>(row) * p.Lk + jw, p.dropout_p,
                             p.dropout_scale);
      }
      float pd[kRowsPerWarp], ds[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        // lse = NaN (a poisoned row) is "visible": P, dS and so dK, dV of its keys turn NaN. An invisible
        // pair gives exact zeros, whatever dP (V) and delta (a poisoned row's O) hold.
        const bool visible = key_ok[r] && i < sq.Lq && lse_i != neg_inf && (!p.causal || jw + r <= i + sq.Lk - sq.Lq);
        const float pr = visible ? expf(s[r] - lse_i) : 0.0f;
        const float fr = component(f, r);
        pd[r] = pr * fr;
        ds[r] = visible ? pr * (dp[r] * fr - delta_i) : 0.0f;
      }
      p_s[warp * kTileRows + lane] = make4(pd[0], pd[1], pd[2], pd[3]);
      ds_s[warp * kTileRows + lane] = make4(ds[0], ds[1], ds[2], ds[3]);
      __syncwarp();
      accumulate<D_MAX, kQStride>(dv, p_s + warp * kTileRows, do_s, c0, group, nq);
      accumulate<D_MAX, kQStride>(dk, ds_s + warp * kTileRows, q_s, c0, group, nq);
    }
  }

  combine_groups<D_MAX>(dk);
  combine_groups<D_MAX>(dv);
  T* dk_bh = p.dk + slice_offset(p.dk_strides, b, head_kv, sq.k_start);
  T* dv_bh = p.dv + slice_offset(p.dv_strides, b, head_kv, sq.k_start);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int j = jw + r;
    if (j < sq.Lk && group == 0) {  // keys no query sees got no tile: zeros
      // dK = dS^T (scale Q): scaled already.
      store_cols<kCols>(dk_bh + j * p.dk_strides.row, c0, p.D, p.vec2, dk[r], 1.0f);
      store_cols<kCols>(dv_bh + j * p.dv_strides.row, c0, p.D, p.vec2, dv[r], 1.0f);
    }
  }
}

// dQ. Grid (ceil(max Lq_b / kBlock), B H), block kThreads: warp w owns query rows i0 + 4w .. i0 + 4w + 3 of
// sequence b, head h, lane j takes key j0 + j of each key tile of kv head h / group.
template <typename T, int D_MAX>
FF_GLOBAL void FF_LAUNCH_BOUNDS_BLOCKS(AttentionBwdConfig<D_MAX>::kThreads, 1)
    attention_bwd_dq_kernel(const AttentionBwdParams<T> p) {
  using namespace attention_detail;
  using Cfg = AttentionBwdConfig<D_MAX>;
  using Cols = LaneCols<D_MAX>;
  constexpr int kKStride = D_MAX + 4;
  constexpr int kCols = Cols::kPerLane;
  __shared__ float4 q_s4[Cfg::kBlock * D_MAX / 4];    // scale Q, (kBlock, D_MAX)
  __shared__ float4 do_s4[Cfg::kBlock * D_MAX / 4];   // dO, (kBlock, D_MAX)
  __shared__ float4 k_s4[kTileRows * kKStride / 4];   // K tile, (32, D_MAX + 4)
  __shared__ float4 v_s4[kTileRows * kKStride / 4];   // V tile, (32, D_MAX + 4)
  __shared__ float4 ds_s[Cfg::kWarps * kTileRows];    // dS, (kWarps, 32 keys, 4 rows)
  float* q_s = reinterpret_cast<float*>(q_s4);
  float* do_s = reinterpret_cast<float*>(do_s4);
  float* k_s = reinterpret_cast<float*>(k_s4);
  float* v_s = reinterpret_cast<float*>(v_s4);

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int c0 = (lane % Cols::kLanesPerRow) * kCols, group = lane / Cols::kLanesPerRow;
  const int bh = blockIdx.y, b = bh / p.H, head = bh - b * p.H;
  const SeqRows sq = seq_rows(p, b);
  const int i0 = blockIdx.x * Cfg::kBlock, row0 = i0 + warp * kRowsPerWarp;
  if (i0 >= sq.Lq) return;  // past this sequence's queries
  const int n4 = (p.D + 3) / 4;
  const int head_kv = head / p.group;
  const T* k_bh = p.k + slice_offset(p.k_strides, b, head_kv, sq.k_start);  // the sequence's rows
  const T* v_bh = p.v + slice_offset(p.v_strides, b, head_kv, sq.k_start);
  const int lse0 = sq.lse_row(head, p.Lq) + row0;  // the lse (and delta) row of the warp's first query
  const float neg_inf = -ff_inf();
  const bool* kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(b) * p.Lk : nullptr;

  load_tile<Cfg::kBlock, D_MAX, D_MAX, Cfg::kThreads>(q_s, p.q + slice_offset(p.q_strides, b, head, sq.q_start + i0),
                                                      p.q_strides.row, sq.Lq - i0, p.D, p.vec2, p.scale);
  load_tile<Cfg::kBlock, D_MAX, D_MAX, Cfg::kThreads>(
      do_s, p.dout + slice_offset(p.dout_strides, b, head, sq.q_start + i0), p.dout_strides.row, sq.Lq - i0, p.D,
      p.vec2, 1.0f);
  float lse[kRowsPerWarp], delta[kRowsPerWarp], dq[kRowsPerWarp][kCols];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int i = row0 + r;
    lse[r] = i < sq.Lq ? p.lse[lse0 + r] : neg_inf;
    delta[r] = i < sq.Lq ? p.delta[lse0 + r] : 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) dq[r][c] = 0.0f;
  }

  const int key_end = causal_key_end(p.causal, imin(i0 + Cfg::kBlock, sq.Lq), sq.Lq, sq.Lk);
  const int diagonal = row0 + sq.Lk - sq.Lq;  // causal: row row0 + r sees keys j <= diagonal + r
  // Where the warp's rows of dQ go (computed before the key loop: fewer values live through it).
  T* dq_w = p.dq + slice_offset(p.dq_strides, b, head, sq.q_start + row0);
  const int rows_w = sq.Lq - row0;
  for (int j0 = 0; j0 < key_end; j0 += kTileRows) {
    const int nk = imin(kTileRows, key_end - j0);
    __syncthreads();  // every warp is done with the previous K, V, dS (and Q, dO are written)
    load_tile<kTileRows, D_MAX, kKStride, Cfg::kThreads>(k_s, k_bh + j0 * p.k_strides.row, p.k_strides.row, nk,
                                                         p.D, p.vec2, 1.0f);
    load_tile<kTileRows, D_MAX, kKStride, Cfg::kThreads>(v_s, v_bh + j0 * p.v_strides.row, p.v_strides.row, nk,
                                                         p.D, p.vec2, 1.0f);
    __syncthreads();

    const int j = j0 + lane;
    const bool key_ok = j < j0 + nk && !(kpm != nullptr && kpm[j]);
    float s[kRowsPerWarp], dp[kRowsPerWarp], ds[kRowsPerWarp];
    dot_rows4(k_s + lane * kKStride, q_s + warp * kRowsPerWarp * D_MAX, D_MAX, n4, s);
    dot_rows4(v_s + lane * kKStride, do_s + warp * kRowsPerWarp * D_MAX, D_MAX, n4, dp);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      // As in the dK/dV kernel: lse = NaN gives a NaN dQ row; an invisible pair gives exact zeros. (Rows past
      // the sequence have lse = -inf.)
      const bool visible = key_ok && lse[r] != neg_inf && (!p.causal || j <= diagonal + r);
      const float pr = visible ? expf(s[r] - lse[r]) : 0.0f;
      float fr = 1.0f;
      if (p.dropout_p > 0.0f) {
        const uint64_t idx = static_cast<uint64_t>(lse0 + r) * p.Lk + j;
        fr = dropout_factor(load_seed(p.seed), idx, p.dropout_p, p.dropout_scale);
      }
      ds[r] = visible ? pr * (dp[r] * fr - delta[r]) : 0.0f;
    }
    ds_s[warp * kTileRows + lane] = make4(ds[0], ds[1], ds[2], ds[3]);
    __syncwarp();
    accumulate<D_MAX, kKStride>(dq, ds_s + warp * kTileRows, k_s, c0, group, nk);
  }

  combine_groups<D_MAX>(dq);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (r < rows_w && group == 0) {  // rows with no visible key: dS = 0, so zeros
      store_cols<kCols>(dq_w + r * p.dq_strides.row, c0, p.D, p.vec2, dq[r], p.scale);
    }
  }
}

}  // namespace cuda
}  // namespace fastformer

// instantiations: attention_fwd_kernel<float, 16> attention_fwd_kernel<float, 32> attention_fwd_kernel<float, 64>
// instantiations: attention_fwd_kernel<float, 128> attention_fwd_kernel<__half, 16> attention_fwd_kernel<__half, 32>
// instantiations: attention_fwd_kernel<__half, 64> attention_fwd_kernel<__half, 128>
// instantiations: attention_fwd_kernel<__nv_bfloat16, 16> attention_fwd_kernel<__nv_bfloat16, 32>
// instantiations: attention_fwd_kernel<__nv_bfloat16, 64> attention_fwd_kernel<__nv_bfloat16, 128>
// instantiations: attention_bwd_delta_kernel<float> attention_bwd_delta_kernel<__half>
// instantiations: attention_bwd_delta_kernel<__nv_bfloat16>
// instantiations: attention_bwd_dkdv_kernel<float, 16> attention_bwd_dkdv_kernel<float, 32>
// instantiations: attention_bwd_dkdv_kernel<float, 64> attention_bwd_dkdv_kernel<float, 128>
// instantiations: attention_bwd_dkdv_kernel<__half, 16> attention_bwd_dkdv_kernel<__half, 32>
// instantiations: attention_bwd_dkdv_kernel<__half, 64> attention_bwd_dkdv_kernel<__half, 128>
// instantiations: attention_bwd_dkdv_kernel<__nv_bfloat16, 16> attention_bwd_dkdv_kernel<__nv_bfloat16, 32>
// instantiations: attention_bwd_dkdv_kernel<__nv_bfloat16, 64> attention_bwd_dkdv_kernel<__nv_bfloat16, 128>
// instantiations: attention_bwd_dq_kernel<float, 16> attention_bwd_dq_kernel<float, 32>
// instantiations: attention_bwd_dq_kernel<float, 64> attention_bwd_dq_kernel<float, 128>
// instantiations: attention_bwd_dq_kernel<__half, 16> attention_bwd_dq_kernel<__half, 32>
// instantiations: attention_bwd_dq_kernel<__half, 64> attention_bwd_dq_kernel<__half, 128>
// instantiations: attention_bwd_dq_kernel<__nv_bfloat16, 16> attention_bwd_dq_kernel<__nv_bfloat16, 32>
// instantiations: attention_bwd_dq_kernel<__nv_bfloat16, 64> attention_bwd_dq_kernel<__nv_bfloat16, 128>
