// Small CUDA kernels that test the CPU SIMT execution model itself (tests/cuda_sim/test_model.py):
// coordinates, warp shuffles, 16-bit conversions, a shared-memory handoff with and without its barrier,
// and barriers that deadlock on a GPU. Built with fastformer.cuda_sim.build.
#include <torch/extension.h>

#include "cuda/common.cuh"

namespace {

using namespace fastformer::cuda;

// out[global thread][0..5] = threadIdx.x/y/z, blockIdx.x/y/z.
FF_GLOBAL void coords_kernel(int* out) {
  const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  int* o = out + (block * blockDim.x * blockDim.y * blockDim.z + thread) * 6;
  o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
  o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z;
}

// One warp; out (4, 32): shfl(x, src[lane]), shfl_xor(x, arg), shfl_down(x, arg), shfl_up(x, arg).
FF_GLOBAL void shuffle_kernel(const float* x, const int* src, int arg, int width, float* out) {
  const int lane = threadIdx.x;
  const float v = x[lane];
  out[lane] = __shfl_sync(kFullMask, v, src[lane], width);
  out[32 + lane] = __shfl_xor_sync(kFullMask, v, arg, width);
  out[64 + lane] = __shfl_down_sync(kFullMask, v, arg, width);
  out[96 + lane] = __shfl_up_sync(kFullMask, v, arg, width);
}

FF_GLOBAL void convert_kernel(const float* x, int n, float* half_out, float* bf16_out) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    half_out[i] = to_float(from_float<__half>(x[i]));
    bf16_out[i] = to_float(from_float<__nv_bfloat16>(x[i]));
  }
}

// Each block reverses its row of 256 values through shared memory: thread t stores x[t], then loads
// the value thread 255 - t stored. Without the barrier between store and load a thread reads a slot
// its partner has not written yet (in this launch): the race the model must expose.
template <bool kBarrier>
FF_GLOBAL void reverse_kernel(const float* x, float* out) {
  __shared__ float tile[256];
  const int t = threadIdx.x;
  tile[t] = x[blockIdx.x * 256 + t];
  if (kBarrier) __syncthreads();
  out[blockIdx.x * 256 + t] = tile[255 - t];
}

// Only half the block reaches the barrier.
FF_GLOBAL void divergent_barrier_kernel(float* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// Two warps wait at two different __syncthreads.
FF_GLOBAL void two_barriers_kernel(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// Half a warp takes part in a shuffle.
FF_GLOBAL void divergent_shuffle_kernel(float* out) {
  float v = threadIdx.x;
  if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(kFullMask, v, 1);
  out[threadIdx.x] = v;
}

void check_cpu_float(const at::Tensor& t) {
  TORCH_CHECK(t.is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat, "expected a contiguous CPU float tensor");
}

at::Tensor coords(std::vector<int64_t> grid, std::vector<int64_t> block) {
  const dim3 g(grid[0], grid[1], grid[2]), b(block[0], block[1], block[2]);
  auto out = at::full({grid[0] * grid[1] * grid[2] * block[0] * block[1] * block[2], 6}, -1, at::kInt);
  int* p = out.data_ptr<int>();
  fastformer::sim::launch(g, b, [&] { coords_kernel(p); });
  return out;
}

at::Tensor shuffles(const at::Tensor& x, const at::Tensor& src, int64_t arg, int64_t width) {
  check_cpu_float(x);
  auto out = at::full({4, 32}, std::nanf(""), at::kFloat);
  const float* xp = x.data_ptr<float>();
  const int* sp = src.data_ptr<int>();
  float* op = out.data_ptr<float>();
  fastformer::sim::launch(dim3(1), dim3(32), [&] { shuffle_kernel(xp, sp, arg, width, op); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> convert(const at::Tensor& x) {
  check_cpu_float(x);
  auto h = at::empty_like(x), b = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float *hp = h.data_ptr<float>(), *bp = b.data_ptr<float>();
  const int n = x.numel();
  fastformer::sim::launch(dim3(1), dim3(64), [&] { convert_kernel(xp, n, hp, bp); });
  return {h, b};
}

at::Tensor reverse(const at::Tensor& x, bool barrier) {
  check_cpu_float(x);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 256, "x must be (rows, 256)");
  auto out = at::full_like(x, std::nanf(""));
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (barrier) {
    fastformer::sim::launch(dim3(x.size(0)), dim3(256), [&] { reverse_kernel<true>(xp, op); });
  } else {
    fastformer::sim::launch(dim3(x.size(0)), dim3(256), [&] { reverse_kernel<false>(xp, op); });
  }
  return out;
}

void run_broken(const std::string& which) {
  auto out = at::zeros({64}, at::kFloat);
  float* op = out.data_ptr<float>();
  if (which == "divergent_barrier") {
    fastformer::sim::launch(dim3(2), dim3(64), [&] { divergent_barrier_kernel(op); });
  } else if (which == "two_barriers") {
    fastformer::sim::launch(dim3(1), dim3(64), [&] { two_barriers_kernel(op); });
  } else if (which == "divergent_shuffle") {
    fastformer::sim::launch(dim3(1), dim3(64), [&] { divergent_shuffle_kernel(op); });
  } else if (which == "bad_block") {
    fastformer::sim::launch(dim3(1), dim3(48), [&] { divergent_barrier_kernel(op); });
  } else {
    TORCH_CHECK(false, "unknown broken kernel ", which);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("coords", &coords);
  m.def("shuffles", &shuffles);
  m.def("convert", &convert);
  m.def("reverse", &reverse);
  m.def("run_broken", &run_broken);
  m.def("set_schedule_seed", &fastformer::sim::set_schedule_seed);
}
