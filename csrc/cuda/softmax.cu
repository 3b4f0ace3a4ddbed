// Launchers of the softmax kernels (csrc/cuda/softmax.cuh): validate, allocate, pick the layout.
//
// N <= kSoftmaxWarpMaxN: warp per row, kPerLane = ceil(N / 32) rounded up to a power of two (1 .. 32),
// grid ceil(R / 4) blocks of 4 warps. N > kSoftmaxWarpMaxN: block per row, grid R blocks of 256 threads.
// In the warp layout 16-byte runs when N is a multiple of the pack (4 floats, 8 halves) and the tensors are
// 16-byte aligned; else half2/float2 pairs when N is even and every row pointer is 2-element aligned.
#include <ATen/ExpandUtils.h>

#include <cstdint>

#include "cuda_ops.h"
#include "launch.h"
#include "ops.h"
#include "softmax.cuh"

namespace fastformer::cuda {
namespace {

// The expanded mask's addressing: x's leading dims, size-1 dims dropped and neighbours merged where the
// mask's strides allow (outer stride == inner stride * inner size), so the kernels unravel few dims.
SoftmaxMask mask_layout(const Tensor& x, const Tensor& expanded) {
  SoftmaxMask m{};
  m.base = expanded.const_data_ptr<bool>();
  m.col_stride = expanded.stride(-1);
  for (int64_t d = 0; d + 1 < x.dim(); ++d) {
    const int64_t size = x.size(d), stride = expanded.stride(d);
    if (size == 1) continue;
    if (m.dims > 0 && m.strides[m.dims - 1] == stride * size) {
      m.sizes[m.dims - 1] *= size;
      m.strides[m.dims - 1] = stride;
      continue;
    }
    TORCH_CHECK(m.dims < kSoftmaxMaxDims, "fastformer ", kBackend, " softmax: the mask varies along more than ",
                kSoftmaxMaxDims, " separate leading dims of x ", x.sizes(),
                "; reshape x and the mask to fewer dims or pass a contiguous mask of x's shape");
    m.sizes[m.dims] = size;
    m.strides[m.dims] = stride;
    ++m.dims;
  }
  return m;
}

// The warp layout's grid: kSoftmaxWarpRows rows (warps) per block.
dim3 warp_grid(int64_t R) { return dim3(static_cast<unsigned>((R + kSoftmaxWarpRows - 1) / kSoftmaxWarpRows)); }

}  // namespace

Tensor softmax_fwd(const Tensor& x, const c10::optional<Tensor>& mask, double scale) {
  // The arguments were checked by csrc/ops.h (check_softmax); here the backend's own limits.
  check_input(x, "x");
  check_dtype(x, "x");
  SoftmaxMask layout{};
  Tensor expanded;
  if (mask.has_value()) {
    TORCH_CHECK(mask->device() == x.device(), "fastformer ", kBackend, " softmax: mask must be on x's device");
    expanded = mask->expand(x.sizes());  // a view: stride 0 along broadcast dims
    layout = mask_layout(x, expanded);
  }
  Tensor y = at::empty_like(x);
  const int64_t N = x.size(-1), R = N == 0 ? 0 : x.numel() / N;
  if (R == 0) return y;
  check_row_limits("softmax", R, N);
  DeviceScope scope(x);
  FF_DISPATCH_KERNEL_TYPES(x.scalar_type(), "fastformer_softmax_fwd_cuda", [&] {
    using T = typename DeviceType<scalar_t>::type;
    SoftmaxFwdParams<T> p{};
    p.x = device_ptr<scalar_t>(x);
    p.y = device_ptr_mut<scalar_t>(y);
    p.mask = layout;
    p.rows = R;
    p.cols = static_cast<int>(N);
    p.scale = static_cast<float>(scale);
    p.vec2 = N % 2 == 0 && aligned2(x) && aligned2(y);
    p.packs = N % kPack<T> == 0 && aligned16(x) && aligned16(y);
    if (N > kSoftmaxWarpMaxN) {
      launch(softmax_fwd_block_kernel<T>, dim3(static_cast<unsigned>(R)), dim3(kSoftmaxBlockThreads), p);
    } else {
      launch_per_lane(p.cols, warp_grid(R), dim3(kSoftmaxWarpRows * kWarpSize), p, softmax_fwd_warp_kernel<T, 1>,
                      softmax_fwd_warp_kernel<T, 2>, softmax_fwd_warp_kernel<T, 4>, softmax_fwd_warp_kernel<T, 8>,
                      softmax_fwd_warp_kernel<T, 16>, softmax_fwd_warp_kernel<T, 32>);
    }
  });
  return y;
}

Tensor softmax_bwd(const Tensor& dy, const Tensor& y, double scale) {
  // The arguments were checked by csrc/ops.h (check_softmax_bwd); here the backend's own limits.
  check_input(dy, "dy");
  check_input(y, "y");
  check_dtype(y, "y");
  Tensor dx = at::empty_like(y);
  const int64_t N = y.size(-1), R = N == 0 ? 0 : y.numel() / N;
  if (R == 0) return dx;
  check_row_limits("softmax", R, N);
  DeviceScope scope(y);
  FF_DISPATCH_KERNEL_TYPES(y.scalar_type(), "fastformer_softmax_bwd_cuda", [&] {
    using T = typename DeviceType<scalar_t>::type;
    SoftmaxBwdParams<T> p{};
    p.dy = device_ptr<scalar_t>(dy);
    p.y = device_ptr<scalar_t>(y);
    p.dx = device_ptr_mut<scalar_t>(dx);
    p.rows = R;
    p.cols = static_cast<int>(N);
    p.scale = static_cast<float>(scale);
    p.vec2 = N % 2 == 0 && aligned2(dy) && aligned2(y) && aligned2(dx);
    p.packs = N % kPack<T> == 0 && aligned16(dy) && aligned16(y) && aligned16(dx);
    if (N > kSoftmaxWarpMaxN) {
      launch(softmax_bwd_block_kernel<T>, dim3(static_cast<unsigned>(R)), dim3(kSoftmaxBlockThreads), p);
    } else {
      launch_per_lane(p.cols, warp_grid(R), dim3(kSoftmaxWarpRows * kWarpSize), p, softmax_bwd_warp_kernel<T, 1>,
                      softmax_bwd_warp_kernel<T, 2>, softmax_bwd_warp_kernel<T, 4>, softmax_bwd_warp_kernel<T, 8>,
                      softmax_bwd_warp_kernel<T, 16>, softmax_bwd_warp_kernel<T, 32>);
    }
  });
  return dx;
}

}  // namespace fastformer::cuda

#if defined(__CUDACC__)
#include <torch/library.h>

TORCH_LIBRARY_IMPL(fastformer, CUDA, m) { FASTFORMER_IMPL_OP(m, fastformer::cuda, softmax); }
#endif
