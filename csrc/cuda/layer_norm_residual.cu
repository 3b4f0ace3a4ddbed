// Launchers of the layer_norm_residual kernels (csrc/cuda/layer_norm_residual.cuh): validate, allocate,
// pick the layout (a warp per row for N <= kLnrWarpMaxN, kPerLane = ceil(N / 32) rounded up to a power of
// two; a block of kLnrThreads per row above) and, for backward, size the deterministic two-stage
// dweight/dbias reduction. 16-byte packs (warp layout) when N is a multiple of the pack, every tensor
// is 16-byte aligned and x has the stream's dtype; half2/float2 pairs when N is even and every row pointer
// is 2-element aligned. A float16/bfloat16 x beside a float32 residual runs the kernels with TX = __half or
// __nv_bfloat16 (dispatch_lnr_types): no cast before or after them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "cuda_ops.h"
#include "launch.h"
#include "ops.h"
#include "layer_norm_residual.cuh"

namespace fastformer::cuda {
namespace {

// The arguments were checked by csrc/ops.h (check_layer_norm_residual, check_layer_norm_residual_bwd:
// shapes, dtypes, eps, dropout_p); here only that every tensor the kernels index is on the device and
// contiguous (a cheap guard against a direct call of a launcher), then the backend's own limits.
void check_inputs(std::initializer_list<std::pair<const Tensor*, const char*>> tensors) {
  for (const auto& [t, name] : tensors) check_input(*t, name);
}

// Calls f(scalar_t(), branch_t()) with the at:: types of the residual stream and of the branch x (and dx):
// one type, or a float32 stream with an at::Half / at::BFloat16 branch (csrc/ops.h lnr_branch_dtype_ok).
template <typename F>
void dispatch_lnr_types(at::ScalarType stream, at::ScalarType branch, const F& f) {
  if (stream == at::kFloat && branch == at::kHalf) return f(float(), at::Half());
  if (stream == at::kFloat && branch == at::kBFloat16) return f(float(), at::BFloat16());
  TORCH_CHECK(branch == stream, "fastformer ", kBackend, " layer_norm_residual: a ", branch, " branch beside a ",
              stream, " residual is not supported");
  FF_DISPATCH_KERNEL_TYPES(stream, "fastformer_lnr_cuda", [&] { f(scalar_t(), scalar_t()); });
}

// The leading-dims shape of the per-row statistics.
std::vector<int64_t> stat_shape(const Tensor& t) {
  auto shape = t.sizes().vec();
  shape.pop_back();
  return shape;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_residual_fwd(const Tensor& x, const Tensor& residual,
                                                                   const Tensor& weight, const Tensor& bias,
                                                                   double eps, double dropout_p,
                                                                   const c10::optional<Tensor>& seed) {
  check_inputs({{&x, "x"}, {&residual, "residual"}, {&weight, "weight"}, {&bias, "bias"}});
  check_dtype(x, "x");
  check_dtype(residual, "residual");
  const int64_t N = x.size(-1), R = x.numel() / N;
  const auto stats = stat_shape(x);
  Tensor y = at::empty_like(residual), s = at::empty_like(residual);
  Tensor mean = at::empty(stats, x.options().dtype(at::kFloat)), rstd = at::empty(stats, x.options().dtype(at::kFloat));
  if (R == 0) return {y, s, mean, rstd};
  check_row_limits("layer_norm_residual", R, N);
  DeviceScope scope(x);
  dispatch_lnr_types(residual.scalar_type(), x.scalar_type(), [&](auto stream, auto branch) {
    using scalar_t = decltype(stream);
    using branch_t = decltype(branch);
    using T = typename DeviceType<scalar_t>::type;
    using TX = typename DeviceType<branch_t>::type;
    LnrFwdParams<T, TX> p{};
    p.x = device_ptr<branch_t>(x);
    p.residual = device_ptr<scalar_t>(residual);
    p.weight = device_ptr<scalar_t>(weight);
    p.bias = device_ptr<scalar_t>(bias);
    p.y = device_ptr_mut<scalar_t>(y);
    p.s = device_ptr_mut<scalar_t>(s);
    p.mean = mean.mutable_data_ptr<float>();
    p.rstd = rstd.mutable_data_ptr<float>();
    p.rows = R;
    p.cols = static_cast<int>(N);
    p.eps = static_cast<float>(eps);
    p.dropout_p = static_cast<float>(dropout_p);
    p.inv_keep = 1.0f / (1.0f - p.dropout_p);
    p.seed = seed_pointer(seed);
    p.vec2 = N % 2 == 0 && aligned2(x) && aligned2(residual) && aligned2(weight) && aligned2(bias) && aligned2(y) &&
             aligned2(s);
    p.packs = N % kPack<T> == 0 && aligned16(x) && aligned16(residual) && aligned16(weight) && aligned16(bias) &&
              aligned16(y) && aligned16(s);
    if (N <= kLnrWarpMaxN) {
      const dim3 grid(static_cast<unsigned>((R + kLnrWarpRows - 1) / kLnrWarpRows));
      launch_per_lane(p.cols, grid, dim3(kLnrThreads), p, layer_norm_residual_fwd_warp_kernel<T, 1, TX>,
                      layer_norm_residual_fwd_warp_kernel<T, 2, TX>, layer_norm_residual_fwd_warp_kernel<T, 4, TX>,
                      layer_norm_residual_fwd_warp_kernel<T, 8, TX>, layer_norm_residual_fwd_warp_kernel<T, 16, TX>,
                      layer_norm_residual_fwd_warp_kernel<T, 32, TX>);
    } else {
      launch(layer_norm_residual_fwd_block_kernel<T, TX>, dim3(static_cast<unsigned>(R)), dim3(kLnrThreads), p);
    }
  });
  return {y, s, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_residual_bwd(const Tensor& dy, const c10::optional<Tensor>& ds,
                                                                   const Tensor& s, const Tensor& weight,
                                                                   const Tensor& mean, const Tensor& rstd,
                                                                   double dropout_p,
                                                                   const c10::optional<Tensor>& seed,
                                                                   at::ScalarType dx_dtype) {
  check_inputs({{&dy, "dy"}, {&s, "s"}, {&weight, "weight"}, {&mean, "mean"}, {&rstd, "rstd"}});
  if (ds.has_value()) check_input(*ds, "ds");
  check_dtype(s, "s");
  const int64_t N = s.size(-1), R = s.numel() / N;
  Tensor dx = at::empty_like(s, s.options().dtype(dx_dtype)), dres = at::empty_like(s);
  check_dtype(dx, "dx");
  if (R == 0) return {dx, dres, at::zeros_like(weight), at::zeros_like(weight)};
  check_row_limits("layer_norm_residual", R, N);
  DeviceScope scope(s);
  // Stage 1: P chunks of chunk_rows rows, one per block; the split depends on R and N only.
  const bool warp_rows = N <= kLnrWarpMaxN;
  const int64_t max_partials = warp_rows ? kLnrBwdWarpMaxBlocks : kLnrBwdBlockMaxBlocks;
  const int64_t min_rows = warp_rows ? kLnrBwdWarpMinRows : 1;
  const int64_t chunk_rows = std::max(min_rows, (R + max_partials - 1) / max_partials);
  const int64_t partials = (R + chunk_rows - 1) / chunk_rows;
  const dim3 grid(static_cast<unsigned>(partials));
  // The stage-1 partials of dweight and dbias: (2, P, N) float32 in one allocation. Stage 2 writes dweight
  // and dbias in weight's dtype: no reduction or cast op after the kernels.
  Tensor partial = at::empty({2, partials, N}, s.options().dtype(at::kFloat));
  Tensor dweight = at::empty_like(weight), dbias = at::empty_like(weight);
  dispatch_lnr_types(s.scalar_type(), dx_dtype, [&](auto stream, auto branch) {
    using scalar_t = decltype(stream);
    using branch_t = decltype(branch);
    using T = typename DeviceType<scalar_t>::type;
    using TX = typename DeviceType<branch_t>::type;
    LnrBwdParams<T, TX> p{};
    p.dy = device_ptr<scalar_t>(dy);
    p.ds = ds.has_value() ? device_ptr<scalar_t>(*ds) : nullptr;
    p.s = device_ptr<scalar_t>(s);
    p.weight = device_ptr<scalar_t>(weight);
    p.mean = mean.const_data_ptr<float>();
    p.rstd = rstd.const_data_ptr<float>();
    p.dx = device_ptr_mut<branch_t>(dx);
    p.dresidual = device_ptr_mut<scalar_t>(dres);
    p.partial_dw = partial.mutable_data_ptr<float>();
    p.partial_db = p.partial_dw + partials * N;
    p.rows = R;
    p.cols = static_cast<int>(N);
    p.chunk_rows = chunk_rows;
    p.dropout_p = static_cast<float>(dropout_p);
    p.inv_keep = 1.0f / (1.0f - p.dropout_p);
    p.seed = seed_pointer(seed);
    p.vec2 = N % 2 == 0 && aligned2(dy) && (!ds.has_value() || aligned2(*ds)) && aligned2(s) && aligned2(weight) &&
             aligned2(dx) && aligned2(dres);
    p.packs = N % kPack<T> == 0 && aligned16(dy) && (!ds.has_value() || aligned16(*ds)) && aligned16(s) &&
              aligned16(weight) && aligned16(dx) && aligned16(dres);
    if (warp_rows) {
      launch_per_lane(p.cols, grid, dim3(kLnrThreads), p, layer_norm_residual_bwd_warp_kernel<T, 1, TX>,
                      layer_norm_residual_bwd_warp_kernel<T, 2, TX>, layer_norm_residual_bwd_warp_kernel<T, 4, TX>,
                      layer_norm_residual_bwd_warp_kernel<T, 8, TX>, layer_norm_residual_bwd_warp_kernel<T, 16, TX>,
                      layer_norm_residual_bwd_warp_kernel<T, 32, TX>);
    } else {
      launch(layer_norm_residual_bwd_block_kernel<T, TX>, grid, dim3(kLnrThreads), p);
    }
    LnrReduceParams<T> q{};
    q.partial_dw = p.partial_dw;
    q.partial_db = p.partial_db;
    q.dweight = device_ptr_mut<scalar_t>(dweight);
    q.dbias = device_ptr_mut<scalar_t>(dbias);
    q.partials = static_cast<int>(partials);
    q.cols = p.cols;
    launch(layer_norm_residual_bwd_reduce_kernel<T>, dim3(static_cast<unsigned>((N + kWarpSize - 1) / kWarpSize)),
           dim3(kLnrReduceStripes * kWarpSize), q);
  });
  return {dx, dres, dweight, dbias};
}

}  // namespace fastformer::cuda

#if defined(__CUDACC__)
#include <torch/library.h>

TORCH_LIBRARY_IMPL(fastformer, CUDA, m) { FASTFORMER_IMPL_OP(m, fastformer::cuda, layer_norm_residual); }
#endif
