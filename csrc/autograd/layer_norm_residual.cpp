// Autograd of fastformer::layer_norm_residual_fwd and its _py twin: forward saves s = residual +
// dropout(x + x_bias), weight, the row mean and rstd, the dropout seed, x_bias (for its dtype: dx_bias is
// returned in it) and x's dtype; backward calls the matching layer_norm_residual_bwd op with the gradients
// of y, of s and of the compute-dtype output y_c (pre-norm uses s's; an unused output's gradient stays
// undefined: dy becomes zeros, ds and dy_c stay absent) and x's dtype as dx_dtype, so that a
// float16/bfloat16 branch beside a float32 residual gets its gradient in its own dtype from the kernel (no
// cast by the engine). mean and rstd are not differentiable, nor y_c when it was not requested (empty).
#include "common.h"

// A namespace of the op's own: the sources of _C may be compiled as one unit (setup.py, FASTFORMER_UNITY_BUILD).
namespace fastformer::autograd::layer_norm_residual {
namespace {

using at::Tensor;
using ScalarTypeOpt = std::optional<at::ScalarType>;
using Out5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using FwdSig = Out5(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, double, const OptTensor&,
                    const OptTensor&, ScalarTypeOpt);
using FwdPySig = Out5(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, double, const OptTensor&,
                      const OptTensor&, ScalarTypeOpt, c10::string_view);
using BwdSig = Out5(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                    const OptTensor&, ScalarTypeOpt, const OptTensor&, const OptTensor&);
using BwdPySig = Out5(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                      double, const OptTensor&, ScalarTypeOpt, const OptTensor&, const OptTensor&, c10::string_view);

// The kernel op below autograd: layer_norm_residual_fwd, or its _py twin for a backend written in Python.
Out5 call_fwd(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias, double eps,
              double dropout_p, const OptTensor& seed, const OptTensor& x_bias, ScalarTypeOpt compute_dtype,
              const Backend& backend) {
  static const auto fwd = op_handle<FwdSig>("fastformer::layer_norm_residual_fwd");
  static const auto fwd_py = op_handle<FwdPySig>("fastformer::layer_norm_residual_fwd_py");
  at::AutoDispatchBelowADInplaceOrView guard;
  return backend ? fwd_py.call(x, residual, weight, bias, eps, dropout_p, seed, x_bias, compute_dtype, *backend)
                 : fwd.call(x, residual, weight, bias, eps, dropout_p, seed, x_bias, compute_dtype);
}

struct LayerNormResidual : public torch::autograd::Function<LayerNormResidual> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual, const Tensor& weight,
                               const Tensor& bias, double eps, double dropout_p, const OptTensor& seed,
                               const OptTensor& x_bias, ScalarTypeOpt compute_dtype, const Backend& backend) {
    auto [y, s, mean, rstd, y_c] = call_fwd(x, residual, weight, bias, eps, dropout_p, seed, x_bias, compute_dtype,
                                            backend);
    ctx->save_for_backward({s, weight, mean, rstd, save_optional(seed), save_optional(x_bias)});
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["dx_dtype"] = x.scalar_type();  // dx in x's dtype (a float16/bfloat16 branch: not s's)
    ctx->saved_data["backend"] = backend_value(backend);
    const bool has_y_c = compute_dtype.has_value() && *compute_dtype != residual.scalar_type();
    ctx->mark_non_differentiable(has_y_c ? variable_list{mean, rstd} : variable_list{mean, rstd, y_c});
    ctx->set_materialize_grads(false);
    return {y, s, mean, rstd, y_c};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("layer_norm_residual");
    static const auto bwd = op_handle<BwdSig>("fastformer::layer_norm_residual_bwd");
    static const auto bwd_py = op_handle<BwdPySig>("fastformer::layer_norm_residual_bwd_py");
    const auto saved = ctx->get_saved_variables();
    const Tensor &s = saved[0], &weight = saved[1], &mean = saved[2], &rstd = saved[3];
    const OptTensor seed = load_optional(saved[4]), x_bias = load_optional(saved[5]);
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const at::ScalarType dx_dtype = ctx->saved_data["dx_dtype"].toScalarType();
    const Backend backend = backend_of(ctx);
    at::AutoDispatchBelowADInplaceOrView guard;  // no graph to record: straight to the kernel
    const Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(s);
    const OptTensor ds = load_optional(grads[1]);
    const OptTensor dy_c = load_optional(grads[4]);
    auto [dx, dresidual, dweight, dbias, dx_bias] =
        backend ? bwd_py.call(dy, ds, s, weight, mean, rstd, dropout_p, seed, dx_dtype, dy_c, x_bias, *backend)
                : bwd.call(dy, ds, s, weight, mean, rstd, dropout_p, seed, dx_dtype, dy_c, x_bias);
    return {dx, dresidual, dweight, dbias, Tensor(), Tensor(), Tensor(),
            x_bias.has_value() ? dx_bias : Tensor(), Tensor(), Tensor()};
  }
};

// Whether the call records a graph: an input, x_bias included, requires grad.
bool records(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
             const OptTensor& x_bias) {
  return records_graph(x, residual, weight, bias) ||
         (x_bias.has_value() && at::GradMode::is_enabled() && x_bias->requires_grad());
}

Out5 layer_norm_residual_fwd(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                             double eps, double dropout_p, const OptTensor& seed, const OptTensor& x_bias,
                             ScalarTypeOpt compute_dtype) {
  if (!records(x, residual, weight, bias, x_bias)) {
    return call_fwd(x, residual, weight, bias, eps, dropout_p, seed, x_bias, compute_dtype, Backend());
  }
  auto r = LayerNormResidual::apply(x, residual, weight, bias, eps, dropout_p, seed, x_bias, compute_dtype, Backend());
  return {r[0], r[1], r[2], r[3], r[4]};
}

Out5 layer_norm_residual_fwd_py(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                                double eps, double dropout_p, const OptTensor& seed, const OptTensor& x_bias,
                                ScalarTypeOpt compute_dtype, c10::string_view backend) {
  const Backend name{std::string(backend)};
  if (!records(x, residual, weight, bias, x_bias)) {
    return call_fwd(x, residual, weight, bias, eps, dropout_p, seed, x_bias, compute_dtype, name);
  }
  auto r = LayerNormResidual::apply(x, residual, weight, bias, eps, dropout_p, seed, x_bias, compute_dtype, name);
  return {r[0], r[1], r[2], r[3], r[4]};
}

}  // namespace
}  // namespace fastformer::autograd::layer_norm_residual

TORCH_LIBRARY_IMPL(fastformer, Autograd, m) {
  m.impl("layer_norm_residual_fwd", TORCH_FN(fastformer::autograd::layer_norm_residual::layer_norm_residual_fwd));
  m.impl("layer_norm_residual_fwd_py", TORCH_FN(fastformer::autograd::layer_norm_residual::layer_norm_residual_fwd_py));
}
