// CPU helper over csrc/philox.h: fills the keep-factors of a contiguous run of elements,
// one Philox call per four elements (instead of one per element).
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif
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

#if defined(CPU_CAPABILITY_AVX512)
// Philox4x32-10 and the keep test for 16 consecutive counters (64 elements) in AVX-512 registers, then
// the transpose into element order (element 4 l + w = word w of counter l): faster than the compiler's
// vectorization of philox_lanes (docs/cpu-kernels.md, "Measured"). Each
// counter's words sit in the low halves of 64-bit lanes (two registers of 8 counters per word), so one
// vpmuludq gives a full 32 x 32 -> 64-bit product: its low half is the product's lo word and a shift
// gives the hi word. The high halves of the lanes carry garbage that vpmuludq and the final pack ignore.
struct PhiloxKeysAvx512 {
  __m512i k0[10], k1[10];  // the round keys, broadcast
  explicit PhiloxKeysAvx512(uint64_t seed) {
    uint32_t a = static_cast<uint32_t>(seed), b = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round, a += 0x9E3779B9u, b += 0xBB67AE85u) {
      k0[round] = _mm512_set1_epi32(static_cast<int32_t>(a));
      k1[round] = _mm512_set1_epi32(static_cast<int32_t>(b));
    }
  }
};

inline void philox_factors_avx512(const PhiloxKeysAvx512& keys, uint64_t first, __m512i threshold, __m512 inv_keep,
                                  float* out) {
  const __m512i m0 = _mm512_set1_epi64(0xD2511F53), m2 = _mm512_set1_epi64(0xCD9E8D57);
  const __m512i iota = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  __m512i c[2][4];  // [half: counters first + 8 h + (0..7)][word]
  for (int h = 0; h < 2; ++h) {
    const __m512i counter = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(first + 8 * h)), iota);
    c[h][0] = counter;
    c[h][1] = _mm512_srli_epi64(counter, 32);
    c[h][2] = c[h][3] = _mm512_setzero_si512();
  }
  for (int round = 0; round < 10; ++round) {
    for (int h = 0; h < 2; ++h) {
      const __m512i p0 = _mm512_mul_epu32(c[h][0], m0), p2 = _mm512_mul_epu32(c[h][2], m2);
      c[h][0] = _mm512_ternarylogic_epi32(_mm512_srli_epi64(p2, 32), c[h][1], keys.k0[round], 0x96);  // a ^ b ^ c
      c[h][2] = _mm512_ternarylogic_epi32(_mm512_srli_epi64(p0, 32), c[h][3], keys.k1[round], 0x96);
      c[h][1] = p2;
      c[h][3] = p0;
    }
  }
  // Word w of the 16 counters (the low halves of both halves' lanes), then kept iff
  // (x ^ (x >> 31)) >= threshold, x the word as int32 (see dropout_factors).
  const __m512i pack = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  __m512 f[4];
  for (int w = 0; w < 4; ++w) {
    const __m512i x = _mm512_permutex2var_epi32(c[0][w], pack, c[1][w]);
    f[w] = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(_mm512_xor_si512(x, _mm512_srai_epi32(x, 31)), threshold),
                               inv_keep);
  }
  // 4 x 4 transposes inside each 128-bit chunk j: u[k]'s chunk j = the four words of counter 4 j + k ...
  auto lo64 = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi64 = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  const __m512 t0 = _mm512_unpacklo_ps(f[0], f[1]), t1 = _mm512_unpackhi_ps(f[0], f[1]);
  const __m512 t2 = _mm512_unpacklo_ps(f[2], f[3]), t3 = _mm512_unpackhi_ps(f[2], f[3]);
  const __m512 u0 = lo64(t0, t2), u1 = hi64(t0, t2), u2 = lo64(t1, t3), u3 = hi64(t1, t3);
  // ... then a 4 x 4 transpose of the chunks: output vector k = chunk k of u0, u1, u2, u3.
  const __m512 a = _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 b = _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1));
  const __m512 c2 = _mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 d = _mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(3, 1, 3, 1));
  _mm512_storeu_ps(out, _mm512_shuffle_f32x4(a, c2, _MM_SHUFFLE(2, 0, 2, 0)));
  _mm512_storeu_ps(out + 16, _mm512_shuffle_f32x4(b, d, _MM_SHUFFLE(2, 0, 2, 0)));
  _mm512_storeu_ps(out + 32, _mm512_shuffle_f32x4(a, c2, _MM_SHUFFLE(3, 1, 3, 1)));
  _mm512_storeu_ps(out + 48, _mm512_shuffle_f32x4(b, d, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

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
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    if (t + kBlock <= n) {
      const PhiloxKeysAvx512 keys(seed);
      const __m512i vthreshold = _mm512_set1_epi32(threshold);
      const __m512 vinv_keep = _mm512_set1_ps(inv_keep);
      for (; t + kBlock <= n; t += kBlock) {
        philox_factors_avx512(keys, (start + t) >> 2, vthreshold, vinv_keep, factor + t);
      }
    }
  }
#endif
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
