// Autograd of fastformer::layer_norm_residual_fwd and its _py twin: forward saves s = residual +
// dropout(x), weight, the row mean and rstd, the dropout seed and x's dtype; backward calls the matching
// layer_norm_residual_bwd op with the gradients of y and of s (pre-norm uses both; an unused output's
// gradient stays undefined: dy becomes zeros, ds stays absent) and x's dtype as dx_dtype, so that a
// float16/bfloat16 branch beside a float32 residual gets its gradient in its own dtype from the kernel (no
// cast by the engine). mean and rstd are not differentiable.
#include "common.h"

// A namespace of the op's own: the sources of _C may be compiled as one unit (setup.py, FASTFORMER_UNITY_BUILD).
namespace fastformer::autograd::layer_norm_residual {
namespace {

using at::Tensor;
using Out4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using FwdSig = Out4(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, double, const OptTensor&);
using FwdPySig = Out4(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, double, const OptTensor&,
                      c10::string_view);
using BwdSig = Out4(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                    const OptTensor&, std::optional<at::ScalarType>);
using BwdPySig = Out4(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                      double, const OptTensor&, std::optional<at::ScalarType>, c10::string_view);

// The kernel op below autograd: layer_norm_residual_fwd, or its _py twin for a backend written in Python.
Out4 call_fwd(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias, double eps,
              double dropout_p, const OptTensor& seed, const Backend& backend) {
  static const auto fwd = op_handle<FwdSig>("fastformer::layer_norm_residual_fwd");
  static const auto fwd_py = op_handle<FwdPySig>("fastformer::layer_norm_residual_fwd_py");
  at::AutoDispatchBelowADInplaceOrView guard;
  return backend ? fwd_py.call(x, residual, weight, bias, eps, dropout_p, seed, *backend)
                 : fwd.call(x, residual, weight, bias, eps, dropout_p, seed);
}

struct LayerNormResidual : public torch::autograd::Function<LayerNormResidual> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual, const Tensor& weight,
                               const Tensor& bias, double eps, double dropout_p, const OptTensor& seed,
                               const Backend& backend) {
    auto [y, s, mean, rstd] = call_fwd(x, residual, weight, bias, eps, dropout_p, seed, backend);
    ctx->save_for_backward({s, weight, mean, rstd, save_optional(seed)});
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["dx_dtype"] = x.scalar_type();  // dx in x's dtype (a float16/bfloat16 branch: not s's)
    ctx->saved_data["backend"] = backend_value(backend);
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    return {y, s, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("layer_norm_residual");
    static const auto bwd = op_handle<BwdSig>("fastformer::layer_norm_residual_bwd");
    static const auto bwd_py = op_handle<BwdPySig>("fastformer::layer_norm_residual_bwd_py");
    const auto saved = ctx->get_saved_variables();
    const Tensor &s = saved[0], &weight = saved[1], &mean = saved[2], &rstd = saved[3];
    const OptTensor seed = load_optional(saved[4]);
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const at::ScalarType dx_dtype = ctx->saved_data["dx_dtype"].toScalarType();
    const Backend backend = backend_of(ctx);
    at::AutoDispatchBelowADInplaceOrView guard;  // no graph to record: straight to the kernel
    const Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(s);
    const OptTensor ds = load_optional(grads[1]);
    auto [dx, dresidual, dweight, dbias] =
        backend ? bwd_py.call(dy, ds, s, weight, mean, rstd, dropout_p, seed, dx_dtype, *backend)
                : bwd.call(dy, ds, s, weight, mean, rstd, dropout_p, seed, dx_dtype);
    return {dx, dresidual, dweight, dbias, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Out4 layer_norm_residual_fwd(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                             double eps, double dropout_p, const OptTensor& seed) {
  if (!records_graph(x, residual, weight, bias)) {
    return call_fwd(x, residual, weight, bias, eps, dropout_p, seed, Backend());
  }
  auto r = LayerNormResidual::apply(x, residual, weight, bias, eps, dropout_p, seed, Backend());
  return {r[0], r[1], r[2], r[3]};
}

Out4 layer_norm_residual_fwd_py(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                                double eps, double dropout_p, const OptTensor& seed, c10::string_view backend) {
  const Backend name{std::string(backend)};
  if (!records_graph(x, residual, weight, bias)) {
    return call_fwd(x, residual, weight, bias, eps, dropout_p, seed, name);
  }
  auto r = LayerNormResidual::apply(x, residual, weight, bias, eps, dropout_p, seed, name);
  return {r[0], r[1], r[2], r[3]};
}

}  // namespace
}  // namespace fastformer::autograd::layer_norm_residual

TORCH_LIBRARY_IMPL(fastformer, Autograd, m) {
  m.impl("layer_norm_residual_fwd", TORCH_FN(fastformer::autograd::layer_norm_residual::layer_norm_residual_fwd));
  m.impl("layer_norm_residual_fwd_py", TORCH_FN(fastformer::autograd::layer_norm_residual::layer_norm_residual_fwd_py));
}
