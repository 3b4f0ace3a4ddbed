// A projection's gradients in bf16 training on the CPU: dW (N, K) float32 = dy (M, N)^T x (M, K) and its bias's,
// db (N) float32 = the column sums of dy, dy and x bfloat16 (fastformer/nn/linear.py's _ComputeLinear backward; M
// the micro-batch's tokens). ATen multiplies
// bfloat16 into bfloat16 only on the CPU, so without this the gradient came out of oneDNN in bf16 and autograd
// cast it to the float32 parameter's dtype: one cast (and one rounding to bf16) per weight per micro-batch
// (issue 52); the bias's, a sum with a float32 result, cast all of dy to float32 first. Here the sums stay in
// float32 from the first product to the gradient, and db is summed from the blocks of dy as they are packed.
// Compiled per instruction-set level, on the one micro-kernel (csrc/gemm/products.h: bf16_dot where the CPU has
// AVX512_BF16, else bf16_emulated, bit for bit the same where no subnormal number occurs).
//
// Algorithm: the sum runs over the tokens, the rows of both operands, so both are read as pairs of rows
// interleaved (pack_row_pairs: the layout vdpbf16ps sums), dy's as the A operand read a step at a time
// (tile_gemm_bf16's a_pairs: no transpose), x's as B. Tokens in blocks of kTokenBlock:
//   for each block of tokens [t0, t1):
//     B = pairs of x[t0:t1, :]                          (kTokenBlock / 2 x K uint32);
//     for each chunk of this thread's rows of dW:
//       db[chunk] (+)= column sums of dy[t0:t1, rows of the chunk];
//       A = pairs of dy[t0:t1, rows of the chunk]       (kTokenBlock / 2 x kRowChunk uint32);
//       dW[chunk] (+)= A^T B   (the tile product: 64-column blocks of B in L1, 6-row register blocks of A)
// Every element's sum is its own chain: the pairs of a block in token order, the blocks added to the float32
// result in token order. So dW does not depend on the threads (threads take rows of dW; each packs its own
// copy of B), on memory offsets or on the level. dy and x may have any row stride (unit column stride).
// Memory: dy and x read once each (and written once as pairs, in cache); B re-read from L1/L2 per 6 rows;
// dW read and written once per token block (8 bytes per output per 512 tokens, against 512 multiply-adds).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <tuple>
#include <vector>

#include "cpu/kernel_table.h"
#include "gemm/products.h"

namespace fastformer {
namespace cpu {
namespace {

// Tokens per block: the B block of a 64-column register block is kTokenBlock / 2 x 64 pairs = 64 KiB (L2, beside
// the thread's A chunk), and dW is read and written once per block (the block sizes' measurements:
// docs/cpu-kernels.md, "Measured").
constexpr int64_t kTokenBlock = 512;
// Rows of dW per task: a multiple of the register block's 6 rows, enough that packing B per thread (K x
// kTokenBlock per block, against rows x K x kTokenBlock multiply-adds) stays a few percent.
constexpr int64_t kRowGrain = 48;
// Rows of dW per product within a thread's rows: the A chunk, kTokenBlock / 2 x kRowChunk pairs = 192 KiB, stays
// in L2 while the tile product passes over it once per 64 columns (a thread's whole A, 8 MiB for the 8,000-row
// output projection at 2 threads, came from L3 each time).
constexpr int64_t kRowChunk = 192;

}  // namespace

// db[j] (+ when accumulate)= sum over the block's rows t of dy[t][j], j < cols: float32 sums in row order (a
// block's sum, then added to db). Memory: the block's dy, just packed, read again from cache.
void column_sums(const c10::BFloat16* dy, int64_t tokens, int64_t cols, int64_t ld, bool accumulate, float* db) {
  thread_local std::vector<float> sums;
  sums.assign(cols, 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    const c10::BFloat16* row = dy + t * ld;
    for (int64_t j = 0; j < cols; ++j) sums[j] += static_cast<float>(row[j]);
  }
  for (int64_t j = 0; j < cols; ++j) db[j] = accumulate ? db[j] + sums[j] : sums[j];
}

std::tuple<Tensor, Tensor> weight_grad(const Tensor& dy, const Tensor& x, bool emulated) {
  const int64_t M = dy.size(0), N = dy.size(1), K = x.size(1);
  Tensor dw = at::empty({N, K}, dy.options().dtype(at::kFloat));
  Tensor db = at::empty({N}, dy.options().dtype(at::kFloat));
  if (M == 0 || N == 0 || K == 0) {
    dw.zero_();
    if (M == 0 || N == 0) return {dw, db.zero_()};
  }
  const c10::BFloat16* dyp = dy.const_data_ptr<c10::BFloat16>();
  const c10::BFloat16* xp = x.const_data_ptr<c10::BFloat16>();
  const int64_t ld_dy = dy.stride(0), ld_x = x.stride(0);
  float* out = dw.mutable_data_ptr<float>();
  float* bias = db.mutable_data_ptr<float>();
  at::parallel_for(0, N, kRowGrain, [&](int64_t r0, int64_t r1) {
    std::vector<uint32_t> a_pairs(kTokenBlock / 2 * std::min(kRowChunk, r1 - r0)), b_pairs(kTokenBlock / 2 * K);
    for (int64_t t0 = 0; t0 < M; t0 += kTokenBlock) {
      const int64_t tokens = std::min(kTokenBlock, M - t0);
      if (K > 0) pack_row_pairs(xp + t0 * ld_x, tokens, K, ld_x, b_pairs.data(), K);
      for (int64_t c0 = r0; c0 < r1; c0 += kRowChunk) {
        const int64_t rows = std::min(kRowChunk, r1 - c0);
        const c10::BFloat16* dy_block = dyp + t0 * ld_dy + c0;
        column_sums(dy_block, tokens, rows, ld_dy, /*accumulate=*/t0 > 0, bias + c0);
        if (K == 0) continue;
        pack_row_pairs(dy_block, tokens, rows, ld_dy, a_pairs.data(), rows);
        tile_gemm_bf16(rows, K, tokens, 1.0f, reinterpret_cast<const c10::BFloat16*>(a_pairs.data()), 2 * rows,
                       b_pairs.data(), K, /*accumulate=*/t0 > 0, out + c0 * K, K, emulated, /*a_pairs=*/true);
      }
    }
  });
  return {dw, db};
}

}  // namespace cpu
}  // namespace fastformer
