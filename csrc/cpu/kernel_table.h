// The CPU kernels of one instruction-set level as a table of entry points: the ops' (csrc/op_entry_points.h),
// then, grouped, the decoding GEMMs' (csrc/gemm/gemm.h), the inference room's (csrc/inference/inference.h) and the
// optimizer's (csrc/optim/optim.h).
//
// The kernel files (csrc/cpu/<op>.cpp, and the per-level files of csrc/gemm/ and csrc/inference/: setup.py's
// LEVEL_SOURCES) are compiled once per level (default x86-64, AVX2, AVX-512: each with its own -m flags and
// ATen's CPU_CAPABILITY, as ATen builds its own kernels) into a module of its own, fastformer._cpu_<level>
// (csrc/cpu/level_module.cpp), whose symbols stay hidden. fastformer._C registers the CPU dispatch key once
// and calls through the table of the level chosen at import (csrc/cpu_levels.cpp, fastformer/_ext.py). Only
// the chosen level's module is ever loaded, so no instruction of a higher level can run on a CPU without it
// (one binary for every x86-64 CPU).
//
// The table's layout is checked, not remembered: setup.py compiles every module with FASTFORMER_KERNEL_TABLE,
// a digest of the headers that declare the table and what crosses it (this file, ops.h, op_entry_points.h,
// gemm/gemm.h, inference/inference.h, optim/optim.h), and fastformer._C refuses a level module whose digest differs.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <tuple>

#include "gemm/gemm.h"
#include "inference/inference.h"
#include "optim/optim.h"
#include "ops.h"

#ifndef FASTFORMER_KERNEL_TABLE
#error "compile with -DFASTFORMER_KERNEL_TABLE=\"<digest>\" (setup.py derives it from the table's headers)"
#endif

namespace fastformer {
namespace cpu {
using at::Tensor;
#include "op_entry_points.h"

// csrc/gemm: y (M, n) = x (M, K) W^T + bias for a weight packed as panels (gemm.h's float32 layout);
// float32, contiguous, arguments checked by the caller (csrc/gemm/gemm.cpp).
Tensor packed_linear(const Tensor& x, const Tensor& panels, const c10::optional<Tensor>& bias, int64_t n);
// The same on raw pointers: x (M, K) row-major, y (M, n) with rows y_stride (>= n) floats apart, bias nullptr
// for none.
void packed_linear_rows(const float* x, int64_t M, int64_t K, const float* panels, const float* bias, float* y,
                        int64_t n, int64_t y_stride);
// The same with W quantized to int8 (csrc/gemm/int8_linear.cpp), activations quantized per row there;
// variant: an index into int8_variants(), or -1: int8_choose(M, n, K).
void int8_linear_rows(const float* x, int64_t M, int64_t K, const Int8Weight& w, const float* bias, float* y,
                      int64_t n, int64_t y_stride, int variant);
// The int8 dot-product variants this CPU runs at this level, null-terminated: our own best first ("avx512_vnni",
// "avx_vnni", "avx2", "default"), then "onednn" where torch has oneDNN (csrc/gemm/int8_onednn.h).
const char* const* int8_variants();
// The rule: the index of the variant for an M x K by K x N product (the first that prefers it: oneDNN's on a
// CPU with AMX where gemm/int8_onednn.h onednn_preferred holds; else 0).
int int8_choose(int64_t M, int64_t N, int64_t K);
// Whether a projection bound for `variant` (an index, or -1: the rule) needs its weight prepared (oneDNN's pack):
// the variant packs, or the rule can prefer one that does for some product.
bool int8_packs(int variant);

// The tile products' variants this CPU runs at this level, null-terminated ("fma", then "bf16_dot" where the CPU
// has AVX512_BF16, "bf16_emulated": csrc/gemm/products.h), and C (m, n) = A (m, k) B (k, n) by one of them
// (products.cpp; A and B 2-D with unit column stride, checked by the caller: gemm.cpp).
const char* const* product_variants();
Tensor tile_product(const Tensor& a, const Tensor& b, const std::string& variant);
// A projection's gradients in bf16 training, dW (N, K) float32 = dy (M, N)^T x (M, K) and db (N) float32 = the
// column sums of dy, with dy and x bfloat16 of unit column stride (csrc/gemm/weight_grad.cpp; checked by the
// caller: gemm.cpp); emulated: bf16_emulated even where bf16_dot runs (the tests').
std::tuple<Tensor, Tensor> weight_grad(const Tensor& dy, const Tensor& x, bool emulated);

// The forward of layer_norm_residual without dropout on raw float32 rows (csrc/cpu/layer_norm_residual.cpp):
// s = residual + x and y = LayerNorm(s), mean and rstd (R,) written. Row by row each input row is read
// before that row's outputs are written, so y or s may be the residual itself.
void layer_norm_residual_rows(const float* x, const float* residual, const float* weight, const float* bias,
                              float* y, float* s, float* mean, float* rstd, int64_t R, int64_t N, double eps);

// csrc/inference: one step of the incremental decoder (decoder_step.cpp): writes step.logits and this
// step's keys/values into the caches.
void decoder_step(const DecoderStep& step);
// The beam search's pass over the vocabulary (search_candidates.cpp): per row of logits (N, V), rows
// row_stride (>= V) floats apart, lse (N) and the best `width` producible logits and their tokens (N, width);
// only_eos (N) or nullptr.
void search_candidates(const float* logits, int64_t N, int64_t V, int64_t row_stride, const bool* only_eos,
                       int64_t pad, int64_t bos,
                       int64_t eos, int64_t width, double* lse, float* top_values, int64_t* top_tokens);

// csrc/optim: one fused Adam step of `count` parameters (adam_cpu.cpp), arguments checked by the caller
// (csrc/optim/adam.cpp).
void adam_step(const AdamTensor* tensors, int64_t count, const AdamHyper& hyper);
}  // namespace cpu

constexpr const char* kCpuKernelsCapsule = "fastformer.cpu_kernels";

// The non-op entries, in three groups (each list is the one place its members are named: the struct and the
// level module's initializer expand it).
#define FASTFORMER_GEMM_KERNELS(X) \
  X(packed_linear) X(int8_linear_rows) X(int8_variants) X(int8_choose) X(int8_packs) X(product_variants) X(tile_product) \
  X(weight_grad)
#define FASTFORMER_INFERENCE_KERNELS(X) X(decoder_step) X(search_candidates)
#define FASTFORMER_OPTIM_KERNELS(X) X(adam_step)
#define FASTFORMER_CPU_TABLE_MEMBER(name) decltype(&cpu::name) name;

struct GemmKernels {  // csrc/gemm: the decoding GEMMs (not ops)
  FASTFORMER_GEMM_KERNELS(FASTFORMER_CPU_TABLE_MEMBER)
};
struct InferenceKernels {  // csrc/inference: the decoder step and the search's candidate pass
  FASTFORMER_INFERENCE_KERNELS(FASTFORMER_CPU_TABLE_MEMBER)
};
struct OptimKernels {  // csrc/optim: the fused optimizer step
  FASTFORMER_OPTIM_KERNELS(FASTFORMER_CPU_TABLE_MEMBER)
};

struct CpuKernels {
  const char* layout;  // FASTFORMER_KERNEL_TABLE of the module that filled it (first: read before anything else)
  const char* level;   // "default", "avx2" or "avx512"
  int vector_floats;   // floats per at::vec::Vectorized<float> at this level
#define FASTFORMER_CPU_TABLE_ENTRY(op, ...) \
  decltype(&cpu::op##_fwd) op##_fwd;        \
  decltype(&cpu::op##_bwd) op##_bwd;
  FASTFORMER_OPS(FASTFORMER_CPU_TABLE_ENTRY)
#undef FASTFORMER_CPU_TABLE_ENTRY
  GemmKernels gemm;
  InferenceKernels inference;
  OptimKernels optim;
};

}  // namespace fastformer
