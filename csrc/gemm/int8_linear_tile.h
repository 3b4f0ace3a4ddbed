// The int8 GEMM's inner tile (csrc/gemm/int8_linear.cpp), written once and included once per dot-product
// instruction, each time inside its own namespace (and, for the VNNI instructions, inside a
// `#pragma GCC target` region, so that only that copy may use them). The including namespace defines
//   struct Isa {
//     using Reg;                       // a vector of int32 lanes
//     using Row;                       // one row's 4 activation bytes, broadcast (and whatever the dot needs)
//     static constexpr int kLanes;     // int32 lanes (= columns) per Reg
//     static constexpr int kRows;      // rows per pass: kRows x (32 / kLanes) accumulators fit the registers
//     Reg zero(); Row row(const uint8_t* four); Reg load(const int8_t* w);
//     Reg dot(Reg acc, const Row& a, Reg w);  // acc[lane] += sum of 4 byte products of column `lane`
//     void store(int32_t* out, Reg);
//   };
// Panel layout (int8, csrc/gemm/gemm.h int8_index): (ceil(N / 32), K4, 32, 4): for each group of 4 k (K4 =
// ceil(K / 4), zeros past K) the 32 columns' 4 bytes each, 128 contiguous bytes; so for one k4 a Reg holds
// kLanes columns' 4 weights, and one broadcast of a row's 4 activation bytes meets them all. Memory traffic: the panel (K4 x 128
// bytes) once per group of kRows rows, the rows' bytes from L1.

// acc (R, 32) int32 = a (R rows of K4 x 4 bytes, row stride a_stride) . panel (K4, 32, 4).
template <int R>
void tile_rows(const uint8_t* a, int64_t a_stride, int64_t K4, const int8_t* panel, int32_t* acc_out) {
  constexpr int kRegs = kInt8Panel / Isa::kLanes;
  typename Isa::Reg acc[R][kRegs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kRegs; ++v) acc[r][v] = Isa::zero();
  for (int64_t k4 = 0; k4 < K4; ++k4) {
    typename Isa::Reg w[kRegs];
    for (int v = 0; v < kRegs; ++v) w[v] = Isa::load(panel + int8_index(v * Isa::kLanes, 4 * k4, K4));
    for (int r = 0; r < R; ++r) {
      const typename Isa::Row row = Isa::row(a + r * a_stride + k4 * 4);
      for (int v = 0; v < kRegs; ++v) acc[r][v] = Isa::dot(acc[r][v], row, w[v]);
    }
  }
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
