// Fused masked scaled dot-product attention on the tensor cores of sm_80 and newer, forward and backward,
// float16 / bfloat16 storage with float32 accumulation: FlashAttention-2's structure with mma.sync
// m16n8k16, ldmatrix and cp.async (csrc/cuda/mma.cuh). The launchers (csrc/cuda/attention.cu) pick these
// kernels for 16-bit inputs on compute capability 8.0 and newer, and the SIMT kernels of attention.cuh
// for float32 or older GPUs; the semantics (masks, bottom-right causal, Lq != Lk, dropout, non-finite
// scores, grouped-query heads, packed sequences: seq_rows) are those of attention.cuh, whose parameter
// structs these kernels take.
//
// One structure serves the three kernels. A block of kWarps warps owns kRows = 16 kWarps rows of one
// side (query rows in the forward and dQ kernels, keys in the dK/dV kernel), staged once in shared
// memory, and walks tiles of kTileN rows of the other side, staged by cp.async (double-buffered where
// shared memory allows: kStages). Warp w owns rows 16w .. 16w+15 of the block and, for each tile:
//   scores   C (16 x kTileN, float32 in registers) = A_w X^T, A_w from the owned tile (ldmatrix), X the
//            walked tile read as the B operand (ldmatrix, rows = n): mma over D_MAX / 16 k-steps;
//   weights  C turned elementwise into weights W (probabilities, dropped probabilities, dS) in registers;
//   product  acc (16 x D_MAX, float32) += W Y, W's registers reused as A fragments (the C layout of two
//            n8 blocks is the A layout of one k16 block), Y a walked tile read transposed (ldmatrix.trans).
// A lane holds the scores of rows g and g + 8 (g = lane / 4) at columns 8 nb + 2t, 8 nb + 2t + 1
// (t = lane % 4) of every n8 block nb; row reductions are over the lane's values and then the 4 lanes of
// its quad (two shuffles).
//
//   forward  owned Q; walked K (scores S = Q K^T) and V (acc += P V); online softmax per row as in
//            attention.cuh: m' = max(m, rowmax(scale s)), l = l e^(m - m') + sum e^(scale s - m'),
//            acc = acc e^(m - m') + (e^(scale s - m') r) V; out = acc / l, lse = m + log l.
//   dQ       owned Q, dO; walked K, V: S = Q K^T, dP = dO V^T, dS = P (dP r - delta), dQ += dS K.
//   dK, dV   owned K, V (kv head h_kv); walked Q, dO of each query head of its group in turn: S^T = K Q^T,
//            dP^T = V dO^T, dV += (P r)^T dO, dK += dS^T Q.
// P = e^(scale s - lse) is recomputed from the same products in the same k order as the forward's (the
// scale applied to the float32 dot product in both), so the backward sees the forward's probabilities.
// delta = rowsum(dO O) comes from attention.cuh's attention_bwd_delta_kernel. Each output is written by
// exactly one block: deterministic, no atomics. dQ and dK leave the kernels times scale.
//
// Shared memory: every tile row holds D_MAX + 8 elements (16 bytes of padding: the 8 row addresses of one
// ldmatrix matrix fall in distinct bank groups); columns D..D_MAX-1 and rows past the sequence are zeros
// (cp.async zero-fill), so they add nothing to the products. Global rows are read and written at each
// tensor's batch, head and row strides (attention.cuh RowStrides: views of (B, L, H, D) in place). Tiles
// move as 16-byte cp.async chunks when `vec8` (D % 8 == 0; every pointer and stride 16-byte aligned), else
// by element copies.
//   forward  Q (kRows) + kStages x (K, V) (kTileN):  D_MAX 16, 32, 64: 4 warps, kTileN 64, 2 stages:
//            15, 25, 45 KB; D_MAX 128: 4 warps, kTileN 32, 1 stage: 34 KB
//   backward 2 owned (kRows) + kStages x 2 walked (kTileN): D_MAX 16, 32: 4 warps, 64, 2 stages: 18, 30 KB;
//            D_MAX 64: 4 warps, 32, 2 stages: 36 KB; D_MAX 128: 3 warps, 32, 1 stage: 42.5 KB
// Bytes moved per (b, h): the owned side once, the walked side once per owned block, e.g. the forward
// (2 Lq + 2 Lk ceil(Lq / kRows)) D sizeof(T) + 4 Lq; FLOPs 4 Lq Lk D (forward), 10 Lq Lk D (backward:
// S twice, dP twice, dV, dK, dQ; S and dP are recomputed in both backward kernels).
#pragma once
#include "attention.cuh"
#include "mma.cuh"

namespace fastformer {
namespace cuda {

template <int kWarps_, int kTileN_, int kStages_>
struct MmaTiles {
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kRows = 16 * kWarps;  // owned rows per block
  static constexpr int kTileN = kTileN_;     // rows of a walked tile
  static constexpr int kStages = kStages_;   // buffers of the walked tiles (2: cp.async double buffering)
};

template <int D_MAX>
struct AttentionFwdMmaConfig : MmaTiles<4, D_MAX == 128 ? 32 : 64, D_MAX == 128 ? 1 : 2> {};

template <int D_MAX>
struct AttentionBwdMmaConfig
    : MmaTiles<D_MAX == 128 ? 3 : 4, D_MAX >= 64 ? 32 : 64, D_MAX == 128 ? 1 : 2> {};

namespace attention_mma_detail {

using attention_detail::causal_key_end;
using attention_detail::imax;
using attention_detail::imin;
using attention_detail::seq_rows;
using attention_detail::SeqRows;

// Copies rows [0, rows) of a (rows, D) slice of global memory at row stride `ld` elements (last dim
// contiguous) into a tile of kRows rows of D_MAX + 8 elements; rows >= `rows` and columns >= D become
// zeros. vec8: 16-byte cp.async chunks (the caller commits and waits), else plain element copies. All
// kThreads threads of the block take part.
template <int kRows, int D_MAX, int kThreads, typename T>
FF_DEVICE void stage_tile(T* tile, const T* src, int64_t ld, int rows, int D, bool vec8) {
  constexpr int kStride = D_MAX + 8, kChunks = D_MAX / 8;
  for (int idx = static_cast<int>(threadIdx.x); idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    T* dst = tile + r * kStride + c;
    const bool row_in = r < rows;
    if (vec8) {  // D % 8 == 0: a chunk is wholly inside or outside the row
      const bool in = row_in && c < D;
      cp_async16(dst, in ? src + r * ld + c : src, in ? 16 : 0);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        dst[e] = row_in && c + e < D ? src[r * ld + c + e] : from_float<T>(0.0f);
      }
    }
  }
}

// The A fragment (16 x 16) of rows r0.., columns k0.. of a tile (row stride kStride elements).
template <int kStride, typename T>
FF_DEVICE void load_a(uint32_t (&a)[4], const T* tile, int r0, int k0, int lane) {
  ldmatrix_x4(a, tile + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + k0 + (lane >> 4) * 8);
}

// B fragments of the n8 blocks n0 and n0 + 8 at k-step k0, from a tile stored (n, k) (row = n: the walked
// K, V, Q, dO tiles as the right operand of A X^T): b[0], b[1] for n0; b[2], b[3] for n0 + 8.
template <int kStride, typename T>
FF_DEVICE void load_b_rows_n(uint32_t (&b)[4], const T* tile, int n0, int k0, int lane) {
  ldmatrix_x4(b, tile + (n0 + (lane & 7) + (lane >> 4) * 8) * kStride + k0 + ((lane >> 3) & 1) * 8);
}

// The same from a tile stored (k, n) (row = k: the walked tile as Y in W Y), transposed by ldmatrix.
template <int kStride, typename T>
FF_DEVICE void load_b_rows_k(uint32_t (&b)[4], const T* tile, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + n0 + (lane >> 4) * 8);
}

// c (16 x kTileN) = A X^T: A rows r0..r0+15 of `owned`, X the kTileN rows of `walked`, over D_MAX.
template <int kTileN, int D_MAX, typename T>
FF_DEVICE void scores(float (&c)[kTileN / 8][4], const T* owned, int r0, const T* walked, int lane) {
  constexpr int kStride = D_MAX + 8;
#pragma unroll
  for (int nb = 0; nb < kTileN / 8; ++nb) {
#pragma unroll
    for (int e = 0; e < 4; ++e) c[nb][e] = 0.0f;
  }
#pragma unroll
  for (int k0 = 0; k0 < D_MAX; k0 += 16) {
    uint32_t a[4];
    load_a<kStride>(a, owned, r0, k0, lane);
#pragma unroll
    for (int n0 = 0; n0 < kTileN; n0 += 16) {
      uint32_t b[4];
      load_b_rows_n<kStride>(b, walked, n0, k0, lane);
      mma_16816<T>(c[n0 / 8], a, b[0], b[1]);
      mma_16816<T>(c[n0 / 8 + 1], a, b[2], b[3]);
    }
  }
}

// acc (16 x D_MAX) += W Y: W (16 x kTileN) in the C layout, rounded to T; Y the kTileN rows of `walked`.
template <int kTileN, int D_MAX, typename T>
FF_DEVICE void accumulate(float (&acc)[D_MAX / 8][4], const float (&w)[kTileN / 8][4], const T* walked, int lane) {
  constexpr int kStride = D_MAX + 8;
#pragma unroll
  for (int kk = 0; kk < kTileN / 16; ++kk) {
    const uint32_t a[4] = {pack2<T>(w[2 * kk][0], w[2 * kk][1]), pack2<T>(w[2 * kk][2], w[2 * kk][3]),
                           pack2<T>(w[2 * kk + 1][0], w[2 * kk + 1][1]), pack2<T>(w[2 * kk + 1][2], w[2 * kk + 1][3])};
#pragma unroll
    for (int n0 = 0; n0 < D_MAX; n0 += 16) {
      uint32_t b[4];
      load_b_rows_k<kStride>(b, walked, 16 * kk, n0, lane);
      mma_16816<T>(acc[n0 / 8], a, b[0], b[1]);
      mma_16816<T>(acc[n0 / 8 + 1], a, b[2], b[3]);
    }
  }
}

// Max and sum over the 4 lanes of a quad (the lanes holding one row); every lane gets the result.
FF_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFullMask, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFullMask, x, 2));
}
FF_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(kFullMask, x, 1);
  return x + __shfl_xor_sync(kFullMask, x, 2);
}

// Stores row `row` of acc (the lane's half h: row g or g + 8) times mult into a (., D) global row.
template <int D_MAX, typename T>
FF_DEVICE void store_row(T* dst, const float (&acc)[D_MAX / 8][4], int h, int t, int D, bool vec2, float mult) {
#pragma unroll
  for (int db = 0; db < D_MAX / 8; ++db) {
    const int c = db * 8 + 2 * t;
    const float x0 = acc[db][2 * h] * mult, x1 = acc[db][2 * h + 1] * mult;
    if (vec2) {
      if (c < D) {
        float2 v;
        v.x = x0;
        v.y = x1;
        store2(dst + c, v);
      }
    } else {
      if (c < D) dst[c] = from_float<T>(x0);
      if (c + 1 < D) dst[c + 1] = from_float<T>(x1);
    }
  }
}

// Walks the tiles [0, n_tiles) of the walked side: stages tile `tile` of each of the kWalked sources
// (src[w] + tile kTileN rows of ld[w] elements, `rows_left(tile)` valid rows) into its buffer,
// double-buffered when kStages == 2 (tile + 1 is in flight while tile is computed), then calls
// body(tile, buffers) between two block barriers. The owned tiles' copies (issued before) complete with
// the first tile's group.
template <typename Cfg, int D_MAX, int kWalked, typename T, typename RowsLeft, typename Body>
FF_DEVICE void walk_tiles(T* buffers, const T* const (&src)[kWalked], const int64_t (&ld)[kWalked], int n_tiles,
                          int D, bool vec8, RowsLeft rows_left, Body body) {
  constexpr int kTileElems = Cfg::kTileN * (D_MAX + 8);
  auto stage = [&](int tile, int buf) {
#pragma unroll
    for (int w = 0; w < kWalked; ++w) {
      stage_tile<Cfg::kTileN, D_MAX, Cfg::kThreads>(buffers + (buf * kWalked + w) * kTileElems,
                                                    src[w] + tile * Cfg::kTileN * ld[w], ld[w], rows_left(tile),
                                                    D, vec8);
    }
  };
  if (Cfg::kStages == 2 && n_tiles > 0) stage(0, 0);
  cp_async_commit();
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int buf = Cfg::kStages == 2 ? tile & 1 : 0;
    if (Cfg::kStages == 1) {
      stage(tile, 0);
      cp_async_commit();
      cp_async_wait<0>();
    } else if (tile + 1 < n_tiles) {
      stage(tile + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this tile (and the owned tiles) written by every thread's copies
    body(tile, buffers + buf * kWalked * kTileElems);
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }
  cp_async_wait<0>();  // no tile: the owned tiles' copies still retire
}

}  // namespace attention_mma_detail

// Forward. Grid (ceil(max Lq_b / kRows), B H), block kThreads: warp w owns query rows i0 + 16w .. i0 + 16w + 15
// of sequence b, head h (keys of kv head h / group).
template <typename T, int D_MAX>
FF_GLOBAL void FF_LAUNCH_BOUNDS_BLOCKS(AttentionFwdMmaConfig<D_MAX>::kThreads, 1)
    attention_fwd_mma_kernel(const AttentionFwdParams<T> p) {
  using namespace attention_mma_detail;
  using Cfg = AttentionFwdMmaConfig<D_MAX>;
  constexpr int kStride = D_MAX + 8, kNB = Cfg::kTileN / 8, kTileElems = Cfg::kTileN * kStride;
  __shared__ float4 q_s4[Cfg::kRows * kStride / 8];                  // Q, (kRows, D_MAX + 8)
  __shared__ float4 kv_s4[Cfg::kStages * 2 * kTileElems / 8];        // per stage: K, V (kTileN, D_MAX + 8)
  T* q_s = reinterpret_cast<T*>(q_s4);

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int bh = blockIdx.y, b = bh / p.H, head = bh - b * p.H;
  const SeqRows sq = seq_rows(p, b);
  const int i0 = blockIdx.x * Cfg::kRows;
  if (i0 >= sq.Lq) return;  // past this sequence's queries
  const bool* kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(b) * p.Lk : nullptr;
  const int lse_h = sq.lse_row(head, p.Lq);
  const float neg_inf = -ff_inf();
  __shared__ uint64_t seed_s;  // the dropout seed (common.cuh load_seed), read by thread 0 for the block
  if (threadIdx.x == 0 && p.dropout_p > 0.0f) seed_s = load_seed(p.seed);  // seen after the first barrier

  stage_tile<Cfg::kRows, D_MAX, Cfg::kThreads>(q_s, p.q + slice_offset(p.q_strides, b, head, sq.q_start + i0),
                                               p.q_strides.row, sq.Lq - i0, p.D, p.vec8);
  float m[2] = {neg_inf, neg_inf}, l[2] = {0.0f, 0.0f};  // rows g, g + 8; l is this lane's share
  float acc[D_MAX / 8][4];
#pragma unroll
  for (int db = 0; db < D_MAX / 8; ++db) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[db][e] = 0.0f;
  }

  const int key_end = causal_key_end(p.causal, imin(i0 + Cfg::kRows, sq.Lq), sq.Lq, sq.Lk);
  const T* const src[2] = {p.k + slice_offset(p.k_strides, b, head / p.group, sq.k_start),
                           p.v + slice_offset(p.v_strides, b, head / p.group, sq.k_start)};
  const int64_t ld[2] = {p.k_strides.row, p.v_strides.row};
  walk_tiles<Cfg, D_MAX, 2>(
      reinterpret_cast<T*>(kv_s4), src, ld, ceil_div(key_end, Cfg::kTileN), p.D, p.vec8,
      [&](int tile) { return key_end - tile * Cfg::kTileN; },
      [&](int tile, const T* kv) {
        const int j0 = tile * Cfg::kTileN;
        float s[kNB][4];
        scores<Cfg::kTileN, D_MAX>(s, q_s, 16 * warp, kv, lane);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = i0 + 16 * warp + g + 8 * h;
          float mx = neg_inf;
#pragma unroll
          for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = j0 + nb * 8 + 2 * t + e;
              const bool visible = j < key_end && !(kpm != nullptr && kpm[j]) && i < sq.Lq &&
                                   (!p.causal || j <= i + sq.Lk - sq.Lq);
              const float x = visible ? s[nb][2 * h + e] * p.scale : neg_inf;
              s[nb][2 * h + e] = x;
              mx = fmaxf(mx, x);
            }
          }
          // +inf -> NaN: e^(s - m) and so l, acc and lse turn NaN (a NaN s does that through its own e^(s - m)).
          const float m_new = poison_unbounded(fmaxf(m[h], quad_max(mx)));
          const float m_use = m_new == neg_inf ? 0.0f : m_new;  // a row with nothing visible yet stays at 0
          const float corr = expf(m[h] - m_use);
          l[h] *= corr;
#pragma unroll
          for (int db = 0; db < D_MAX / 8; ++db) {
            acc[db][2 * h] *= corr;
            acc[db][2 * h + 1] *= corr;
          }
#pragma unroll
          for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float pr = expf(s[nb][2 * h + e] - m_use);
              l[h] += pr;
              if (p.dropout_p > 0.0f) {
                const uint64_t idx = static_cast<uint64_t>(lse_h + i) * p.Lk + (j0 + nb * 8 + 2 * t + e);
                pr *= dropout_factor(seed_s, idx, p.dropout_p, p.dropout_scale);
              }
              s[nb][2 * h + e] = pr;
            }
          }
          m[h] = m_new;
        }
        accumulate<Cfg::kTileN, D_MAX>(acc, s, kv + kTileElems, lane);
      });

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = i0 + 16 * warp + g + 8 * h;
    const float l_row = quad_sum(l[h]);
    if (i < sq.Lq) {
      const int row = lse_h + i;
      // l = 0: no visible key (or only -inf scores) -> zeros and lse = -inf; l = NaN: out and lse NaN.
      store_row<D_MAX>(p.out + slice_offset(p.out_strides, b, head, sq.q_start + i), acc, h, t, p.D, p.vec2,
                       l_row == 0.0f ? 0.0f : 1.0f / l_row);
      if (t == 0) p.lse[row] = l_row == 0.0f ? neg_inf : m[h] + logf(l_row);
    }
  }
}

// dQ. Grid (ceil(max Lq_b / kRows), B H), block kThreads: warp w owns query rows i0 + 16w .. i0 + 16w + 15
// of sequence b, head h (keys of kv head h / group).
template <typename T, int D_MAX>
FF_GLOBAL void FF_LAUNCH_BOUNDS_BLOCKS(AttentionBwdMmaConfig<D_MAX>::kThreads, 1)
    attention_bwd_dq_mma_kernel(const AttentionBwdParams<T> p) {
  using namespace attention_mma_detail;
  using Cfg = AttentionBwdMmaConfig<D_MAX>;
  constexpr int kStride = D_MAX + 8, kNB = Cfg::kTileN / 8, kTileElems = Cfg::kTileN * kStride;
  __shared__ float4 own_s4[2 * Cfg::kRows * kStride / 8];           // Q, dO (kRows, D_MAX + 8)
  __shared__ float4 kv_s4[Cfg::kStages * 2 * kTileElems / 8];       // per stage: K, V (kTileN, D_MAX + 8)
  T* q_s = reinterpret_cast<T*>(own_s4);
  T* do_s = q_s + Cfg::kRows * kStride;

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int bh = blockIdx.y, b = bh / p.H, head = bh - b * p.H;
  const SeqRows sq = seq_rows(p, b);
  const int i0 = blockIdx.x * Cfg::kRows;
  if (i0 >= sq.Lq) return;  // past this sequence's queries
  const bool* kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(b) * p.Lk : nullptr;
  const int lse_h = sq.lse_row(head, p.Lq);
  const float neg_inf = -ff_inf();
  __shared__ uint64_t seed_s;  // the dropout seed (common.cuh load_seed), read by thread 0 for the block
  if (threadIdx.x == 0 && p.dropout_p > 0.0f) seed_s = load_seed(p.seed);  // seen after the first barrier

  stage_tile<Cfg::kRows, D_MAX, Cfg::kThreads>(q_s, p.q + slice_offset(p.q_strides, b, head, sq.q_start + i0),
                                               p.q_strides.row, sq.Lq - i0, p.D, p.vec8);
  stage_tile<Cfg::kRows, D_MAX, Cfg::kThreads>(do_s, p.dout + slice_offset(p.dout_strides, b, head, sq.q_start + i0),
                                               p.dout_strides.row, sq.Lq - i0, p.D, p.vec8);
  float lse[2], delta[2], dq[D_MAX / 8][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = i0 + 16 * warp + g + 8 * h;
    lse[h] = i < sq.Lq ? p.lse[lse_h + i] : neg_inf;
    delta[h] = i < sq.Lq ? p.delta[lse_h + i] : 0.0f;
  }
#pragma unroll
  for (int db = 0; db < D_MAX / 8; ++db) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[db][e] = 0.0f;
  }

  const int key_end = causal_key_end(p.causal, imin(i0 + Cfg::kRows, sq.Lq), sq.Lq, sq.Lk);
  const T* const src[2] = {p.k + slice_offset(p.k_strides, b, head / p.group, sq.k_start),
                           p.v + slice_offset(p.v_strides, b, head / p.group, sq.k_start)};
  const int64_t ld[2] = {p.k_strides.row, p.v_strides.row};
  walk_tiles<Cfg, D_MAX, 2>(
      reinterpret_cast<T*>(kv_s4), src, ld, ceil_div(key_end, Cfg::kTileN), p.D, p.vec8,
      [&](int tile) { return key_end - tile * Cfg::kTileN; },
      [&](int tile, const T* kv) {
        const int j0 = tile * Cfg::kTileN;
        float s[kNB][4], dp[kNB][4];
        scores<Cfg::kTileN, D_MAX>(s, q_s, 16 * warp, kv, lane);
        scores<Cfg::kTileN, D_MAX>(dp, do_s, 16 * warp, kv + kTileElems, lane);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = i0 + 16 * warp + g + 8 * h;
#pragma unroll
          for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = j0 + nb * 8 + 2 * t + e;
              // As attention.cuh: lse = NaN gives a NaN dQ row; an invisible pair gives exact zeros.
              const bool visible = j < key_end && !(kpm != nullptr && kpm[j]) && i < sq.Lq && lse[h] != neg_inf &&
                                   (!p.causal || j <= i + sq.Lk - sq.Lq);
              const float pr = visible ? expf(s[nb][2 * h + e] * p.scale - lse[h]) : 0.0f;
              float fr = 1.0f;
              if (p.dropout_p > 0.0f) {
                const uint64_t idx = static_cast<uint64_t>(lse_h + i) * p.Lk + j;
                fr = dropout_factor(seed_s, idx, p.dropout_p, p.dropout_scale);
              }
              s[nb][2 * h + e] = visible ? pr * (dp[nb][2 * h + e] * fr - delta[h]) : 0.0f;  // dS
            }
          }
        }
        accumulate<Cfg::kTileN, D_MAX>(dq, s, kv, lane);
      });

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = i0 + 16 * warp + g + 8 * h;
    if (i < sq.Lq) {
      store_row<D_MAX>(p.dq + slice_offset(p.dq_strides, b, head, sq.q_start + i), dq, h, t, p.D, p.vec2, p.scale);
    }
  }
}

// dK and dV. Grid (ceil(max Lk_b / kRows), B H_kv), block kThreads: warp w owns keys j_blk + 16w .. j_blk + 16w + 15
// of sequence b, kv head h_kv, summed over the query heads of its group in turn (no atomics).
template <typename T, int D_MAX>
FF_GLOBAL void FF_LAUNCH_BOUNDS_BLOCKS(AttentionBwdMmaConfig<D_MAX>::kThreads, 1)
    attention_bwd_dkdv_mma_kernel(const AttentionBwdParams<T> p) {
  using namespace attention_mma_detail;
  using Cfg = AttentionBwdMmaConfig<D_MAX>;
  constexpr int kStride = D_MAX + 8, kNB = Cfg::kTileN / 8, kTileElems = Cfg::kTileN * kStride;
  __shared__ float4 own_s4[2 * Cfg::kRows * kStride / 8];           // K, V (kRows, D_MAX + 8)
  __shared__ float4 qdo_s4[Cfg::kStages * 2 * kTileElems / 8];      // per stage: Q, dO (kTileN, D_MAX + 8)
  T* k_s = reinterpret_cast<T*>(own_s4);
  T* v_s = k_s + Cfg::kRows * kStride;

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int H_kv = p.H / p.group;
  const int bh = blockIdx.y, b = bh / H_kv, head_kv = bh - b * H_kv;
  const SeqRows sq = seq_rows(p, b);
  const int j_blk = blockIdx.x * Cfg::kRows;
  if (j_blk >= sq.Lk) return;  // past this sequence's keys
  const bool* kpm = p.key_padding_mask ? p.key_padding_mask + static_cast<int64_t>(b) * p.Lk : nullptr;
  const float neg_inf = -ff_inf();
  __shared__ uint64_t seed_s;  // the dropout seed (common.cuh load_seed), read by thread 0 for the block
  if (threadIdx.x == 0 && p.dropout_p > 0.0f) seed_s = load_seed(p.seed);  // seen after the first barrier

  stage_tile<Cfg::kRows, D_MAX, Cfg::kThreads>(k_s, p.k + slice_offset(p.k_strides, b, head_kv, sq.k_start + j_blk),
                                               p.k_strides.row, sq.Lk - j_blk, p.D, p.vec8);
  stage_tile<Cfg::kRows, D_MAX, Cfg::kThreads>(v_s, p.v + slice_offset(p.v_strides, b, head_kv, sq.k_start + j_blk),
                                               p.v_strides.row, sq.Lk - j_blk, p.D, p.vec8);
  bool key_ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = j_blk + 16 * warp + g + 8 * h;
    key_ok[h] = j < sq.Lk && !(kpm != nullptr && kpm[j]);
  }
  float dk[D_MAX / 8][4], dv[D_MAX / 8][4];
#pragma unroll
  for (int db = 0; db < D_MAX / 8; ++db) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[db][e] = dv[db][e] = 0.0f;
  }

  // Queries before the diagonal of the block's first key see none of its keys.
  const int first = p.causal ? imax(0, j_blk - (sq.Lk - sq.Lq)) / Cfg::kTileN * Cfg::kTileN : 0;
  const int64_t ld[2] = {p.q_strides.row, p.dout_strides.row};
  for (int head = head_kv * p.group; head < (head_kv + 1) * p.group; ++head) {
    const int lse_h = sq.lse_row(head, p.Lq);
    const T* const src[2] = {p.q + slice_offset(p.q_strides, b, head, sq.q_start + first),
                             p.dout + slice_offset(p.dout_strides, b, head, sq.q_start + first)};
    walk_tiles<Cfg, D_MAX, 2>(
        reinterpret_cast<T*>(qdo_s4), src, ld, ceil_div(imax(0, sq.Lq - first), Cfg::kTileN), p.D, p.vec8,
        [&](int tile) { return sq.Lq - first - tile * Cfg::kTileN; },
        [&](int tile, const T* qdo) {
          const int i0 = first + tile * Cfg::kTileN;
          float s[kNB][4], dp[kNB][4];
          scores<Cfg::kTileN, D_MAX>(s, k_s, 16 * warp, qdo, lane);                // S^T
          scores<Cfg::kTileN, D_MAX>(dp, v_s, 16 * warp, qdo + kTileElems, lane);  // dP^T
#pragma unroll
          for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int i = i0 + nb * 8 + 2 * t + e;
              const int row = lse_h + i;
              const float lse_i = i < sq.Lq ? p.lse[row] : neg_inf;
              const float delta_i = i < sq.Lq ? p.delta[row] : 0.0f;
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int j = j_blk + 16 * warp + g + 8 * h;
                // lse = NaN (a poisoned row) is "visible": P, dS and so dK, dV of its keys turn NaN.
                const bool visible =
                    key_ok[h] && i < sq.Lq && lse_i != neg_inf && (!p.causal || j <= i + sq.Lk - sq.Lq);
                const float pr = visible ? expf(s[nb][2 * h + e] * p.scale - lse_i) : 0.0f;
                float fr = 1.0f;
                if (p.dropout_p > 0.0f) {
                  fr = dropout_factor(seed_s, static_cast<uint64_t>(row) * p.Lk + j, p.dropout_p, p.dropout_scale);
                }
                s[nb][2 * h + e] = pr * fr;                                                      // (P r)^T
                dp[nb][2 * h + e] = visible ? pr * (dp[nb][2 * h + e] * fr - delta_i) : 0.0f;  // dS^T
              }
            }
          }
          accumulate<Cfg::kTileN, D_MAX>(dv, s, qdo + kTileElems, lane);
          accumulate<Cfg::kTileN, D_MAX>(dk, dp, qdo, lane);
        });
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = j_blk + 16 * warp + g + 8 * h;
    if (j < sq.Lk) {  // keys no query sees got no tile: zeros
      store_row<D_MAX>(p.dk + slice_offset(p.dk_strides, b, head_kv, sq.k_start + j), dk, h, t, p.D, p.vec2, p.scale);
      store_row<D_MAX>(p.dv + slice_offset(p.dv_strides, b, head_kv, sq.k_start + j), dv, h, t, p.D, p.vec2, 1.0f);
    }
  }
}

}  // namespace cuda
}  // namespace fastformer

// architectures: sm_80
// instantiations: attention_fwd_mma_kernel<__half, 16> attention_fwd_mma_kernel<__half, 32>
// instantiations: attention_fwd_mma_kernel<__half, 64> attention_fwd_mma_kernel<__half, 128>
// instantiations: attention_fwd_mma_kernel<__nv_bfloat16, 16> attention_fwd_mma_kernel<__nv_bfloat16, 32>
// instantiations: attention_fwd_mma_kernel<__nv_bfloat16, 64> attention_fwd_mma_kernel<__nv_bfloat16, 128>
// instantiations: attention_bwd_dq_mma_kernel<__half, 16> attention_bwd_dq_mma_kernel<__half, 32>
// instantiations: attention_bwd_dq_mma_kernel<__half, 64> attention_bwd_dq_mma_kernel<__half, 128>
// instantiations: attention_bwd_dq_mma_kernel<__nv_bfloat16, 16> attention_bwd_dq_mma_kernel<__nv_bfloat16, 32>
// instantiations: attention_bwd_dq_mma_kernel<__nv_bfloat16, 64> attention_bwd_dq_mma_kernel<__nv_bfloat16, 128>
// instantiations: attention_bwd_dkdv_mma_kernel<__half, 16> attention_bwd_dkdv_mma_kernel<__half, 32>
// instantiations: attention_bwd_dkdv_mma_kernel<__half, 64> attention_bwd_dkdv_mma_kernel<__half, 128>
// instantiations: attention_bwd_dkdv_mma_kernel<__nv_bfloat16, 16> attention_bwd_dkdv_mma_kernel<__nv_bfloat16, 32>
// instantiations: attention_bwd_dkdv_mma_kernel<__nv_bfloat16, 64> attention_bwd_dkdv_mma_kernel<__nv_bfloat16, 128>
