// The CPU kernels of one instruction-set level as a table of the entry points of csrc/op_entry_points.h.
//
// The kernel files csrc/cpu/<op>.cpp are compiled once per level (default x86-64, AVX2, AVX-512: each
// with its own -m flags and ATen's CPU_CAPABILITY, as ATen builds its own kernels) into a module of its
// own, fastformer._cpu_<level> (csrc/cpu/level_module.cpp), whose symbols stay hidden. fastformer._C
// registers the CPU dispatch key once and calls through the table of the level chosen at import
// (csrc/cpu_levels.cpp, fastformer/_ext.py). Only the chosen level's module is ever loaded, so no
// instruction of a higher level can run on a CPU without it (one binary for every x86-64 CPU).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <tuple>

#include "cpu/decoder_step.h"
#include "ops.h"

namespace fastformer {

// Columns per panel of a weight packed for packed_linear (csrc/cpu/packed_linear.cpp).
constexpr int kPackedLinearPanel = 32;

namespace cpu {
using at::Tensor;
#include "op_entry_points.h"

// y (M, n) = x (M, K) W^T + bias for a weight packed as panels (ceil(n / kPackedLinearPanel), K,
// kPackedLinearPanel); float32, contiguous, arguments checked by the caller (csrc/cpu_levels.cpp).
Tensor packed_linear(const Tensor& x, const Tensor& panels, const c10::optional<Tensor>& bias, int64_t n);
// The same on raw pointers: y (M, n) row-major, x (M, K) row-major, bias nullptr for none.
void packed_linear_rows(const float* x, int64_t M, int64_t K, const float* panels, const float* bias, float* y,
                        int64_t n);

// The same with W quantized to int8 (csrc/cpu/int8_linear.cpp), activations quantized per row here;
// variant: an index into int8_variants() (0: the best this CPU runs at this level).
void int8_linear_rows(const float* x, int64_t M, int64_t K, const Int8Weight& w, const float* bias, float* y,
                      int64_t n, int variant);
// The int8 dot-product variants this CPU runs at this level, best first, null-terminated: "avx512_vnni",
// "avx_vnni", "avx2", "default".
const char* const* int8_variants();

// The forward of layer_norm_residual without dropout on raw float32 rows (csrc/cpu/layer_norm_residual.cpp):
// s = residual + x and y = LayerNorm(s), mean and rstd (R,) written. Row by row each input row is read
// before that row's outputs are written, so y or s may be the residual itself.
void layer_norm_residual_rows(const float* x, const float* residual, const float* weight, const float* bias,
                              float* y, float* s, float* mean, float* rstd, int64_t R, int64_t N, double eps);

// One step of the incremental decoder (csrc/cpu/decoder_step.cpp): writes step.logits and this step's
// keys/values into the caches.
void decoder_step(const DecoderStep& step);

// The beam search's pass over the vocabulary (csrc/cpu/search_candidates.cpp): per row of logits (N, V),
// lse (N) and the best `width` producible logits and their tokens (N, width); only_eos (N) or nullptr.
void search_candidates(const float* logits, int64_t N, int64_t V, const bool* only_eos, int64_t pad, int64_t bos,
                       int64_t eos, int64_t width, double* lse, float* top_values, int64_t* top_tokens);
}  // namespace cpu

// Bumped whenever the table's layout changes: a module of another layout is refused at import.
constexpr int kCpuKernelsAbi = 5;
constexpr const char* kCpuKernelsCapsule = "fastformer.cpu_kernels";

struct CpuKernels {
  int abi;            // kCpuKernelsAbi of the module that filled it
  const char* level;  // "default", "avx2" or "avx512"
  int vector_floats;  // floats per at::vec::Vectorized<float> at this level
#define FASTFORMER_CPU_TABLE_ENTRY(op, ...) \
  decltype(&cpu::op##_fwd) op##_fwd;        \
  decltype(&cpu::op##_bwd) op##_bwd;
  FASTFORMER_OPS(FASTFORMER_CPU_TABLE_ENTRY)
#undef FASTFORMER_CPU_TABLE_ENTRY
  decltype(&cpu::packed_linear) packed_linear;  // the decoder's small-M projections (not an op)
  decltype(&cpu::decoder_step) decoder_step;    // the incremental decoder's whole step (not an op)
  decltype(&cpu::search_candidates) search_candidates;  // the beam search's pass over the vocabulary
  decltype(&cpu::int8_linear_rows) int8_linear_rows;    // the int8 projections (not an op)
  decltype(&cpu::int8_variants) int8_variants;
};

}  // namespace fastformer
