// An int8 weight packed for oneDNN (csrc/gemm/int8_onednn.h), once per weight: the packed form is kept in a
// process-wide cache keyed on the weight's storage (and offset and version), so that the Python projections
// (fastformer/nn/linear.py, through int8_linear) and the C++ decoder (its binder) share one copy, made at the
// first call that wants it (fastformer/nn/quantize.py pack_for_providers, through int8_prepare, makes it at
// quantization and load where the rule can choose oneDNN). An entry lives until its weight's storage is freed
// (pruned when a later weight is packed); a weight changed in place (its version moved) is packed again and its
// old entry kept until then, so that a decoder bound to it never reads freed memory.
// Memory: Wq read once (n K4 4 bytes), unpacked into (n, K4 4) row-major bytes, packed by oneDNN (its
// blocked layout, about n K bytes more per weight, plus per-column compensation).
#define FASTFORMER_GEMM_CHECKS
#include "gemm/int8_onednn.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <memory>
#include <mutex>

namespace fastformer {
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t offset, version, n, K;
  std::unique_ptr<OnednnInt8> packed;
};

std::mutex g_mutex;
std::vector<Entry> g_entries;

std::unique_ptr<OnednnInt8> pack(const at::Tensor& weight, int64_t n, int64_t K) {
  static const c10::OperatorHandle prepack = *onednn_op("onednn::qlinear_prepack");
  const int64_t K4 = (K + 3) / 4, Kp = K4 * 4;
  // Wq (n, Kp) row-major from the kernels' layout (gemm.h int8_index; zeros past K).
  at::Tensor rows = at::empty({n, Kp}, weight.options());
  const int8_t* src = weight.const_data_ptr<int8_t>();
  int8_t* dst = rows.mutable_data_ptr<int8_t>();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t k = 0; k < Kp; ++k) dst[r * Kp + k] = src[int8_index(r, k, K4)];
  }
  auto packed = std::make_unique<OnednnInt8>();
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

}  // namespace

const OnednnInt8* onednn_int8_weight(const at::Tensor& weight, int64_t n, int64_t K) {
  TORCH_CHECK(onednn_int8_runs(), "fastformer: oneDNN's int8 products need a torch built with oneDNN (MKLDNN) on "
              "x86-64; this torch has none (torch.backends.mkldnn.is_available() is False)");
  c10::StorageImpl* storage = weight.storage().unsafeGetStorageImpl();
  const int64_t offset = weight.storage_offset(), version = weight._version();
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const Entry& e : g_entries) {
    const auto live = e.storage.lock();
    if (live.get() == storage && e.offset == offset && e.version == version && e.n == n && e.K == K) {
      return e.packed.get();
    }
  }
  // Entries whose weight is gone go now (nothing can read them: a decoder holds its weights' storage).
  g_entries.erase(std::remove_if(g_entries.begin(), g_entries.end(), [](const Entry& e) { return e.storage.expired(); }),
                  g_entries.end());
  g_entries.push_back({weight.storage().getWeakStorageImpl(), offset, version, n, K, pack(weight, n, K)});
  return g_entries.back().packed.get();
}

}  // namespace fastformer
