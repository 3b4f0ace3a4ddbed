// Fused masked scaled dot-product attention on the CPU, forward and backward (FlashAttention-2's
// algorithm, arranged for CPU caches and ATen's at::vec SIMD).
//
// Forward, one work item per (batch, head, tile of kBlockQ query rows), spread over threads with
// at::parallel_for:
//   stage Q_tile * scale in a float buffer (kBlockQ x Dp, Dp = D rounded up to the SIMD width)
//   for each block of kBlockK keys (blocks past the tile's causal limit are skipped):
//     stage K_blk transposed (D x kBlockK) and V_blk (kBlockK x Dp) as float
//     per query row: s = q_i K_blk^T (kBlockK SIMD lanes, D fused multiply-adds each),
//       masked keys -> -inf, online softmax: m' = max(m, max s), l = l e^(m - m') + sum e^(s - m'),
//       acc = acc e^(m - m') + sum_j dropout_j e^(s_j - m') v_j
//   out_i = acc / l, lse_i = m + log l; a row with no visible key gives out 0, lse -inf.
// At most one block of scores (kBlockK floats) per thread exists at a time; no L x L matrix.
// Memory traffic: Q, O once; K, V once per query tile (ceil(Lq / kBlockQ) times).
//
// Backward, one work item per (batch, head), so dq, dk, dv accumulate without atomics:
//   D_i = dO_i . O_i; for each key block, for each query row: recompute p = e^(s - lse_i) from the
//   saved logsumexp, dp = dO_i V_blk^T, then with the forward's dropout factors r (regenerated from
//   the seed): dV_j += p_j r_j dO_i, ds_j = p_j (dp_j r_j - D_i), dQ_i += scale ds_j k_j,
//   dK_j += scale ds_j q_i.
// Dropout: element (b, h, i, j) of the probability matrix is flat index ((b H + h) Lq + i) Lk + j in
// the Philox stream of csrc/philox.h, the same on every backend.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_ops.h"
#include "cpu/dropout.h"

namespace fastformer::cpu {
namespace {

constexpr int64_t kBlockQ = 32;  // query rows per forward work item
constexpr int64_t kBlockK = 64;  // keys staged per block

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct AttnDims {
  int64_t B, H, Lq, Lk, D, Dp;
  bool causal;
  // Keys [0, key_end(i)) can be visible to query row i (bottom-right causal alignment).
  int64_t key_end(int64_t i) const {
    return causal ? std::min<int64_t>(Lk, std::max<int64_t>(0, i + Lk - Lq + 1)) : Lk;
  }
};

// out[0:kBlockK] = sum_d x[d] * bt[d * kBlockK + 0:kBlockK]: one row times a transposed block,
// kBlockK / Vec::size() accumulators kept in registers.
template <typename acc_t>
inline void row_times_block(const acc_t* x, const acc_t* bt, int64_t D, acc_t* out) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t kLanes = kBlockK / Vec::size();
  Vec acc[kLanes];
  for (int64_t u = 0; u < kLanes; ++u) acc[u] = Vec(acc_t(0));
  for (int64_t d = 0; d < D; ++d) {
    const Vec xd(x[d]);
    const acc_t* row = bt + d * kBlockK;
    for (int64_t u = 0; u < kLanes; ++u) acc[u] = at::vec::fmadd(xd, Vec::loadu(row + u * Vec::size()), acc[u]);
  }
  for (int64_t u = 0; u < kLanes; ++u) acc[u].store(out + u * Vec::size());
}

// Stages rows [j0, j0 + nk) of one (b, h)'s K or V: a transposed copy (D x kBlockK) and/or a
// row-major copy (kBlockK x Dp), either may be nullptr; lanes past nk are zero.
template <typename scalar_t, typename acc_t>
void stage_keys(const scalar_t* src, int64_t j0, int64_t nk, const AttnDims& s, acc_t* transposed, acc_t* rows) {
  if (transposed != nullptr) std::fill(transposed, transposed + s.D * kBlockK, acc_t(0));
  if (rows != nullptr) std::fill(rows, rows + kBlockK * s.Dp, acc_t(0));
  for (int64_t t = 0; t < nk; ++t) {
    const scalar_t* row = src + (j0 + t) * s.D;
    if (transposed != nullptr) {
      for (int64_t d = 0; d < s.D; ++d) transposed[d * kBlockK + t] = static_cast<acc_t>(row[d]);
    }
    if (rows != nullptr) convert_row(row, rows + t * s.Dp, s.D);
  }
}

// visible[t] = key j0 + t exists (t < nk) and is not padding.
inline void key_visibility(const bool* pad, int64_t j0, int64_t nk, char* visible) {
  for (int64_t t = 0; t < kBlockK; ++t) visible[t] = t < nk && (pad == nullptr || !pad[j0 + t]);
}

template <typename scalar_t>
void attention_fwd_kernel(const scalar_t* q, const scalar_t* k, const scalar_t* v, const bool* kpm,
                          scalar_t* out, at::opmath_type<scalar_t>* lse, const AttnDims s, double dropout_p,
                          double scale, uint64_t seed) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t D = s.D, Dp = s.Dp;
  const int64_t tiles = (s.Lq + kBlockQ - 1) / kBlockQ;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, s.B * s.H * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> qs(kBlockQ * Dp), acc(kBlockQ * Dp), kt(D * kBlockK), vb(kBlockK * Dp);
    std::vector<acc_t> p(kBlockK), drop(kBlockK), m(kBlockQ), l(kBlockQ);
    std::vector<char> visible(kBlockK);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / tiles, i0 = (item % tiles) * kBlockQ, b = bh / s.H;
      const int64_t nq = std::min(kBlockQ, s.Lq - i0);
      const bool* pad = kpm ? kpm + b * s.Lk : nullptr;
      std::fill(qs.begin(), qs.end(), acc_t(0));
      for (int64_t r = 0; r < nq; ++r) {
        convert_row(q + (bh * s.Lq + i0 + r) * D, qs.data() + r * Dp, D);
        vec_scale(static_cast<acc_t>(scale), qs.data() + r * Dp, D);
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), acc_t(0));
      const int64_t tile_key_end = s.key_end(i0 + nq - 1);
      for (int64_t j0 = 0; j0 < tile_key_end; j0 += kBlockK) {
        const int64_t nk = std::min(kBlockK, tile_key_end - j0);
        stage_keys(k + bh * s.Lk * D, j0, nk, s, kt.data(), static_cast<acc_t*>(nullptr));
        stage_keys(v + bh * s.Lk * D, j0, nk, s, static_cast<acc_t*>(nullptr), vb.data());
        key_visibility(pad, j0, nk, visible.data());
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t i = i0 + r, ke = s.key_end(i);
          if (ke <= j0) continue;
          row_times_block(qs.data() + r * Dp, kt.data(), D, p.data());
          for (int64_t t = 0; t < kBlockK; ++t) {
            if (!visible[t] || j0 + t >= ke) p[t] = neg_inf;
          }
          const acc_t block_max = vec_max(p.data(), kBlockK);
          if (block_max == neg_inf) continue;
          const acc_t m_new = std::max(m[r], block_max);
          const acc_t correction = std::exp(m[r] - m_new);  // 0 when m[r] = -inf
          for (int64_t t = 0; t < kBlockK; t += Vec::size()) {
            (Vec::loadu(p.data() + t) - Vec(m_new)).exp().store(p.data() + t);
          }
          l[r] = l[r] * correction + vec_sum(p.data(), kBlockK);
          m[r] = m_new;
          acc_t* acc_r = acc.data() + r * Dp;
          vec_scale(correction, acc_r, Dp);
          if (dropout_p > 0) {
            dropout_factors(seed, static_cast<uint64_t>((bh * s.Lq + i) * s.Lk + j0), nk, dropout_p, drop.data());
            for (int64_t t = 0; t < nk; ++t) p[t] *= drop[t];
          }
          for (int64_t t = 0; t < nk; ++t) {
            if (p[t] != acc_t(0)) vec_axpy(p[t], vb.data() + t * Dp, acc_r, Dp);
          }
        }
      }
      for (int64_t r = 0; r < nq; ++r) {
        const int64_t i = i0 + r;
        scalar_t* out_i = out + (bh * s.Lq + i) * D;
        acc_t* acc_r = acc.data() + r * Dp;
        if (l[r] == acc_t(0)) {  // no visible key: zeros, never NaN
          std::fill(out_i, out_i + D, scalar_t(0));
          lse[bh * s.Lq + i] = neg_inf;
        } else {
          vec_scale(acc_t(1) / l[r], acc_r, D);
          convert_row(acc_r, out_i, D);
          lse[bh * s.Lq + i] = m[r] + std::log(l[r]);
        }
      }
    }
  });
}

template <typename scalar_t>
void attention_bwd_kernel(const scalar_t* dout, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                          const scalar_t* out, const at::opmath_type<scalar_t>* lse, const bool* kpm,
                          scalar_t* dq, scalar_t* dk, scalar_t* dv, const AttnDims s, double dropout_p,
                          double scale, uint64_t seed) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = s.D, Dp = s.Dp, Lq = s.Lq, Lk = s.Lk;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const acc_t scale_acc = static_cast<acc_t>(scale);
  at::parallel_for(0, s.B * s.H, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> qs(Lq * Dp), dos(Lq * Dp), dqs(Lq * Dp), delta(Lq), orow(Dp);
    std::vector<acc_t> kt(D * kBlockK), vt(D * kBlockK), kb(kBlockK * Dp), dkb(kBlockK * Dp), dvb(kBlockK * Dp);
    std::vector<acc_t> p(kBlockK), dp(kBlockK), drop(kBlockK, acc_t(1));
    std::vector<char> visible(kBlockK);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.H;
      const bool* pad = kpm ? kpm + b * Lk : nullptr;
      const acc_t* lse_bh = lse + bh * Lq;
      std::fill(qs.begin(), qs.end(), acc_t(0));
      std::fill(dos.begin(), dos.end(), acc_t(0));
      std::fill(dqs.begin(), dqs.end(), acc_t(0));
      for (int64_t i = 0; i < Lq; ++i) {
        convert_row(q + (bh * Lq + i) * D, qs.data() + i * Dp, D);
        vec_scale(scale_acc, qs.data() + i * Dp, D);
        convert_row(dout + (bh * Lq + i) * D, dos.data() + i * Dp, D);
        convert_row(out + (bh * Lq + i) * D, orow.data(), D);
        delta[i] = vec_dot(dos.data() + i * Dp, orow.data(), D);  // D_i = dO_i . O_i
      }
      const int64_t all_key_end = s.key_end(Lq - 1);
      for (int64_t j0 = 0; j0 < all_key_end; j0 += kBlockK) {
        const int64_t nk = std::min(kBlockK, all_key_end - j0);
        stage_keys(k + bh * Lk * D, j0, nk, s, kt.data(), kb.data());
        stage_keys(v + bh * Lk * D, j0, nk, s, vt.data(), static_cast<acc_t*>(nullptr));
        key_visibility(pad, j0, nk, visible.data());
        std::fill(dkb.begin(), dkb.end(), acc_t(0));
        std::fill(dvb.begin(), dvb.end(), acc_t(0));
        for (int64_t i = 0; i < Lq; ++i) {
          const int64_t ke = s.key_end(i);
          if (ke <= j0 || lse_bh[i] == neg_inf) continue;
          const acc_t* q_i = qs.data() + i * Dp;
          const acc_t* do_i = dos.data() + i * Dp;
          row_times_block(q_i, kt.data(), D, p.data());
          using Vec = at::vec::Vectorized<acc_t>;
          for (int64_t t = 0; t < kBlockK; t += Vec::size()) {
            (Vec::loadu(p.data() + t) - Vec(lse_bh[i])).exp().store(p.data() + t);
          }
          for (int64_t t = 0; t < kBlockK; ++t) {
            if (!visible[t] || j0 + t >= ke) p[t] = acc_t(0);
          }
          row_times_block(do_i, vt.data(), D, dp.data());
          if (dropout_p > 0) {
            dropout_factors(seed, static_cast<uint64_t>((bh * Lq + i) * Lk + j0), nk, dropout_p, drop.data());
          }
          acc_t* dq_i = dqs.data() + i * Dp;
          for (int64_t t = 0; t < nk; ++t) {
            if (p[t] == acc_t(0)) continue;
            const acc_t p_dropped = p[t] * drop[t];
            if (p_dropped != acc_t(0)) vec_axpy(p_dropped, do_i, dvb.data() + t * Dp, Dp);
            const acc_t ds = p[t] * (dp[t] * drop[t] - delta[i]);
            vec_axpy(ds * scale_acc, kb.data() + t * Dp, dq_i, Dp);
            vec_axpy(ds, q_i, dkb.data() + t * Dp, Dp);  // q_i is already scaled
          }
        }
        for (int64_t t = 0; t < nk; ++t) {
          convert_row(dkb.data() + t * Dp, dk + (bh * Lk + j0 + t) * D, D);
          convert_row(dvb.data() + t * Dp, dv + (bh * Lk + j0 + t) * D, D);
        }
      }
      // Keys no query can see (past the causal limit of the last row) get zero gradients.
      std::fill(dk + (bh * Lk + all_key_end) * D, dk + (bh + 1) * Lk * D, scalar_t(0));
      std::fill(dv + (bh * Lk + all_key_end) * D, dv + (bh + 1) * Lk * D, scalar_t(0));
      for (int64_t i = 0; i < Lq; ++i) convert_row(dqs.data() + i * Dp, dq + (bh * Lq + i) * D, D);
    }
  });
}

AttnDims check_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                         const c10::optional<Tensor>& key_padding_mask, bool causal, double dropout_p) {
  check_cpu_contiguous(q, "q");
  check_cpu_contiguous(k, "k");
  check_cpu_contiguous(v, "v");
  check_float_dtype(q, "q");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "fastformer attention: q, k, v must be 4-D (B, H, L, D)");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "fastformer attention: q, k, v must share a dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "fastformer attention: k and v must have the same shape");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "fastformer attention: q (B, H, Lq, D) and k (B, H, Lk, D) disagree");
  check_dropout(dropout_p);
  AttnDims s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), 0, causal};
  s.Dp = round_up(s.D, at::vec::Vectorized<double>::size() * 2);  // a multiple of every SIMD width used
  if (key_padding_mask.has_value()) {
    const Tensor& m = *key_padding_mask;
    check_cpu_contiguous(m, "key_padding_mask");
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 2 && m.size(0) == s.B && m.size(1) == s.Lk,
                "fastformer attention: key_padding_mask must be bool (B, Lk)");
  }
  return s;
}

}  // namespace

std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const c10::optional<Tensor>& key_padding_mask, bool causal,
                                         double dropout_p, double scale, int64_t seed) {
  const AttnDims s = check_attention(q, k, v, key_padding_mask, causal, dropout_p);
  Tensor out = at::empty_like(q);
  Tensor lse = at::empty({s.B, s.H, s.Lq}, q.options().dtype(at::toOpMathType(q.scalar_type())));
  if (q.numel() == 0) return {out, lse.fill_(-std::numeric_limits<double>::infinity())};
  const bool* kpm = key_padding_mask.has_value() ? key_padding_mask->data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "fastformer_attention_fwd_cpu", [&] {
    attention_fwd_kernel<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), kpm,
                                   out.data_ptr<scalar_t>(), lse.data_ptr<at::opmath_type<scalar_t>>(), s,
                                   dropout_p, scale, static_cast<uint64_t>(seed));
  });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                 const Tensor& v, const Tensor& out, const Tensor& lse,
                                                 const c10::optional<Tensor>& key_padding_mask, bool causal,
                                                 double dropout_p, double scale, int64_t seed) {
  const AttnDims s = check_attention(q, k, v, key_padding_mask, causal, dropout_p);
  check_cpu_contiguous(dout, "dout");
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(lse, "lse");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "fastformer attention: dout/out must match q");
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "fastformer attention: dout/out must have q's dtype");
  TORCH_CHECK(lse.scalar_type() == at::toOpMathType(q.scalar_type()) && lse.dim() == 3 && lse.size(0) == s.B &&
                  lse.size(1) == s.H && lse.size(2) == s.Lq,
              "fastformer attention: lse must be (B, H, Lq) in the accumulation dtype");
  Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  if (q.numel() == 0 || k.numel() == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  const bool* kpm = key_padding_mask.has_value() ? key_padding_mask->data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "fastformer_attention_bwd_cpu", [&] {
    attention_bwd_kernel<scalar_t>(dout.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                                   v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                   lse.data_ptr<at::opmath_type<scalar_t>>(), kpm, dq.data_ptr<scalar_t>(),
                                   dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), s, dropout_p, scale,
                                   static_cast<uint64_t>(seed));
  });
  return {dq, dk, dv};
}

}  // namespace fastformer::cpu
