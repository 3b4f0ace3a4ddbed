// y = LayerNorm(residual + dropout(x + x_bias)) over the last dim on the CPU, forward and backward.
//
// Rows (R rows of N) are spread over threads. Forward, per row, in a thread-local float buffer:
//   s = residual + (x + x_bias) * r   (r = dropout factor from csrc/philox.h, element index row * N + col;
//                             x_bias (N,) optional, upcast once per call), rounded to residual's dtype: the
//                             statistics are those of the s returned
//   mean = sum(s) / N, var = sum((s - mean)^2) / N  (two sweeps over the cached row: no cancellation)
//   y = (s - mean) * rstd * weight + bias,  rstd = 1 / sqrt(var + eps)
// writes y, s (the pre-norm residual stream), mean and rstd (saved for backward), and with a compute dtype
// C (float16/bfloat16) y_c = y rounded to C, from the row while it is in cache (bitwise y.to(C)).
// DRAM traffic: reads x, residual; writes y, s: 4 N sizeof(T) per row (T: residual's dtype; a float16 or
// bfloat16 x beside a float32 residual, autocast's branch, is read as it is and upcast in the row buffer:
// (2 + 3 * 4) N bytes per row), + N sizeof(C) for y_c.
// Backward, per row, with xhat = (s - mean) * rstd and g = (dy + dy_c) * weight (dy_c: grad of y_c, optional):
//   ds_total = rstd * (g - mean(g) - xhat * mean(g * xhat)) + ds   (ds: grad of the s output)
//   dresidual = ds_total, dx = ds_total * r   (dx written in x's dtype, dresidual in s's)
//   dweight = sum_rows (dy + dy_c) * xhat, dbias = sum_rows (dy + dy_c)   (written in weight's dtype)
//   dx_bias = sum_rows dx (the float dx, before its rounding; written in x_bias's dtype)
// dweight/dbias/dx_bias are reduced in two stages without races: rows are cut into at most kPartials fixed
// chunks (independent of the thread count, so results are deterministic), each chunk sums its rows
// into its own float partial (a work buffer), then the partials are summed in chunk order, in place
// (no tensor ops: on tiny inputs a reduction op's dispatch cost more than the whole kernel).
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "cpu/cpu_ops.h"
#include "cpu/dropout.h"

namespace fastformer::cpu {
namespace {

constexpr int64_t kPartials = 64;

// Calls f(x_t()) with the element type x_t of a branch of dtype `branch` beside a stream of scalar_t:
// scalar_t itself, or at::Half / at::BFloat16 beside float (csrc/ops.h lnr_branch_dtype_ok checked which).
template <typename scalar_t, typename F>
void with_branch_type(at::ScalarType branch, const F& f) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (branch == at::kHalf) return f(at::Half());
    if (branch == at::kBFloat16) return f(at::BFloat16());
  }
  f(scalar_t());
}

// scalar_t: residual's (and weight's, y's, s's) element type; x_t: the branch x's, scalar_t or, beside float,
// at::Half / at::BFloat16 (with_branch_type).
// y_c (R, N): the compute-dtype copy of y (at::Half or at::BFloat16 by c_type), or nullptr.
struct ComputeOut {
  void* data = nullptr;
  at::ScalarType type = at::kFloat;
};

// Row r of y_c = row y_row of y (scalar_t, already rounded) converted to the compute dtype: y.to(C) bitwise.
template <typename scalar_t>
void write_compute_row(const ComputeOut& c, const scalar_t* y_row, int64_t r, int64_t N) {
  if (c.type == at::kHalf) {
    convert_row(y_row, static_cast<at::Half*>(c.data) + r * N, N);
  } else {
    convert_row(y_row, static_cast<at::BFloat16*>(c.data) + r * N, N);
  }
}

// x_bias (N,) of any floating dtype as acc_t (into buffer; N elements once per call), or nullptr.
template <typename acc_t>
const acc_t* x_bias_as_acc(const c10::optional<Tensor>& x_bias, Buffer<acc_t>& buffer) {
  if (!x_bias.has_value()) return nullptr;
  const int64_t N = x_bias->numel();
  buffer.resize(N);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_bias->scalar_type(), "fastformer_lnr_x_bias", [&] {
    convert_row(x_bias->data_ptr<scalar_t>(), buffer.data(), N);
  });
  return buffer.data();
}

template <typename scalar_t, typename x_t = scalar_t>
void layer_norm_residual_fwd_kernel(const x_t* x, const scalar_t* residual, const scalar_t* weight,
                                    const scalar_t* bias, const at::opmath_type<scalar_t>* xb, scalar_t* y,
                                    scalar_t* s_out, const ComputeOut& y_c, at::opmath_type<scalar_t>* mean_out,
                                    at::opmath_type<scalar_t>* rstd_out, int64_t R, int64_t N, double eps,
                                    double dropout_p, uint64_t seed) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t grain = std::max<int64_t>(1, 16384 / N);
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> w_buf, b_buf, x_buf, res_buf, s_buf, y_buf, drop(dropout_p > 0 ? N : 0);
    const acc_t* w = as_acc(weight, N, w_buf);
    const acc_t* b = as_acc(bias, N, b_buf);
    for (int64_t r = begin; r < end; ++r) {
      const acc_t* xr = as_acc(x + r * N, N, x_buf);
      const acc_t* res = as_acc(residual + r * N, N, res_buf);
      // Sweep 1: s = residual + (x + x_bias) * dropout, written out; its sum.
      acc_t* s = output_row(s_out + r * N, N, s_buf);
      if (dropout_p > 0) dropout_factors(seed, static_cast<uint64_t>(r * N), N, dropout_p, drop.data());
      Vec vsum(acc_t(0));
      int64_t j = 0;
      for (; j + Vec::size() <= N; j += Vec::size()) {
        Vec xv = Vec::loadu(xr + j);
        if (xb != nullptr) xv = xv + Vec::loadu(xb + j);
        if (dropout_p > 0) xv = xv * Vec::loadu(drop.data() + j);
        const Vec sv = xv + Vec::loadu(res + j);
        sv.store(s + j);
        vsum = vsum + sv;
      }
      acc_t sum = at::vec::vec_reduce_all<acc_t>([](Vec p, Vec q) { return p + q; }, vsum);
      for (; j < N; ++j) {
        const acc_t xv = xb != nullptr ? xr[j] + xb[j] : xr[j];
        s[j] = res[j] + (dropout_p > 0 ? xv * drop[j] : xv);
        sum += s[j];
      }
      if constexpr (!std::is_same_v<scalar_t, acc_t>) {
        // Normalize the s that is returned (rounded to scalar_t), so backward's xhat, rebuilt from the
        // saved s, matches the forward's exactly: with a tiny variance rstd amplifies any mismatch.
        finish_output(s, s_out + r * N, N);
        convert_row(s_out + r * N, s, N);
        sum = vec_sum(s, N);
      }
      // Sweep 2 (cache): variance around the mean (two-pass: no cancellation).
      const acc_t mean = sum / static_cast<acc_t>(N);
      const Vec vmean(mean);
      Vec vvar(acc_t(0));
      for (j = 0; j + Vec::size() <= N; j += Vec::size()) {
        const Vec c = Vec::loadu(s + j) - vmean;
        vvar = at::vec::fmadd(c, c, vvar);
      }
      acc_t var = at::vec::vec_reduce_all<acc_t>([](Vec p, Vec q) { return p + q; }, vvar);
      for (; j < N; ++j) var += (s[j] - mean) * (s[j] - mean);
      const acc_t rstd = acc_t(1) / std::sqrt(var / static_cast<acc_t>(N) + static_cast<acc_t>(eps));
      // Sweep 3: y = (s - mean) * rstd * w + b, written out.
      acc_t* yr = output_row(y + r * N, N, y_buf);
      const Vec vrstd(rstd);
      for (j = 0; j + Vec::size() <= N; j += Vec::size()) {
        const Vec xhat = (Vec::loadu(s + j) - vmean) * vrstd;
        at::vec::fmadd(xhat, Vec::loadu(w + j), Vec::loadu(b + j)).store(yr + j);
      }
      for (; j < N; ++j) yr[j] = (s[j] - mean) * rstd * w[j] + b[j];
      finish_output(yr, y + r * N, N);
      if (y_c.data != nullptr) write_compute_row(y_c, y + r * N, r, N);  // from the rounded y, in cache
      mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  });
}

// dy_c (R, N): the gradient of y_c (at::Half or at::BFloat16 by type), or nullptr.
struct ComputeGrad {
  const void* data = nullptr;
  at::ScalarType type = at::kFloat;
};

// g = dy row + dy_c row (row r), in acc_t: the gradient reaching y and its rounded copy y_c.
template <typename acc_t>
const acc_t* add_compute_grad(const acc_t* g, const ComputeGrad& c, int64_t r, int64_t N, Buffer<acc_t>& c_buf,
                              Buffer<acc_t>& sum_buf) {
  const acc_t* gc = c.type == at::kHalf ? as_acc(static_cast<const at::Half*>(c.data) + r * N, N, c_buf)
                                        : as_acc(static_cast<const at::BFloat16*>(c.data) + r * N, N, c_buf);
  if (static_cast<int64_t>(sum_buf.size()) < N) sum_buf.resize(N);
  using Vec = at::vec::Vectorized<acc_t>;
  int64_t j = 0;
  for (; j + Vec::size() <= N; j += Vec::size()) (Vec::loadu(g + j) + Vec::loadu(gc + j)).store(sum_buf.data() + j);
  for (; j < N; ++j) sum_buf[j] = g[j] + gc[j];
  return sum_buf.data();
}

template <typename scalar_t, typename x_t = scalar_t>
void layer_norm_residual_bwd_kernel(const scalar_t* dy, const ComputeGrad& dy_c, const scalar_t* ds_in,
                                    const scalar_t* s_saved, const scalar_t* weight,
                                    const at::opmath_type<scalar_t>* mean, const at::opmath_type<scalar_t>* rstd,
                                    x_t* dx, scalar_t* dresidual, at::opmath_type<scalar_t>* partial_dw,
                                    at::opmath_type<scalar_t>* partial_db, at::opmath_type<scalar_t>* partial_dxb,
                                    int64_t R, int64_t N, double dropout_p, uint64_t seed) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t chunks = std::min(R, kPartials);
  const int64_t rows_per_chunk = (R + chunks - 1) / chunks;
  // Chunks per task: about 16K elements, as the forward's rows (a parallel region costs more than a few
  // tiny chunks). The chunks are fixed whatever the threads, so this changes no result.
  const int64_t grain = std::max<int64_t>(1, 16384 / (rows_per_chunk * N));
  at::parallel_for(0, chunks, grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> w_buf, dy_buf, dyc_buf, g_buf, s_buf, ds_buf, dres_buf, dx_buf, drop(dropout_p > 0 ? N : 0);
    const acc_t* w = as_acc(weight, N, w_buf);
    for (int64_t c = begin; c < end; ++c) {
      acc_t* dw = partial_dw + c * N;
      acc_t* db = partial_db + c * N;
      acc_t* dxb = partial_dxb != nullptr ? partial_dxb + c * N : nullptr;
      std::fill(dw, dw + N, acc_t(0));
      std::fill(db, db + N, acc_t(0));
      if (dxb != nullptr) std::fill(dxb, dxb + N, acc_t(0));
      for (int64_t r = c * rows_per_chunk; r < std::min(R, (c + 1) * rows_per_chunk); ++r) {
        const acc_t* g = as_acc(dy + r * N, N, dy_buf);
        if (dy_c.data != nullptr) g = add_compute_grad(g, dy_c, r, N, dyc_buf, g_buf);
        const acc_t* s = as_acc(s_saved + r * N, N, s_buf);
        const Vec vmu(mean[r]), vrs(rstd[r]);
        // Sweep 1: xhat = (s - mean) rstd; sums of dy w and dy w xhat; dweight += dy xhat, dbias += dy.
        Vec vsum_g(acc_t(0)), vsum_gx(acc_t(0));
        int64_t j = 0;
        for (; j + Vec::size() <= N; j += Vec::size()) {
          const Vec xhat = (Vec::loadu(s + j) - vmu) * vrs;
          const Vec gv = Vec::loadu(g + j);
          const Vec gw = gv * Vec::loadu(w + j);
          vsum_g = vsum_g + gw;
          vsum_gx = at::vec::fmadd(gw, xhat, vsum_gx);
          at::vec::fmadd(gv, xhat, Vec::loadu(dw + j)).store(dw + j);
          (Vec::loadu(db + j) + gv).store(db + j);
        }
        auto add = [](Vec p, Vec q) { return p + q; };
        acc_t sum_g = at::vec::vec_reduce_all<acc_t>(add, vsum_g);
        acc_t sum_gx = at::vec::vec_reduce_all<acc_t>(add, vsum_gx);
        for (; j < N; ++j) {
          const acc_t xhat = (s[j] - mean[r]) * rstd[r];
          sum_g += g[j] * w[j];
          sum_gx += g[j] * w[j] * xhat;
          dw[j] += g[j] * xhat;
          db[j] += g[j];
        }
        // Sweep 2: ds = rstd (dy w - mean(dy w) - xhat mean(dy w xhat)) + ds_in; dresidual = ds, dx = ds r.
        const acc_t mean_g = sum_g / static_cast<acc_t>(N), mean_gx = sum_gx / static_cast<acc_t>(N);
        const acc_t* dsi = ds_in != nullptr ? as_acc(ds_in + r * N, N, ds_buf) : nullptr;
        acc_t* dres = output_row(dresidual + r * N, N, dres_buf);
        acc_t* dxr = output_row(dx + r * N, N, dx_buf);
        if (dropout_p > 0) dropout_factors(seed, static_cast<uint64_t>(r * N), N, dropout_p, drop.data());
        const Vec vmean_g(mean_g), vmean_gx(mean_gx);
        for (j = 0; j + Vec::size() <= N; j += Vec::size()) {
          const Vec xhat = (Vec::loadu(s + j) - vmu) * vrs;
          const Vec gw = Vec::loadu(g + j) * Vec::loadu(w + j);
          Vec d = vrs * (gw - vmean_g - xhat * vmean_gx);
          if (dsi != nullptr) d = d + Vec::loadu(dsi + j);
          d.store(dres + j);
          if (dropout_p > 0) d = d * Vec::loadu(drop.data() + j);
          d.store(dxr + j);
          if (dxb != nullptr) (Vec::loadu(dxb + j) + d).store(dxb + j);
        }
        for (; j < N; ++j) {
          const acc_t xhat = (s[j] - mean[r]) * rstd[r];
          acc_t d = rstd[r] * (g[j] * w[j] - mean_g - xhat * mean_gx);
          if (dsi != nullptr) d += dsi[j];
          dres[j] = d;
          dxr[j] = dropout_p > 0 ? d * drop[j] : d;
          if (dxb != nullptr) dxb[j] += dxr[j];
        }
        finish_output(dres, dresidual + r * N, N);
        finish_output(dxr, dx + r * N, N);
      }
    }
  });
}

// out[j] = sum over c = 0, 1, ..., used - 1 (in that order) of partial[c * N + j].
template <typename acc_t>
void sum_partials(const acc_t* partial, int64_t used, int64_t N, acc_t* out) {
  using Vec = at::vec::Vectorized<acc_t>;
  int64_t j = 0;
  for (; j + Vec::size() <= N; j += Vec::size()) {
    Vec v(acc_t(0));
    for (int64_t c = 0; c < used; ++c) v = v + Vec::loadu(partial + c * N + j);
    v.store(out + j);
  }
  for (; j < N; ++j) {
    acc_t v = 0;
    for (int64_t c = 0; c < used; ++c) v += partial[c * N + j];
    out[j] = v;
  }
}

// The compute-dtype output: (R..., N) in compute_dtype, or empty (0,) when compute_dtype is the stream's own.
Tensor compute_output(const Tensor& residual, at::ScalarType compute_dtype) {
  const bool wanted = compute_dtype != residual.scalar_type();
  return wanted ? at::empty_like(residual, residual.options().dtype(compute_dtype))
                : at::empty({0}, residual.options());
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layer_norm_residual_fwd(
    const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias, double eps, double dropout_p,
    const c10::optional<Tensor>& seed, const c10::optional<Tensor>& x_bias, at::ScalarType compute_dtype) {
  const int64_t N = x.size(-1), R = x.numel() / N;
  auto stat_shape = x.sizes().vec();
  stat_shape.pop_back();
  const auto stat_opts = residual.options().dtype(at::toOpMathType(residual.scalar_type()));
  Tensor y = at::empty_like(residual), s = at::empty_like(residual);
  Tensor mean = at::empty(stat_shape, stat_opts), rstd = at::empty(stat_shape, stat_opts);
  Tensor y_c = compute_output(residual, compute_dtype);
  if (R == 0) return {y, s, mean, rstd, y_c};
  const ComputeOut c_out{compute_dtype != residual.scalar_type() ? y_c.data_ptr() : nullptr, compute_dtype};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, residual.scalar_type(), "fastformer_lnr_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Buffer<acc_t> xb_buf;
    const acc_t* xb = x_bias_as_acc(x_bias, xb_buf);
    with_branch_type<scalar_t>(x.scalar_type(), [&](auto branch) {
      using x_t = decltype(branch);
      layer_norm_residual_fwd_kernel<scalar_t, x_t>(
          x.data_ptr<x_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), bias.data_ptr<scalar_t>(),
          xb, y.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(), c_out, mean.data_ptr<acc_t>(), rstd.data_ptr<acc_t>(),
          R, N, eps, dropout_p, seed_value(seed));
    });
  });
  return {y, s, mean, rstd, y_c};
}

void layer_norm_residual_rows(const float* x, const float* residual, const float* weight, const float* bias,
                              float* y, float* s, float* mean, float* rstd, int64_t R, int64_t N, double eps) {
  layer_norm_residual_fwd_kernel<float>(x, residual, weight, bias, nullptr, y, s, ComputeOut(), mean, rstd, R, N,
                                        eps, 0.0, 0);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layer_norm_residual_bwd(
    const Tensor& dy, const c10::optional<Tensor>& ds, const Tensor& s, const Tensor& weight, const Tensor& mean,
    const Tensor& rstd, double dropout_p, const c10::optional<Tensor>& seed, at::ScalarType dx_dtype,
    const c10::optional<Tensor>& dy_c, const c10::optional<Tensor>& x_bias) {
  const int64_t N = s.size(-1), R = s.numel() / N;
  Tensor dx = at::empty_like(s, s.options().dtype(dx_dtype)), dres = at::empty_like(s);
  Tensor dweight = at::empty_like(weight), dbias = at::empty_like(weight);
  Tensor dx_bias = x_bias.has_value() ? at::empty_like(*x_bias) : at::empty({0}, weight.options());
  const ComputeGrad c_grad{dy_c.has_value() ? dy_c->data_ptr() : nullptr,
                           dy_c.has_value() ? dy_c->scalar_type() : at::kFloat};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.scalar_type(), "fastformer_lnr_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // The chunk partials (chunks x N each for dweight, dbias and dx_bias) in a work buffer, not tensors: no
    // allocator or dispatcher round trip per call.
    const int64_t chunks = std::max<int64_t>(1, std::min(R, kPartials));
    Buffer<acc_t> partial_dw(R == 0 ? 0 : chunks * N), partial_db(R == 0 ? 0 : chunks * N);
    Buffer<acc_t> partial_dxb(R == 0 || !x_bias.has_value() ? 0 : chunks * N);
    if (R > 0) {
      with_branch_type<scalar_t>(dx_dtype, [&](auto branch) {
        using x_t = decltype(branch);
        layer_norm_residual_bwd_kernel<scalar_t, x_t>(
            dy.data_ptr<scalar_t>(), c_grad, ds.has_value() ? ds->data_ptr<scalar_t>() : nullptr,
            s.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), mean.data_ptr<acc_t>(), rstd.data_ptr<acc_t>(),
            dx.data_ptr<x_t>(), dres.data_ptr<scalar_t>(), partial_dw.data(), partial_db.data(),
            x_bias.has_value() ? partial_dxb.data() : nullptr, R, N, dropout_p, seed_value(seed));
      });
    }
    // Second stage: the chunk partials summed in a fixed order (chunk 0 first), whatever the thread count.
    const int64_t used = R == 0 ? 0 : chunks;
    scalar_t* dw = dweight.data_ptr<scalar_t>();
    scalar_t* db = dbias.data_ptr<scalar_t>();
    Buffer<acc_t> row_w, row_b;
    acc_t* sum_w = output_row(dw, N, row_w);
    acc_t* sum_b = output_row(db, N, row_b);
    sum_partials(partial_dw.data(), used, N, sum_w);
    sum_partials(partial_db.data(), used, N, sum_b);
    finish_output(sum_w, dw, N);
    finish_output(sum_b, db, N);
    if (x_bias.has_value()) {
      Buffer<acc_t> row_xb(N);
      sum_partials(partial_dxb.data(), used, N, row_xb.data());
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dx_bias.scalar_type(), "fastformer_lnr_dxb", [&] {
        convert_row(row_xb.data(), dx_bias.data_ptr<scalar_t>(), N);
      });
    }
  });
  return {dx, dres, dweight, dbias, dx_bias};
}

}  // namespace fastformer::cpu
