// y = dropout(act(x + bias)) over the last dim on the CPU, forward and backward; act = relu, gelu (exact,
// erf) or silu (csrc/activation.h).
//
// x, y: R contiguous rows of N in x's dtype T (float16, bfloat16, float32, float64); bias (N,) of any floating
// dtype, converted once per call into an acc_t row (acc_t: float32, float64 for float64 x). All arithmetic in
// acc_t with at::vec (the tails scalar).
// Forward: rows spread over threads (about 16K elements a task); per row
//   h = x + b, y = act(h) r   (r: dropout factor, csrc/cpu/dropout.h, element index row N + col: the flat
//                             row-major index in x), rounded to T.
//   DRAM: x read, y written: 2 N sizeof(T) per row (bias cached).
// Backward, dz = dy act'(h) r:
//   relu from the saved y: dz = dy / (1 - p) where y > 0, else 0 (y > 0 iff the element was kept and h > 0:
//     no Philox, no x);
//   gelu, silu from the saved x: h = x + b again, r regenerated from the seed;
//     gelu'(h) = Phi(h) + h phi(h),  silu'(h) = s (1 + h (1 - s)) with s = sigmoid(h).
//   dx = dz rounded to T; dbias = sum over rows of dz (unrounded, acc_t), without races and independent of the
//   thread count: the rows are cut into at most kPartials fixed chunks, each chunk sums its rows into its own
//   partial row (a work buffer), then the partials are summed in chunk order and written in bias's dtype.
//   DRAM: dy, saved read, dx written: 3 N sizeof(T) per row, plus the partials (kPartials N acc_t, cached).
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>

#include "activation.h"
#include "cpu/cpu_ops.h"
#include "cpu/dropout.h"

namespace fastformer::cpu {
// A namespace of the op's own: the level sources may be compiled as one unit (setup.py, FASTFORMER_UNITY_BUILD).
namespace bias_act {
namespace {

constexpr int64_t kPartials = 64;

template <int kAct>
using Act = std::integral_constant<int, kAct>;

// f(Act<code>()) for the activation code (checked by csrc/ops.h): one kernel instantiation per activation.
template <typename F>
void with_activation(int64_t code, const F& f) {
  if (code == kActGelu) return f(Act<kActGelu>());
  if (code == kActSilu) return f(Act<kActSilu>());
  f(Act<kActRelu>());
}

// act(h) and act'(h), vectorized and scalar.
template <int kAct, typename acc_t>
inline at::vec::Vectorized<acc_t> act_vec(at::vec::Vectorized<acc_t> h) {
  using Vec = at::vec::Vectorized<acc_t>;
  if constexpr (kAct == kActRelu) {
    return at::vec::maximum(h, Vec(acc_t(0)));  // propagates NaN, as torch.relu
  } else if constexpr (kAct == kActGelu) {
    return h * Vec(acc_t(0.5)) * (Vec(acc_t(1)) + (h * Vec(acc_t(M_SQRT1_2))).erf());
  } else {
    return h / (Vec(acc_t(1)) + h.neg().exp());
  }
}

template <int kAct, typename acc_t>
inline acc_t act_scalar(acc_t h) {
  if constexpr (kAct == kActRelu) {
    return h > acc_t(0) || std::isnan(h) ? h : acc_t(0);
  } else if constexpr (kAct == kActGelu) {
    return h * acc_t(0.5) * (acc_t(1) + std::erf(h * acc_t(M_SQRT1_2)));
  } else {
    return h / (acc_t(1) + std::exp(-h));
  }
}

template <int kAct, typename acc_t>
inline at::vec::Vectorized<acc_t> grad_vec(at::vec::Vectorized<acc_t> h) {  // gelu, silu
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec one(acc_t(1));
  if constexpr (kAct == kActGelu) {
    const Vec cdf = Vec(acc_t(0.5)) * (one + (h * Vec(acc_t(M_SQRT1_2))).erf());
    const Vec pdf = (h * h * Vec(acc_t(-0.5))).exp() * Vec(acc_t(0.5 * M_2_SQRTPI * M_SQRT1_2));
    return at::vec::fmadd(h, pdf, cdf);
  } else {
    const Vec s = one / (one + h.neg().exp());
    return s * at::vec::fmadd(h, one - s, one);
  }
}

template <int kAct, typename acc_t>
inline acc_t grad_scalar(acc_t h) {
  if constexpr (kAct == kActGelu) {
    const acc_t cdf = acc_t(0.5) * (acc_t(1) + std::erf(h * acc_t(M_SQRT1_2)));
    return cdf + h * std::exp(acc_t(-0.5) * h * h) * acc_t(0.5 * M_2_SQRTPI * M_SQRT1_2);
  } else {
    const acc_t s = acc_t(1) / (acc_t(1) + std::exp(-h));
    return s * (acc_t(1) + h * (acc_t(1) - s));
  }
}

template <int kAct, typename scalar_t>
void bias_activation_fwd_kernel(const scalar_t* x, const at::opmath_type<scalar_t>* b, scalar_t* y, int64_t R,
                                int64_t N, double dropout_p, uint64_t seed) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t grain = std::max<int64_t>(1, 16384 / N);
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> x_buf, y_buf, drop(dropout_p > 0 ? N : 0);
    for (int64_t r = begin; r < end; ++r) {
      const acc_t* xr = as_acc(x + r * N, N, x_buf);
      acc_t* yr = output_row(y + r * N, N, y_buf);
      if (dropout_p > 0) dropout_factors(seed, static_cast<uint64_t>(r * N), N, dropout_p, drop.data());
      int64_t j = 0;
      for (; j + Vec::size() <= N; j += Vec::size()) {
        Vec a = act_vec<kAct>(Vec::loadu(xr + j) + Vec::loadu(b + j));
        if (dropout_p > 0) a = a * Vec::loadu(drop.data() + j);
        a.store(yr + j);
      }
      for (; j < N; ++j) {
        const acc_t a = act_scalar<kAct>(xr[j] + b[j]);
        yr[j] = dropout_p > 0 ? a * drop[j] : a;
      }
      finish_output(yr, y + r * N, N);
    }
  });
}

template <int kAct, typename scalar_t>
void bias_activation_bwd_kernel(const scalar_t* dy, const scalar_t* saved, const at::opmath_type<scalar_t>* b,
                                scalar_t* dx, at::opmath_type<scalar_t>* partial, int64_t R, int64_t N,
                                double dropout_p, uint64_t seed) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr bool kRelu = kAct == kActRelu;
  const bool regenerate = !kRelu && dropout_p > 0;  // relu reads the mask off y
  const acc_t inv_keep = acc_t(1) / (acc_t(1) - static_cast<acc_t>(dropout_p));
  const int64_t chunks = std::min(R, kPartials);
  const int64_t rows_per_chunk = (R + chunks - 1) / chunks;
  // Chunks per task: about 16K elements. The chunks are fixed whatever the threads: no result changes.
  const int64_t grain = std::max<int64_t>(1, 16384 / (rows_per_chunk * N));
  at::parallel_for(0, chunks, grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> dy_buf, s_buf, dx_buf, drop(regenerate ? N : 0);
    const Vec zero(acc_t(0)), vinv_keep(inv_keep);
    for (int64_t c = begin; c < end; ++c) {
      acc_t* db = partial + c * N;
      std::fill(db, db + N, acc_t(0));
      for (int64_t r = c * rows_per_chunk; r < std::min(R, (c + 1) * rows_per_chunk); ++r) {
        const acc_t* g = as_acc(dy + r * N, N, dy_buf);
        const acc_t* s = as_acc(saved + r * N, N, s_buf);
        acc_t* d = output_row(dx + r * N, N, dx_buf);
        if (regenerate) dropout_factors(seed, static_cast<uint64_t>(r * N), N, dropout_p, drop.data());
        int64_t j = 0;
        for (; j + Vec::size() <= N; j += Vec::size()) {
          const Vec sv = Vec::loadu(s + j);
          Vec dz;
          if constexpr (kRelu) {
            dz = Vec::blendv(zero, Vec::loadu(g + j) * vinv_keep, sv > zero);
          } else {
            dz = Vec::loadu(g + j) * grad_vec<kAct>(sv + Vec::loadu(b + j));
            if (regenerate) dz = dz * Vec::loadu(drop.data() + j);
          }
          dz.store(d + j);
          (Vec::loadu(db + j) + dz).store(db + j);
        }
        for (; j < N; ++j) {
          acc_t dz;
          if constexpr (kRelu) {
            dz = s[j] > acc_t(0) ? g[j] * inv_keep : acc_t(0);
          } else {
            dz = g[j] * grad_scalar<kAct>(s[j] + b[j]);
            if (regenerate) dz *= drop[j];
          }
          d[j] = dz;
          db[j] += dz;
        }
        finish_output(d, dx + r * N, N);
      }
    }
  });
}

// bias (N,) of any floating dtype as an acc_t row.
template <typename acc_t>
void bias_row(const Tensor& bias, Buffer<acc_t>& row) {
  row.resize(bias.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bias.scalar_type(), "fastformer_bias_act_bias", [&] {
    convert_row(bias.const_data_ptr<scalar_t>(), row.data(), bias.numel());
  });
}

}  // namespace
}  // namespace bias_act

Tensor bias_activation_fwd(const Tensor& x, const Tensor& bias, int64_t activation, double dropout_p,
                           const c10::optional<Tensor>& seed) {
  Tensor y = at::empty_like(x);
  const int64_t N = x.size(-1);
  if (x.numel() == 0) return y;
  const int64_t R = x.numel() / N;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fastformer_bias_act_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Buffer<acc_t> b;
    bias_act::bias_row(bias, b);
    bias_act::with_activation(activation, [&](auto act) {
      bias_act::bias_activation_fwd_kernel<decltype(act)::value, scalar_t>(x.const_data_ptr<scalar_t>(), b.data(),
                                                                 y.mutable_data_ptr<scalar_t>(), R, N, dropout_p,
                                                                 seed_value(seed));
    });
  });
  return y;
}

std::tuple<Tensor, Tensor> bias_activation_bwd(const Tensor& dy, const Tensor& saved, const Tensor& bias,
                                               int64_t activation, double dropout_p,
                                               const c10::optional<Tensor>& seed) {
  Tensor dx = at::empty_like(saved), dbias = at::empty_like(bias);
  const int64_t N = saved.size(-1);
  const int64_t R = N == 0 ? 0 : saved.numel() / N;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, saved.scalar_type(), "fastformer_bias_act_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using Vec = at::vec::Vectorized<acc_t>;
    const int64_t chunks = std::min(R, bias_act::kPartials);
    Buffer<acc_t> b, partial(chunks * N), sum(N);
    if (R > 0) {
      bias_act::bias_row(bias, b);
      bias_act::with_activation(activation, [&](auto act) {
        bias_act::bias_activation_bwd_kernel<decltype(act)::value, scalar_t>(
            dy.const_data_ptr<scalar_t>(), saved.const_data_ptr<scalar_t>(), b.data(),
            dx.mutable_data_ptr<scalar_t>(), partial.data(), R, N, dropout_p, seed_value(seed));
      });
    }
    // Second stage: the chunk partials summed in chunk order (chunk 0 first), whatever the thread count.
    int64_t j = 0;
    for (; j + Vec::size() <= N; j += Vec::size()) {
      Vec v(acc_t(0));
      for (int64_t c = 0; c < chunks; ++c) v = v + Vec::loadu(partial.data() + c * N + j);
      v.store(sum.data() + j);
    }
    for (; j < N; ++j) {
      acc_t v = 0;
      for (int64_t c = 0; c < chunks; ++c) v += partial[c * N + j];
      sum[j] = v;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bias.scalar_type(), "fastformer_bias_act_dbias", [&] {
      convert_row(sum.data(), dbias.mutable_data_ptr<scalar_t>(), N);
    });
  });
  return {dx, dbias};
}

}  // namespace fastformer::cpu
