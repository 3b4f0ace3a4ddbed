// The tile products of the CPU attention kernel (csrc/cpu/attention.cpp), in fastformer's own register-blocked
// micro-kernel rather than a BLAS, so that every result depends on the values alone: not on where the buffers
// lie, not on the thread that runs the tile, not on a BLAS's mode or build (MKL's default mode on Intel takes
// alignment- and thread-dependent paths; other torch builds link OpenBLAS).
//
//   C (m x n, ldc) = alpha op(A) B   (+ C when accumulate)
//   op(A)(i, t) = A[i lda + t], or A[t lda + i] when a_transposed;  B (k x n, ldb) row-major.
//
// Every element of C is computed the same way, whatever its position and the pointers' alignment:
//   acc = 0; for t = 0 .. k - 1: acc = fma(op(A)(i, t), B[t, j], acc);   C = alpha acc (+ C)
// in the level's at::vec vectors (fused multiply-adds at the avx2 and avx512 levels). Lanes never exchange values
// (no horizontal sum), so the order of the sums does not depend on the vector width either: the avx2 and avx512
// levels give the same products. Products of the form A B^T (scores S = Q K^T, dP = dO V^T) take B^T from a
// transposed copy (transpose_rows below), which the caller makes once per key block.
//
// Register block: kTileRows rows of C by tile_vectors() vectors of columns (avx512: 6 x 64 floats, 24
// accumulators, four B vectors and one broadcast of A in its 32 registers; avx2: 6 x 16 floats in its 16). Loop
// order: column blocks outside, row blocks inside, so a column block's k rows of B stay in L1 while every row
// block streams past them. Memory traffic per call: A read once per column block, B once, C once (twice when
// accumulating). The loop over k holds the accumulators in registers: no branch and no partial load in it
// (GCC kept them on the stack, stored every iteration, while the loop also handled a short last block).
// Columns past the last whole block go through zero-padded copies (the same arithmetic); rows past the last
// whole block take a smaller row block.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fastformer::cpu {

constexpr int kTileRows = 6;

// Column vectors per register block: 4 where a vector is 64 bytes (avx512: 32 registers hold 6 x 4
// accumulators, 4 vectors of B and a broadcast), else 2 (avx2's 16 registers: 6 x 2 + 2 + 1).
template <typename T>
constexpr int tile_vectors() {
  return sizeof(at::vec::Vectorized<T>) >= 64 ? 4 : 2;
}

// rows (<= kTileRows) rows of C, from row i0, by NV whole vectors of columns from column j0:
//   acc = op(A)[i0 : i0 + rows, :] B[:, j0 : j0 + NV V]  (kept in registers: no branch, no partial load in the loop)
// then C = alpha acc (+ C). B's block is whole here: tile_gemm_impl pads a short last block first.
template <typename T, int rows, bool a_transposed>
inline void tile_block(int64_t i0, int64_t j0, int64_t k, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb,
                       bool accumulate, T* c, int64_t ldc) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t V = Vec::size();
  constexpr int NV = tile_vectors<T>();
  Vec acc[rows][NV];
  for (int r = 0; r < rows; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec(T(0));
  }
  const T* bt = b + j0;
  for (int64_t t = 0; t < k; ++t, bt += ldb) {
    Vec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = Vec::loadu(bt + v * V);
    for (int r = 0; r < rows; ++r) {
      const Vec ar(a_transposed ? a[t * lda + i0 + r] : a[(i0 + r) * lda + t]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(ar, bv[v], acc[r][v]);
    }
  }
  const Vec valpha(alpha);
  for (int r = 0; r < rows; ++r) {
    T* cr = c + (i0 + r) * ldc + j0;
    for (int v = 0; v < NV; ++v) {
      Vec cv = acc[r][v] * valpha;
      if (accumulate) cv = cv + Vec::loadu(cr + v * V);
      cv.store(cr + v * V);
    }
  }
}

// Row blocks of kTileRows down one column block (then the remaining rows as one smaller block).
template <typename T, bool a_transposed>
inline void tile_column(int64_t m, int64_t j0, int64_t k, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb,
                        bool accumulate, T* c, int64_t ldc) {
  int64_t i0 = 0;
  for (; i0 + kTileRows <= m; i0 += kTileRows) {
    tile_block<T, kTileRows, a_transposed>(i0, j0, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
  }
  switch (m - i0) {
    case 5: tile_block<T, 5, a_transposed>(i0, j0, k, alpha, a, lda, b, ldb, accumulate, c, ldc); break;
    case 4: tile_block<T, 4, a_transposed>(i0, j0, k, alpha, a, lda, b, ldb, accumulate, c, ldc); break;
    case 3: tile_block<T, 3, a_transposed>(i0, j0, k, alpha, a, lda, b, ldb, accumulate, c, ldc); break;
    case 2: tile_block<T, 2, a_transposed>(i0, j0, k, alpha, a, lda, b, ldb, accumulate, c, ldc); break;
    case 1: tile_block<T, 1, a_transposed>(i0, j0, k, alpha, a, lda, b, ldb, accumulate, c, ldc); break;
    default: break;
  }
}

template <typename T, bool a_transposed>
inline void tile_gemm_impl(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
                           int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  constexpr int64_t W = tile_vectors<T>() * at::vec::Vectorized<T>::size();
  const int64_t whole = n / W * W;
  for (int64_t j0 = 0; j0 < whole; j0 += W) tile_column<T, a_transposed>(m, j0, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
  const int64_t width = n - whole;
  if (width == 0) return;
  // The last, short column block: B's columns copied into a zero-padded k x W panel and C's into an m x W
  // panel, the same block kernel run on them (so these columns are computed exactly as whole ones), C's
  // columns copied back. Memory: k x W and 2 m x W more.
  thread_local std::vector<T> b_pad, c_pad;
  b_pad.assign(k * W, T(0));
  c_pad.assign(m * W, T(0));
  for (int64_t t = 0; t < k; ++t) std::copy(b + t * ldb + whole, b + t * ldb + n, b_pad.data() + t * W);
  if (accumulate) {
    for (int64_t i = 0; i < m; ++i) std::copy(c + i * ldc + whole, c + i * ldc + n, c_pad.data() + i * W);
  }
  tile_column<T, a_transposed>(m, 0, k, alpha, a, lda, b_pad.data(), W, accumulate, c_pad.data(), W);
  for (int64_t i = 0; i < m; ++i) std::copy(c_pad.data() + i * W, c_pad.data() + i * W + width, c + i * ldc + whole);
}

// C (m x n, ldc) = alpha op(A) B (+ C when accumulate); see the top of this file.
template <typename T>
inline void tile_gemm(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, bool a_transposed,
                      const T* b, int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  if (a_transposed) {
    tile_gemm_impl<T, true>(m, n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
  } else {
    tile_gemm_impl<T, false>(m, n, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
  }
}

// dst (cols x rows, ld_dst) = src (rows x cols, ld_src)^T, converted to dst's type (float16/bfloat16 -> float):
// the B of a product A src^T (a key or value block, read as its transpose). Memory: rows x cols elements read
// and written once.
template <typename S, typename T>
inline void transpose_rows(const S* src, int64_t rows, int64_t cols, int64_t ld_src, T* dst, int64_t ld_dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const S* s = src + r * ld_src;
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = static_cast<T>(s[c]);
  }
}

}  // namespace fastformer::cpu
