// The CPU SIMT execution model: runs the CUDA kernels of csrc/cuda/*.cuh, unchanged, on the CPU.
//
// Test equipment for the "cuda_sim" backend (never serves users). A launch runs the grid's blocks
// (spread over OpenMP threads); inside a block every CUDA thread is a fiber (ucontext) with its own
// stack, so per-thread locals are private and `__shared__` variables (static thread_local here) are
// shared by the block. Fibers run one at a time until they reach a barrier:
//   __syncthreads()            block barrier: released when every thread of the block waits at it,
//                              at the same source line;
//   __syncwarp(), __shfl_*()   warp collectives: released when all 32 lanes wait at the same one;
//                              a shuffle's values are exchanged at the release, and the warp runs on:
//                              warps advance independently until they reach a __syncthreads.
// A thread that exits while others wait at a barrier, threads waiting at different barriers, or a
// state where nothing can run is a deadlock on a GPU (or undefined behaviour): here it raises a
// std::runtime_error naming the block, the threads and the source lines, never hangs.
// Between barriers the order in which warps (and lanes) run is shuffled from the schedule seed
// (set_schedule_seed; 0 = index order), so a missing barrier lets a thread read shared memory that
// another has not written yet, or has already overwritten, and the result changes.
//
// Only what csrc/cuda/compat.h promises is provided: thread/block coordinates, static shared memory,
// the barriers and full-mask shuffles above, __half/__nv_bfloat16 storage types with their conversion
// intrinsics, float2/float4 and a few math functions; and, for the sm_80 tensor-core kernels
// (csrc/cuda/mma.cuh), the warp-collective instructions mma.sync and ldmatrix and the asynchronous
// copies cp.async:
//   warp_collective()          an instruction whose lanes exchange more than a shuffle's 8 bytes: each
//                              lane deposits a pointer to its operand record; when all 32 lanes wait at
//                              the same one, a function computes every lane's results from the 32
//                              records at once (mma.sync's and ldmatrix's fragment layouts of the PTX
//                              ISA live in csrc/cuda/mma.cuh; a wrong lane mapping gives wrong numbers);
//   cp_async / commit / wait   a copy lands either at once or only when its thread's cp.async.wait_group
//                              retires its group, drawn per copy from the schedule seed (seed 0: at the
//                              wait): a tile read before its wait (or before the __syncthreads after it)
//                              holds stale data, a buffer refilled while another warp still reads it
//                              changes under that warp, and a thread that exits with copies never
//                              waited for raises an error.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace fastformer {
namespace sim {

struct Coords {
  dim3 thread_idx, block_idx, block_dim, grid_dim;
};

// Coordinates of the running CUDA thread (only valid inside a kernel run by launch()).
const Coords& coords();

// Runs body() once per thread of every block of the grid. Throws std::runtime_error on a deadlock,
// a divergent barrier or an invalid configuration (block size not a multiple of 32 or above 1024).
void launch(dim3 grid, dim3 block, const std::function<void()>& body);

// The seed that shuffles the order of warps and lanes between barriers (0 = index order).
void set_schedule_seed(uint64_t seed);
uint64_t schedule_seed();

// Mutation testing: the __syncthreads at `line` of the file whose path ends with `file` becomes a no-op
// (as if deleted from the source) until cleared with an empty file name. Returns nothing; the number
// of times a thread passed the deleted barrier is deleted_barrier_hits().
void delete_barrier(const char* file, int line);
uint64_t deleted_barrier_hits();

// Barriers, called through the macros below with the call site.
void syncthreads(const char* file, int line);
void syncwarp(unsigned mask, const char* file, int line);

// A warp-collective instruction with per-lane operands of any size (mma.sync, ldmatrix): `record` is the
// calling lane's operand record; when all 32 lanes wait at the same call site, compute(records) runs
// once with the 32 records (index = lane) and writes each lane's results into its own record.
using CollectiveFn = void (*)(void* const* records);
void warp_collective(void* record, CollectiveFn compute, const char* file, int line);

// Asynchronous global -> shared copies (cp.async.cg.shared.global [dst], [src], bytes, src_bytes): copies
// src_bytes and zero-fills up to `bytes`; queued on the calling thread until a wait retires its group.
void cp_async(void* dst, const void* src, int bytes, int src_bytes);
void cp_async_commit();                   // cp.async.commit_group: the queued copies form a group
void cp_async_wait(int pending_groups);   // cp.async.wait_group N: all but the newest N groups done

// The compute capability the model plays (launchers choose kernels by it): 80 unless set (e.g. 60 runs
// the P100 SIMT kernels for every dtype).
void set_compute_capability(int major_minor);
int compute_capability();

enum class ShuffleMode { kIndex, kXor, kDown, kUp };
// A warp shuffle of a value of up to 8 bytes; returns the bits the source lane deposited.
uint64_t shuffle(unsigned mask, uint64_t bits, ShuffleMode mode, int lane_arg, int width, const char* file, int line);

// A call site of a warp collective; the macros below build one so errors can name the source line.
struct CallSite {
  const char* file;
  int line;

  template <typename T>
  T exchange(unsigned mask, T value, ShuffleMode mode, int lane_arg, int width) const {
    static_assert(sizeof(T) <= 8, "cuda_sim: shuffles move values of up to 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    bits = shuffle(mask, bits, mode, lane_arg, width, file, line);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
  }
  template <typename T>
  T shfl(unsigned mask, T value, int src_lane, int width = 32) const {
    return exchange(mask, value, ShuffleMode::kIndex, src_lane, width);
  }
  template <typename T>
  T shfl_xor(unsigned mask, T value, int lane_mask, int width = 32) const {
    return exchange(mask, value, ShuffleMode::kXor, lane_mask, width);
  }
  template <typename T>
  T shfl_down(unsigned mask, T value, int delta, int width = 32) const {
    return exchange(mask, value, ShuffleMode::kDown, delta, width);
  }
  template <typename T>
  T shfl_up(unsigned mask, T value, int delta, int width = 32) const {
    return exchange(mask, value, ShuffleMode::kUp, delta, width);
  }
  void sync_warp(unsigned mask = 0xffffffffu) const { syncwarp(mask, file, line); }
  void sync_block() const { syncthreads(file, line); }
};

}  // namespace sim
}  // namespace fastformer

// ---- CUDA built-ins -------------------------------------------------------------------------------
#define threadIdx (::fastformer::sim::coords().thread_idx)
#define blockIdx (::fastformer::sim::coords().block_idx)
#define blockDim (::fastformer::sim::coords().block_dim)
#define gridDim (::fastformer::sim::coords().grid_dim)
constexpr int warpSize = 32;

#define __shared__ static thread_local
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __syncthreads() (::fastformer::sim::CallSite{__FILE__, __LINE__}.sync_block())
#define __syncwarp(...) (::fastformer::sim::CallSite{__FILE__, __LINE__}.sync_warp(__VA_ARGS__))
#define __shfl_sync(...) (::fastformer::sim::CallSite{__FILE__, __LINE__}.shfl(__VA_ARGS__))
#define __shfl_xor_sync(...) (::fastformer::sim::CallSite{__FILE__, __LINE__}.shfl_xor(__VA_ARGS__))
#define __shfl_down_sync(...) (::fastformer::sim::CallSite{__FILE__, __LINE__}.shfl_down(__VA_ARGS__))
#define __shfl_up_sync(...) (::fastformer::sim::CallSite{__FILE__, __LINE__}.shfl_up(__VA_ARGS__))

template <typename T>
inline T __ldg(const T* p) { return *p; }

// ---- vector types -------------------------------------------------------------------------------
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// ---- math ---------------------------------------------------------------------------------------
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

// ---- 16-bit storage types (bit-compatible with c10::Half / c10::BFloat16), round to nearest even ----
struct alignas(2) __half { uint16_t x; };
struct alignas(2) __nv_bfloat16 { uint16_t x; };
struct alignas(4) __half2 { __half x, y; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };

inline float __half2float(__half h) {
  const uint32_t sign = static_cast<uint32_t>(h.x & 0x8000u) << 16;
  const uint32_t exp = (h.x >> 10) & 0x1fu, man = h.x & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp != 0) return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
  const float sub = static_cast<float>(man) * 5.9604644775390625e-08f;  // subnormal: man * 2^-24
  return sign ? -sub : sub;
}
inline __half __float2half_rn(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7fffffffu;
  if (au >= 0x7f800000u) return __half{static_cast<uint16_t>(sign | (au > 0x7f800000u ? 0x7e00u : 0x7c00u))};
  if (au >= 0x477ff000u) return __half{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to >= 65520: inf
  if (au < 0x38800000u) {  // below the smallest normal half 2^-14: a subnormal (or zero), man = round(|f| * 2^24)
    const float scaled = __uint_as_float(au) * 16777216.0f;
    return __half{static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)))};
  }
  const uint32_t rounded = au + 0xfffu + ((au >> 13) & 1u);  // round mantissa to 10 bits, ties to even
  return __half{static_cast<uint16_t>(sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13))};
}
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float(static_cast<uint32_t>(b.x) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // nan
  return __nv_bfloat16{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
inline __half2 __float22half2_rn(float2 v) { return __half2{__float2half_rn(v.x), __float2half_rn(v.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half_rn(a), __float2half_rn(b)}; }
inline __half2 __halves2half2(__half a, __half b) { return __half2{a, b}; }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 b) { return float2{__bfloat162float(b.x), __bfloat162float(b.y)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) {
  return __nv_bfloat162{__float2bfloat16_rn(v.x), __float2bfloat16_rn(v.y)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
