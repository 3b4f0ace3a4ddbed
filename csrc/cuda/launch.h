// Host-side helpers of the launchers csrc/cuda/<op>.cu (ATen; never included by a kernel header).
//
// The launchers are compiled twice: by nvcc into fastformer._C (backend "cuda", CUDA tensors, kernels
// launched on the current stream and checked), and as plain C++ into the cuda_sim extension (backend
// "cuda_sim", CPU tensors, kernels run by the SIMT execution model of csrc/cuda_sim/simt.h). Everything
// that differs between the two lives here, so each launcher is written once.
#pragma once
#include <ATen/ATen.h>

#include <climits>
#include <cstdint>
#include <utility>

#include "compat.h"

#if defined(__CUDACC__)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace fastformer::cuda {

#if defined(__CUDACC__)
constexpr const char* kBackend = "cuda";
#else
constexpr const char* kBackend = "cuda_sim";
#endif

// at:: scalar type -> the kernels' storage type.
template <typename scalar_t> struct DeviceType;
template <> struct DeviceType<float> { using type = float; };
template <> struct DeviceType<at::Half> { using type = __half; };
template <> struct DeviceType<at::BFloat16> { using type = __nv_bfloat16; };

template <typename scalar_t>
inline const typename DeviceType<scalar_t>::type* device_ptr(const at::Tensor& t) {
  return reinterpret_cast<const typename DeviceType<scalar_t>::type*>(t.const_data_ptr<scalar_t>());
}
template <typename scalar_t>
inline typename DeviceType<scalar_t>::type* device_ptr_mut(at::Tensor& t) {
  return reinterpret_cast<typename DeviceType<scalar_t>::type*>(t.mutable_data_ptr<scalar_t>());
}

// A tensor on this backend's device (CUDA, or CPU for cuda_sim).
inline void check_device(const at::Tensor& t, const char* name) {
#if defined(__CUDACC__)
  TORCH_CHECK(t.is_cuda(), "fastformer ", kBackend, " backend: ", name, " must be a CUDA tensor, got ", t.device());
#else
  TORCH_CHECK(t.is_cpu(), "fastformer ", kBackend, " backend: ", name, " must be a CPU tensor, got ", t.device());
#endif
}

// A tensor the kernels may read: on this backend's device and contiguous.
inline void check_input(const at::Tensor& t, const char* name) {
  check_device(t, name);
  TORCH_CHECK(t.is_contiguous(), "fastformer ", kBackend, " backend: ", name, " must be contiguous");
}

// A tensor the kernels read as rows at any strides: on this backend's device, its last dim contiguous.
inline void check_rows(const at::Tensor& t, const char* name) {
  check_device(t, name);
  TORCH_CHECK(t.dim() >= 1 && (t.size(-1) <= 1 || t.stride(-1) == 1), "fastformer ", kBackend, " backend: ", name,
              " must have a contiguous last dim, got strides ", t.strides());
}

// The dropout seed as the kernels take it: a pointer to the 0-dim int64 tensor of the call (csrc/ops.h
// check_seed), on this backend's device; nullptr without one (no dropout). The kernels read it themselves
// (common.cuh load_seed); the host never does: that would be a sync, and a value passed at launch would be
// frozen into a captured CUDA graph, whose replays rewrite the tensor instead.
inline const int64_t* seed_pointer(const c10::optional<at::Tensor>& seed) {
  if (!seed.has_value()) return nullptr;
  check_input(*seed, "seed");
  return seed->const_data_ptr<int64_t>();
}

// float32 and float16 everywhere; bfloat16 on sm_80 and newer (and in the CPU model, which plays sm_80).
inline void check_dtype(const at::Tensor& t, const char* name) {
  const auto d = t.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, "fastformer ", kBackend, " backend: ", name,
              " must be float32, float16 or bfloat16, got ", d);
#if defined(__CUDACC__)
  if (d == at::kBFloat16) {
    const auto* prop = at::cuda::getDeviceProperties(t.get_device());
    TORCH_CHECK(prop->major >= 8, "fastformer cuda backend: bfloat16 needs compute capability 8.0 or newer, device ",
                t.get_device(), " has ", prop->major, ".", prop->minor, "; use float16 or float32");
  }
#endif
}

// Whether t's data starts at a multiple of two elements (half2/float2 pairs) or of 16 bytes (kPack runs).
inline bool aligned2(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % (2 * t.element_size()) == 0;
}
inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; }

// The row kernels index rows and columns with 32-bit ints: R rows of N elements must fit.
inline void check_row_limits(const char* op, int64_t R, int64_t N) {
  TORCH_CHECK(N <= INT_MAX, "fastformer ", kBackend, " ", op, ": rows of ", N, " elements exceed the kernels' limit of ",
              INT_MAX);
  TORCH_CHECK(R <= INT_MAX, "fastformer ", kBackend, " ", op, ": ", R, " rows exceed the kernels' limit of ", INT_MAX);
}

// Makes the inputs' device current for the launches in scope (a no-op in the CPU model).
struct DeviceScope {
#if defined(__CUDACC__)
  explicit DeviceScope(const at::Tensor& t) : guard(t.device()) {}
  c10::cuda::CUDAGuard guard;
#else
  explicit DeviceScope(const at::Tensor&) {}
#endif
};

// Streaming multiprocessors of the current device (the CPU model plays a device with 8).
inline int multiprocessor_count() {
#if defined(__CUDACC__)
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
#else
  return 8;
#endif
}

// Compute capability of the current device as 10 major + minor (the CPU model plays 80 unless told
// otherwise: fastformer::sim::set_compute_capability).
inline int compute_capability() {
#if defined(__CUDACC__)
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  return prop->major * 10 + prop->minor;
#else
  return ::fastformer::sim::compute_capability();
#endif
}

// kernel<<<grid, block, 0, current stream>>>(args...) followed by a launch check; in the CPU model,
// the grid's blocks run on the SIMT execution model. No dynamic shared memory.
template <typename... KernelArgs, typename... Args>
inline void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, Args&&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
#if defined(__CUDACC__)
  kernel<<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
#else
  ::fastformer::sim::launch(grid, block, [&] { kernel(args...); });
#endif
}

// The warp-row layout (common.cuh): launches kernel<T, kPerLane> for the smallest kPerLane in
// {1, 2, 4, ..., 32} with 32 kPerLane >= cols (the caller keeps cols <= 1024).
template <typename P, typename K1, typename K2, typename K4, typename K8, typename K16, typename K32>
inline void launch_per_lane(int cols, dim3 grid, dim3 block, const P& p, K1 k1, K2 k2, K4 k4, K8 k8, K16 k16, K32 k32) {
  const int per_lane = (cols + 31) / 32;
  if (per_lane <= 1) launch(k1, grid, block, p);
  else if (per_lane <= 2) launch(k2, grid, block, p);
  else if (per_lane <= 4) launch(k4, grid, block, p);
  else if (per_lane <= 8) launch(k8, grid, block, p);
  else if (per_lane <= 16) launch(k16, grid, block, p);
  else launch(k32, grid, block, p);
}

// AT_DISPATCH over the dtypes the kernels store (float, half, bfloat16): scalar_t is the at:: type.
#define FF_DISPATCH_KERNEL_TYPES(TYPE, NAME, ...)                                    \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)          \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)       \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

}  // namespace fastformer::cuda
