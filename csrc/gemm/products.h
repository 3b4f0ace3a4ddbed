// The CPU tile products of one instruction-set level, on the one micro-kernel (csrc/gemm/micro_kernel.h): the
// variants, each with the guarantee it keeps, the packers of their B operands, and the entry points the
// attention kernels call (csrc/cpu/attention_kernels.h). The int8 variants of the decoding GEMMs are the same
// micro-kernel on 4-byte dot products (csrc/gemm/int8_linear.cpp, listed by int8_variants()); the float32
// panels of decoding are FmaIsa<float> on a packed layout (csrc/gemm/packed_linear.cpp).
//
// | variant       | operands           | instruction           | lanes        | block      | where                    |
// |---------------|--------------------|-----------------------|--------------|------------|--------------------------|
// | fma           | float32, float64   | at::vec fmadd         | a vector     | 6 x 4 (avx512), 6 x 2 | every level |
// | bf16_dot      | bf16 x bf16 -> f32 | vdpbf16ps (zmm)       | 16           | 6 x 4      | avx512 level, AVX512_BF16 |
// | bf16_emulated | bf16 x bf16 -> f32 | two at::vec fmadds    | a vector     | 4 x 4 (avx512), 4 x 2 | every level |
//
// Guarantees (tests/ops/test_products.py checks each, through C.tile_product, at shifted memory offsets;
// tests/ops/test_threads.py through attention at 1, 2 and 3 threads):
//   fma: C[i, j] = alpha (fma chain over t of A[i, t] B[t, j]) (+ C), in order t = 0, 1, ...: no horizontal
//     sums, so the result depends on row i of A and column j of B alone: not on offsets, threads, blocks or
//     the vector width (the avx2 and avx512 levels give the same products).
//   bf16_dot: per pair of inputs (t = 2s, 2s + 1): acc = acc + A[i, 2s+1] B[2s+1, j] (rounded), then
//     + A[i, 2s] B[2s, j] (rounded): the order of vdpbf16ps as Intel documents it (the product of two
//     bfloat16 values is exact in float32); measured bit for bit against bf16_emulated on an AMD EPYC (Zen 4).
//     The instruction treats subnormal inputs and results as zero (DAZ, FTZ).
//   bf16_emulated: the same chain with fused multiply-adds (exact products, the same roundings), so it equals
//     bf16_dot bit for bit where no subnormal number occurs: bfloat16 attention gives the same results on CPUs
//     with and without AVX512_BF16, and at every level.
// bf16 tile products take bf16_dot where the CPU has it (checked once at run time), else bf16_emulated.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace fastformer::cpu::micro {

// float32 and float64: one fused multiply-add a step.
template <typename T>
struct FmaIsa {
  using Vec = at::vec::Vectorized<T>;
  using AElem = T;
  using BElem = T;
  using Out = T;
  using Acc = Vec;
  using AReg = Vec;
  using BReg = Vec;
  static constexpr int kLanes = Vec::size(), kDepth = 1;
  // avx512 (64-byte vectors): 6 x 4 accumulators, 4 B registers and a broadcast in its 32 registers; avx2
  // and the default level: 6 x 2 + 2 + 1 in 16.
  static constexpr int kRows = 6, kVectors = sizeof(Vec) >= 64 ? 4 : 2;
  static Acc zero() { return Vec(T(0)); }
  static AReg broadcast(const T* a) { return Vec(*a); }
  static BReg load(const T* b) { return Vec::loadu(b); }
  static Acc madd(const Acc& acc, const AReg& a, const BReg& b) { return at::vec::fmadd(a, b, acc); }
  static Vec out(const Acc& acc) { return acc; }
};

// A bfloat16 value's float32: its 16 bits on top.
inline float bf16_bits_to_float(uint32_t high) {
  float f;
  std::memcpy(&f, &high, 4);
  return f;
}

// bfloat16 pairs with float32 sums, in the order of vdpbf16ps, on any CPU: per step, the odd element's product
// then the even one's, each a fused multiply-add (exact product, one rounding). A pair is 32 bits: the even
// element (k = 2s) in the low half, the odd one (2s + 1) in the high half, as in memory.
struct Bf16Emulated {
  using Vec = at::vec::Vectorized<float>;
  using IVec = at::vec::Vectorized<int32_t>;
  using AElem = c10::BFloat16;
  using BElem = uint32_t;
  using Out = float;
  struct Pair {
    Vec odd, even;
  };
  using Acc = Vec;
  using AReg = Pair;
  using BReg = Pair;
  static constexpr int kLanes = Vec::size(), kDepth = 2;
  // avx512: 4 x 4 accumulators, 8 registers of B (each pair register unpacked into two) and 2 broadcasts;
  // avx2: 4 x 2 + 4 + 2 in 16.
  static constexpr int kRows = 4, kVectors = sizeof(Vec) >= 64 ? 4 : 2;
  static Acc zero() { return Vec(0.0f); }
  static AReg broadcast(const c10::BFloat16* a) {
    uint32_t pair;
    std::memcpy(&pair, a, 4);
    return {Vec(bf16_bits_to_float(pair & 0xFFFF0000u)), Vec(bf16_bits_to_float(pair << 16))};
  }
  static BReg load(const uint32_t* b) {
    const IVec w = IVec::loadu(b);
    return {at::vec::cast<float>(w & IVec(static_cast<int32_t>(0xFFFF0000u))), at::vec::cast<float>(w << IVec(16))};
  }
  static Acc madd(const Acc& acc, const AReg& a, const BReg& b) {
    return at::vec::fmadd(a.even, b.even, at::vec::fmadd(a.odd, b.odd, acc));
  }
  static Vec out(const Acc& acc) { return acc; }
};

#include "gemm/micro_kernel.h"

}  // namespace fastformer::cpu::micro

#if defined(CPU_CAPABILITY_AVX512)
// ---- bf16_dot: vdpbf16ps (only this region may use AVX512_BF16) -----------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512bf16")
namespace fastformer::cpu::micro::bf16_dot {
struct Isa {
  using AElem = c10::BFloat16;
  using BElem = uint32_t;
  using Out = float;
  using Acc = __m512;
  using AReg = __m512bh;
  using BReg = __m512bh;
  static constexpr int kLanes = 16, kDepth = 2, kRows = 6, kVectors = 4;  // 24 accumulators, 4 B, 1 broadcast
  static Acc zero() { return _mm512_setzero_ps(); }
  static AReg broadcast(const c10::BFloat16* a) {
    int32_t pair;
    std::memcpy(&pair, a, 4);
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
  }
  static BReg load(const uint32_t* b) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(b)); }
  static Acc madd(Acc acc, AReg a, BReg b) { return _mm512_dpbf16_ps(acc, a, b); }
  static at::vec::Vectorized<float> out(Acc acc) { return acc; }
};
#include "gemm/micro_kernel.h"

inline void tile_gemm(int64_t m, int64_t n, int64_t k, float alpha, const c10::BFloat16* a, int64_t lda,
                      bool a_pairs, const uint32_t* b, int64_t ldb, bool accumulate, float* c, int64_t ldc) {
  if (a_pairs) return tile_product<Isa, true>(m, n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
  tile_product<Isa, false>(m, n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
}
}  // namespace fastformer::cpu::micro::bf16_dot
#pragma GCC pop_options
#endif

namespace fastformer::cpu {

// Whether this level runs bf16 tile products on vdpbf16ps (the CPU has AVX512_BF16; the avx512 level only).
inline bool bf16_dot_runs() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool runs = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return runs;
#else
  return false;
#endif
}

// C (m x n, ldc) = alpha op(A) B (+ C when accumulate), float32 or float64 (the variant fma):
// op(A)(i, t) = A[i lda + t], or A[t lda + i] when a_transposed; B (k x n, ldb) row-major.
template <typename T>
inline void tile_gemm(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, bool a_transposed,
                      const T* b, int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  if (a_transposed) {
    micro::tile_product<micro::FmaIsa<T>, true>(m, n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
  } else {
    micro::tile_product<micro::FmaIsa<T>, false>(m, n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
  }
}

// C (m x n float32, ldc) = alpha A B (+ C when accumulate), B as packed pairs (ceil(k / 2) rows of ldb pairs:
// pack_row_pairs, pack_column_pairs); A (m x k, lda) bfloat16 row-major, or, a_pairs, A^T packed as B is
// (ceil(k / 2) rows of lda bfloat16, the pairs of A^T's rows interleaved: pack_row_pairs of A^T; a weight's
// gradient dy^T x, csrc/gemm/weight_grad.cpp): bf16_dot where it runs, else bf16_emulated (`emulated` forces
// bf16_emulated: the test hooks', products.cpp and weight_grad.cpp).
inline void tile_gemm_bf16(int64_t m, int64_t n, int64_t k, float alpha, const c10::BFloat16* a, int64_t lda,
                           const uint32_t* b, int64_t ldb, bool accumulate, float* c, int64_t ldc,
                           bool emulated = false, bool a_pairs = false) {
#if defined(CPU_CAPABILITY_AVX512)
  if (!emulated && bf16_dot_runs()) {
    return micro::bf16_dot::tile_gemm(m, n, k, alpha, a, lda, a_pairs, b, ldb, accumulate, c, ldc);
  }
#endif
  if (a_pairs) {
    return micro::tile_product<micro::Bf16Emulated, true>(m, n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
  }
  micro::tile_product<micro::Bf16Emulated, false>(m, n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
}

inline uint32_t bf16_pair(c10::BFloat16 even, c10::BFloat16 odd) {
  return static_cast<uint32_t>(even.x) | (static_cast<uint32_t>(odd.x) << 16);
}

// The B operand of a bf16 product from a row-major (k x n, ld) matrix M, B = M: pairs of rows interleaved,
// dst (ceil(k / 2) x n, ld_dst) with dst[s][j] = (M[2s][j], M[2s + 1][j]) (zero past k). Memory: k n elements
// read and written once.
inline void pack_row_pairs(const c10::BFloat16* src, int64_t k, int64_t n, int64_t ld, uint32_t* dst, int64_t ld_dst) {
  for (int64_t s = 0; s < k / 2; ++s) {
    const c10::BFloat16* even = src + 2 * s * ld;
    const c10::BFloat16* odd = even + ld;
    uint32_t* d = dst + s * ld_dst;
    for (int64_t j = 0; j < n; ++j) d[j] = bf16_pair(even[j], odd[j]);
  }
  if (k % 2 != 0) {
    const c10::BFloat16* even = src + (k - 1) * ld;
    uint32_t* d = dst + (k / 2) * ld_dst;
    for (int64_t j = 0; j < n; ++j) d[j] = even[j].x;
  }
}

// dst (cols x rows, ld_dst) = src (rows x cols, ld_src)^T for 32-bit elements (float32, or bf16 pairs as uint32):
// whole 16 x 16 (avx512) or 8 x 8 (avx2) blocks transposed in registers (unpack 32-bit, unpack 64-bit, then
// shuffle 128-bit lanes), the edges element by element. A pure permutation: the bits move, nothing is
// computed. Memory: rows x cols elements read and written once (an element-wise loop wrote each element to
// another cache line, and took as long as the products it fed at short sequence lengths).
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// One register of 32-bit lanes and the three permutations of the transpose, per width.
#if defined(CPU_CAPABILITY_AVX512)
struct TransposeRegs {
  using R = __m512i;
  static constexpr int kLanes = 16;
  static R load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static void store(int32_t* p, R v) { _mm512_storeu_si512(p, v); }
  static R lo32(R a, R b) { return _mm512_unpacklo_epi32(a, b); }
  static R hi32(R a, R b) { return _mm512_unpackhi_epi32(a, b); }
  static R lo64(R a, R b) { return _mm512_unpacklo_epi64(a, b); }
  static R hi64(R a, R b) { return _mm512_unpackhi_epi64(a, b); }
  // After the unpacks each 128-bit lane holds a 4 x 4 block in place; two shuffles of whole lanes put the blocks
  // where the transpose wants them (r[j] and r[j + 4] within each half, then the halves).
  static void lanes(R* r, R* t) {
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 4; ++j) {
        t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
        t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
      }
    }
    for (int j = 0; j < 8; ++j) {
      r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
      r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
  }
};
#else
struct TransposeRegs {
  using R = __m256i;
  static constexpr int kLanes = 8;
  static R load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(int32_t* p, R v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static R lo32(R a, R b) { return _mm256_unpacklo_epi32(a, b); }
  static R hi32(R a, R b) { return _mm256_unpackhi_epi32(a, b); }
  static R lo64(R a, R b) { return _mm256_unpacklo_epi64(a, b); }
  static R hi64(R a, R b) { return _mm256_unpackhi_epi64(a, b); }
  static void lanes(R* r, R* t) {  // the two 128-bit halves exchanged between r[j] and r[j + 4]
    for (int j = 0; j < 4; ++j) {
      t[j] = _mm256_permute2x128_si256(r[j], r[j + 4], 0x20);
      t[j + 4] = _mm256_permute2x128_si256(r[j], r[j + 4], 0x31);
    }
    for (int j = 0; j < 8; ++j) r[j] = t[j];
  }
};
#endif
constexpr int64_t kTransposeBlock = TransposeRegs::kLanes;
// One W x W block (W = the register's lanes): unpack pairs of rows (32-bit, then 64-bit), then whole lanes.
inline void transpose_block32(const void* src, int64_t ld_src, void* dst, int64_t ld_dst) {
  using Regs = TransposeRegs;
  constexpr int W = Regs::kLanes;
  const int32_t* s = static_cast<const int32_t*>(src);
  int32_t* d = static_cast<int32_t*>(dst);
  typename Regs::R r[W], t[W];
  for (int i = 0; i < W; ++i) r[i] = Regs::load(s + i * ld_src);
  for (int i = 0; i < W / 2; ++i) {
    t[2 * i] = Regs::lo32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = Regs::hi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < W / 4; ++i) {
    r[4 * i] = Regs::lo64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = Regs::hi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = Regs::lo64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = Regs::hi64(t[4 * i + 1], t[4 * i + 3]);
  }
  Regs::lanes(r, t);
  for (int i = 0; i < W; ++i) Regs::store(d + i * ld_dst, r[i]);
}
#else
constexpr int64_t kTransposeBlock = 0;  // element by element
inline void transpose_block32(const void*, int64_t, void*, int64_t) {}
#endif

template <typename T>
inline void transpose32(const T* src, int64_t rows, int64_t cols, int64_t ld_src, T* dst, int64_t ld_dst) {
  static_assert(sizeof(T) == 4, "32-bit elements");
  constexpr int64_t W = kTransposeBlock;
  const int64_t whole_rows = W > 0 ? rows / W * W : 0, whole_cols = W > 0 ? cols / W * W : 0;
  for (int64_t r0 = 0; r0 < whole_rows; r0 += W) {
    for (int64_t c0 = 0; c0 < whole_cols; c0 += W) {
      transpose_block32(src + r0 * ld_src + c0, ld_src, dst + c0 * ld_dst + r0, ld_dst);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // the edges: columns past the whole blocks, rows past them
    // (memcpy: src may be a pair pointer into bfloat16 rows, 2-byte aligned)
    for (int64_t c = r < whole_rows ? whole_cols : 0; c < cols; ++c) {
      std::memcpy(dst + c * ld_dst + r, src + r * ld_src + c, 4);
    }
  }
}

// The B operand of a bf16 product from the rows of an (n x k, ld) matrix M, B = M^T (a key or value block read
// as its transpose, S = Q K^T): dst (ceil(k / 2) x n, ld_dst) with dst[s][j] = (M[j][2s], M[j][2s + 1]), the
// 32-bit pair as it lies in row j (zero past k): a transpose of 32-bit pairs (transpose32), row j's last odd
// element on its own. Memory: n k elements read and written once.
inline void pack_column_pairs(const c10::BFloat16* src, int64_t n, int64_t k, int64_t ld, uint32_t* dst,
                              int64_t ld_dst) {
  if (ld % 2 == 0) {  // rows of whole pairs (any start: the loads are unaligned)
    transpose32(reinterpret_cast<const uint32_t*>(src), n, k / 2, ld / 2, dst, ld_dst);
  } else {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t s = 0; s < k / 2; ++s) std::memcpy(dst + s * ld_dst + j, src + j * ld + 2 * s, 4);
    }
  }
  if (k % 2 != 0) {
    for (int64_t j = 0; j < n; ++j) dst[(k / 2) * ld_dst + j] = src[j * ld + k - 1].x;
  }
}

// dst (cols x rows, ld_dst) = src (rows x cols, ld_src)^T, converted to dst's type (the B operand of an fma
// product A src^T; transpose32 where no conversion is needed).
template <typename S, typename T>
inline void transpose_rows(const S* src, int64_t rows, int64_t cols, int64_t ld_src, T* dst, int64_t ld_dst) {
  if constexpr (std::is_same_v<S, T> && sizeof(T) == 4) return transpose32(src, rows, cols, ld_src, dst, ld_dst);
  for (int64_t r = 0; r < rows; ++r) {
    const S* s = src + r * ld_src;
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = static_cast<T>(s[c]);
  }
}

}  // namespace fastformer::cpu
