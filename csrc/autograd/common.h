// What the autograd kernels of csrc/autograd/<op>.cpp share: typed handles of the registered ops, and
// the backend name that tells a fastformer::<op>_<phase> call (C++ kernels) from a *_py one (Python).
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>

#include <optional>
#include <string>

namespace fastformer::autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

// The backend of a *_py op, or nullopt for the C++ kernel op.
using Backend = std::optional<std::string>;

// The typed handle of fastformer::<name>, looked up once.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// An optional tensor saved for backward (an undefined tensor stands for nullopt) and read back.
inline at::Tensor save_optional(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }
inline OptTensor load_optional(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

inline Backend backend_of(const AutogradContext* ctx) {
  const auto& v = ctx->saved_data.at("backend");
  return v.isNone() ? Backend() : Backend(v.toStringRef());
}
// Whether a call records a graph: grad mode on and an input that requires grad. Without one, the autograd
// kernels skip the autograd node (its allocation and saved state) and call the kernel op directly.
template <typename... Tensors>
bool records_graph(const Tensors&... inputs) {
  return at::GradMode::is_enabled() && (inputs.requires_grad() || ...);
}

// Backward runs with grad mode on only for a double backward (create_graph=True), which the kernel ops
// cannot give: their backward is not differentiable, and letting it run would yield zero second-order
// gradients with a mere warning. Called first in every backward.
inline void check_first_order(const char* op) {
  TORCH_CHECK(!at::GradMode::is_enabled(), "fastformer ", op,
              ": double backward (create_graph=True) is not supported: the backward kernels are not differentiable");
}

inline c10::IValue backend_value(const Backend& b) { return b.has_value() ? c10::IValue(*b) : c10::IValue(); }

}  // namespace fastformer::autograd
