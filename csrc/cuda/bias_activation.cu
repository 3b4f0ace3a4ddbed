// Launchers of the bias_activation kernels (csrc/cuda/bias_activation.cuh): validate, allocate, size the grid
// (x: quads of columns, kBaThreads per block; y: chunks of rows) and, for backward, the deterministic
// two-stage dbias reduction. The kernels read the bias in its own type when it is float32 or x's type (the
// float32 master bias beside a float16/bfloat16 x, or a bias in the compute dtype); another dtype (a float64
// bias, or float16 beside bfloat16) is converted to float32 first, and dbias back.
#include <algorithm>
#include <cstdint>

#include "cuda_ops.h"
#include "launch.h"
#include "ops.h"
#include "bias_activation.cuh"

namespace fastformer::cuda {
namespace {

// The bias as the kernels read it: itself when float32 or of x's dtype, else a float32 copy.
Tensor kernel_bias(const Tensor& bias, const Tensor& x) {
  const auto d = bias.scalar_type();
  return d == at::kFloat || d == x.scalar_type() ? bias : bias.to(at::kFloat);
}

// Calls f(scalar_t(), bias_t()) with the at:: types of x and of the kernel bias (float or scalar_t).
template <typename F>
void dispatch_types(at::ScalarType x, at::ScalarType bias, const F& f) {
  FF_DISPATCH_KERNEL_TYPES(x, "fastformer_bias_act_cuda", [&] {
    if (bias == at::kFloat) {
      f(scalar_t(), float());
    } else {
      f(scalar_t(), scalar_t());
    }
  });
}

bool aligned4(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % (4 * t.element_size()) == 0; }

dim3 quad_blocks(int64_t N) { return dim3(static_cast<unsigned>(((N + 3) / 4 + kBaThreads - 1) / kBaThreads)); }

}  // namespace

Tensor bias_activation_fwd(const Tensor& x, const Tensor& bias, int64_t activation, double dropout_p,
                           const c10::optional<Tensor>& seed) {
  check_input(x, "x");
  check_input(bias, "bias");
  check_dtype(x, "x");
  Tensor y = at::empty_like(x);
  const int64_t N = x.size(-1);
  if (x.numel() == 0) return y;
  const int64_t R = x.numel() / N;
  check_row_limits("bias_activation", R, N);
  DeviceScope scope(x);
  const Tensor b = kernel_bias(bias, x);
  dispatch_types(x.scalar_type(), b.scalar_type(), [&](auto xs, auto bs) {
    using scalar_t = decltype(xs);
    using bias_t = decltype(bs);
    using T = typename DeviceType<scalar_t>::type;
    using TB = typename DeviceType<bias_t>::type;
    BiasActFwdParams<T, TB> p{};
    p.x = device_ptr<scalar_t>(x);
    p.bias = device_ptr<bias_t>(b);
    p.y = device_ptr_mut<scalar_t>(y);
    p.rows = R;
    p.cols = static_cast<int>(N);
    p.chunk_rows = std::max<int64_t>(kBaFwdRows, (R + kBaMaxGridY - 1) / kBaMaxGridY);
    p.activation = static_cast<int>(activation);
    p.dropout_p = static_cast<float>(dropout_p);
    p.inv_keep = 1.0f / (1.0f - p.dropout_p);
    p.seed = seed_pointer(seed);
    p.vec4 = N % 4 == 0 && aligned4(x) && aligned4(y);
    const dim3 grid(quad_blocks(N).x, static_cast<unsigned>((R + p.chunk_rows - 1) / p.chunk_rows));
    launch(bias_activation_fwd_kernel<T, TB>, grid, dim3(kBaThreads), p);
  });
  return y;
}

std::tuple<Tensor, Tensor> bias_activation_bwd(const Tensor& dy, const Tensor& saved, const Tensor& bias,
                                               int64_t activation, double dropout_p,
                                               const c10::optional<Tensor>& seed) {
  check_input(dy, "dy");
  check_input(saved, "saved");
  check_input(bias, "bias");
  check_dtype(saved, "saved");
  Tensor dx = at::empty_like(saved);
  const int64_t N = saved.size(-1);
  const int64_t R = N == 0 ? 0 : saved.numel() / N;
  if (R == 0) return {dx, at::zeros_like(bias)};
  check_row_limits("bias_activation", R, N);
  DeviceScope scope(saved);
  const Tensor b = kernel_bias(bias, saved);
  // Stage 1: P chunks of chunk_rows rows; the split depends on R only.
  const int64_t chunk_rows = std::max<int64_t>(kBaBwdMinRows, (R + kBaBwdMaxChunks - 1) / kBaBwdMaxChunks);
  const int64_t partials = (R + chunk_rows - 1) / chunk_rows;
  Tensor partial = at::empty({partials, N}, saved.options().dtype(at::kFloat));
  Tensor dbias = at::empty_like(b);
  dispatch_types(saved.scalar_type(), b.scalar_type(), [&](auto xs, auto bs) {
    using scalar_t = decltype(xs);
    using bias_t = decltype(bs);
    using T = typename DeviceType<scalar_t>::type;
    using TB = typename DeviceType<bias_t>::type;
    BiasActBwdParams<T, TB> p{};
    p.dy = device_ptr<scalar_t>(dy);
    p.saved = device_ptr<scalar_t>(saved);
    p.bias = device_ptr<bias_t>(b);
    p.dx = device_ptr_mut<scalar_t>(dx);
    p.partial = partial.mutable_data_ptr<float>();
    p.rows = R;
    p.cols = static_cast<int>(N);
    p.chunk_rows = chunk_rows;
    p.activation = static_cast<int>(activation);
    p.dropout_p = static_cast<float>(dropout_p);
    p.inv_keep = 1.0f / (1.0f - p.dropout_p);
    p.seed = seed_pointer(seed);
    p.vec4 = N % 4 == 0 && aligned4(dy) && aligned4(saved) && aligned4(dx);
    launch(bias_activation_bwd_kernel<T, TB>, dim3(quad_blocks(N).x, static_cast<unsigned>(partials)),
           dim3(kBaThreads), p);
    BiasActDbiasParams<TB> q{};
    q.partial = p.partial;
    q.dbias = device_ptr_mut<bias_t>(dbias);
    q.partials = static_cast<int>(partials);
    q.cols = p.cols;
    launch(bias_activation_dbias_kernel<TB>, dim3(static_cast<unsigned>((N + kBaThreads - 1) / kBaThreads)),
           dim3(kBaThreads), q);
  });
  return {dx, dbias.scalar_type() == bias.scalar_type() ? dbias : dbias.to(bias.scalar_type())};
}

}  // namespace fastformer::cuda

#if defined(__CUDACC__)
#include <torch/library.h>

TORCH_LIBRARY_IMPL(fastformer, CUDA, m) { FASTFORMER_IMPL_OP(m, fastformer::cuda, bias_activation); }
#endif
