// y = x W^T + b with W quantized to int8 (fastformer.quantize(model, "int8"): the decoder step's projections,
// csrc/inference/decoder_step.cpp, and the quantized model's Linear layers, fastformer/nn/linear.py). Compiled per
// instruction-set level like every CPU kernel; within a level, the best dot-product instruction this CPU has
// is chosen at run time (int8_variants below).
//
// Arithmetic (the same as CTranslate2's int8 on the CPU), checked against a float64 reference of it in
// tests/nn/test_int8.py; csrc/gemm/gemm.h states the int8 rule, one rule for both operands:
//   weight, once (csrc/gemm/gemm.cpp quantize_int8): per output channel n, s_w[n] and Wq[n, :];
//   activations, per call (quantize_rows below, vectorized, the same results as gemm.h's quantize_int8_row):
//     per row m, s_x[m] = max_k |x[m, k]| / 127 and xq[m, k] = round-half-even(x[m, k] * (127 / max_k |x[m, k]|))
//     in [-127, 127] (float32 products); a row with a NaN or an infinity: s_x[m] = NaN, xq[m, :] = 0;
//   acc[m, n] = sum_k xq[m, k] Wq[n, k] in int32 (exact; vnni's unsigned sum, up to K 255 127, stays below 2^31 for
//     K <= 65,536, which the callers check);
//   y[m, n] = float(acc[m, n]) * (s_x[m] s_w[n]) + b[n] in float32. A row of zeros gives y = b; a non-finite row
//   of x (or channel of W) gives NaN outputs.
// Shapes: x (M, K) float32; the weight Wq (ceil(N / 32), K4 = ceil(K / 4), 32, 4) int8 (gemm.h int8_index;
// zeros past N and past K); weight_scale s_w (N,) float32; weight_colsum[n] = sum_k Wq[n, k] (N,) int32; bias
// (N,) or none; y (M, N).
// The dot products (4 byte products summed into an int32 lane):
//   avx512_vnni: vpdpbusd on 16 lanes (unsigned x signed bytes: the activations go in as xq + 128, and
//     128 colsum[n] comes off each accumulator);
//   avx_vnni: the same instruction VEX-encoded on 8 lanes (AVX2-level CPUs that have it);
//   avx2: |xq| (unsigned) times sign(xq) Wq (signed, vpsignb) with vpmaddubsw, pairs summed to int32 with
//     vpmaddwd, then vpaddd: exact, since a pair is at most 2 x 127 x 127 < 2^15 (no saturation); 4
//     instructions for vnni's 1;
//   default: the same tile in plain C++ (in every level's list; the only one of our own at the baseline level);
//   onednn: oneDNN's int8 products (csrc/gemm/int8_onednn.h: AMX tiles where the CPU has them), on xq + 128
//     with zero point 128, returning the same sums; our epilogue. Listed last, wherever torch has oneDNN.
// The provider table (kVariants below) is the one place a variant is described: its name, whether it runs here,
// whether the rule prefers it, whether it needs its weight prepared, its tile; the epilogue (epilogue_row) is
// written once for all of them. The rule (int8_choose, "auto"): the first variant that runs here and prefers the
// product, else the first that runs (our best). Only oneDNN's has a preference (int8_onednn.h onednn_preferred: a
// CPU with AMX, from 32 rows and 2^22 multiply-adds a call); on CPUs without AMX ours are as fast as oneDNN's or
// faster, and below those bounds oneDNN's fixed cost per call dominates (docs/decoding.md, "int8 providers").
// Which variant a caller asked for (a name, or FASTFORMER_INT8_PROVIDER) is read in one place, csrc/gemm/gemm.cpp
// int8_variant_index.
// The VNNI variants are compiled into the avx2 and avx512 modules under `#pragma GCC target` (only their
// region may use the instructions) and chosen only after __builtin_cpu_supports says the CPU has them.
// Memory traffic: the weight once as bytes (a quarter of float32's) a task, x once (quantized into a
// buffer of M K bytes), y written once. (Panel, row block) units split over threads; every output is
// computed by one thread in a fixed order, so results do not depend on the thread count.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu/kernel_table.h"
#include "gemm/int8_onednn.h"

namespace fastformer::cpu {
namespace {

constexpr int kInt8Panel = kPackedLinearPanel;  // columns per panel: the float32 panels' width
constexpr int64_t kInt8BlockRows = 16;           // rows per work unit: a multiple of every variant's rows
constexpr int64_t kInt8TaskBytes = 65536;        // the least work of a task: K x rows, summed over its units

// The micro-kernel's names for an int8 Isa's types (csrc/gemm/micro_kernel.h): 4 activation bytes (unsigned or
// signed per variant) against 4 weight bytes a step, int32 lanes.
#define INT8_ISA_TYPES                                        \
  using AElem = uint8_t;                                      \
  using BElem = int8_t;                                       \
  using Acc = Reg;                                            \
  using BReg = Reg;                                           \
  using AReg = Row;                                           \
  static constexpr int kDepth = 4, kVectors = kInt8Panel / kLanes;

inline int32_t four_bytes(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- default: plain C++ ------------------------------------------------------------------------
namespace plain {
struct Isa {
  struct Reg { int32_t lane[8]; };
  struct Row { int8_t byte[4]; };
  static constexpr int kLanes = 8, kRows = 4;
  INT8_ISA_TYPES
  static Reg zero() { return Reg{}; }
  static Row broadcast(const uint8_t* four) {
    Row r;
    std::memcpy(r.byte, four, 4);
    return r;
  }
  static Reg load(const int8_t* w) {
    Reg r;
    std::memcpy(r.lane, w, sizeof(r.lane));  // the bytes, reread per lane in dot
    return r;
  }
  static Reg madd(Reg acc, const Row& a, const Reg& w) {
    int8_t bytes[32];
    std::memcpy(bytes, w.lane, 32);
    for (int l = 0; l < 8; ++l)
      for (int j = 0; j < 4; ++j) acc.lane[l] += int32_t(a.byte[j]) * int32_t(bytes[4 * l + j]);
    return acc;
  }
  static void store(int32_t* out, const Reg& v) { std::memcpy(out, v.lane, sizeof(v.lane)); }
};
#include "gemm/micro_kernel.h"
#include "gemm/int8_linear_tile.h"
}  // namespace plain

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// ---- avx2: vpmaddubsw + vpmaddwd, exact ---------------------------------------------------------
namespace avx2 {
struct Isa {
  using Reg = __m256i;
  struct Row { __m256i abs, sign; };
  static constexpr int kLanes = 8, kRows = 2;
  INT8_ISA_TYPES
  static Reg zero() { return _mm256_setzero_si256(); }
  static Row broadcast(const uint8_t* four) {
    const __m256i b = _mm256_set1_epi32(four_bytes(four));
    return {_mm256_abs_epi8(b), b};
  }
  static Reg load(const int8_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
  static Reg madd(Reg acc, const Row& a, Reg w) {
    // |x| (<= 127, unsigned) times w with x's sign (signed): x w, pairs <= 2 x 127^2 < 2^15.
    const __m256i pairs = _mm256_maddubs_epi16(a.abs, _mm256_sign_epi8(w, a.sign));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static void store(int32_t* out, Reg v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), v); }
};
#include "gemm/micro_kernel.h"
#include "gemm/int8_linear_tile.h"
}  // namespace avx2
#endif

#if defined(CPU_CAPABILITY_AVX512)
// ---- avx512_vnni: vpdpbusd on zmm (only this region may use the VNNI instructions) -------------
#pragma GCC push_options
#pragma GCC target("avx512vnni")
namespace vnni512 {
struct Isa {
  using Reg = __m512i;
  using Row = __m512i;
  static constexpr int kLanes = 16, kRows = 4;
  INT8_ISA_TYPES
  static Reg zero() { return _mm512_setzero_si512(); }
  static Row broadcast(const uint8_t* four) { return _mm512_set1_epi32(four_bytes(four)); }
  static Reg load(const int8_t* w) { return _mm512_loadu_si512(w); }
  static Reg madd(Reg acc, const Row& a, Reg w) { return _mm512_dpbusd_epi32(acc, a, w); }
  static void store(int32_t* out, Reg v) { _mm512_storeu_si512(out, v); }
};
#include "gemm/micro_kernel.h"
#include "gemm/int8_linear_tile.h"
}  // namespace vnni512
#pragma GCC pop_options
#elif defined(CPU_CAPABILITY_AVX2)
// ---- avx_vnni: vpdpbusd VEX-encoded on ymm (only this region may use it) -----------------------
#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace vnni256 {
struct Isa {
  using Reg = __m256i;
  using Row = __m256i;
  static constexpr int kLanes = 8, kRows = 2;
  INT8_ISA_TYPES
  static Reg zero() { return _mm256_setzero_si256(); }
  static Row broadcast(const uint8_t* four) { return _mm256_set1_epi32(four_bytes(four)); }
  static Reg load(const int8_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
  static Reg madd(Reg acc, const Row& a, Reg w) { return _mm256_dpbusd_avx_epi32(acc, a, w); }
  static void store(int32_t* out, Reg v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), v); }
};
#include "gemm/micro_kernel.h"
#include "gemm/int8_linear_tile.h"
}  // namespace vnni256
#pragma GCC pop_options
#endif

// The int8 provider table: one row per variant, its name, whether this CPU runs it, whether the rule ("auto")
// prefers it for an M x K by K x N product over the first row that runs (our best), whether its products need
// the weight prepared once (int8_prepare: oneDNN's pack), the offset its activations go in with (0, or 128 for an
// unsigned operand: the VNNI tiles and oneDNN), and how it multiplies: our tile and its rows per pass, or nullptr:
// oneDNN's products.
struct Variant {
  const char* name;
  bool (*runs)();
  bool (*preferred)(int64_t M, int64_t N, int64_t K);  // nullptr: only as the first that runs
  bool packs;
  int offset;
  int rows;
  void (*tile)(int, const uint8_t*, int64_t, int64_t, const int8_t*, int32_t*);
};

bool always() { return true; }
#if defined(CPU_CAPABILITY_AVX512)
bool has_avx512_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
}
#elif defined(CPU_CAPABILITY_AVX2)
bool has_avx_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni");
}
#endif

// This level's variants, best first (the order of int8_variants()).
const Variant kVariants[] = {
#if defined(CPU_CAPABILITY_AVX512)
    {"avx512_vnni", &has_avx512_vnni, nullptr, false, 128, vnni512::Isa::kRows, &vnni512::tile},
    {"avx2", &always, nullptr, false, 0, avx2::Isa::kRows, &avx2::tile},
#elif defined(CPU_CAPABILITY_AVX2)
    {"avx_vnni", &has_avx_vnni, nullptr, false, 128, vnni256::Isa::kRows, &vnni256::tile},
    {"avx2", &always, nullptr, false, 0, avx2::Isa::kRows, &avx2::tile},
#endif
    {"default", &always, nullptr, false, 0, plain::Isa::kRows, &plain::tile},
    {"onednn", &onednn_int8_runs, &onednn_preferred, true, 128, 0, nullptr},
};

// The variants this CPU runs, best first, as a null-terminated list of names (and their table rows).
struct Runnable {
  std::vector<const Variant*> variants;
  std::vector<const char*> names;
  Runnable() {
    for (const Variant& v : kVariants) {
      if (v.runs()) {
        variants.push_back(&v);
        names.push_back(v.name);
      }
    }
    names.push_back(nullptr);
  }
};

const Runnable& runnable() {
  static const Runnable r;
  return r;
}

// Rows of x (M, K) as bytes q (M, K4 4): xq + offset (see the top), zero-padded past K (offset bytes),
// and their scales s_x (M,): gemm.h's rule (int8_step), vectorized (at::vec: abs, a NaN-propagating max,
// multiply, round-half-even, clamp), rows split over threads; a row's bytes depend on that row alone.
void quantize_rows(const float* x, int64_t M, int64_t K, int offset, uint8_t* q, float* scales) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t stride = (K + 3) / 4 * 4;
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, K)), [&](int64_t m0, int64_t m1) {
    alignas(64) float chunk[256];
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x + m * K;
      const float amax = at::vec::map_reduce_all<float>([](Vec v) { return v.abs(); },
                                                        [](Vec a, Vec b) { return at::vec::maximum(a, b); }, row, K);
      uint8_t* out = q + m * stride;
      std::fill(out + K, out + stride, static_cast<uint8_t>(offset));
      const Int8Step step = int8_step(amax);
      scales[m] = step.scale;
      if (!(step.inv > 0.0f)) {  // a row of zeros, or one with a NaN or an infinity: xq = 0
        std::fill(out, out + K, static_cast<uint8_t>(offset));
        continue;
      }
      const Vec inv(step.inv), lo(-127.0f), hi(127.0f);
      for (int64_t k0 = 0; k0 < K; k0 += 256) {
        const int64_t n = std::min<int64_t>(256, K - k0);
        at::vec::map([&](Vec v) { return at::vec::clamp((v * inv).round(), lo, hi); }, chunk, row + k0, n);
        // local copies: a store through uint8_t* may alias anything, so a captured offset would be reloaded
        // every byte and the loop would not vectorize
        const int32_t off = offset;
        uint8_t* __restrict dst = out + k0;
        for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<uint8_t>(static_cast<int32_t>(chunk[j]) + off);
      }
    }
  });
}

// The epilogue, written once for every variant: y's row (columns n0 .. n0 + width) from that row's exact sums
// (M rows of `width`: int32 from our tiles, float32 or int32 from oneDNN's), y = float(sum - offset colsum)
// (s_x s_w) + b, where offset is the variant's activation offset (128 for an unsigned operand; oneDNN's sums come
// back offset-free: 0). The same float operations whichever variant ran, so y is bit-identical across variants.
// Local restrict pointers, so that it vectorizes.
template <typename Sum>
inline void epilogue_row(const Sum* __restrict sums, int32_t offset, const Int8Weight& w, int64_t n0, int64_t width,
                         float s, const float* bias, float* __restrict out) {
  const int32_t* __restrict colsum = w.weight_colsum + n0;
  const float* __restrict sw = w.weight_scale + n0;
  if (bias != nullptr) {
    const float* __restrict b = bias + n0;
    for (int64_t c = 0; c < width; ++c) out[c] = static_cast<float>(sums[c] - offset * colsum[c]) * (s * sw[c]) + b[c];
  } else {
    for (int64_t c = 0; c < width; ++c) out[c] = static_cast<float>(sums[c] - offset * colsum[c]) * (s * sw[c]);
  }
}

// y = x W^T + b through oneDNN's products (int8_onednn.h), a block of output columns at a time: x quantized
// here once, each block's sums by oneDNN, then our epilogue on them (rows over threads) while they are in cache.
void onednn_linear_rows(const float* x, int64_t M, int64_t K, int offset, const Int8Weight& w, const float* bias,
                        float* y, int64_t n, int64_t y_stride) {
  TORCH_CHECK(w.onednn != nullptr, "fastformer int8_linear: the variant onednn needs the weight packed for oneDNN "
              "(csrc/gemm/gemm.cpp int8_projection attaches it); this is a bug in fastformer");
  const int64_t stride = (K + 3) / 4 * 4;
  at::Tensor q = at::empty({M, stride}, at::kByte);
  std::vector<float> sx(M);
  quantize_rows(x, M, K, offset, q.mutable_data_ptr<uint8_t>(), sx.data());
  for (int64_t b = 0; b < w.onednn->blocks(); ++b) {
    const int64_t n0 = w.onednn->columns[b], width = w.onednn->columns[b + 1] - n0;
    const at::Tensor sums = onednn_int8_sums(*w.onednn, b, q);
    auto rows = [&](const auto* block_sums) {  // float32 (one chunk of inputs) or int32 (several) sums
      at::parallel_for(0, M, std::max<int64_t>(1, 16384 / width), [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
          epilogue_row(block_sums + m * width, 0, w, n0, width, sx[m], bias, y + m * y_stride + n0);
        }
      });
    };
    if (sums.scalar_type() == at::kFloat) {
      rows(sums.const_data_ptr<float>());
    } else {
      rows(sums.const_data_ptr<int32_t>());
    }
  }
}

}  // namespace

const char* const* int8_variants() { return runnable().names.data(); }

int int8_choose(int64_t M, int64_t N, int64_t K) {
  const std::vector<const Variant*>& variants = runnable().variants;
  for (size_t i = 0; i < variants.size(); ++i) {
    if (variants[i]->preferred != nullptr && variants[i]->preferred(M, N, K)) return static_cast<int>(i);
  }
  return 0;
}

bool int8_packs(int variant) {
  const std::vector<const Variant*>& variants = runnable().variants;
  if (variant >= 0) return variants.at(variant)->packs;
  // auto: whether the rule prefers a packing variant for some product (oneDNN's on a CPU with AMX, at enough rows)
  constexpr int64_t kMany = std::numeric_limits<int32_t>::max();
  for (const Variant* v : variants) {
    if (v->packs && v->preferred != nullptr && v->preferred(kMany, kMany, kMany)) return true;
  }
  return false;
}

void int8_linear_rows(const float* x, int64_t M, int64_t K, const Int8Weight& w, const float* bias, float* y,
                      int64_t n, int64_t y_stride, int variant) {
  if (M == 0 || n == 0) return;
  const Runnable& run = runnable();
  if (variant < 0 || variant >= static_cast<int>(run.variants.size())) variant = int8_choose(M, n, K);
  if (run.variants[variant]->tile == nullptr) {
    if (K > 0) return onednn_linear_rows(x, M, K, run.variants[variant]->offset, w, bias, y, n, y_stride);
    variant = 0;  // no products to make (y = b): our own kernel writes it
  }
  const Variant& v = *run.variants[variant];
  const int64_t K4 = (K + 3) / 4, stride = K4 * 4;
  std::unique_ptr<uint8_t[]> q(new uint8_t[M * stride]);  // every byte written by quantize_rows
  std::vector<float> sx(M);
  quantize_rows(x, M, K, v.offset, q.get(), sx.data());
  const int64_t P = (n + kInt8Panel - 1) / kInt8Panel;
  // Work units: (panel, block of up to kInt8BlockRows rows), panel-major, so that the units of a task share
  // their panels (each read from memory once a task, then from L1). Split by rows as well as panels so
  // that a projection with few panels and many rows (d x d at batch 32, beam 4: 8 panels, 128 rows) still
  // spreads over the threads. A task is at least kInt8TaskBytes activation bytes a panel column (K x rows
  // of a unit, summed over its units: 2M byte products): below that, waking a second thread costs more
  // than it saves (batch 1).
  const int64_t block = std::min<int64_t>(M, kInt8BlockRows), blocks = (M + block - 1) / block;
  const int64_t grain = std::max<int64_t>(1, kInt8TaskBytes / std::max<int64_t>(1, K * block));
  at::parallel_for(0, P * blocks, grain, [&](int64_t u0, int64_t u1) {
    int32_t acc[4 * kInt8Panel];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t p = u / blocks, b0 = u % blocks * block, b1 = std::min(M, b0 + block);
      const int64_t n0 = p * kInt8Panel, width = std::min<int64_t>(kInt8Panel, n - n0);
      const int8_t* panel = w.weight + int8_index(n0, 0, K4);
      for (int64_t m0 = b0; m0 < b1; m0 += v.rows) {
        const int rows = static_cast<int>(std::min<int64_t>(v.rows, b1 - m0));
        v.tile(rows, q.get() + m0 * stride, stride, K4, panel, acc);
        for (int r = 0; r < rows; ++r) {
          epilogue_row(acc + r * kInt8Panel, v.offset, w, n0, width, sx[m0 + r], bias, y + (m0 + r) * y_stride + n0);
        }
      }
    }
  });
}

}  // namespace fastformer::cpu
