// CPU helper over csrc/philox.h: fills the keep-factors of a contiguous run of elements,
// one Philox call per four elements (instead of one per element).
#pragma once
#include <algorithm>
#include <cstdint>
#include "philox.h"

namespace fastformer::cpu {

// Philox4x32-10 of kLanes consecutive counters at once, written lane-parallel (structure of arrays,
// 32x32->64-bit products) so the compiler vectorizes it (vpmuludq): words[w][lane] is word w of
// counter first + lane.
constexpr int64_t kPhiloxLanes = 16;

inline void philox_lanes(uint64_t seed, uint64_t first, uint32_t words[4][kPhiloxLanes]) {
  uint32_t c0[kPhiloxLanes], c1[kPhiloxLanes], c2[kPhiloxLanes], c3[kPhiloxLanes];
  for (int64_t l = 0; l < kPhiloxLanes; ++l) {
    const uint64_t counter = first + static_cast<uint64_t>(l);
    c0[l] = static_cast<uint32_t>(counter);
    c1[l] = static_cast<uint32_t>(counter >> 32);
    c2[l] = 0;
    c3[l] = 0;
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
#pragma omp simd
    for (int64_t l = 0; l < kPhiloxLanes; ++l) {
      const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0[l];
      const uint64_t p2 = static_cast<uint64_t>(0xCD9E8D57u) * c2[l];
      const uint32_t n0 = static_cast<uint32_t>(p2 >> 32) ^ c1[l] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[l] ^ k1;
      c1[l] = static_cast<uint32_t>(p2);
      c3[l] = static_cast<uint32_t>(p0);
      c0[l] = n0;
      c2[l] = n2;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int64_t l = 0; l < kPhiloxLanes; ++l) {
    words[0][l] = c0[l];
    words[1][l] = c1[l];
    words[2][l] = c2[l];
    words[3][l] = c3[l];
  }
}

// The smallest y in [0, 2^31] with philox_uniform's float(y) * 2^-31 >= p (that product is monotonic
// in y), so "kept" becomes an integer compare, exactly equal to the float one.
inline int32_t keep_threshold(float p) {
  int64_t lo = 0, hi = int64_t(1) << 31;  // answer in [lo, hi]
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<float>(mid) * 4.6566127342e-10f >= p) hi = mid; else lo = mid + 1;
  }
  return static_cast<int32_t>(std::min<int64_t>(lo, INT32_MAX));
}

// factor[t] = (1/(1-p) if element start+t is kept else 0), t in [0, n): one Philox call per four
// elements, kPhiloxLanes calls (4 * kPhiloxLanes elements) at a time where the run is aligned.
template <typename acc_t>
inline void dropout_factors(uint64_t seed, uint64_t start, int64_t n, double p, acc_t* factor) {
  const float p32 = static_cast<float>(p);  // the comparison is in float32 on every backend
  const acc_t inv_keep = acc_t(1) / (acc_t(1) - static_cast<acc_t>(p));
  const int32_t threshold = keep_threshold(p32);
  constexpr int64_t kBlock = 4 * kPhiloxLanes;
  uint32_t words[4][kPhiloxLanes];
  int64_t t = 0;
  for (; t < n && ((start + t) & 3) != 0; ++t) {  // unaligned head, one element at a time
    factor[t] = philox_uniform(philox4x32_10(seed, (start + t) >> 2).w[(start + t) & 3]) >= p32 ? inv_keep : acc_t(0);
  }
  for (; t + kBlock <= n; t += kBlock) {
    philox_lanes(seed, (start + t) >> 2, words);
    acc_t* out = factor + t;
#pragma omp simd
    for (int64_t l = 0; l < kPhiloxLanes; ++l) {
      for (int w = 0; w < 4; ++w) {
        const int32_t x = static_cast<int32_t>(words[w][l]);
        out[4 * l + w] = (x ^ (x >> 31)) >= threshold ? inv_keep : acc_t(0);  // x ^ (x >> 31) = x < 0 ? -x - 1 : x
      }
    }
  }
  if (t < n) {  // tail
    philox_lanes(seed, (start + t) >> 2, words);
    for (int64_t e = 0; t < n; ++e, ++t) {
      factor[t] = philox_uniform(words[e & 3][e >> 2]) >= p32 ? inv_keep : acc_t(0);
    }
  }
}

}  // namespace fastformer::cpu
