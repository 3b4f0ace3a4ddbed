// Small CUDA kernels that test the CPU SIMT execution model itself (tests/cuda_sim/test_model.py):
// coordinates, warp shuffles, 16-bit conversions, a shared-memory handoff with and without its barrier,
// barriers that deadlock on a GPU, and the sm_80 instructions of csrc/cuda/mma.cuh (mma.sync, ldmatrix,
// cp.async). Built with fastformer.cuda_sim.build.
#include <torch/extension.h>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"

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

// One warp, one mma.sync m16n8k16: each lane packs its A (16 x 16) and B (16 x 8) fragments from global
// memory by the PTX ISA's layout, written here independently of the model (lane = 4 g + t), and unpacks
// D = A B + C (16 x 8) the same way.
template <typename T>
FF_GLOBAL void mma_kernel(const T* a, const T* b, const float* c, float* d) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  auto A = [&](int r, int k) { return to_float(a[r * 16 + k]); };
  auto B = [&](int k, int n) { return to_float(b[k * 8 + n]); };
  const uint32_t af[4] = {pack2<T>(A(g, 2 * t), A(g, 2 * t + 1)), pack2<T>(A(g + 8, 2 * t), A(g + 8, 2 * t + 1)),
                          pack2<T>(A(g, 2 * t + 8), A(g, 2 * t + 9)),
                          pack2<T>(A(g + 8, 2 * t + 8), A(g + 8, 2 * t + 9))};
  float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
  mma_16816<T>(acc, af, pack2<T>(B(2 * t, g), B(2 * t + 1, g)), pack2<T>(B(2 * t + 8, g), B(2 * t + 9, g)));
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

// One warp, one ldmatrix.x4 (plain or .trans) of a 16 x 16 tile of 16-bit values staged in shared memory:
// lane l gives the address of row l % 8 of the 8 x 8 matrix l / 8 (matrices in the order (rows 0-7,
// cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), (rows 8-15, cols 8-15)); out (32, 4) holds
// each lane's 4 registers.
template <bool kTrans>
FF_GLOBAL void ldmatrix_kernel(const uint16_t* x, uint32_t* out) {
  __shared__ float4 tile4[16 * 16 * 2 / 16];
  uint16_t* tile = reinterpret_cast<uint16_t*>(tile4);
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) tile[i] = x[i];
  __syncwarp();
  const int m = lane / 8, row = (m / 2) * 8 + lane % 8, col = (m % 2) * 8;
  uint32_t r[4];
  if (kTrans) {
    ldmatrix_x4_trans(r, tile + row * 16 + col);
  } else {
    ldmatrix_x4(r, tile + row * 16 + col);
  }
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// cp.async: each of 32 threads copies 16 bytes (4 floats) of x into shared memory, src_bytes of them
// from x and the rest zero-filled, then records the shared slot before the wait (before: whatever landed
// already, else the -1 it held) and after it (after). wait = false: exits with the copy pending.
FF_GLOBAL void cp_async_kernel(const float* x, int src_bytes, bool wait, float* before, float* after) {
  __shared__ float4 slots[32];
  const int t = threadIdx.x;
  slots[t] = make_float4(-1.0f, -1.0f, -1.0f, -1.0f);
  cp_async16(&slots[t], x + 4 * t, src_bytes);
  cp_async_commit();
  const float4 b = slots[t];
  before[4 * t] = b.x;
  before[4 * t + 1] = b.y;
  before[4 * t + 2] = b.z;
  before[4 * t + 3] = b.w;
  if (!wait) return;
  cp_async_wait<0>();
  const float4 a = slots[t];
  after[4 * t] = a.x;
  after[4 * t + 1] = a.y;
  after[4 * t + 2] = a.z;
  after[4 * t + 3] = a.w;
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

at::Tensor mma(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  TORCH_CHECK(a.sizes() == at::IntArrayRef({16, 16}) && b.sizes() == at::IntArrayRef({16, 8}) &&
                  c.sizes() == at::IntArrayRef({16, 8}) && a.scalar_type() == b.scalar_type(),
              "mma: a (16, 16), b (16, 8) of one 16-bit dtype, c (16, 8) float32");
  check_cpu_float(c);
  auto d = at::full({16, 8}, std::nanf(""), at::kFloat);
  const float* cp = c.data_ptr<float>();
  float* dp = d.data_ptr<float>();
  if (a.scalar_type() == at::kHalf) {
    const auto* ap = reinterpret_cast<const __half*>(a.data_ptr<at::Half>());
    const auto* bp = reinterpret_cast<const __half*>(b.data_ptr<at::Half>());
    fastformer::sim::launch(dim3(1), dim3(32), [&] { mma_kernel<__half>(ap, bp, cp, dp); });
  } else {
    TORCH_CHECK(a.scalar_type() == at::kBFloat16, "mma: float16 or bfloat16 operands");
    const auto* ap = reinterpret_cast<const __nv_bfloat16*>(a.data_ptr<at::BFloat16>());
    const auto* bp = reinterpret_cast<const __nv_bfloat16*>(b.data_ptr<at::BFloat16>());
    fastformer::sim::launch(dim3(1), dim3(32), [&] { mma_kernel<__nv_bfloat16>(ap, bp, cp, dp); });
  }
  return d;
}

// x: (16, 16) int16 (the bits of 16-bit values); returns (32, 4) int64 register values.
at::Tensor ldmatrix(const at::Tensor& x, bool trans) {
  TORCH_CHECK(x.sizes() == at::IntArrayRef({16, 16}) && x.scalar_type() == at::kShort && x.is_contiguous(),
              "ldmatrix: x must be a contiguous (16, 16) int16 tensor");
  std::vector<uint32_t> regs(32 * 4, 0xdeadbeefu);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<int16_t>());
  if (trans) {
    fastformer::sim::launch(dim3(1), dim3(32), [&] { ldmatrix_kernel<true>(xp, regs.data()); });
  } else {
    fastformer::sim::launch(dim3(1), dim3(32), [&] { ldmatrix_kernel<false>(xp, regs.data()); });
  }
  auto out = at::empty({32, 4}, at::kLong);
  for (int i = 0; i < 128; ++i) out.data_ptr<int64_t>()[i] = regs[i];
  return out;
}

std::tuple<at::Tensor, at::Tensor> cp_async(const at::Tensor& x, int64_t src_bytes, bool wait) {
  check_cpu_float(x);
  TORCH_CHECK(x.numel() == 128, "cp_async: x must hold 128 floats");
  auto before = at::full({128}, std::nanf(""), at::kFloat), after = at::full({128}, std::nanf(""), at::kFloat);
  const float* xp = x.data_ptr<float>();
  float *bp = before.data_ptr<float>(), *ap = after.data_ptr<float>();
  fastformer::sim::launch(dim3(1), dim3(32), [&] { cp_async_kernel(xp, static_cast<int>(src_bytes), wait, bp, ap); });
  return {before, after};
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
  m.def("mma", &mma);
  m.def("ldmatrix", &ldmatrix);
  m.def("cp_async", &cp_async);
  m.def("set_schedule_seed", &fastformer::sim::set_schedule_seed);
}
