// Tensor-core and asynchronous-copy primitives of sm_80 and newer, for the kernels of
// csrc/cuda/attention_mma.cuh: mma.sync m16n8k16 (f16/bf16 in, f32 accumulate), ldmatrix (x4, plain and
// transposed) and cp.async (16 bytes, zero-filling, commit/wait groups).
//
// Under nvcc/NVRTC each is one PTX instruction (inline asm); compiled for an architecture below sm_80
// (a multi-architecture build) the bodies trap, and the launcher never picks these kernels there. Under
// the CPU SIMT model (csrc/cuda_sim/simt.h) mma.sync and ldmatrix are warp collectives computed from the
// 32 lanes' registers with the fragment layouts of the PTX ISA written out below, and cp.async is queued
// per thread until its wait_group, so a wrong lane mapping or a missing wait gives wrong numbers in CI.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 g + t (g = lane / 4, t = lane % 4),
// a 32-bit register holds two 16-bit elements, the lower column (or row, for B) in its low half:
//   A (16 x 16, row-major) a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//                          a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   B (16 x 8, k x n)      b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   C, D (16 x 8, f32)     c[0], c[1] = C[g][2t, 2t+1]     c[2], c[3] = C[g+8][2t, 2t+1]
// ldmatrix.x4: lanes 8i .. 8i+7 give the row addresses (16 bytes each) of 8 x 8 matrix i; lane l receives
// r[i] = M_i[l / 4][2 (l % 4), 2 (l % 4) + 1], or with .trans M_i[2 (l % 4), 2 (l % 4) + 1][l / 4].
#pragma once
#include "common.cuh"
#if !defined(__CUDACC__)
#include <stdexcept>
#include <string>
#include <type_traits>
#endif

namespace fastformer {
namespace cuda {

// Two elements as one 32-bit register (lo in the low half), rounded to nearest even.
template <typename T> FF_DEVICE uint32_t pack2(float lo, float hi);
template <> FF_DEVICE uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <> FF_DEVICE uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

#if defined(__CUDACC__)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FF_SM80_ONLY(body) __trap();
#else
#define FF_SM80_ONLY(body) body
#endif

FF_DEVICE uint32_t shared_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, the last 16 - src_bytes of them zero-filled (src_bytes 0: no read).
FF_DEVICE void cp_async16(void* dst, const void* src, int src_bytes) {
  FF_SM80_ONLY(asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                            "r"(src_bytes));)
}
FF_DEVICE void cp_async_commit() { FF_SM80_ONLY(asm volatile("cp.async.commit_group;\n" ::);) }
template <int kPending>
FF_DEVICE void cp_async_wait() {
  FF_SM80_ONLY(asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));)
}

FF_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  FF_SM80_ONLY(asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                            : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                            : "r"(shared_address(row)));)
}
FF_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  FF_SM80_ONLY(asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                            : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                            : "r"(shared_address(row)));)
}

// d += A B for one 16 x 8 x 16 tile (A, B fragments of T, D in float32).
template <typename T> FF_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
FF_DEVICE void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  FF_SM80_ONLY(asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));)
}
template <>
FF_DEVICE void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  FF_SM80_ONLY(asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));)
}
#undef FF_SM80_ONLY

#else  // the CPU SIMT model: the same instructions, from the layouts in the header comment

namespace mma_sim {

FF_DEVICE float element(uint16_t bits, bool bf16) {
  return bf16 ? __bfloat162float(__nv_bfloat16{bits}) : __half2float(__half{bits});
}
FF_DEVICE uint16_t lo16(uint32_t r) { return static_cast<uint16_t>(r & 0xffffu); }
FF_DEVICE uint16_t hi16(uint32_t r) { return static_cast<uint16_t>(r >> 16); }

struct MmaRecord {
  const uint32_t* a;  // 4 registers
  uint32_t b0, b1;
  float* d;           // 4 accumulators, read and written
  bool bf16;
};

// D = C + A B over the warp's 32 records: products of 16-bit values are exact in float32; summed in k order.
inline void mma_compute(void* const* records) {
  float A[16][16], B[16][8], C[16][8];
  const bool bf16 = static_cast<const MmaRecord*>(records[0])->bf16;
  for (int lane = 0; lane < 32; ++lane) {
    const MmaRecord& r = *static_cast<const MmaRecord*>(records[lane]);
    const int g = lane / 4, t = lane % 4;
    for (int half = 0; half < 2; ++half) {  // a[0], a[1]: columns 2t, 2t+1; a[2], a[3]: columns 2t+8, 2t+9
      const int col = 2 * t + 8 * half;
      A[g][col] = element(lo16(r.a[2 * half]), bf16);
      A[g][col + 1] = element(hi16(r.a[2 * half]), bf16);
      A[g + 8][col] = element(lo16(r.a[2 * half + 1]), bf16);
      A[g + 8][col + 1] = element(hi16(r.a[2 * half + 1]), bf16);
    }
    B[2 * t][g] = element(lo16(r.b0), bf16);
    B[2 * t + 1][g] = element(hi16(r.b0), bf16);
    B[2 * t + 8][g] = element(lo16(r.b1), bf16);
    B[2 * t + 9][g] = element(hi16(r.b1), bf16);
    C[g][2 * t] = r.d[0];
    C[g][2 * t + 1] = r.d[1];
    C[g + 8][2 * t] = r.d[2];
    C[g + 8][2 * t + 1] = r.d[3];
  }
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 8; ++n) {
      float acc = C[m][n];
      for (int k = 0; k < 16; ++k) acc += A[m][k] * B[k][n];
      C[m][n] = acc;
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const MmaRecord& r = *static_cast<const MmaRecord*>(records[lane]);
    const int g = lane / 4, t = lane % 4;
    r.d[0] = C[g][2 * t];
    r.d[1] = C[g][2 * t + 1];
    r.d[2] = C[g + 8][2 * t];
    r.d[3] = C[g + 8][2 * t + 1];
  }
}

struct LdmatrixRecord {
  const uint16_t* row;  // this lane's row address (lanes 8i..8i+7: the rows of matrix i)
  uint32_t* r;          // 4 result registers
  bool trans;
};

inline void ldmatrix_compute(void* const* records) {
  const uint16_t* rows[4][8];
  for (int lane = 0; lane < 32; ++lane) {
    const auto& rec = *static_cast<const LdmatrixRecord*>(records[lane]);
    if (reinterpret_cast<uintptr_t>(rec.row) % 16 != 0) {
      throw std::runtime_error("cuda_sim: ldmatrix row addresses must be 16-byte aligned (lane " +
                               std::to_string(lane) + ")");
    }
    rows[lane / 8][lane % 8] = rec.row;
  }
  for (int lane = 0; lane < 32; ++lane) {
    const auto& rec = *static_cast<const LdmatrixRecord*>(records[lane]);
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = rec.trans ? rows[i][2 * t][g] : rows[i][g][2 * t];
      const uint16_t hi = rec.trans ? rows[i][2 * t + 1][g] : rows[i][g][2 * t + 1];
      rec.r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
}

}  // namespace mma_sim

FF_DEVICE void cp_async16(void* dst, const void* src, int src_bytes) {
  ::fastformer::sim::cp_async(dst, src, 16, src_bytes);
}
FF_DEVICE void cp_async_commit() { ::fastformer::sim::cp_async_commit(); }
template <int kPending>
FF_DEVICE void cp_async_wait() {
  ::fastformer::sim::cp_async_wait(kPending);
}

// The call site (file, line) of a collective names it in the model's divergence errors.
FF_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row, const char* file = __builtin_FILE(),
                           int line = __builtin_LINE()) {
  mma_sim::LdmatrixRecord rec{static_cast<const uint16_t*>(row), r, false};
  ::fastformer::sim::warp_collective(&rec, mma_sim::ldmatrix_compute, file, line);
}
FF_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row, const char* file = __builtin_FILE(),
                                 int line = __builtin_LINE()) {
  mma_sim::LdmatrixRecord rec{static_cast<const uint16_t*>(row), r, true};
  ::fastformer::sim::warp_collective(&rec, mma_sim::ldmatrix_compute, file, line);
}

template <typename T>
FF_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(sizeof(T) == 2, "mma_16816 takes __half or __nv_bfloat16 fragments");
  mma_sim::MmaRecord rec{a, b0, b1, d, std::is_same<T, __nv_bfloat16>::value};
  ::fastformer::sim::warp_collective(&rec, mma_sim::mma_compute, file, line);
}

#endif

}  // namespace cuda
}  // namespace fastformer
