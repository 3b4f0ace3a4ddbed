// The checks of argument values (csrc/value_checks.h says where each runs): each rule once on the host (CPU
// tensors; GPU tensors outside the deferred mode, after a copy) and once as device ops (the deferred mode),
// side by side below, in the same order, so that they cannot drift apart.
#include "value_checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fastformer {

uint64_t (*stream_capture_id)(const c10::Device& device) = nullptr;

namespace {

using at::Tensor;

// ---- the deferred flag: one int32 word per rule a deferred check can find broken ----
// A word per rule, not a bit: its update is one in-place logical_or_ of the rule's 0-dim "broken" into its own
// word (a bit would need a read-modify-write of a shared word, two kernels, and checks on two streams could
// lose each other's bits); and check_deferred() names the rule.
struct Rule {
  const char* op;
  const char* what;  // "<what> was passed since the last check_deferred()"
};
constexpr int kTableRules = 4;  // per cu_seqlens table, in the order of check_table_on_host and table_broken
constexpr Rule kRules[] = {
    {"cross_entropy", "a target outside [0, V) and not ignore_index"},
    {"attention_varlen", "a cu_seqlens_q whose first entry is not 0"},
    {"attention_varlen", "a cu_seqlens_q that decreases (it must be non-decreasing)"},
    {"attention_varlen", "a cu_seqlens_q with a sequence longer than max_seqlen_q"},
    {"attention_varlen", "a cu_seqlens_q whose last entry is not q's row count (the packed total)"},
    {"attention_varlen", "a cu_seqlens_k whose first entry is not 0"},
    {"attention_varlen", "a cu_seqlens_k that decreases (it must be non-decreasing)"},
    {"attention_varlen", "a cu_seqlens_k with a sequence longer than max_seqlen_k"},
    {"attention_varlen", "a cu_seqlens_k whose last entry is not k's row count (the packed total)"},
};
constexpr int64_t kWords = sizeof(kRules) / sizeof(kRules[0]);
constexpr int64_t kTargetWord = 0;
constexpr int64_t table_words(const SeqlensTable& table) { return 1 + kTableRules * table.index; }
static_assert(kWords == 1 + 2 * kTableRules, "a word per rule: the target's and four per table");

// A GPU table whose values were checked: the same tensor (alive, at the same version) with the same total and
// max_seqlen, in the same capture (0: none), needs no second check. `on_host`: checked at the call (known
// good); else deferred (its result is in the flag), which serves only deferred checks.
struct CheckedTable {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> tensor;
  uint32_t version;
  int64_t total, max_seqlen;
  uint64_t capture;
  bool on_host;
};
constexpr size_t kCheckedTables = 8;  // per device: a model's few tables (queries and keys, encoder and decoder)

struct DeviceChecks {
  Tensor flag;                        // (kWords) int32, allocated outside any capture, never freed
  std::vector<CheckedTable> checked;  // the latest kCheckedTables, oldest first
};

struct State {
  std::atomic<bool> deferred{false};
  std::mutex mutex;  // guards devices: checks run on the caller's thread and on autograd's
  std::unordered_map<c10::Device, DeviceChecks> devices;
};

// Never destroyed: the flags are device memory, and static destructors may run after the CUDA runtime's.
State& state() {
  static State* s = new State();
  return *s;
}

uint64_t capture_of(const c10::Device& device) {
  return device.is_cuda() && stream_capture_id != nullptr ? stream_capture_id(device) : 0;
}

// The device's flag, allocated (zeros) at the first need outside a capture; undefined during a capture that
// found none (memory allocated there would belong to the graph's pool), and on the meta device (no values,
// nothing to check or to read back). No tensor op runs under the mutex (an op may call into Python, a
// TorchDispatchMode, and wait for the GIL).
Tensor flag_for(const c10::Device& device) {
  if (device.is_meta()) return Tensor();
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto it = s.devices.find(device);
    if (it != s.devices.end() && it->second.flag.defined()) return it->second.flag;
  }
  if (capture_of(device) != 0) return Tensor();
  const Tensor fresh = at::zeros({kWords}, at::TensorOptions().dtype(at::kInt).device(device));
  std::lock_guard<std::mutex> lock(s.mutex);
  DeviceChecks& d = s.devices[device];
  if (!d.flag.defined()) d.flag = fresh;
  return d.flag;
}

// OR a rule's (or, for a table, its four rules') 0-dim / (4) bool "broken" into its words: one kernel.
void or_into(const Tensor& flag, int64_t word, const Tensor& broken) {
  flag.narrow(0, word, broken.numel()).logical_or_(broken.reshape({broken.numel()}));
}

bool remembered(const Tensor& cu, int64_t total, int64_t max_seqlen, uint64_t capture, bool deferred) {
  if (cu.is_inference()) return false;  // no version counter
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto it = s.devices.find(cu.device());
  if (it == s.devices.end()) return false;
  const uint32_t version = cu.unsafeGetTensorImpl()->version_counter().current_version();
  for (const CheckedTable& c : it->second.checked) {
    if (!c.tensor.expired() && c.tensor._unsafe_get_target() == cu.unsafeGetTensorImpl() && c.version == version &&
        c.total == total && c.max_seqlen == max_seqlen && c.capture == capture && (c.on_host || deferred)) {
      return true;
    }
  }
  return false;
}

void remember(const Tensor& cu, int64_t total, int64_t max_seqlen, uint64_t capture, bool on_host) {
  if (cu.is_inference()) return;
  // Released after the lock (declared before it): the last reference to a dead tensor frees what is left of
  // it, which must not happen under the mutex (see flag_for).
  std::vector<CheckedTable> dropped;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<CheckedTable>& checked = s.devices[cu.device()].checked;
  if (checked.size() == kCheckedTables) {
    dropped.push_back(std::move(checked.front()));
    checked.erase(checked.begin());
  }
  checked.push_back({c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(cu.getIntrusivePtr()),
                     cu.unsafeGetTensorImpl()->version_counter().current_version(), total, max_seqlen, capture,
                     on_host});
}

// ---- cross_entropy: each target in [0, V) or ignore_index ----

[[noreturn]] void target_out_of_range(int64_t t, int64_t V, int64_t ignore_index) {
  TORCH_CHECK_VALUE(false, "fastformer cross_entropy: target holds ", t, ", outside the classes [0, ", V,
                    ") and not ignore_index (", ignore_index, ")");
}

// target on the CPU: a loop (on small inputs tensor ops cost more than the op).
void check_targets_on_host(const Tensor& target, int64_t V, int64_t ignore_index) {
  const Tensor t = target.contiguous();
  const int64_t* p = t.const_data_ptr<int64_t>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) {
    if (p[i] != ignore_index && (p[i] < 0 || p[i] >= V)) target_out_of_range(p[i], V, ignore_index);
  }
}

// The same rule as device ops, elementwise: target's shape, bool.
Tensor targets_outside(const Tensor& target, int64_t V, int64_t ignore_index) {
  return target.ne(ignore_index).logical_and_(target.lt(0).logical_or_(target.ge(V)));
}

// ---- attention_varlen: a cu_seqlens table ----
// Four rules, in this order (their words in the flag): the first entry is 0; the entries do not decrease; no
// sequence is longer than max_seqlen; the last entry is the packed tensor's row count. Differences in int64:
// int32 ones can wrap around.

void check_table_on_host(const Tensor& host, const SeqlensTable& table, int64_t total, int64_t max_seqlen) {
  const int32_t* c = host.const_data_ptr<int32_t>();
  const int64_t B = host.size(0) - 1;
  TORCH_CHECK_VALUE(c[0] == 0, "fastformer attention_varlen: ", table.name, "[0] must be 0, got ", c[0]);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t length = int64_t{c[b + 1]} - c[b];
    TORCH_CHECK_VALUE(length >= 0, "fastformer attention_varlen: ", table.name, " must be non-decreasing, but entry ",
                      b + 1, " is ", c[b + 1], " after ", c[b]);
    TORCH_CHECK_VALUE(length <= max_seqlen, "fastformer attention_varlen: sequence ", b, " has ", length, " rows (",
                      table.name, "), more than ", table.max_name, " = ", max_seqlen);
  }
  TORCH_CHECK_VALUE(c[B] == total, "fastformer attention_varlen: the last entry of ", table.name, " is ", c[B],
                    " but the packed tensor has ", total, " rows; it must be the total");
}

// The same four rules as device ops: (4) bool, one entry per rule.
Tensor table_broken(const Tensor& cu, int64_t total, int64_t max_seqlen) {
  const int64_t B = cu.size(0) - 1;
  const Tensor c = cu.to(at::kLong);
  const Tensor first = c.select(0, 0).ne(0), last = c.select(0, B).ne(total);
  if (B == 0) {  // no sequence: nothing to decrease or to be too long
    const Tensor no = at::zeros_like(first);
    return at::stack({first, no, no, last});
  }
  const auto [shortest, longest] = at::aminmax(c.narrow(0, 1, B) - c.narrow(0, 0, B));  // sequence lengths (B)
  return at::stack({first, shortest.lt(0), longest.gt(max_seqlen), last});
}

}  // namespace

// ---- the entry points (csrc/value_checks.h) ----

void defer_target_check(const Tensor& target, int64_t V, int64_t ignore_index) {
  const Tensor flag = flag_for(target.device());
  if (flag.defined()) or_into(flag, kTargetWord, targets_outside(target, V, ignore_index).any());
}

void defer_cu_seqlens_check(const Tensor& cu, const SeqlensTable& table, int64_t total, int64_t max_seqlen) {
  const Tensor flag = flag_for(cu.device());
  if (flag.defined()) or_into(flag, table_words(table), table_broken(cu, total, max_seqlen));
}

void check_target_values(const Tensor& target, int64_t V, int64_t ignore_index) {
  if (target.device().is_cpu()) return check_targets_on_host(target, V, ignore_index);
  if (deferred_checks_enabled()) return defer_target_check(target, V, ignore_index);
  if (capture_of(target.device()) != 0) return;  // a captured step cannot wait for the host
  const Tensor outside = targets_outside(target, V, ignore_index);
  if (outside.any().item<bool>()) {  // the host read: a reduction, a copy of one bool and a sync
    target_out_of_range(target.masked_select(outside).slice(0, 0, 1).cpu().item<int64_t>(), V, ignore_index);
  }
}

void check_cu_seqlens_values(const Tensor& cu, const SeqlensTable& table, int64_t total, int64_t max_seqlen) {
  if (cu.device().is_cpu()) return check_table_on_host(cu.contiguous(), table, total, max_seqlen);
  const bool deferred = deferred_checks_enabled();
  const uint64_t capture = capture_of(cu.device());
  if (!deferred && capture != 0) return;  // a captured step cannot wait for the host
  if (remembered(cu, total, max_seqlen, capture, deferred)) return;
  if (deferred) {
    if (!flag_for(cu.device()).defined()) return;  // a capture found no flag: unchecked
    defer_cu_seqlens_check(cu, table, total, max_seqlen);
  } else {
    check_table_on_host(cu.to(at::kCPU).contiguous(), table, total, max_seqlen);
  }
  remember(cu, total, max_seqlen, capture, !deferred);
}

Tensor checked_cu_seqlens(const Tensor& host, const c10::Device& device, int64_t total, int64_t max_seqlen) {
  TORCH_CHECK_VALUE(host.device().is_cpu() && host.scalar_type() == at::kInt && host.dim() == 1 && host.size(0) >= 1,
                    "fastformer checked_cu_seqlens: the table must be a 1-D int32 CPU tensor of B + 1 entries, got ",
                    host.scalar_type(), " of shape ", host.sizes(), " on ", host.device());
  TORCH_CHECK_VALUE(max_seqlen >= 0, "fastformer checked_cu_seqlens: max_seqlen must be >= 0, got ", max_seqlen);
  const Tensor table = host.contiguous();
  check_table_on_host(table, kCuSeqlensQ, total, max_seqlen);
  if (device.is_cpu()) return table;
  const bool pinned = device.is_cuda();
  const Tensor copy = (pinned ? table.pin_memory() : table).to(at::TensorOptions().device(device), pinned);
  remember(copy, total, max_seqlen, capture_of(device), /*on_host=*/true);
  return copy;
}

bool deferred_checks_enabled() { return state().deferred.load(std::memory_order_relaxed); }

void set_deferred_checks(bool on, const std::optional<c10::Device>& device) {
  state().deferred.store(on, std::memory_order_relaxed);
  if (on && device.has_value()) flag_for(*device);
}

void check_deferred() {
  std::vector<std::pair<c10::Device, Tensor>> flags;
  std::vector<std::vector<CheckedTable>> forgotten;  // released after the lock (see remember)
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    for (auto& [device, d] : s.devices) {
      forgotten.push_back(std::move(d.checked));
      d.checked.clear();
      if (d.flag.defined()) flags.emplace_back(device, d.flag);
    }
  }
  std::string broken;
  for (const auto& [device, flag] : flags) {
    const Tensor words = flag.to(at::kCPU);  // waits for the checks queued on the current stream
    const int32_t* w = words.const_data_ptr<int32_t>();
    bool any = false;
    for (int64_t i = 0; i < kWords; ++i) {
      if (w[i] == 0) continue;
      any = true;
      broken += std::string(broken.empty() ? "" : "; ") + "fastformer " + kRules[i].op + ": " + kRules[i].what +
                " was passed since the last check_deferred() (checked on " + device.str() + ", deferred)";
    }
    if (any) flag.zero_();
  }
  TORCH_CHECK_VALUE(broken.empty(), broken);
}

}  // namespace fastformer
