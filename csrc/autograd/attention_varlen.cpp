// Autograd of fastformer::attention_varlen_fwd and attention_varlen_fwd_py: forward saves q, k, v, out, lse, the
// cu_seqlens tables and the dropout seed; backward calls the matching attention_varlen_bwd op, which recomputes
// the probabilities from lse and regenerates the dropout mask from the seed. lse is not differentiable.
#include "common.h"

// A namespace of the op's own: the sources of _C may be compiled as one unit (setup.py, FASTFORMER_UNITY_BUILD).
namespace fastformer::autograd::attention_varlen {
namespace {

using at::Tensor;
using FwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                          int64_t, int64_t, bool, double, std::optional<double>, const OptTensor&);
using FwdPySig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                            const Tensor&, int64_t, int64_t, bool, double, std::optional<double>,
                                            const OptTensor&, c10::string_view);
using BwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                                                  int64_t, bool, double, std::optional<double>, const OptTensor&);
using BwdPySig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                    const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                    int64_t, int64_t, bool, double, std::optional<double>,
                                                    const OptTensor&, c10::string_view);

// The arguments after q, k, v that forward and backward both take.
struct Args {
  Tensor cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q, max_seqlen_k;
  bool causal;
  double dropout_p;
  std::optional<double> scale;
  OptTensor seed;
};

// The kernel op below autograd: attention_varlen_fwd, or attention_varlen_fwd_py for a backend written in Python.
std::tuple<Tensor, Tensor> call_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Args& a,
                                    const Backend& backend) {
  static const auto fwd = op_handle<FwdSig>("fastformer::attention_varlen_fwd");
  static const auto fwd_py = op_handle<FwdPySig>("fastformer::attention_varlen_fwd_py");
  at::AutoDispatchBelowADInplaceOrView guard;
  return backend ? fwd_py.call(q, k, v, a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k, a.causal,
                               a.dropout_p, a.scale, a.seed, *backend)
                 : fwd.call(q, k, v, a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k, a.causal,
                            a.dropout_p, a.scale, a.seed);
}

struct AttentionVarlen : public torch::autograd::Function<AttentionVarlen> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, bool causal, double dropout_p, std::optional<double> scale,
                               const OptTensor& seed, const Backend& backend) {
    const Args a{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p, scale, seed};
    auto [out, lse] = call_fwd(q, k, v, a, backend);
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, save_optional(seed)});
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["backend"] = backend_value(backend);
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);  // lse has no gradient: no zero-filled (H, Tq) buffer for it
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("attention_varlen");
    static const auto bwd = op_handle<BwdSig>("fastformer::attention_varlen_bwd");
    static const auto bwd_py = op_handle<BwdPySig>("fastformer::attention_varlen_bwd_py");
    const auto saved = ctx->get_saved_variables();
    const OptTensor seed = load_optional(saved[7]);
    const int64_t max_q = ctx->saved_data["max_seqlen_q"].toInt(), max_k = ctx->saved_data["max_seqlen_k"].toInt();
    const bool causal = ctx->saved_data["causal"].toBool();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const auto scale = ctx->saved_data["scale"].toOptional<double>();
    const Backend backend = backend_of(ctx);
    at::AutoDispatchBelowADInplaceOrView guard;  // no graph to record: straight to the kernel
    const Tensor& dout = grads[0];
    if (!dout.defined()) return variable_list(12);  // out unused: no gradient for any input
    auto [dq, dk, dv] =
        backend ? bwd_py.call(dout, saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6], max_q, max_k,
                              causal, dropout_p, scale, seed, *backend)
                : bwd.call(dout, saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6], max_q, max_k,
                           causal, dropout_p, scale, seed);
    return {dq, dk, dv, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> attention_varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                                double dropout_p, std::optional<double> scale, const OptTensor& seed) {
  if (!records_graph(q, k, v)) {
    return call_fwd(q, k, v, {cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p, scale, seed},
                    Backend());
  }
  auto r = AttentionVarlen::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p,
                                  scale, seed, Backend());
  return {r[0], r[1]};
}

std::tuple<Tensor, Tensor> attention_varlen_fwd_py(const Tensor& q, const Tensor& k, const Tensor& v,
                                                   const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                   int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                                   double dropout_p, std::optional<double> scale,
                                                   const OptTensor& seed, c10::string_view backend) {
  const Backend name{std::string(backend)};
  if (!records_graph(q, k, v)) {
    return call_fwd(q, k, v, {cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p, scale, seed},
                    name);
  }
  auto r = AttentionVarlen::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p,
                                  scale, seed, name);
  return {r[0], r[1]};
}

}  // namespace
}  // namespace fastformer::autograd::attention_varlen

TORCH_LIBRARY_IMPL(fastformer, Autograd, m) {
  m.impl("attention_varlen_fwd", TORCH_FN(fastformer::autograd::attention_varlen::attention_varlen_fwd));
  m.impl("attention_varlen_fwd_py", TORCH_FN(fastformer::autograd::attention_varlen::attention_varlen_fwd_py));
}
