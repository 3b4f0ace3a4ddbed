// CPU helper over csrc/philox.h: fills the keep-factors of a contiguous run of elements,
// one Philox call per four elements (instead of one per element).
#pragma once
#include <cstdint>
#include "philox.h"

namespace fastformer::cpu {

// factor[t] = (1/(1-p) if element start+t is kept else 0), t in [0, n).
template <typename acc_t>
inline void dropout_factors(uint64_t seed, uint64_t start, int64_t n, double p, acc_t* factor) {
  const float p32 = static_cast<float>(p);  // the comparison is in float32 on every backend
  const acc_t inv_keep = acc_t(1) / (acc_t(1) - static_cast<acc_t>(p));
  int64_t t = 0;
  while (t < n) {
    const uint64_t i = start + static_cast<uint64_t>(t);
    const Philox4 r = philox4x32_10(seed, i >> 2);
    for (uint32_t w = static_cast<uint32_t>(i & 3); w < 4 && t < n; ++w, ++t) {
      factor[t] = philox_uniform(r.w[w]) >= p32 ? inv_keep : acc_t(0);
    }
  }
}

}  // namespace fastformer::cpu
