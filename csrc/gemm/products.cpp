// The tile products' variants as entry points (csrc/gemm/products.h has the variants and their guarantees):
// the list this CPU runs at this level, and one product by a named variant, for the tests that check each
// variant's guarantee (tests/ops/test_products.py). Compiled per instruction-set level.
#include <ATen/ATen.h>

#include "cpu/kernel_table.h"
#include "gemm/products.h"

namespace fastformer::cpu {

// This level's variants: bf16_dot only where the CPU has AVX512_BF16 (the avx512 level only).
const char* const* product_variants() {
  static const char* const with_bf16_dot[] = {"fma", "bf16_dot", "bf16_emulated", nullptr};
  static const char* const without[] = {"fma", "bf16_emulated", nullptr};
  return bf16_dot_runs() ? with_bf16_dot : without;
}

// C (m, n) = A (m, k) B (k, n) by the named variant (checked by the caller: csrc/gemm/gemm.cpp tile_product):
// fma on float32 or float64 (C of that dtype), the bf16 variants on bfloat16 (B packed into pairs of rows
// first; C float32). A and B may lie at any offset: their storage is the caller's.
Tensor tile_product(const Tensor& a, const Tensor& b, const std::string& variant) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (variant == "fma") {
    Tensor c = at::empty({m, n}, a.options());
    AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "fastformer_tile_product", [&] {
      tile_gemm<scalar_t>(m, n, k, scalar_t(1), a.const_data_ptr<scalar_t>(), a.stride(0), false,
                          b.const_data_ptr<scalar_t>(), b.stride(0), false, c.mutable_data_ptr<scalar_t>(), n);
    });
    return c;
  }
  Tensor c = at::empty({m, n}, a.options().dtype(at::kFloat));
  std::vector<uint32_t> pairs((k + 1) / 2 * n);
  pack_row_pairs(b.const_data_ptr<c10::BFloat16>(), k, n, b.stride(0), pairs.data(), n);
  tile_gemm_bf16(m, n, k, 1.0f, a.const_data_ptr<c10::BFloat16>(), a.stride(0), pairs.data(), n, false,
                 c.mutable_data_ptr<float>(), n, /*emulated=*/variant == "bf16_emulated");
  return c;
}

}  // namespace fastformer::cpu
