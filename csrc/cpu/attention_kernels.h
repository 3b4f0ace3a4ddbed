// The CPU attention kernels, forward and backward, shared by the ops attention (csrc/cpu/attention.cpp, dense
// (B, H, L, D) tensors) and attention_varlen (csrc/cpu/attention_varlen.cpp, packed sequences). Fused masked
// scaled dot-product attention on the CPU: FlashAttention-2's algorithm on tiles, with the tile products done by
// fastformer's own register-blocked micro-kernel (csrc/gemm/products.h, no BLAS: the results depend on the values
// alone, not on the thread count, the buffers' placement or a BLAS's mode) and the softmax/mask/dropout work
// vectorized with at::vec.
//
// Two ops share these kernels:
//   attention          q (B, H, Lq, D), k and v (B, H_kv, Lk, D), key_padding_mask (B, Lk), out (B, H, Lq, D),
//                      lse (B, H, Lq);
//   attention_varlen   packed sequences: q (Tq, H, D), k and v (Tk, H_kv, D), sequence b at rows
//                      cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q (and cu_seqlens_k's of k, v), out (Tq, H, D),
//                      lse (H, Tq) (flash-attn's varlen layout).
// Both are "sequences" (Seqs below): sequence b of query length Lq_b and key length Lk_b, its rows at a start
// row (0 for dense tensors, cu_seqlens[b] for packed ones) of batch b (always 0 for packed ones). Grouped-query
// attention: query head h reads key/value head h / (H / H_kv), in place (no copies of K and V).
// lse is in the accumulation type acc_t (float for half/bfloat16/float, double for double).
// float16 inputs are converted tile by tile into acc_t buffers, float and double tiles are used in place;
// bfloat16 tiles are multiplied as bfloat16 (ForwardTiles, BackwardTiles below).
// Layout: any strides with the last dim contiguous (``Rows``): a tile is rows at a row stride, which the
// tile products take as their leading dimension. So q, k, v as transformers passes them (views (B, H, L, D) of
// (B, L, H, D) projections) are read in place, and out, dq, dk, dv are always written in that layout
// (rows_like): no copy on the way in or out.
//
// Forward, one work item per (sequence, head, tile of kBlockQ query rows), spread over threads (so work is
// split by tokens: one long sequence among short ones is many items):
//   for each block of kBlockK keys up to the tile's causal limit:
//     S = scale Q_t K_b^T                        (tile_gemm with K_b^T transposed into a thread buffer, D x kBlockK;
//                                                 kBlockQ x kBlockK scores in a thread buffer)
//     masked scores -> -inf; per row online softmax: m' = max(m, max S), l = l e^(m - m') + sum e^(S - m'),
//     O *= e^(m - m'); P = e^(S - m') * dropout;  O += P V_b   (tile_gemm)
//   out = O / l, lse = m + log l; a row with no visible key (or only -inf scores) gets out = 0, lse = -inf;
//   one with a NaN or +inf visible score gets out = NaN, lse = NaN (its m turns NaN); invisible keys are
//   never read into the softmax, whatever their scores.
// Memory traffic: Q and O once, K and V once per query tile (ceil(Lq / kBlockQ) times); scores never
// leave the thread's cache (no Lq x Lk matrix).
//
// Backward, one work item per (sequence, key/value head), so dq, dk, dv need no atomics: the items are split
// among the threads by their cost (Lq_b Lk_b times the heads of the group), not by their count, so one long
// sequence among short ones does not leave a thread idle. Per query head of the group, FlashAttention-2's
// loop order (key blocks outside, query tiles inside; K_b^T and V_b^T transposed once per key block), dK and
// dV accumulated over the group's heads in acc_t before they are written; probabilities recomputed from the
// saved logsumexp:
//   P = e^(scale Q_t K_b^T - lse) (masked -> 0);  dP = dO_t V_b^T;  r = dropout factors of the forward
//   dV_b += (P r)^T dO_t;  dS = P (dP r - D),  D_i = dO_i . O_i;  dQ_t += scale dS K_b;  dK_b += scale dS^T Q_t
// Dropout: element (b, h, i, j) of the probability matrix has flat index r Lk + j in the Philox stream of
// csrc/philox.h, r the index of query row (b, h, i) in lse, the same on every backend, regenerated in
// backward: ((b H + h) Lq + i) Lk + j for attention; (h Tq + cu_seqlens_q[b] + i) Tk + j for attention_varlen
// (Tq, Tk the packed totals).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_ops.h"
#include "cpu/dropout.h"
#include "gemm/products.h"

// A namespace of its own (not an unnamed one): the level's sources may be compiled as one unit (setup.py).
namespace fastformer::cpu::attention_kernels {

constexpr int64_t kBlockQ = 64;   // query rows per tile
constexpr int64_t kBlockK = 128;  // keys per block (the leading dimension of score tiles)

// Element (b, h, i, :) of a (B, H, L, D) tensor whose last dim is contiguous: base + b sb + h sh + i sl.
template <typename T>
struct Rows {
  T* base;
  int64_t sb, sh, sl;
  T* row(int64_t b, int64_t h, int64_t i) const { return base + b * sb + h * sh + i * sl; }
};
template <typename T>
Rows<T> rows_of(const Tensor& t) {
  return Rows<T>{t.data_ptr<std::remove_const_t<T>>(), t.stride(0), t.stride(1), t.stride(2)};
}

// n rows of D elements at row stride ld as acc_t: {src, ld} when the types agree, else converted into
// buffer ({buffer, D}).
template <typename scalar_t, typename acc_t>
inline std::pair<const acc_t*, int64_t> rows_as_acc(const scalar_t* src, int64_t n, int64_t ld, int64_t D,
                                                    Buffer<acc_t>& buffer) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return {src, ld};
  } else {
    if (static_cast<int64_t>(buffer.size()) < n * D) buffer.resize(n * D);
    for (int64_t r = 0; r < n; ++r) convert_row(src + r * ld, buffer.data() + r * D, D);
    return {buffer.data(), D};
  }
}

// The sequences of a call and where their rows are (see the top of the file).
struct Seqs {
  int64_t B, H, H_kv, D;
  int64_t Lq, Lk;                  // dense: every sequence's lengths; packed: the totals Tq, Tk
  const int32_t* cu_q = nullptr;   // packed: (B + 1) row offsets of the sequences in q; null for dense tensors
  const int32_t* cu_k = nullptr;   // packed: in k and v
  bool causal;

  bool packed() const { return cu_q != nullptr; }
  // Packed tables were checked on the host (csrc/ops.h check_cu_seqlens): 0 first, non-decreasing, the total last.
  int64_t q_start(int64_t b) const { return packed() ? cu_q[b] : 0; }
  int64_t k_start(int64_t b) const { return packed() ? cu_k[b] : 0; }
  int64_t q_len(int64_t b) const { return packed() ? cu_q[b + 1] - cu_q[b] : Lq; }
  int64_t k_len(int64_t b) const { return packed() ? cu_k[b + 1] - cu_k[b] : Lk; }
  int64_t group() const { return H / H_kv; }
  // Index in lse of query row (b, h, i): (b H + h) Lq + i, or h Tq + cu_q[b] + i packed. Dropout element
  // (b, h, i, j) is lse_index(b, h, i) Lk + j.
  int64_t lse_index(int64_t b, int64_t h, int64_t i) const {
    return packed() ? h * Lq + cu_q[b] + i : (b * H + h) * Lq + i;
  }
};

// One sequence's lengths and which of its keys a query row can see.
struct Seq {
  int64_t Lq, Lk;
  bool causal;
  // Keys [0, key_end(i)) can be visible to query row i (bottom-right causal alignment).
  int64_t key_end(int64_t i) const {
    return causal ? std::min<int64_t>(Lk, std::max<int64_t>(0, i + Lk - Lq + 1)) : Lk;
  }
  // First query row that can see key j (0 if not causal).
  int64_t first_query(int64_t j) const { return causal ? std::max<int64_t>(0, j - (Lk - Lq)) : 0; }
};

// [first, last) ranges of items 0..n-1 for each of `parts` threads, each range of about equal summed cost
// (cost(i) >= 0): boundaries[t] .. boundaries[t + 1]. Each item is computed by one thread, in one order,
// whatever the split, so results do not depend on the thread count.
template <typename Cost>
std::vector<int64_t> split_by_cost(int64_t n, int64_t parts, Cost cost) {
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost(i);
  std::vector<int64_t> boundaries(parts + 1, n);
  boundaries[0] = 0;
  for (int64_t t = 1; t < parts; ++t) {
    const double target = prefix[n] * static_cast<double>(t) / static_cast<double>(parts);
    boundaries[t] = std::max(boundaries[t - 1],
                             static_cast<int64_t>(std::lower_bound(prefix.begin() + 1, prefix.end(), target) -
                                                  prefix.begin()));
  }
  return boundaries;
}

// x[0:n] = exp(x[0:n] - m); returns the sum.
template <typename T>
inline T exp_sub_sum(T* x, int64_t n, T m) {
  using Vec = at::vec::Vectorized<T>;
  const Vec vm(m);
  Vec acc(T(0));
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = (Vec::loadu(x + j) - vm).exp();
    e.store(x + j);
    acc = acc + e;
  }
  if (j < n) {
    const Vec e = (Vec::loadu(x + j, n - j) - vm).exp();
    e.store(x + j, n - j);
    acc = acc + Vec::set(Vec(T(0)), e, n - j);
  }
  return at::vec::vec_reduce_all<T>([](Vec a, Vec b) { return a + b; }, acc);
}

// x[0:n] *= y[0:n]
template <typename T>
inline void vec_mul(T* x, const T* y, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(x + j) * Vec::loadu(y + j)).store(x + j);
  for (; j < n; ++j) x[j] *= y[j];
}

// Scores of row i against keys [j0, j0 + nk) that it cannot see become `value`: padded keys
// (pad_bias[t] = -inf) and keys past its causal limit.
template <typename T>
inline void mask_row(T* s, int64_t nk, const T* pad_bias, int64_t visible_end, T value) {
  if (pad_bias != nullptr) {
    for (int64_t t = 0; t < nk; ++t) {
      if (pad_bias[t] != T(0)) s[t] = value;
    }
  }
  for (int64_t t = std::max<int64_t>(0, visible_end); t < nk; ++t) s[t] = value;
}

// ---- The tile products, by element type --------------------------------------------------------------------
// float, double, half (the default): operands in acc_t (half converted tile by tile into buffers, float and
// double read in place), products on the fma micro-kernel (csrc/gemm/products.h); B operands of the form
// M^T transposed once per key block.
// bfloat16: operands stay bfloat16 (q, k, v, dout read in place as A operands, packed into pairs as B operands:
// products.h pack_row_pairs, pack_column_pairs), bf16 products with float32 sums (vdpbf16ps where the CPU has
// AVX512_BF16, the same arithmetic emulated elsewhere); the probabilities P and dS are rounded to bfloat16 for
// their products, as FlashAttention does on GPUs, the scores, softmax and every sum stay float32. No tile is
// converted to float32 before a product. In the backward, P^T and dS^T (the A operands of dV and dK) are read as
// P's and dS's pairs of rows a step at a time (products.h tile_gemm_bf16's a_pairs): nothing is transposed.
// ldk: the score tiles' leading dimension (>= every key block's nk); bq: query rows per tile.
template <typename scalar_t, bool = std::is_same_v<scalar_t, c10::BFloat16>>
struct ForwardTiles {
  using acc_t = at::opmath_type<scalar_t>;
  int64_t D, ldk;
  Buffer<acc_t> kt, q_buf, v_buf;  // K_b^T (D x ldk); Q_t and V_b as acc_t where scalar_t is not
  const acc_t* qt = nullptr;
  const acc_t* vb = nullptr;
  int64_t ldq = 0, ldv = 0;
  ForwardTiles(int64_t D, int64_t bq, int64_t ldk) : D(D), ldk(ldk), kt(D * ldk) {
    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      q_buf.resize(bq * D);
      v_buf.resize(ldk * D);
    }
  }
  void load_q(const scalar_t* q, int64_t nq, int64_t ld) { std::tie(qt, ldq) = rows_as_acc(q, nq, ld, D, q_buf); }
  void load_block(const scalar_t* k, int64_t k_ld, const scalar_t* v, int64_t v_ld, int64_t nk) {
    transpose_rows(k, nk, D, k_ld, kt.data(), ldk);
    std::tie(vb, ldv) = rows_as_acc(v, nk, v_ld, D, v_buf);
  }
  // s (nq x nk, ld ldk) = scale Q_t K_b^T
  void scores(int64_t nq, int64_t nk, acc_t scale, acc_t* s) {
    tile_gemm<acc_t>(nq, nk, D, scale, qt, ldq, false, kt.data(), ldk, false, s, ldk);
  }
  // o (nq x D) += p (nq x nk, ld ldk) V_b
  void add_pv(int64_t nq, int64_t nk, const acc_t* p, acc_t* o) {
    tile_gemm<acc_t>(nq, D, nk, acc_t(1), p, ldk, false, vb, ldv, true, o, D);
  }
};

template <typename scalar_t>
struct ForwardTiles<scalar_t, true> {
  using bf16 = c10::BFloat16;
  int64_t D, ldk;
  Buffer<uint32_t> kp, vp;  // K_b^T as pairs (ceil(D / 2) x ldk), V_b as pairs of rows (ceil(ldk / 2) x D)
  Buffer<bf16> pb;          // P rounded to bfloat16 (bq x ldk)
  const bf16* qt = nullptr;
  int64_t ldq = 0;
  ForwardTiles(int64_t D, int64_t bq, int64_t ldk)
      : D(D), ldk(ldk), kp((D + 1) / 2 * ldk), vp((ldk + 1) / 2 * D), pb(bq * ldk) {}
  void load_q(const bf16* q, int64_t, int64_t ld) {
    qt = q;
    ldq = ld;
  }
  void load_block(const bf16* k, int64_t k_ld, const bf16* v, int64_t v_ld, int64_t nk) {
    pack_column_pairs(k, nk, D, k_ld, kp.data(), ldk);
    pack_row_pairs(v, nk, D, v_ld, vp.data(), D);
  }
  void scores(int64_t nq, int64_t nk, float scale, float* s) {
    tile_gemm_bf16(nq, nk, D, scale, qt, ldq, kp.data(), ldk, false, s, ldk);
  }
  void add_pv(int64_t nq, int64_t nk, const float* p, float* o) {
    for (int64_t r = 0; r < nq; ++r) convert_row(p + r * ldk, pb.data() + r * ldk, nk);
    tile_gemm_bf16(nq, D, nk, 1.0f, pb.data(), ldk, vp.data(), D, true, o, D);
  }
};

// The backward's: per query head, Q and dO (Lq rows); per key block, K_b and V_b; per query tile (from row i0,
// a multiple of kBlockQ) the five products.
template <typename scalar_t, bool = std::is_same_v<scalar_t, c10::BFloat16>>
struct BackwardTiles {
  using acc_t = at::opmath_type<scalar_t>;
  int64_t D, ldk;
  Buffer<acc_t> kt, vt, q_buf, do_buf, k_buf;  // K_b^T, V_b^T (D x ldk); Q, dO, K_b as acc_t where needed
  const acc_t *qa = nullptr, *doa = nullptr, *kb = nullptr;
  int64_t ldq = 0, lddo = 0, ldkb = 0;
  BackwardTiles(int64_t D, int64_t max_q, int64_t, int64_t ldk) : D(D), ldk(ldk), kt(D * ldk), vt(D * ldk) {
    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      q_buf.resize(max_q * D);
      do_buf.resize(max_q * D);
      k_buf.resize(ldk * D);
    }
  }
  void load_head(const scalar_t* q, int64_t q_ld, const scalar_t* dout, int64_t do_ld, int64_t Lq) {
    std::tie(qa, ldq) = rows_as_acc(q, Lq, q_ld, D, q_buf);
    std::tie(doa, lddo) = rows_as_acc(dout, Lq, do_ld, D, do_buf);
  }
  void load_block(const scalar_t* k, int64_t k_ld, const scalar_t* v, int64_t v_ld, int64_t nk) {
    std::tie(kb, ldkb) = rows_as_acc(k, nk, k_ld, D, k_buf);
    transpose_rows(kb, nk, D, ldkb, kt.data(), ldk);
    transpose_rows(v, nk, D, v_ld, vt.data(), ldk);
  }
  // p (nq x nk, ld ldk) = scale Q_t K_b^T
  void scores(int64_t i0, int64_t nq, int64_t nk, acc_t scale, acc_t* p) {
    tile_gemm<acc_t>(nq, nk, D, scale, qa + i0 * ldq, ldq, false, kt.data(), ldk, false, p, ldk);
  }
  // dp (nq x nk, ld ldk) = dO_t V_b^T
  void dprobs(int64_t i0, int64_t nq, int64_t nk, acc_t* dp) {
    tile_gemm<acc_t>(nq, nk, D, acc_t(1), doa + i0 * lddo, lddo, false, vt.data(), ldk, false, dp, ldk);
  }
  // dv_b (nk x D) += p^T dO_t; dk_b (nk x D) += scale ds^T Q_t; dq_t (nq x D) += scale ds K_b
  void add_grads(int64_t i0, int64_t nq, int64_t nk, acc_t scale, const acc_t* p, const acc_t* ds, acc_t* dv_b,
                 acc_t* dk_b, acc_t* dq_t) {
    tile_gemm<acc_t>(nk, D, nq, acc_t(1), p, ldk, true, doa + i0 * lddo, lddo, true, dv_b, D);
    tile_gemm<acc_t>(nk, D, nq, scale, ds, ldk, true, qa + i0 * ldq, ldq, true, dk_b, D);
    tile_gemm<acc_t>(nq, D, nk, scale, ds, ldk, false, kb, ldkb, true, dq_t, D);
  }
};

template <typename scalar_t>
struct BackwardTiles<scalar_t, true> {
  using bf16 = c10::BFloat16;
  int64_t D, ldk, bq;
  // pairs: Q and dO as pairs of rows (ceil(max_q / 2) x D); K_b^T and V_b^T (ceil(D / 2) x ldk); K_b as pairs of
  // rows (ceil(ldk / 2) x D); P and dS rounded, as pairs of rows (ceil(bq / 2) x ldk)
  Buffer<uint32_t> qp, dop, kp, vp, kr, pp, dsp;
  Buffer<bf16> p_rows, ds_rows;  // P and dS (bq x ldk), rounded to bfloat16
  const bf16 *qa = nullptr, *doa = nullptr;
  int64_t ldq = 0, lddo = 0;
  BackwardTiles(int64_t D, int64_t max_q, int64_t bq, int64_t ldk)
      : D(D), ldk(ldk), bq(bq), qp((max_q + 1) / 2 * D), dop((max_q + 1) / 2 * D), kp((D + 1) / 2 * ldk),
        vp((D + 1) / 2 * ldk), kr((ldk + 1) / 2 * D), pp((bq + 1) / 2 * ldk), dsp((bq + 1) / 2 * ldk),
        p_rows(bq * ldk), ds_rows(bq * ldk) {}
  void load_head(const bf16* q, int64_t q_ld, const bf16* dout, int64_t do_ld, int64_t Lq) {
    qa = q;
    ldq = q_ld;
    doa = dout;
    lddo = do_ld;
    pack_row_pairs(q, Lq, D, q_ld, qp.data(), D);
    pack_row_pairs(dout, Lq, D, do_ld, dop.data(), D);
  }
  void load_block(const bf16* k, int64_t k_ld, const bf16* v, int64_t v_ld, int64_t nk) {
    pack_column_pairs(k, nk, D, k_ld, kp.data(), ldk);
    pack_column_pairs(v, nk, D, v_ld, vp.data(), ldk);
    pack_row_pairs(k, nk, D, k_ld, kr.data(), D);
  }
  void scores(int64_t i0, int64_t nq, int64_t nk, float scale, float* p) {
    tile_gemm_bf16(nq, nk, D, scale, qa + i0 * ldq, ldq, kp.data(), ldk, false, p, ldk);
  }
  void dprobs(int64_t i0, int64_t nq, int64_t nk, float* dp) {
    tile_gemm_bf16(nq, nk, D, 1.0f, doa + i0 * lddo, lddo, vp.data(), ldk, false, dp, ldk);
  }
  // i0 is even (a multiple of kBlockQ): row i0 of Q and dO begins pair row i0 / 2.
  void add_grads(int64_t i0, int64_t nq, int64_t nk, float scale, const float* p, const float* ds, float* dv_b,
                 float* dk_b, float* dq_t) {
    // P and dS rounded row by row (vectorized), then interleaved as pairs of rows: P^T and dS^T are the A operands
    // of dV and dK, read a step (a pair of queries) at a time (a_pairs), so nothing is transposed; dS's rows are
    // also dQ's A operand as they are.
    for (int64_t r = 0; r < nq; ++r) {
      convert_row(p + r * ldk, p_rows.data() + r * ldk, nk);
      convert_row(ds + r * ldk, ds_rows.data() + r * ldk, nk);
    }
    pack_row_pairs(p_rows.data(), nq, nk, ldk, pp.data(), ldk);
    pack_row_pairs(ds_rows.data(), nq, nk, ldk, dsp.data(), ldk);
    const auto* p_pairs = reinterpret_cast<const bf16*>(pp.data());
    const auto* ds_pairs = reinterpret_cast<const bf16*>(dsp.data());
    tile_gemm_bf16(nk, D, nq, 1.0f, p_pairs, 2 * ldk, dop.data() + i0 / 2 * D, D, true, dv_b, D, false, true);
    tile_gemm_bf16(nk, D, nq, scale, ds_pairs, 2 * ldk, qp.data() + i0 / 2 * D, D, true, dk_b, D, false, true);
    tile_gemm_bf16(nq, D, nk, scale, ds_rows.data(), ldk, kr.data(), D, true, dq_t, D);
  }
};

// n rows of D elements at row stride ld: every cache line they touch prefetched (into all levels).
template <typename T>
inline void prefetch_rows(const T* first, int64_t n, int64_t ld, int64_t D) {
  constexpr int64_t kLine = 64;
  for (int64_t r = 0; r < n; ++r) {
    const char* row = reinterpret_cast<const char*>(first + r * ld);
    for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(T)); byte += kLine) __builtin_prefetch(row + byte);
  }
}

template <typename scalar_t>
void attention_fwd_kernel(const Rows<const scalar_t> q, const Rows<const scalar_t> k, const Rows<const scalar_t> v,
                          const bool* kpm, const Rows<scalar_t> out, at::opmath_type<scalar_t>* lse, const Seqs s,
                          double dropout_p, double scale, uint64_t seed) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = s.D, group = s.group();
  // Items (b, h, query tile), sequence by sequence: first_item[b] .. first_item[b + 1] are sequence b's.
  std::vector<int64_t> first_item(s.B + 1, 0);
  int64_t max_q = 0, max_k = 0;
  for (int64_t b = 0; b < s.B; ++b) {
    first_item[b + 1] = first_item[b] + s.H * ((s.q_len(b) + kBlockQ - 1) / kBlockQ);
    max_q = std::max(max_q, s.q_len(b));
    max_k = std::max(max_k, s.k_len(b));
  }
  const int64_t bq = std::min(kBlockQ, max_q), ldk = std::max<int64_t>(1, std::min(kBlockK, max_k));
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, first_item[s.B], 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> sc(bq * ldk), o(bq * D), m(bq), l(bq), pad_bias(ldk), drop(ldk);
    ForwardTiles<scalar_t> tiles(D, bq, ldk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const Seq seq{s.q_len(b), s.k_len(b), s.causal};
      const int64_t tiles_q = (seq.Lq + kBlockQ - 1) / kBlockQ, local = item - first_item[b];
      const int64_t h = local / tiles_q, i0 = (local % tiles_q) * kBlockQ, h_kv = h / group;
      const int64_t nq = std::min(kBlockQ, seq.Lq - i0), qs = s.q_start(b), ks = s.k_start(b);
      const bool* pad = kpm ? kpm + b * s.Lk : nullptr;
      tiles.load_q(q.row(b, h, qs + i0), nq, q.sl);
      std::fill(o.begin(), o.end(), acc_t(0));
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), acc_t(0));
      const int64_t tile_key_end = seq.key_end(i0 + nq - 1);
      for (int64_t j0 = 0; j0 < tile_key_end; j0 += kBlockK) {
        const int64_t nk = std::min(kBlockK, tile_key_end - j0);
        tiles.load_block(k.row(b, h_kv, ks + j0), k.sl, v.row(b, h_kv, ks + j0), v.sl, nk);
        if (pad != nullptr) {
          for (int64_t t = 0; t < nk; ++t) pad_bias[t] = pad[j0 + t] ? neg_inf : acc_t(0);
        }
        tiles.scores(nq, nk, static_cast<acc_t>(scale), sc.data());  // S (nq x nk) = scale Q_t K_b^T
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t i = i0 + r;
          acc_t* p = sc.data() + r * ldk;
          acc_t* o_r = o.data() + r * D;
          mask_row(p, nk, pad ? pad_bias.data() : nullptr, seq.key_end(i) - j0, neg_inf);
          const acc_t block_max = vec_max(p, nk);
          if (block_max == neg_inf) {  // nothing visible in this block: contributes nothing
            std::fill(p, p + nk, acc_t(0));
            continue;
          }
          // NaN or +inf among the visible scores: m = NaN from here on, and the row's out and lse are NaN.
          const acc_t m_new = poison_unbounded(nan_max(m[r], block_max));
          const acc_t correction = std::exp(m[r] - m_new);  // 0 while m[r] = -inf
          l[r] = l[r] * correction + exp_sub_sum(p, nk, m_new);
          m[r] = m_new;
          vec_scale(correction, o_r, D);
          if (dropout_p > 0) {
            dropout_factors(seed, static_cast<uint64_t>(s.lse_index(b, h, i) * s.Lk + j0), nk, dropout_p,
                            drop.data());
            vec_mul(p, drop.data(), nk);
          }
        }
        tiles.add_pv(nq, nk, sc.data(), o.data());  // O (nq x D) += P (nq x nk) V_b (nk x D)
      }
      for (int64_t r = 0; r < nq; ++r) {
        const int64_t i = i0 + r;
        scalar_t* out_i = out.row(b, h, qs + i);
        acc_t* o_r = o.data() + r * D;
        acc_t& lse_i = lse[s.lse_index(b, h, i)];
        if (l[r] == acc_t(0)) {  // no visible key: zeros, never NaN
          std::fill(out_i, out_i + D, scalar_t(0));
          lse_i = neg_inf;
        } else {
          vec_scale(acc_t(1) / l[r], o_r, D);
          convert_row(o_r, out_i, D);
          lse_i = m[r] + std::log(l[r]);
        }
      }
    }
  });
}

template <typename scalar_t>
void attention_bwd_kernel(const Rows<const scalar_t> dout, const Rows<const scalar_t> q, const Rows<const scalar_t> k,
                          const Rows<const scalar_t> v, const Rows<const scalar_t> out,
                          const at::opmath_type<scalar_t>* lse, const bool* kpm, const Rows<scalar_t> dq,
                          const Rows<scalar_t> dk, const Rows<scalar_t> dv, const Seqs s, double dropout_p,
                          double scale, uint64_t seed) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = s.D, group = s.group();
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const acc_t scale_acc = static_cast<acc_t>(scale);
  int64_t max_q = 0, max_k = 0;
  for (int64_t b = 0; b < s.B; ++b) {
    max_q = std::max(max_q, s.q_len(b));
    max_k = std::max(max_k, s.k_len(b));
  }
  const int64_t bq = std::min(kBlockQ, max_q), ldk = std::max<int64_t>(1, std::min(kBlockK, max_k));
  // Items (b, h_kv); each thread takes a range of about equal cost.
  const int64_t items = s.B * s.H_kv, threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  const std::vector<int64_t> ranges = split_by_cost(items, threads, [&](int64_t item) {
    const int64_t b = item / s.H_kv;
    return static_cast<double>(group) * static_cast<double>(s.q_len(b) + 1) * static_cast<double>(s.k_len(b) + 1);
  });
  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    Buffer<acc_t> dq_acc(max_q * D), delta(max_q), o_row(D), do_row(D), dk_acc(max_k * D), dv_acc(max_k * D);
    Buffer<acc_t> p(bq * ldk), dp(bq * ldk), pad_bias(ldk), drop(ldk);
    BackwardTiles<scalar_t> tiles(D, max_q, bq, ldk);
    for (int64_t item = ranges[t_begin]; item < ranges[t_end]; ++item) {
      const int64_t b = item / s.H_kv, h_kv = item % s.H_kv;
      if (item + 1 < ranges[t_end]) {  // the next item's inputs on their way into the caches
        const int64_t nb = (item + 1) / s.H_kv, nh = (item + 1) % s.H_kv, nq = s.q_len(nb), nk = s.k_len(nb);
        for (int64_t h = nh * group; h < (nh + 1) * group; ++h) {
          prefetch_rows(q.row(nb, h, s.q_start(nb)), nq, q.sl, D);
          prefetch_rows(dout.row(nb, h, s.q_start(nb)), nq, dout.sl, D);
          prefetch_rows(out.row(nb, h, s.q_start(nb)), nq, out.sl, D);
        }
        prefetch_rows(k.row(nb, nh, s.k_start(nb)), nk, k.sl, D);
        prefetch_rows(v.row(nb, nh, s.k_start(nb)), nk, v.sl, D);
      }
      const Seq seq{s.q_len(b), s.k_len(b), s.causal};
      const int64_t Lq = seq.Lq, Lk = seq.Lk, qs = s.q_start(b), ks = s.k_start(b);
      const bool* pad = kpm ? kpm + b * s.Lk : nullptr;
      // Keys no query can see (past the causal limit of the last row) get zero gradients.
      const int64_t all_key_end = Lq > 0 ? seq.key_end(Lq - 1) : 0;
      std::fill(dk_acc.begin(), dk_acc.begin() + all_key_end * D, acc_t(0));
      std::fill(dv_acc.begin(), dv_acc.begin() + all_key_end * D, acc_t(0));
      for (int64_t h = h_kv * group; h < (h_kv + 1) * group; ++h) {  // the query heads reading this kv head
        tiles.load_head(q.row(b, h, qs), q.sl, dout.row(b, h, qs), dout.sl, Lq);
        for (int64_t i = 0; i < Lq; ++i) {  // D_i = dO_i . O_i
          delta[i] = vec_dot(as_acc(dout.row(b, h, qs + i), D, do_row), as_acc(out.row(b, h, qs + i), D, o_row),
                             D);
        }
        std::fill(dq_acc.begin(), dq_acc.begin() + Lq * D, acc_t(0));
        for (int64_t j0 = 0; j0 < all_key_end; j0 += kBlockK) {
          const int64_t nk = std::min(kBlockK, all_key_end - j0);
          tiles.load_block(k.row(b, h_kv, ks + j0), k.sl, v.row(b, h_kv, ks + j0), v.sl, nk);
          if (pad != nullptr) {
            for (int64_t t = 0; t < nk; ++t) pad_bias[t] = pad[j0 + t] ? neg_inf : acc_t(0);
          }
          acc_t* dk_b = dk_acc.data() + j0 * D;
          acc_t* dv_b = dv_acc.data() + j0 * D;
          // Query tiles that can see some key of this block (causal: rows before first_query see none).
          for (int64_t i0 = seq.first_query(j0) / kBlockQ * kBlockQ; i0 < Lq; i0 += kBlockQ) {
            const int64_t nq = std::min(kBlockQ, Lq - i0);
            tiles.scores(i0, nq, nk, scale_acc, p.data());  // S = scale Q_t K_b^T
            tiles.dprobs(i0, nq, nk, dp.data());            // dO_t V_b^T
            for (int64_t r = 0; r < nq; ++r) {
              const int64_t i = i0 + r;
              acc_t* p_r = p.data() + r * ldk;
              acc_t* dp_r = dp.data() + r * ldk;
              const acc_t lse_i = lse[s.lse_index(b, h, i)];
              if (lse_i == neg_inf) {  // row saw nothing in the forward: no gradient (NaN lse: NaN gradient)
                std::fill(p_r, p_r + nk, acc_t(0));
                std::fill(dp_r, dp_r + nk, acc_t(0));
                continue;
              }
              mask_row(p_r, nk, pad ? pad_bias.data() : nullptr, seq.key_end(i) - j0, neg_inf);
              exp_sub_sum(p_r, nk, lse_i);  // P = e^(S - lse), masked -> 0
              if (dropout_p > 0) {
                dropout_factors(seed, static_cast<uint64_t>(s.lse_index(b, h, i) * s.Lk + j0), nk, dropout_p,
                                drop.data());
                vec_mul(dp_r, drop.data(), nk);  // dP r
              }
              // dS = P (dP r - D_i), kept in dp; P r (for dV) kept in p.
              using Vec = at::vec::Vectorized<acc_t>;
              const Vec vdelta(delta[i]);
              int64_t t = 0;
              for (; t + Vec::size() <= nk; t += Vec::size()) {
                (Vec::loadu(p_r + t) * (Vec::loadu(dp_r + t) - vdelta)).store(dp_r + t);
              }
              for (; t < nk; ++t) dp_r[t] = p_r[t] * (dp_r[t] - delta[i]);
              if (dropout_p > 0) vec_mul(p_r, drop.data(), nk);
            }
            // dV_b (nk x D) += (P r)^T dO_t ; dK_b += scale dS^T Q_t ; dQ_t += scale dS K_b
            tiles.add_grads(i0, nq, nk, scale_acc, p.data(), dp.data(), dv_b, dk_b, dq_acc.data() + i0 * D);
          }
        }
        for (int64_t i = 0; i < Lq; ++i) convert_row(dq_acc.data() + i * D, dq.row(b, h, qs + i), D);
      }
      for (int64_t j = 0; j < Lk; ++j) {
        scalar_t* dk_j = dk.row(b, h_kv, ks + j);
        scalar_t* dv_j = dv.row(b, h_kv, ks + j);
        if (j < all_key_end) {
          convert_row(dk_acc.data() + j * D, dk_j, D);
          convert_row(dv_acc.data() + j * D, dv_j, D);
        } else {
          std::fill(dk_j, dk_j + D, scalar_t(0));
          std::fill(dv_j, dv_j + D, scalar_t(0));
        }
      }
    }
  });
}

// Rows of a packed (T, H, D) tensor (attention_varlen) as a Rows of one batch: (0, h, t) is row t, head h.
template <typename T>
Rows<T> packed_rows_of(const Tensor& t) {
  return Rows<T>{t.data_ptr<std::remove_const_t<T>>(), 0, t.stride(1), t.stride(0)};
}

// Rows of a dense (B, H, L, D) tensor, or of a packed (T, H, D) one.
template <bool packed, typename T>
Rows<T> rows_for(const Tensor& t) {
  if constexpr (packed) {
    return packed_rows_of<T>(t);
  } else {
    return rows_of<T>(t);
  }
}

template <bool packed>
inline void run_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const bool* kpm, const Tensor& out, const Tensor& lse,
             const Seqs& s, double dropout_p, double scale, const c10::optional<Tensor>& seed) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "fastformer_attention_fwd_cpu", [&] {
    attention_fwd_kernel<scalar_t>(rows_for<packed, const scalar_t>(q),
                                   rows_for<packed, const scalar_t>(k),
                                   rows_for<packed, const scalar_t>(v), kpm,
                                   rows_for<packed, scalar_t>(out),
                                   lse.data_ptr<at::opmath_type<scalar_t>>(), s, dropout_p, scale, seed_value(seed));
  });
}

template <bool packed>
inline void run_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
             const Tensor& lse, const bool* kpm, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Seqs& s,
             double dropout_p, double scale, const c10::optional<Tensor>& seed) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "fastformer_attention_bwd_cpu", [&] {
    attention_bwd_kernel<scalar_t>(
        rows_for<packed, const scalar_t>(dout), rows_for<packed, const scalar_t>(q),
        rows_for<packed, const scalar_t>(k), rows_for<packed, const scalar_t>(v),
        rows_for<packed, const scalar_t>(out), lse.data_ptr<at::opmath_type<scalar_t>>(), kpm,
        rows_for<packed, scalar_t>(dq), rows_for<packed, scalar_t>(dk),
        rows_for<packed, scalar_t>(dv), s, dropout_p, scale, seed_value(seed));
  });
}

}  // namespace fastformer::cpu::attention_kernels
