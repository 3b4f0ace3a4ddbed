// Autograd of fastformer::softmax_fwd and softmax_fwd_py: forward saves y; backward calls the matching
// softmax_bwd op, dx = scale y (dy - sum(dy y)).
#include "common.h"

// A namespace of the op's own: the sources of _C may be compiled as one unit (setup.py, FASTFORMER_UNITY_BUILD).
namespace fastformer::autograd::softmax {
namespace {

using at::Tensor;
using FwdSig = Tensor(const Tensor&, const OptTensor&, double);
using FwdPySig = Tensor(const Tensor&, const OptTensor&, double, c10::string_view);
using BwdSig = Tensor(const Tensor&, const Tensor&, double);
using BwdPySig = Tensor(const Tensor&, const Tensor&, double, c10::string_view);

// The kernel op below autograd: softmax_fwd, or softmax_fwd_py for a backend written in Python.
Tensor call_fwd(const Tensor& x, const OptTensor& mask, double scale, const Backend& backend) {
  static const auto fwd = op_handle<FwdSig>("fastformer::softmax_fwd");
  static const auto fwd_py = op_handle<FwdPySig>("fastformer::softmax_fwd_py");
  at::AutoDispatchBelowADInplaceOrView guard;
  return backend ? fwd_py.call(x, mask, scale, *backend) : fwd.call(x, mask, scale);
}

struct Softmax : public torch::autograd::Function<Softmax> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& mask, double scale,
                               const Backend& backend) {
    Tensor y = call_fwd(x, mask, scale, backend);
    ctx->save_for_backward({y});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["backend"] = backend_value(backend);
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("softmax");
    static const auto bwd = op_handle<BwdSig>("fastformer::softmax_bwd");
    static const auto bwd_py = op_handle<BwdPySig>("fastformer::softmax_bwd_py");
    const Tensor y = ctx->get_saved_variables()[0];
    const double scale = ctx->saved_data["scale"].toDouble();
    const Backend backend = backend_of(ctx);
    at::AutoDispatchBelowADInplaceOrView guard;  // no graph to record: straight to the kernel
    Tensor dx = backend ? bwd_py.call(grads[0], y, scale, *backend) : bwd.call(grads[0], y, scale);
    return {dx, Tensor(), Tensor(), Tensor()};
  }
};

Tensor softmax_fwd(const Tensor& x, const OptTensor& mask, double scale) {
  if (!records_graph(x)) return call_fwd(x, mask, scale, Backend());
  return Softmax::apply(x, mask, scale, Backend())[0];
}

Tensor softmax_fwd_py(const Tensor& x, const OptTensor& mask, double scale, c10::string_view backend) {
  const Backend name{std::string(backend)};
  if (!records_graph(x)) return call_fwd(x, mask, scale, name);
  return Softmax::apply(x, mask, scale, name)[0];
}

}  // namespace
}  // namespace fastformer::autograd::softmax

TORCH_LIBRARY_IMPL(fastformer, Autograd, m) {
  m.impl("softmax_fwd", TORCH_FN(fastformer::autograd::softmax::softmax_fwd));
  m.impl("softmax_fwd_py", TORCH_FN(fastformer::autograd::softmax::softmax_fwd_py));
}
