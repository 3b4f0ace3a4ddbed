// y = x W^T + b at inference (the model's projections under no_grad, fastformer/nn/linear.py, and every
// projection of a decoding step, csrc/inference/decoder_step.cpp), on a weight packed once into column panels.
// Compiled per instruction-set level like the op kernels (at::vec::Vectorized<float>: 16 floats on AVX-512,
// 8 on AVX2 and the default level).
//
// Shapes: x (M, K) float32; panels (ceil(N / P), P / S, K, S) float32 (csrc/gemm/gemm.h: panel p holds columns
// p P .. p P + P - 1 of W^T, zeros past N, as P / S strips of S columns, each K x S contiguous; P = 32,
// S = 16); bias (N,) or none; y (M, N).
// Why: at M <= 16 rows a GEMM is a stream of the weight, and a library GEMM on the (out, in) or (in, out)
// layout reads it with strides or repacks it per call. A panel is K P contiguous floats, so the weight
// streams once, front to back: per panel and group of R rows, R x (P / vector) accumulators start at the
// bias, and for each k the P weights of row k (P / vector vector loads, one per strip and vector of it) are
// multiplied by the R broadcasts x[r][k] (fused multiply-add). Memory traffic: the weight once (4 K N bytes,
// padded to P columns), x once per panel from L1, y written once.
// Panels are split over threads (at::parallel_for) when there are enough of them. With more rows the same
// loop is compute-bound: R x P / vector fused multiply-adds per P / vector loads and R broadcasts
// (AVX-512: 8 per 2 + 4), the panel re-read from L1/L2 per row group; on AVX2 from 8 rows the panel is
// taken a strip at a time, 6 rows at a time (12 per 2 + 6: kWideRowGroup below).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

#include "cpu/kernel_table.h"
#include "gemm/products.h"

namespace fastformer {
namespace cpu {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kVecs = kPackedLinearPanel / Vec::size();  // vector registers per panel row
// Rows per pass: R x kVecs accumulators plus kVecs weight vectors stay in the 16 (AVX2) or 32 (AVX-512)
// vector registers.
constexpr int kRowGroup = kVecs <= 2 ? 4 : 2;
static_assert(kPackedLinearStrip % Vec::size() == 0, "a strip's row is a whole number of vectors");
#if defined(CPU_CAPABILITY_AVX2)
// AVX2 with many rows: the 2 x 4 register block above does 8 fused multiply-adds per 4 weight loads and 2
// broadcasts, too many loads for the FMA units to stay busy (well below MKL at M = 128, 1 thread:
// docs/cpu-kernels.md, "Measured"). Instead each panel is taken a strip (2 vectors) at a time, and 6 rows at
// a time: 12 accumulators, 2 weight vectors and a broadcast (15 of the 16 registers), 12 FMAs per 2 loads and
// 6 broadcasts. A strip (K x 16 floats, one cache line per k, contiguous) stays in L1/L2 while the row groups
// pass over it.
constexpr int kWideRowGroup = 6, kWideVecs = 2;
constexpr int64_t kWideMinRows = 8;  // fewer rows: the weight streams once, the 2 x 4 block is the better one
#endif

// y[r][n0 + c0 .. n0 + c0 + V vectors) for rows r < R of x (row stride K): the V vectors of columns from c0
// of one panel whose first `width` columns are real (<= P; the rest is padding). Vector v of row k
// is at column[v] + k S (row k of its strip).
template <int R, int V>
void panel_rows(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t y_stride,
                int64_t n0, int c0, int64_t width) {
  constexpr int kWidth = V * Vec::size();
  const int64_t valid = std::min<int64_t>(kWidth, width - c0);  // real columns of this block
  if (valid <= 0) return;
  alignas(64) float edge[kWidth];  // the last panel's bias (zero-padded) and outputs
  Vec acc[R][V];
  const float* b = bias != nullptr ? bias + n0 + c0 : nullptr;
  if (b != nullptr && valid < kWidth) {
    std::fill(edge, edge + kWidth, 0.0f);
    std::copy(b, b + valid, edge);
    b = edge;
  }
  for (int v = 0; v < V; ++v) {
    const Vec init = b != nullptr ? Vec::loadu(b + v * Vec::size()) : Vec(0.0f);
    for (int r = 0; r < R; ++r) acc[r][v] = init;
  }
  const float* column[V];
  for (int v = 0; v < V; ++v) column[v] = panel + packed_column_offset(c0 + v * Vec::size(), K);
  // the micro-kernel (csrc/gemm/micro_kernel.h): A = x's rows, B's register v at step k = column[v] + k S
  micro::micro_kernel<micro::FmaIsa<float>, R, V>(K, x, K, column, kPackedLinearStrip, acc);
  for (int r = 0; r < R; ++r) {
    float* out = y + r * y_stride + n0 + c0;
    if (valid == kWidth) {
      for (int v = 0; v < V; ++v) acc[r][v].store(out + v * Vec::size());
    } else {
      for (int v = 0; v < V; ++v) acc[r][v].store(edge + v * Vec::size());
      std::copy(edge, edge + valid, out);
    }
  }
}

// panel_rows for the first `rows` (<= R) rows: the block of R rows, or of as many as there are.
template <int R, int V>
void row_group(int rows, const float* x, int64_t K, const float* panel, const float* bias, float* y,
               int64_t y_stride, int64_t n0, int c0, int64_t width) {
  if constexpr (R > 1) {
    if (rows < R) return row_group<R - 1, V>(rows, x, K, panel, bias, y, y_stride, n0, c0, width);
  }
  panel_rows<R, V>(x, K, panel, bias, y, y_stride, n0, c0, width);
}

// The rows of the group that starts at m0: R, except near the end. A group of 1-3 rows keeps too few
// accumulators to cover the FMA latency (2 rows x 2 vectors: 4 chains, a quarter of AVX2's 2 FMAs x 4 cycles
// in flight), so when R / 2 or fewer rows would be left over, the last R + rest rows go as two groups of about
// half (128 rows, R = 6: 20 x 6 + 4 + 4, not 21 x 6 + 2, whose 2-row group took a share of the
// projections' time several times its share of the rows: docs/cpu-kernels.md, "Measured").
template <int R>
int group_rows(int64_t m0, int64_t M) {
  const int64_t left = M - m0, rest = M % R;
  if (M > R && rest != 0 && rest <= R / 2 && left <= R + rest) {
    const int64_t last = R + rest;  // the last two groups' rows
    return static_cast<int>(left == last ? (last + 1) / 2 : left);
  }
  return static_cast<int>(std::min<int64_t>(R, left));
}

// Every row of x times one panel: row groups of R rows, each over the panel's column blocks of V vectors.
// `next` (the panel this thread takes next, or nullptr): its cache lines are prefetched into L2, a share
// before each row group, so that the next panel's first row group does not wait on memory. Where the weight
// does not fit the caches (the output projection: 58,101 x 512 floats, 119 MB) that first pass was
// memory-bound, well below a weight that stays in L3, and the prefetch wins most of that back. From
// kPrefetchMinRows rows only: with fewer the prefetch slowed the stream (docs/cpu-kernels.md, "Measured").
constexpr int64_t kPrefetchMinRows = 8;
template <int R, int V>
void panel_all_rows(const float* x, int64_t M, int64_t K, const float* panel, const float* bias, float* y,
                    int64_t y_stride, int64_t n0, int64_t width, const float* next) {
  constexpr int64_t kLine = 64 / sizeof(float);  // floats per cache line
  const int64_t lines = next != nullptr ? K * kPackedLinearPanel / kLine : 0;
  int64_t groups = 0;  // row groups a column block
  for (int64_t m0 = 0; m0 < M; m0 += group_rows<R>(m0, M)) ++groups;
  groups *= kPackedLinearPanel / (V * Vec::size());
  const int64_t share = (lines + groups - 1) / groups;
  int64_t prefetched = 0;
  for (int c0 = 0; c0 < kPackedLinearPanel; c0 += V * Vec::size()) {
    for (int64_t m0 = 0, rows = 0; m0 < M; m0 += rows) {
      for (const int64_t end = std::min(lines, prefetched + share); prefetched < end; ++prefetched) {
        __builtin_prefetch(next + prefetched * kLine, /*rw=*/0, /*locality=*/2);
      }
      rows = group_rows<R>(m0, M);
      row_group<R, V>(static_cast<int>(rows), x + m0 * K, K, panel, bias, y + m0 * y_stride, y_stride, n0, c0,
                      width);
    }
  }
}

}  // namespace

void packed_linear_rows(const float* x, int64_t M, int64_t K, const float* panels, const float* bias, float* y,
                        int64_t n, int64_t y_stride) {
  if (M == 0 || n == 0) return;
  const int64_t P = (n + kPackedLinearPanel - 1) / kPackedLinearPanel;
  // About 64 K-long panel rows of work per task before a second thread pays off.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPackedLinearPanel, width = std::min<int64_t>(kPackedLinearPanel, n - n0);
      const float* panel = panels + p * K * kPackedLinearPanel;
      // (few rows: the loop streams the weight at memory speed, and the hardware prefetcher keeps up better alone)
      const float* next = p + 1 < p1 && M >= kPrefetchMinRows ? panel + K * kPackedLinearPanel : nullptr;
#if defined(CPU_CAPABILITY_AVX2)
      if (M >= kWideMinRows) {
        panel_all_rows<kWideRowGroup, kWideVecs>(x, M, K, panel, bias, y, y_stride, n0, width, next);
        continue;
      }
#endif
      panel_all_rows<kRowGroup, kVecs>(x, M, K, panel, bias, y, y_stride, n0, width, next);
    }
  });
}

Tensor packed_linear(const Tensor& x, const Tensor& panels, const c10::optional<Tensor>& bias, int64_t n) {
  Tensor y = at::empty({x.size(0), n}, x.options());
  packed_linear_rows(x.const_data_ptr<float>(), x.size(0), x.size(1), panels.const_data_ptr<float>(),
                     bias.has_value() ? bias->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), n, n);
  return y;
}

}  // namespace cpu
}  // namespace fastformer
