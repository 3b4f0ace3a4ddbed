// Launchers of the cross_entropy kernels (csrc/cuda/cross_entropy.cuh): validate, allocate, launch a block
// of kCrossEntropyThreads per row (grid R), 16-byte packs when V is a multiple of the pack and the rows are
// 16-byte aligned.
#include <cstdint>

#include "cross_entropy.cuh"
#include "cuda_ops.h"
#include "launch.h"
#include "ops.h"

namespace fastformer::cuda {
namespace {

// The arguments were checked by csrc/ops.h (check_cross_entropy, check_cross_entropy_bwd: shapes, dtypes,
// the targets' range, unless deferred or captured: csrc/value_checks.h); here only that every tensor the
// kernels index is on the device and contiguous (a cheap guard against a direct call of a launcher), and the
// logits' dtype, this backend's own limit.
void check_rows_of(const Tensor& logits, const Tensor& target, std::initializer_list<std::pair<const Tensor*, const char*>> rows) {
  check_input(logits, "logits");
  check_dtype(logits, "logits");
  check_input(target, "target");
  for (const auto& [t, name] : rows) check_input(*t, name);
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> cross_entropy_fwd(const Tensor& logits, const Tensor& target,
                                                     double label_smoothing, int64_t ignore_index) {
  check_rows_of(logits, target, {});
  Tensor loss = at::empty(target.sizes(), logits.options().dtype(at::kFloat));
  Tensor nll = at::empty_like(loss), lse = at::empty_like(loss);
  const int64_t V = logits.size(-1), R = target.numel();
  if (R == 0) return {loss, nll, lse};
  check_row_limits("cross_entropy", R, V);
  DeviceScope scope(logits);
  FF_DISPATCH_KERNEL_TYPES(logits.scalar_type(), "fastformer_cross_entropy_fwd_cuda", [&] {
    using T = typename DeviceType<scalar_t>::type;
    CrossEntropyFwdParams<T> p{};
    p.logits = device_ptr<scalar_t>(logits);
    p.target = target.const_data_ptr<int64_t>();
    p.loss = loss.mutable_data_ptr<float>();
    p.nll = nll.mutable_data_ptr<float>();
    p.lse = lse.mutable_data_ptr<float>();
    p.rows = R;
    p.cols = static_cast<int>(V);
    p.smoothing = static_cast<float>(label_smoothing);
    p.ignore_index = ignore_index;
    p.packs = V % kPack<T> == 0 && aligned16(logits);
    launch(cross_entropy_fwd_kernel<T>, dim3(static_cast<unsigned>(R)), dim3(kCrossEntropyThreads), p);
  });
  return {loss, nll, lse};
}

Tensor cross_entropy_bwd(const Tensor& dloss, const Tensor& dnll, const Tensor& logits, const Tensor& target,
                         const Tensor& lse, double label_smoothing, int64_t ignore_index) {
  check_rows_of(logits, target, {{&dloss, "dloss"}, {&dnll, "dnll"}, {&lse, "lse"}});
  Tensor dlogits = at::empty_like(logits);
  const int64_t V = logits.size(-1), R = target.numel();
  if (R == 0) return dlogits;
  check_row_limits("cross_entropy", R, V);
  DeviceScope scope(logits);
  FF_DISPATCH_KERNEL_TYPES(logits.scalar_type(), "fastformer_cross_entropy_bwd_cuda", [&] {
    using T = typename DeviceType<scalar_t>::type;
    CrossEntropyBwdParams<T> p{};
    p.dloss = dloss.const_data_ptr<float>();
    p.dnll = dnll.const_data_ptr<float>();
    p.logits = device_ptr<scalar_t>(logits);
    p.target = target.const_data_ptr<int64_t>();
    p.lse = lse.const_data_ptr<float>();
    p.dlogits = device_ptr_mut<scalar_t>(dlogits);
    p.rows = R;
    p.cols = static_cast<int>(V);
    p.smoothing = static_cast<float>(label_smoothing);
    p.ignore_index = ignore_index;
    p.packs = V % kPack<T> == 0 && aligned16(logits) && aligned16(dlogits);
    launch(cross_entropy_bwd_kernel<T>, dim3(static_cast<unsigned>(R)), dim3(kCrossEntropyThreads), p);
  });
  return dlogits;
}

}  // namespace fastformer::cuda

#if defined(__CUDACC__)
#include <torch/library.h>

TORCH_LIBRARY_IMPL(fastformer, CUDA, m) { FASTFORMER_IMPL_OP(m, fastformer::cuda, cross_entropy); }

namespace {
// csrc/value_checks.h stream_capture_id: the value checks (targets, cu_seqlens tables) never read the host
// inside a captured graph, and key the tables they checked by capture.
uint64_t current_stream_capture_id(const at::Device& device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &status, &id));
  return status == cudaStreamCaptureStatusNone ? 0 : (id != 0 ? id : ~uint64_t{0});  // 0 stands for "none"
}
[[maybe_unused]] const bool kCaptureQueryInstalled =
    (fastformer::stream_capture_id = &current_stream_capture_id, true);
}  // namespace
#endif
