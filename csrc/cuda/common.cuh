// Device helpers shared by the kernels of csrc/cuda/: element conversion, vector loads, the warp-row
// register layout, warp and block reductions. Compiles under nvcc, NVRTC and the CPU SIMT model (compat.h).
#pragma once
#include "compat.h"
#include "../philox.h"

namespace fastformer {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

FF_DEVICE float ff_inf() { return __int_as_float(0x7f800000); }
FF_DEVICE float ff_nan() { return __int_as_float(0x7fffffff); }

// The max m of a softmax row (masked entries -inf) made to carry the rule for non-finite logits that every
// backend follows: +inf becomes NaN (NaN stays NaN; finite and -inf are unchanged), so every e^(a - m),
// the sum l and the whole output row turn NaN. A NaN logit needs no test: fmaxf drops it from m, but its
// e^(NaN - m) makes l NaN, and the row's 1 / l spreads it to every column.
FF_DEVICE float poison_unbounded(float m) { return m < ff_inf() ? m : ff_nan(); }

FF_DEVICE int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Element <-> float32 (all arithmetic is in float32; storage is float, __half or __nv_bfloat16).
FF_DEVICE float to_float(float x) { return x; }
FF_DEVICE float to_float(__half x) { return __half2float(x); }
FF_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> FF_DEVICE T from_float(float x);
template <> FF_DEVICE float from_float<float>(float x) { return x; }
template <> FF_DEVICE __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> FF_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Two consecutive elements p[0], p[1] as float2 in one load (p must be aligned to 2 elements):
// a 4-byte half2/bfloat162 load or an 8-byte float2 load.
FF_DEVICE float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }
FF_DEVICE float2 load2(const __half* p) { return __half22float2(*reinterpret_cast<const __half2*>(p)); }
FF_DEVICE float2 load2(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
FF_DEVICE void store2(float* p, float2 v) { *reinterpret_cast<float2*>(p) = v; }
FF_DEVICE void store2(__half* p, float2 v) { *reinterpret_cast<__half2*>(p) = __float22half2_rn(v); }
FF_DEVICE void store2(__nv_bfloat16* p, float2 v) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __float22bfloat162_rn(v);
}

// Butterfly reductions over the 32 lanes of a warp (every lane gets the result; all lanes must call).
FF_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}
// warp_max drops NaN (fmaxf): the softmaxes carry NaN through their sums instead (poison_unbounded).
FF_DEVICE float warp_max(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

// 16-byte packs (128-bit loads and stores): kPack<T> elements, 4 floats or 8 halves. p must be 16-byte aligned.
template <typename T>
constexpr int kPack = 16 / static_cast<int>(sizeof(T));

template <typename T>
FF_DEVICE void load_pack(const T* p, float* v) {  // v[0 .. kPack<T>)
  const float4 raw = *reinterpret_cast<const float4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kPack<T>; ++i) v[i] = to_float(e[i]);
}

template <typename T>
FF_DEVICE void store_pack(T* p, const float* v) {
  float4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < kPack<T>; ++i) e[i] = from_float<T>(v[i]);
  *reinterpret_cast<float4*>(p) = raw;
}

// The warp-row register layout (softmax and layer_norm_residual, rows of N <= 32 kPerLane): a warp holds
// a row, lane l keeps kPerLane values in registers, in runs of `width` consecutive columns: value i of
// lane l is column width l + 32 width (i / width) + i % width. width = kPack<T> (16-byte loads and
// stores) when N is a multiple of the pack, the rows are 16-byte aligned and a lane holds at least a
// pack; else 2 (half2/float2 pairs) when N is even and the rows 2-element aligned; else 1. Columns >= N
// exist only in registers (read as 0, never stored). Each load or store instruction of the warp moves
// 32 width consecutive elements: fully coalesced at every width.
FF_DEVICE int warp_row_col(int i, int lane, int width) {
  return width * lane + width * kWarpSize * (i / width) + i % width;
}

// The run width for kPerLane values of T per lane; packs / vec2: the launcher's alignment findings.
template <typename T, int kPerLane>
FF_DEVICE int warp_row_width(bool packs, bool vec2) {
  return kPerLane >= kPack<T> && packs ? kPack<T> : kPerLane >= 2 && vec2 ? 2 : 1;
}

// Loads a lane's kPerLane values of a row as float (columns >= n read as 0).
template <int kPerLane, typename T>
FF_DEVICE void warp_row_load(const T* row, int n, int lane, int width, float (&v)[kPerLane]) {
  if (width == kPack<T>) {
#pragma unroll
    for (int i = 0; i < kPerLane; i += kPack<T>) {
      const int col = warp_row_col(i, lane, kPack<T>);
      if (col < n) {
        load_pack(row + col, v + i);
      } else {
#pragma unroll
        for (int j = 0; j < kPack<T>; ++j) v[i + j] = 0.0f;
      }
    }
  } else if (width == 2) {
#pragma unroll
    for (int i = 0; i < kPerLane; i += 2) {
      const int col = warp_row_col(i, lane, 2);
      const float2 t = col < n ? load2(row + col) : float2{0.0f, 0.0f};
      v[i] = t.x;
      v[i + 1] = t.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int col = warp_row_col(i, lane, 1);
      v[i] = col < n ? to_float(row[col]) : 0.0f;
    }
  }
}

// Stores a lane's kPerLane values (columns < n), rounded to T.
template <int kPerLane, typename T>
FF_DEVICE void warp_row_store(T* row, int n, int lane, int width, const float (&v)[kPerLane]) {
  if (width == kPack<T>) {
#pragma unroll
    for (int i = 0; i < kPerLane; i += kPack<T>) {
      const int col = warp_row_col(i, lane, kPack<T>);
      if (col < n) store_pack(row + col, v + i);
    }
  } else if (width == 2) {
#pragma unroll
    for (int i = 0; i < kPerLane; i += 2) {
      const int col = warp_row_col(i, lane, 2);
      if (col < n) store2(row + col, float2{v[i], v[i + 1]});
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int col = warp_row_col(i, lane, 1);
      if (col < n) row[col] = from_float<T>(v[i]);
    }
  }
}

// The dropout seed of a launch, read from memory: the call's 0-dim int64 seed tensor (launch.h seed_pointer),
// never a launch argument, since a replayed CUDA graph repeats its launches' arguments while torch's
// generator writes a new seed into the tensor on every replay. Read only with dropout on (without, the
// pointer may be null). The SIMT and row kernels call it at each Philox evaluation: a volatile 8-byte load
// (a cache hit, beside a Philox call's ~60 integer operations) that keeps the compiler from holding the
// seed, and the round keys it derives from it, in registers through the kernel; so they take no more
// registers than with the seed as a launch argument (docs/kernels.md). The tensor-core kernels
// (attention_mma.cuh) read it once per block into shared memory: there a read per call spilled.
FF_DEVICE uint64_t load_seed(const int64_t* seed) {
  return static_cast<uint64_t>(*static_cast<const volatile int64_t*>(seed));
}

// Keep-factors of elements i and i + 1 for an even i (csrc/philox.h dropout_factor of each): both words
// come from the one Philox call of counter i >> 2.
FF_DEVICE float2 dropout_factor2(uint64_t seed, uint64_t i, float p, float inv_keep) {
  const Philox4 r = philox4x32_10(seed, i >> 2);
  const bool high = (i & 2) != 0;
  return float2{philox_uniform(high ? r.w[2] : r.w[0]) >= p ? inv_keep : 0.0f,
                philox_uniform(high ? r.w[3] : r.w[1]) >= p ? inv_keep : 0.0f};
}

// Keep-factors (csrc/philox.h dropout_factor: 1/(1-p) kept, 0 dropped) of a lane's kPerLane values in the
// warp-row layout, value i being element base + warp_row_col(i) of the dropped tensor, under the seed at
// `seed` (load_seed at each Philox call). One Philox call yields the words of 4 consecutive elements: runs
// of 4 or more (base and the runs' columns are multiples of 4 then) take one call per 4 values, pairs one
// call per pair, single values one call each.
template <int kPerLane>
FF_DEVICE void warp_row_dropout(const int64_t* seed, int64_t base, int lane, int width, float p, float inv_keep,
                                float (&r)[kPerLane]) {
  if (width >= 4) {
#pragma unroll
    for (int i = 0; i < kPerLane; i += 4) {
      const Philox4 w =
          philox4x32_10(load_seed(seed), static_cast<uint64_t>(base + warp_row_col(i, lane, width)) >> 2);
#pragma unroll
      for (int k = 0; k < 4; ++k) r[i + k] = philox_uniform(w.w[k]) >= p ? inv_keep : 0.0f;
    }
  } else if (width == 2) {
#pragma unroll
    for (int i = 0; i < kPerLane; i += 2) {
      const float2 f =
          dropout_factor2(load_seed(seed), static_cast<uint64_t>(base + warp_row_col(i, lane, 2)), p, inv_keep);
      r[i] = f.x;
      r[i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      r[i] = dropout_factor(load_seed(seed), static_cast<uint64_t>(base + warp_row_col(i, lane, 1)), p,
                            inv_keep);
    }
  }
}

// Online softmax state (softmax, cross_entropy): running max m and sum l of e^(a - m).
struct SoftmaxOnline {
  float m, l;
};

FF_DEVICE void softmax_online_add(SoftmaxOnline& s, float a) {
  if (a > s.m) {  // the max grows (from -inf too: e^(-inf) = 0 and l is 0 then)
    s.l = s.l * expf(s.m - a) + 1.0f;
    s.m = a;
  } else if (a != -ff_inf()) {
    s.l += expf(a - s.m);
  }
}

// Commutative bit for bit (max and + are), so butterfly partners agree. With m = -inf both l are 0, or NaN
// (a NaN a added while m was -inf): a.l + b.l keeps that NaN.
FF_DEVICE SoftmaxOnline softmax_online_merge(SoftmaxOnline a, SoftmaxOnline b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -ff_inf()) return SoftmaxOnline{m, a.l + b.l};
  return SoftmaxOnline{m, a.l * expf(a.m - m) + b.l * expf(b.m - m)};
}

FF_DEVICE SoftmaxOnline softmax_warp_merge(SoftmaxOnline s) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const SoftmaxOnline o{__shfl_xor_sync(kFullMask, s.m, offset), __shfl_xor_sync(kFullMask, s.l, offset)};
    s = softmax_online_merge(s, o);
  }
  return s;
}

// Sums kValues floats over the threads of the block (blockDim.x a multiple of 32, at most 1024): each warp
// reduces by shuffles, lane 0 of each stages its sums in scratch, then every warp sums the staged values
// in the same order, so all threads get the same result. scratch: the caller's __shared__
// float[kValues][kWarpSize], reusable right after the call. All threads of the block must call it
// (two __syncthreads).
template <int kValues>
FF_DEVICE void block_sum(float (&v)[kValues], float (*scratch)[kWarpSize]) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int i = 0; i < kValues; ++i) v[i] = warp_sum(v[i]);
  __syncthreads();  // every reader of the previous call is done with scratch
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kValues; ++i) scratch[i][warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kValues; ++i) v[i] = warp_sum(lane < warps ? scratch[i][lane] : 0.0f);
}

}  // namespace cuda
}  // namespace fastformer
