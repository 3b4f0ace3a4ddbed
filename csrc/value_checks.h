// The argument checks that read tensor values, not only shapes and dtypes: cross_entropy's targets (each in
// [0, V) or ignore_index) and attention_varlen's cu_seqlens tables (0 first, non-decreasing, no sequence longer
// than max_seqlen, the packed total last). csrc/ops.h calls them after the metadata checks; the rules and both
// ways of checking them live in csrc/value_checks.cpp.
//
// Where the values are read:
//   CPU tensors                  on the host, at the call (free): a ValueError naming the entry.
//   GPU tensors                  on the host, at the call: a copy and a sync (the device's queue drains), so
//                                that an eager caller gets the same clear error at the call.
//   GPU tensors, deferred mode   on the device: the check's "broken" condition is reduced on the GPU and ORed
//                                into a per-device int32 flag (device ops only, fixed shapes, no host read);
//                                check_deferred() reads every flag at once (one sync) and raises. The mode is
//                                process-wide (the autograd engine runs backward on threads of its own).
//   during CUDA graph capture    the deferred check is captured with the rest (every replay checks) when the
//                                device's flag exists; otherwise (immediate mode, or no flag yet: it is never
//                                allocated inside a capture, whose memory belongs to the graph's pool) nothing
//                                is checked, and the kernels' own guards keep a bad value in bounds.
// A GPU table checked once (on the host, or deferred) is not checked again while the same tensor, unchanged
// (its version counter), comes back with the same total and max_seqlen: the per-layer calls of one forward and
// their backward read it once.
// Whatever gets past a check (skipped during capture, or deferred until check_deferred()) stays in bounds in
// every kernel: an out-of-range target reads no logit (its nll is NaN, its row has no one-hot column), and the
// varlen kernels clamp every sequence into [0, T].
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>

namespace fastformer {

// The id of the CUDA graph capture under way on the current stream of a (CUDA) device, 0 when none. Set at
// load by the CUDA part of fastformer._C (csrc/cuda/cross_entropy.cu); null in a build without CUDA kernels.
extern uint64_t (*stream_capture_id)(const c10::Device& device);

// One of attention_varlen's two tables and the names its messages use.
struct SeqlensTable {
  int index;             // 0: queries, 1: keys (its words in the deferred flag)
  const char* name;      // "cu_seqlens_q"
  const char* max_name;  // "max_seqlen_q"
  const char* rows_of;   // "q": whose rows the total counts
};
inline constexpr SeqlensTable kCuSeqlensQ{0, "cu_seqlens_q", "max_seqlen_q", "q"};
inline constexpr SeqlensTable kCuSeqlensK{1, "cu_seqlens_k", "max_seqlen_k", "k"};

// target: int64, any shape, on any device; each entry in [0, V) or ignore_index.
void check_target_values(const at::Tensor& target, int64_t V, int64_t ignore_index);
// cu: int32 (B + 1), B >= 0, on any device; the table of a packed tensor of `total` rows.
void check_cu_seqlens_values(const at::Tensor& cu, const SeqlensTable& table, int64_t total, int64_t max_seqlen);

// A table made on the host (CPU int32 (B + 1)) for a packed tensor of `total` rows, checked there (the rules of
// check_cu_seqlens_values, named as cu_seqlens_q's) and copied to `device` without waiting (from pinned memory),
// remembered as checked: the ops' checks of the copy read nothing more. For callers that build a table on the
// host anyway (fastformer/hf.py: one host read per forward, not one per layer).
at::Tensor checked_cu_seqlens(const at::Tensor& host, const c10::Device& device, int64_t total, int64_t max_seqlen);

// The deferred mode (process-wide). Turning it on with a device allocates that device's flag now (unless its
// stream is capturing), so that a capture that is the mode's first use on the device checks too.
bool deferred_checks_enabled();
void set_deferred_checks(bool on, const std::optional<c10::Device>& device);

// Reads and clears every device's flag (one sync per device holding one) and forgets the tables checked so
// far; raises a ValueError naming each op, argument and rule found broken since the last call.
void check_deferred();

// The device-side checks of the deferred mode, on any device (the GPU path's own functions; tests run them on
// CPU tensors): OR what is broken into the flag of the tensor's device, allocated at its first use.
void defer_target_check(const at::Tensor& target, int64_t V, int64_t ignore_index);
void defer_cu_seqlens_check(const at::Tensor& cu, const SeqlensTable& table, int64_t total, int64_t max_seqlen);

}  // namespace fastformer
