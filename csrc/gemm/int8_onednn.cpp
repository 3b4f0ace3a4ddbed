// An int8 weight packed for oneDNN (csrc/gemm/int8_onednn.h): onednn_int8_pack makes one, owned by whoever holds
// the shared pointer it returns. No cache: the owner is the weight's owner, as torch's LinearPackedParams is
// its Linear's: the int8 module of fastformer/nn/linear.py (its ``onednn``, made by C.int8_prepare at
// quantization and at load, freed with the module), the C++ decoder for a weight it was handed unpacked
// (csrc/inference/decoder.cpp), or one int8_linear call (csrc/gemm/gemm.cpp). The pack is a copy, read-only
// once made: nothing here reads the weight's version counter (inference tensors have none) or takes a lock.
// Memory: Wq read once (n K4 4 bytes), unpacked into (n, K4 4) row-major bytes, packed by oneDNN (its
// blocked layout, about n K bytes more per weight, plus per-column compensation).
#define FASTFORMER_GEMM_CHECKS
#include "gemm/int8_onednn.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <memory>

namespace fastformer {
namespace {

std::atomic<int64_t> g_live{0};  // packs made and not yet freed (onednn_int8_live)

}  // namespace

std::shared_ptr<OnednnInt8> onednn_int8_pack(const at::Tensor& weight, int64_t n, int64_t K) {
  TORCH_CHECK(onednn_int8_runs(), "fastformer: oneDNN's int8 products need a torch built with oneDNN (MKLDNN) on "
              "x86-64; this torch has none (torch.backends.mkldnn.is_available() is False)");
  static const c10::OperatorHandle prepack = *onednn_op("onednn::qlinear_prepack");
  // The pack's tensors are inference tensors whatever the caller's mode: read only, never part of a graph.
  c10::InferenceMode inference;
  const int64_t K4 = (K + 3) / 4, Kp = K4 * 4;
  // Wq (n, Kp) row-major from the kernels' layout (gemm.h int8_index; zeros past K).
  at::Tensor rows = at::empty({n, Kp}, weight.options());
  const int8_t* src = weight.const_data_ptr<int8_t>();
  int8_t* dst = rows.mutable_data_ptr<int8_t>();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t k = 0; k < Kp; ++k) dst[r * Kp + k] = src[int8_index(r, k, K4)];
  }
  OnednnInt8* made = new OnednnInt8;
  g_live.fetch_add(1);
  const std::shared_ptr<OnednnInt8> packed(made, [](OnednnInt8* p) {  // freed by its last owner
    delete p;
    g_live.fetch_sub(1);
  });
  packed->n = n;
  packed->K = K;
  // Blocks of at most kOnednnBlock outputs and chunks of at most kInt8ExactFloatInputs inputs (whole groups of
  // 4), each as equal as that allows.
  auto split = [](int64_t total, int64_t most, int64_t unit) {
    const int64_t count = std::max<int64_t>(1, (total + most - 1) / most);
    const int64_t step = ((total + count - 1) / count + unit - 1) / unit * unit;
    std::vector<int64_t> starts;
    for (int64_t s = 0; s < total; s += step) starts.push_back(s);
    starts.push_back(total);
    return starts;
  };
  packed->columns = split(n, kOnednnBlock, 16);
  packed->inputs = split(Kp, kInt8ExactFloatInputs, 4);
  for (int64_t b = 0; b < packed->blocks(); ++b) {
    for (int64_t c = 0; c < packed->chunks(); ++c) {
      const at::Tensor part = rows.slice(0, packed->columns[b], packed->columns[b + 1])
                                  .slice(1, packed->inputs[c], packed->inputs[c + 1]).contiguous();
      std::vector<c10::IValue> stack{part, c10::IValue()};  // (weight, x_shape: None)
      prepack.callBoxed(&stack);
      packed->packed.push_back(stack[0].toTensor());
    }
  }
  packed->ones = at::ones({kOnednnBlock}, at::kFloat);
  packed->zero_points = at::zeros({kOnednnBlock}, at::kLong);
  return packed;
}

int64_t onednn_int8_live() { return g_live.load(); }

}  // namespace fastformer
