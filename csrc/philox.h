// Counter-based dropout generator shared by every backend (C++, CUDA, and mirrored in Python by
// fastformer/ops/reference.py and in Triton by tl.randint4x): all of them draw the same mask.
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), with
//   key     = (seed_lo, seed_hi)              the 64-bit seed drawn per call by torch's generator of the
//                                             inputs' device into a 0-dim int64 tensor (csrc/ops.h check_seed)
//   counter = (i >> 2 low, i >> 2 high, 0, 0) i = the element's flat index in the dropped tensor
//   word    = (i & 3)                         one Philox call feeds four consecutive elements.
// The 32-bit word becomes a uniform in [0, 1) exactly as Triton's tl.rand does it
// (int32 x -> (x < 0 ? -x - 1 : x) * 2^-31, in float32); an element is kept iff u >= p.
#pragma once
#if !defined(__CUDACC_RTC__)  // NVRTC has no standard headers; csrc/cuda/compat.h typedefs the ints
#include <cstdint>
#endif

#if defined(__CUDACC__)
#define FF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FF_HOST_DEVICE inline
#endif

namespace fastformer {

struct Philox4 {
  uint32_t w[4];
};

FF_HOST_DEVICE Philox4 philox4x32_10(uint64_t seed, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p2 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p2 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p2);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Triton's uint_to_uniform_float for 32-bit words, bit for bit.
FF_HOST_DEVICE float philox_uniform(uint32_t word) {
  const int32_t x = static_cast<int32_t>(word);
  const int32_t y = x < 0 ? ~x : x;  // -x - 1 without overflow
  return static_cast<float>(y) * 4.6566127342e-10f;
}

// Keep-factor of element i: 1/(1-p) if kept, 0 if dropped.
FF_HOST_DEVICE float dropout_factor(uint64_t seed, uint64_t i, float p, float inv_keep) {
  const Philox4 r = philox4x32_10(seed, i >> 2);
  return philox_uniform(r.w[i & 3]) >= p ? inv_keep : 0.0f;
}

}  // namespace fastformer
