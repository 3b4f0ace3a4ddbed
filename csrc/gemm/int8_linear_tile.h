// The int8 GEMM's inner tile (csrc/gemm/int8_linear.cpp) on the one micro-kernel (csrc/gemm/micro_kernel.h, included
// just before this file), written once and included once per dot-product instruction, each time inside its own
// namespace (and, for the VNNI instructions, inside a `#pragma GCC target` region, so that only that copy may use
// them). The including namespace defines the micro-kernel's `struct Isa` with 4-byte steps (kDepth 4: AElem
// uint8_t, BElem int8_t; madd: acc[lane] += the 4 byte products of column `lane`) and kRows, its rows per pass.
// Panel layout (int8, csrc/gemm/gemm.h int8_index): (ceil(N / 32), K4, 32, 4): for each group of 4 k (K4 =
// ceil(K / 4), zeros past K) the 32 columns' 4 bytes each, 128 contiguous bytes; so for one k4 a register holds
// kLanes columns' 4 weights, and one broadcast of a row's 4 activation bytes meets them all. Memory traffic: the
// panel (K4 x 128 bytes) once per group of kRows rows, the rows' bytes from L1.

// acc (R, 32) int32 = a (R rows of K4 x 4 bytes, row stride a_stride) . panel (K4, 32, 4).
template <int R>
void tile_rows(const uint8_t* a, int64_t a_stride, int64_t K4, const int8_t* panel, int32_t* acc_out) {
  constexpr int kRegs = kInt8Panel / Isa::kLanes;
  typename Isa::Acc acc[R][kRegs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kRegs; ++v) acc[r][v] = Isa::zero();
  const int8_t* columns[kRegs];  // register v: columns v kLanes .. of the panel; a step is 128 bytes on
  for (int v = 0; v < kRegs; ++v) columns[v] = panel + int8_index(v * Isa::kLanes, 0, K4);
  micro_kernel<Isa, R, kRegs>(K4, a, a_stride, columns, 4 * kInt8Panel, acc);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kRegs; ++v) Isa::store(acc_out + r * kInt8Panel + v * Isa::kLanes, acc[r][v]);
}

// tile_rows for `rows` <= Isa::kRows rows.
inline void tile(int rows, const uint8_t* a, int64_t a_stride, int64_t K4, const int8_t* panel, int32_t* acc_out) {
  switch (rows) {
    case 1: return tile_rows<1>(a, a_stride, K4, panel, acc_out);
    case 2: if constexpr (Isa::kRows >= 2) return tile_rows<2>(a, a_stride, K4, panel, acc_out); break;
    case 3: if constexpr (Isa::kRows >= 3) return tile_rows<3>(a, a_stride, K4, panel, acc_out); break;
    case 4: if constexpr (Isa::kRows >= 4) return tile_rows<4>(a, a_stride, K4, panel, acc_out); break;
  }
}
