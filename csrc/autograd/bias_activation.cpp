// Autograd of fastformer::bias_activation_fwd and its _py twin: forward saves what backward needs, and no more:
// for relu the output y (dz = dy / (1 - p) where y > 0: the mask and the sign in one tensor, so x, fc1's
// output, can be freed), for gelu and silu the input x (h = x + bias is recomputed); the bias (its values for
// gelu and silu, its dtype for dbias), the dropout seed (the mask is regenerated, never stored) and the
// activation's name. Backward calls the matching bias_activation_bwd op: dx in x's dtype, dbias in bias's.
#include "common.h"

// A namespace of the op's own: the sources of _C may be compiled as one unit (setup.py, FASTFORMER_UNITY_BUILD).
namespace fastformer::autograd::bias_activation {
namespace {

using at::Tensor;
using FwdSig = Tensor(const Tensor&, const Tensor&, c10::string_view, double, const OptTensor&);
using FwdPySig = Tensor(const Tensor&, const Tensor&, c10::string_view, double, const OptTensor&, c10::string_view);
using Out2 = std::tuple<Tensor, Tensor>;
using BwdSig = Out2(const Tensor&, const Tensor&, const Tensor&, c10::string_view, double, const OptTensor&);
using BwdPySig = Out2(const Tensor&, const Tensor&, const Tensor&, c10::string_view, double, const OptTensor&,
                      c10::string_view);

// The kernel op below autograd: bias_activation_fwd, or its _py twin for a backend written in Python.
Tensor call_fwd(const Tensor& x, const Tensor& bias, c10::string_view activation, double dropout_p,
                const OptTensor& seed, const Backend& backend) {
  static const auto fwd = op_handle<FwdSig>("fastformer::bias_activation_fwd");
  static const auto fwd_py = op_handle<FwdPySig>("fastformer::bias_activation_fwd_py");
  at::AutoDispatchBelowADInplaceOrView guard;
  return backend ? fwd_py.call(x, bias, activation, dropout_p, seed, *backend)
                 : fwd.call(x, bias, activation, dropout_p, seed);
}

struct BiasActivation : public torch::autograd::Function<BiasActivation> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias, const std::string& activation,
                               double dropout_p, const OptTensor& seed, const Backend& backend) {
    Tensor y = call_fwd(x, bias, activation, dropout_p, seed, backend);
    ctx->save_for_backward({activation == "relu" ? y : x, bias, save_optional(seed)});
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["backend"] = backend_value(backend);
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("bias_activation");
    static const auto bwd = op_handle<BwdSig>("fastformer::bias_activation_bwd");
    static const auto bwd_py = op_handle<BwdPySig>("fastformer::bias_activation_bwd_py");
    const auto saved = ctx->get_saved_variables();
    const Tensor &kept = saved[0], &bias = saved[1];
    const OptTensor seed = load_optional(saved[2]);
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const Backend backend = backend_of(ctx);
    at::AutoDispatchBelowADInplaceOrView guard;  // no graph to record: straight to the kernel
    auto [dx, dbias] = backend ? bwd_py.call(grads[0], kept, bias, activation, dropout_p, seed, *backend)
                               : bwd.call(grads[0], kept, bias, activation, dropout_p, seed);
    return {dx, dbias, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor bias_activation_fwd(const Tensor& x, const Tensor& bias, c10::string_view activation, double dropout_p,
                           const OptTensor& seed) {
  if (!records_graph(x, bias)) return call_fwd(x, bias, activation, dropout_p, seed, Backend());
  return BiasActivation::apply(x, bias, std::string(activation.data(), activation.size()), dropout_p, seed,
                               Backend())[0];
}

Tensor bias_activation_fwd_py(const Tensor& x, const Tensor& bias, c10::string_view activation, double dropout_p,
                              const OptTensor& seed, c10::string_view backend) {
  const Backend name{std::string(backend)};
  if (!records_graph(x, bias)) return call_fwd(x, bias, activation, dropout_p, seed, name);
  return BiasActivation::apply(x, bias, std::string(activation.data(), activation.size()), dropout_p, seed,
                               name)[0];
}

}  // namespace
}  // namespace fastformer::autograd::bias_activation

TORCH_LIBRARY_IMPL(fastformer, Autograd, m) {
  m.impl("bias_activation_fwd", TORCH_FN(fastformer::autograd::bias_activation::bias_activation_fwd));
  m.impl("bias_activation_fwd_py", TORCH_FN(fastformer::autograd::bias_activation::bias_activation_fwd_py));
}
