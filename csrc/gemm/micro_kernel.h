// fastformer's one register-blocked CPU micro-kernel, and the tile product built on it. Every CPU product of
// fastformer that must not depend on a BLAS runs here: the attention kernels' tile products (float32/float64
// fused multiply-adds; bfloat16 dot products), the decoding GEMMs' float32 panels (csrc/gemm/packed_linear.cpp)
// and their int8 panels (csrc/gemm/int8_linear.cpp). The variants, what each guarantees, and the packers of
// their B operands: csrc/gemm/products.h.
//
// NO INCLUDE GUARD, on purpose: this file is included once per instruction-set region, each time inside a
// namespace of its own (and, for instructions beyond the level's flags, such as vdpbf16ps or vpdpbusd, inside
// that region's `#pragma GCC target`), so that the code below is compiled with the instructions its Isa uses
// and inlined into it. (GCC compiles a template with the options in force where it is defined: instantiated
// from a target region, a template defined outside it calls its Isa's intrinsics out of line.)
//
// An instruction set is a struct `Isa`:
//   using AElem, BElem;    // what A and B are read as (float, double; bfloat16 and packed pairs; bytes)
//   using Acc, AReg, BReg; // an accumulator register (kLanes outputs); a step of one row of A, broadcast; a step
//                          // of kLanes columns of B
//   kLanes                 // output columns per register
//   kDepth                 // inputs k summed per step: 1 (a fused multiply-add), 2 (a bf16 pair), 4 (4 bytes)
//   kRows, kVectors        // the register block: kRows rows by kVectors registers of columns, sized so that
//                          // the accumulators, one step of B and a broadcast fit the vector registers
//   Acc zero(); AReg broadcast(const AElem* step); BReg load(const BElem* step); Acc madd(Acc, AReg, BReg);
// and, for the tile product (not the int8 panels): using Out (float or double) and Vectorized<Out> out(Acc).
//
// The micro-kernel: acc[r][v] (kLanes columns each) += sum over steps t of A(r, t) . B(t, v), where
//   A(r, t) = the kDepth elements at a + r lda + t kDepth (rows of A in memory), or, a_transposed, at
//             a + t lda + r kDepth (steps of A in memory: kDepth 1, A^T row-major; kDepth 2, a step's pairs of
//             every row side by side, as pack_row_pairs lays out A^T);
//   B(t, v) = the register at b[v] + t b_step (the B operand's layout is the caller's: row-major rows, column
//             strips of a packed panel, pair- or quad-interleaved rows);
// in that order, one step at a time for every element, whatever its row, column, block or thread: so a result
// depends on its own row of A and column of B alone.
// Memory: per step NV registers of B loaded and R broadcasts of A, for R x NV madds; the accumulators stay
// in registers (no branch and no partial load in the loop: GCC kept them on the stack, stored every
// iteration, while a loop also handled a short last block).

template <class Isa, int R, int NV, bool a_transposed = false>
inline void micro_kernel(int64_t steps, const typename Isa::AElem* a, int64_t lda,
                         const typename Isa::BElem* const* b, int64_t b_step, typename Isa::Acc (&acc)[R][NV]) {
  for (int64_t t = 0; t < steps; ++t) {
    typename Isa::BReg bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = Isa::load(b[v] + t * b_step);
    for (int r = 0; r < R; ++r) {
      const typename Isa::AElem* ar_at = a_transposed ? a + t * lda + r * Isa::kDepth : a + r * lda + t * Isa::kDepth;
      const typename Isa::AReg ar = Isa::broadcast(ar_at);
      for (int v = 0; v < NV; ++v) acc[r][v] = Isa::madd(acc[r][v], ar, bv[v]);
    }
  }
}

// ---- The tile product ------------------------------------------------------------------------------------
//   C (m x n, ldc, Out) = alpha op(A) B   (+ C when accumulate)
//   op(A) (m x k): A[i lda + t]; a_transposed: A[t lda + i] (kDepth 1), or, kDepth 2, the step s = t / 2 of row i
//      at A + s lda + 2 i (ceil(k / 2) rows of lda AElems, pairs of A^T's rows interleaved: pack_row_pairs; past
//      k: zeros);
//   B: ceil(k / kDepth) rows of ldb BElems, row s holding step s of every column (kDepth 1: B (k x n) row-major;
//      bf16: pairs of rows interleaved, products.h pack_row_pairs / pack_column_pairs; past k: zeros).
// Every element: acc = 0; acc = madd(acc, A(i, step), B(step, j)) for each step in order; C = alpha acc (+ C).
// Register blocks of kRows rows by NV registers of columns. Loop order: column blocks outside, row blocks
// inside, so a column block's B stays in L1 while every row block streams past it. Memory traffic per call: A
// once per column block, B once, C once (twice when accumulating). Columns: blocks of kVectors registers, then
// one of half that and one of a single register where they fit (so that head dims such as 32, 48 and 96 at
// AVX-512 need no padding), then the last columns (fewer than kLanes) through a zero-padded copy of their B
// and C (the same arithmetic). A k that is not a whole number of steps: its last, partial step reads A's last
// values zero-padded (and B's zero-padded row), after the loop (a transposed A arrives zero-padded, as B).

template <class Isa, int R, int NV, bool a_transposed>
inline void tile_block(int64_t i0, int64_t j0, int64_t k, typename Isa::Out alpha, const typename Isa::AElem* a,
                       int64_t lda, const typename Isa::BElem* b, int64_t ldb, bool accumulate,
                       typename Isa::Out* c, int64_t ldc) {
  using OutVec = at::vec::Vectorized<typename Isa::Out>;
  static_assert(OutVec::size() == Isa::kLanes, "an accumulator register holds one vector of outputs");
  typename Isa::Acc acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Isa::zero();
  const typename Isa::BElem* bcol[NV];
  for (int v = 0; v < NV; ++v) bcol[v] = b + j0 + v * Isa::kLanes;
  const typename Isa::AElem* ab = a_transposed ? a + i0 * Isa::kDepth : a + i0 * lda;
  const int64_t steps = a_transposed ? (k + Isa::kDepth - 1) / Isa::kDepth : k / Isa::kDepth;
  micro_kernel<Isa, R, NV, a_transposed>(steps, ab, lda, bcol, ldb, acc);
  if constexpr (Isa::kDepth > 1 && !a_transposed) {
    if (const int64_t rest = k - steps * Isa::kDepth; rest != 0) {
      typename Isa::AElem tail[R * Isa::kDepth] = {};  // each row's last `rest` values, then zeros
      for (int r = 0; r < R; ++r)
        for (int64_t i = 0; i < rest; ++i) tail[r * Isa::kDepth + i] = ab[r * lda + steps * Isa::kDepth + i];
      for (int v = 0; v < NV; ++v) bcol[v] += steps * ldb;
      micro_kernel<Isa, R, NV, false>(1, tail, Isa::kDepth, bcol, ldb, acc);
    }
  }
  const OutVec valpha(alpha);
  for (int r = 0; r < R; ++r) {
    typename Isa::Out* cr = c + (i0 + r) * ldc + j0;
    for (int v = 0; v < NV; ++v) {
      OutVec cv = Isa::out(acc[r][v]) * valpha;
      if (accumulate) cv = cv + OutVec::loadu(cr + v * Isa::kLanes);
      cv.store(cr + v * Isa::kLanes);
    }
  }
}

// A block of `rows` (<= R) rows: the largest instantiation that fits.
template <class Isa, int R, int NV, bool a_transposed, typename... Args>
inline void tile_rows(int rows, int64_t i0, Args... args) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<Isa, R - 1, NV, a_transposed>(rows, i0, args...);
  }
  tile_block<Isa, R, NV, a_transposed>(i0, args...);
}

// Row blocks of kRows down one column block of NV registers from column j0, the remaining rows as one block.
template <class Isa, int NV, bool a_transposed>
inline void tile_column(int64_t m, int64_t j0, int64_t k, typename Isa::Out alpha, const typename Isa::AElem* a,
                        int64_t lda, const typename Isa::BElem* b, int64_t ldb, bool accumulate,
                        typename Isa::Out* c, int64_t ldc) {
  int64_t i0 = 0;
  for (; i0 + Isa::kRows <= m; i0 += Isa::kRows) {
    tile_block<Isa, Isa::kRows, NV, a_transposed>(i0, j0, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
  }
  if (i0 < m) {
    tile_rows<Isa, Isa::kRows - 1, NV, a_transposed>(static_cast<int>(m - i0), i0, j0, k, alpha, a, lda, b, ldb,
                                                       accumulate, c, ldc);
  }
}

template <class Isa, bool a_transposed>
inline void tile_product(int64_t m, int64_t n, int64_t k, typename Isa::Out alpha, const typename Isa::AElem* a,
                         int64_t lda, const typename Isa::BElem* b, int64_t ldb, bool accumulate,
                         typename Isa::Out* c, int64_t ldc) {
  using BElem = typename Isa::BElem;
  using Out = typename Isa::Out;
  constexpr int64_t L = Isa::kLanes;
  int64_t j0 = 0;
  for (; j0 + Isa::kVectors * L <= n; j0 += Isa::kVectors * L) {
    tile_column<Isa, Isa::kVectors, a_transposed>(m, j0, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
  }
  if constexpr (Isa::kVectors >= 4) {
    if (j0 + 2 * L <= n) {
      tile_column<Isa, 2, a_transposed>(m, j0, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
      j0 += 2 * L;
    }
  }
  if (j0 + L <= n) {
    tile_column<Isa, 1, a_transposed>(m, j0, k, alpha, a, lda, b, ldb, accumulate, c, ldc);
    j0 += L;
  }
  const int64_t width = n - j0;
  if (width == 0) return;
  // The last `width` (< L) columns: B's copied into a (B rows x L) panel and C's into an (m x L) panel, the
  // one-register block run on them, C's columns copied back. The buffers are the thread's, kept between calls;
  // only their padding columns are zeroed (B's: they must be zero; C's: their values are never read back).
  // Memory: B rows x L and 2 m x L more.
  thread_local std::vector<BElem> b_pad;
  thread_local std::vector<Out> c_pad;
  const int64_t b_rows = (k + Isa::kDepth - 1) / Isa::kDepth;
  if (static_cast<int64_t>(b_pad.size()) < b_rows * L) b_pad.resize(b_rows * L);
  if (static_cast<int64_t>(c_pad.size()) < m * L) c_pad.resize(m * L);
  for (int64_t t = 0; t < b_rows; ++t) {
    std::copy(b + t * ldb + j0, b + t * ldb + n, b_pad.data() + t * L);
    std::fill(b_pad.data() + t * L + width, b_pad.data() + (t + 1) * L, BElem(0));
  }
  if (accumulate) {
    for (int64_t i = 0; i < m; ++i) std::copy(c + i * ldc + j0, c + i * ldc + n, c_pad.data() + i * L);
  }
  tile_column<Isa, 1, a_transposed>(m, 0, k, alpha, a, lda, b_pad.data(), L, accumulate, c_pad.data(), L);
  for (int64_t i = 0; i < m; ++i) std::copy(c_pad.data() + i * L, c_pad.data() + i * L + width, c + i * ldc + j0);
}
