// Autograd of fastformer::attention_fwd and attention_fwd_py: forward saves q, k, v, out, lse, the mask
// and the dropout seed; backward calls the matching attention_bwd op, which recomputes the probabilities
// from lse and regenerates the dropout mask from the seed. lse is not differentiable.
#include "common.h"

#include "attention_grads.h"

// A namespace of the op's own: the sources of _C may be compiled as one unit (setup.py, FASTFORMER_UNITY_BUILD).
namespace fastformer::autograd::attention {
namespace {

using at::Tensor;
using FwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, bool, double,
                                          std::optional<double>, const OptTensor&);
using FwdPySig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, bool,
                                            double, std::optional<double>, const OptTensor&, c10::string_view);
using BwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, const Tensor&, const OptTensor&, bool, double,
                                                  std::optional<double>, const OptTensor&, int64_t);
using BwdPySig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                    const Tensor&, const Tensor&, const OptTensor&, bool, double,
                                                    std::optional<double>, const OptTensor&, int64_t,
                                                    c10::string_view);

// The kernel op below autograd: attention_fwd, or attention_fwd_py for a backend written in Python.
std::tuple<Tensor, Tensor> call_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& key_padding_mask,
                                    bool causal, double dropout_p, std::optional<double> scale, const OptTensor& seed,
                                    const Backend& backend) {
  static const auto fwd = op_handle<FwdSig>("fastformer::attention_fwd");
  static const auto fwd_py = op_handle<FwdPySig>("fastformer::attention_fwd_py");
  at::AutoDispatchBelowADInplaceOrView guard;
  return backend ? fwd_py.call(q, k, v, key_padding_mask, causal, dropout_p, scale, seed, *backend)
                 : fwd.call(q, k, v, key_padding_mask, causal, dropout_p, scale, seed);
}

struct Attention : public torch::autograd::Function<Attention> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const OptTensor& key_padding_mask, bool causal, double dropout_p,
                               std::optional<double> scale, const OptTensor& seed, const Backend& backend) {
    auto [out, lse] = call_fwd(q, k, v, key_padding_mask, causal, dropout_p, scale, seed, backend);
    ctx->save_for_backward({q, k, v, out, lse, save_optional(key_padding_mask), save_optional(seed)});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["backend"] = backend_value(backend);
    // The gradients' layout, from the inputs as they are here: the parts of one packed projection get the parts
    // of one packed gradient (csrc/attention_grads.h), which the model's split takes back without a copy.
    ctx->saved_data["packed_grads"] = fastformer::attention_packed_kind(q, k, v);
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);  // lse has no gradient: no zero-filled (B, H, Lq) buffer for it
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("attention");
    static const auto bwd = op_handle<BwdSig>("fastformer::attention_bwd");
    static const auto bwd_py = op_handle<BwdPySig>("fastformer::attention_bwd_py");
    const auto saved = ctx->get_saved_variables();
    const OptTensor mask = load_optional(saved[5]), seed = load_optional(saved[6]);
    const bool causal = ctx->saved_data["causal"].toBool();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const auto scale = ctx->saved_data["scale"].toOptional<double>();
    const Backend backend = backend_of(ctx);
    const int64_t packed = ctx->saved_data["packed_grads"].toInt();
    at::AutoDispatchBelowADInplaceOrView guard;  // no graph to record: straight to the kernel
    const Tensor& dout = grads[0];
    if (!dout.defined()) return variable_list(9);  // out unused: no gradient for any input
    auto [dq, dk, dv] =
        backend ? bwd_py.call(dout, saved[0], saved[1], saved[2], saved[3], saved[4], mask, causal, dropout_p, scale,
                              seed, packed, *backend)
                : bwd.call(dout, saved[0], saved[1], saved[2], saved[3], saved[4], mask, causal, dropout_p, scale, seed,
                           packed);
    // the parts of a packed gradient taken back out: views of it (csrc/attention_grads.h)
    const auto parts = fastformer::attention_grad_parts(dq, dk, dv, packed);
    return {parts[0], parts[1], parts[2], Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const OptTensor& key_padding_mask, bool causal, double dropout_p,
                                         std::optional<double> scale, const OptTensor& seed) {
  if (!records_graph(q, k, v)) return call_fwd(q, k, v, key_padding_mask, causal, dropout_p, scale, seed, Backend());
  auto r = Attention::apply(q, k, v, key_padding_mask, causal, dropout_p, scale, seed, Backend());
  return {r[0], r[1]};
}

std::tuple<Tensor, Tensor> attention_fwd_py(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const OptTensor& key_padding_mask, bool causal, double dropout_p,
                                            std::optional<double> scale, const OptTensor& seed,
                                            c10::string_view backend) {
  const Backend name{std::string(backend)};
  if (!records_graph(q, k, v)) return call_fwd(q, k, v, key_padding_mask, causal, dropout_p, scale, seed, name);
  auto r = Attention::apply(q, k, v, key_padding_mask, causal, dropout_p, scale, seed, name);
  return {r[0], r[1]};
}

}  // namespace
}  // namespace fastformer::autograd::attention

TORCH_LIBRARY_IMPL(fastformer, Autograd, m) {
  m.impl("attention_fwd", TORCH_FN(fastformer::autograd::attention::attention_fwd));
  m.impl("attention_fwd_py", TORCH_FN(fastformer::autograd::attention::attention_fwd_py));
}
