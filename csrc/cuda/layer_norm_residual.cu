// Launchers of the layer_norm_residual kernels (csrc/cuda/layer_norm_residual.cuh): validate, allocate,
// pick the layout (a warp per row for N <= kLnrWarpMaxN, kPerLane = ceil(N / 32) rounded up to a power of
// two; a block of kLnrThreads per row above) and, for backward, size the deterministic two-stage
// dweight/dbias reduction. 16-byte packs (warp layout) when N is a multiple of the pack, every tensor
// is 16-byte aligned and every row has the stream's element size (x, y_c, dy_c; a float32 x_bias beside a
// float32 stream); half2/float2 pairs when N is even and every row pointer is 2-element aligned. A
// float16/bfloat16 x beside a float32 residual runs the kernels with TX = __half or __nv_bfloat16
// (dispatch_lnr_types): no cast before or after them. x_bias reaches the kernels as float32 (a copy of N
// elements when it has another dtype); y_c and dy_c are typed at run time (LnrComputeType); dx_bias is
// reduced into float32 and returned in x_bias's dtype (a cast of N elements when that is not float32).
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

// The LnrComputeType of a compute-dtype tensor (float16 or bfloat16: csrc/ops.h check_lnr_compute_dtype).
int compute_type(at::ScalarType t) { return t == at::kHalf ? kLnrComputeHalf : kLnrComputeBFloat16; }

// The leading-dims shape of the per-row statistics.
std::vector<int64_t> stat_shape(const Tensor& t) {
  auto shape = t.sizes().vec();
  shape.pop_back();
  return shape;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layer_norm_residual_fwd(
    const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias, double eps, double dropout_p,
    const c10::optional<Tensor>& seed, const c10::optional<Tensor>& x_bias, at::ScalarType compute_dtype) {
  check_inputs({{&x, "x"}, {&residual, "residual"}, {&weight, "weight"}, {&bias, "bias"}});
  if (x_bias.has_value()) check_input(*x_bias, "x_bias");
  check_dtype(x, "x");
  check_dtype(residual, "residual");
  const int64_t N = x.size(-1), R = x.numel() / N;
  const auto stats = stat_shape(x);
  Tensor y = at::empty_like(residual), s = at::empty_like(residual);
  Tensor mean = at::empty(stats, x.options().dtype(at::kFloat)), rstd = at::empty(stats, x.options().dtype(at::kFloat));
  const bool has_c = compute_dtype != residual.scalar_type();
  Tensor y_c = has_c ? at::empty_like(residual, residual.options().dtype(compute_dtype)) : at::empty({0}, residual.options());
  if (R == 0) return {y, s, mean, rstd, y_c};
  const Tensor xb = x_bias.has_value() ? x_bias->to(at::kFloat) : Tensor();  // no copy when float32
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
    p.x_bias = xb.defined() ? xb.const_data_ptr<float>() : nullptr;
    p.y = device_ptr_mut<scalar_t>(y);
    p.s = device_ptr_mut<scalar_t>(s);
    p.y_c = has_c ? y_c.mutable_data_ptr() : nullptr;
    p.c_type = has_c ? compute_type(compute_dtype) : kLnrComputeNone;
    p.mean = mean.mutable_data_ptr<float>();
    p.rstd = rstd.mutable_data_ptr<float>();
    p.rows = R;
    p.cols = static_cast<int>(N);
    p.eps = static_cast<float>(eps);
    p.dropout_p = static_cast<float>(dropout_p);
    p.inv_keep = 1.0f / (1.0f - p.dropout_p);
    p.seed = seed_pointer(seed);
    p.vec2 = N % 2 == 0 && aligned2(x) && aligned2(residual) && aligned2(weight) && aligned2(bias) && aligned2(y) &&
             aligned2(s) && (!xb.defined() || aligned2(xb)) && (!has_c || aligned2(y_c));
    p.packs = N % kPack<T> == 0 && aligned16(x) && aligned16(residual) && aligned16(weight) && aligned16(bias) &&
              aligned16(y) && aligned16(s) && (!xb.defined() || (sizeof(T) == sizeof(float) && aligned16(xb))) &&
              (!has_c || (sizeof(T) == 2 && aligned16(y_c)));
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
  return {y, s, mean, rstd, y_c};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layer_norm_residual_bwd(
    const Tensor& dy, const c10::optional<Tensor>& ds, const Tensor& s, const Tensor& weight, const Tensor& mean,
    const Tensor& rstd, double dropout_p, const c10::optional<Tensor>& seed, at::ScalarType dx_dtype,
    const c10::optional<Tensor>& dy_c, const c10::optional<Tensor>& x_bias) {
  check_inputs({{&dy, "dy"}, {&s, "s"}, {&weight, "weight"}, {&mean, "mean"}, {&rstd, "rstd"}});
  if (ds.has_value()) check_input(*ds, "ds");
  if (dy_c.has_value()) check_input(*dy_c, "dy_c");
  check_dtype(s, "s");
  const int64_t N = s.size(-1), R = s.numel() / N;
  Tensor dx = at::empty_like(s, s.options().dtype(dx_dtype)), dres = at::empty_like(s);
  check_dtype(dx, "dx");
  // dx_bias reduced in float32: written into the result when x_bias is float32, else cast once (N elements).
  const bool has_xb = x_bias.has_value();
  Tensor dx_bias = has_xb ? at::empty_like(*x_bias, x_bias->options().dtype(at::kFloat)) : at::empty({0}, weight.options());
  if (R == 0) {
    return {dx, dres, at::zeros_like(weight), at::zeros_like(weight), has_xb ? at::zeros_like(*x_bias) : dx_bias};
  }
  check_row_limits("layer_norm_residual", R, N);
  DeviceScope scope(s);
  // Stage 1: P chunks of chunk_rows rows, one per block; the split depends on R and N only.
  const bool warp_rows = N <= kLnrWarpMaxN;
  const int64_t max_partials = warp_rows ? kLnrBwdWarpMaxBlocks : kLnrBwdBlockMaxBlocks;
  const int64_t min_rows = warp_rows ? kLnrBwdWarpMinRows : 1;
  const int64_t chunk_rows = std::max(min_rows, (R + max_partials - 1) / max_partials);
  const int64_t partials = (R + chunk_rows - 1) / chunk_rows;
  const dim3 grid(static_cast<unsigned>(partials));
  // The stage-1 partials of dweight, dbias (and dx_bias): (2 or 3, P, N) float32 in one allocation. Stage 2
  // writes dweight and dbias in weight's dtype: no reduction or cast op after the kernels.
  Tensor partial = at::empty({has_xb ? 3 : 2, partials, N}, s.options().dtype(at::kFloat));
  Tensor dweight = at::empty_like(weight), dbias = at::empty_like(weight);
  dispatch_lnr_types(s.scalar_type(), dx_dtype, [&](auto stream, auto branch) {
    using scalar_t = decltype(stream);
    using branch_t = decltype(branch);
    using T = typename DeviceType<scalar_t>::type;
    using TX = typename DeviceType<branch_t>::type;
    LnrBwdParams<T, TX> p{};
    p.dy = device_ptr<scalar_t>(dy);
    p.dy_c = dy_c.has_value() ? dy_c->const_data_ptr() : nullptr;
    p.c_type = dy_c.has_value() ? compute_type(dy_c->scalar_type()) : kLnrComputeNone;
    p.ds = ds.has_value() ? device_ptr<scalar_t>(*ds) : nullptr;
    p.s = device_ptr<scalar_t>(s);
    p.weight = device_ptr<scalar_t>(weight);
    p.mean = mean.const_data_ptr<float>();
    p.rstd = rstd.const_data_ptr<float>();
    p.dx = device_ptr_mut<branch_t>(dx);
    p.dresidual = device_ptr_mut<scalar_t>(dres);
    p.partial_dw = partial.mutable_data_ptr<float>();
    p.partial_db = p.partial_dw + partials * N;
    p.partial_dxb = has_xb ? p.partial_dw + 2 * partials * N : nullptr;
    p.rows = R;
    p.cols = static_cast<int>(N);
    p.chunk_rows = chunk_rows;
    p.dropout_p = static_cast<float>(dropout_p);
    p.inv_keep = 1.0f / (1.0f - p.dropout_p);
    p.seed = seed_pointer(seed);
    p.vec2 = N % 2 == 0 && aligned2(dy) && (!ds.has_value() || aligned2(*ds)) && aligned2(s) && aligned2(weight) &&
             aligned2(dx) && aligned2(dres) && (!dy_c.has_value() || aligned2(*dy_c));
    p.packs = N % kPack<T> == 0 && aligned16(dy) && (!ds.has_value() || aligned16(*ds)) && aligned16(s) &&
              aligned16(weight) && aligned16(dx) && aligned16(dres) &&
              (!dy_c.has_value() || (sizeof(T) == 2 && aligned16(*dy_c)));
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
    q.partial_dxb = p.partial_dxb;
    q.dx_bias = has_xb ? dx_bias.mutable_data_ptr<float>() : nullptr;
    q.dweight = device_ptr_mut<scalar_t>(dweight);
    q.dbias = device_ptr_mut<scalar_t>(dbias);
    q.partials = static_cast<int>(partials);
    q.cols = p.cols;
    launch(layer_norm_residual_bwd_reduce_kernel<T>, dim3(static_cast<unsigned>((N + kWarpSize - 1) / kWarpSize)),
           dim3(kLnrReduceStripes * kWarpSize), q);
  });
  return {dx, dres, dweight, dbias, has_xb ? dx_bias.to(x_bias->scalar_type()) : dx_bias};
}

}  // namespace fastformer::cuda

#if defined(__CUDACC__)
#include <torch/library.h>

TORCH_LIBRARY_IMPL(fastformer, CUDA, m) { FASTFORMER_IMPL_OP(m, fastformer::cuda, layer_norm_residual); }
#endif
