// Autograd of fastformer::cross_entropy_fwd and its _py twin: forward saves logits, target and the row
// logsumexp lse; backward calls the matching cross_entropy_bwd op with the gradients of loss and nll (an
// unused output's gradient is undefined and becomes zeros). lse is not differentiable, nor is target.
#include "common.h"

// A namespace of the op's own: the sources of _C may be compiled as one unit (setup.py, FASTFORMER_UNITY_BUILD).
namespace fastformer::autograd::cross_entropy {
namespace {

using at::Tensor;
using Out3 = std::tuple<Tensor, Tensor, Tensor>;
using FwdSig = Out3(const Tensor&, const Tensor&, double, int64_t);
using FwdPySig = Out3(const Tensor&, const Tensor&, double, int64_t, c10::string_view);
using BwdSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, int64_t);
using BwdPySig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, int64_t,
                        c10::string_view);

// The kernel op below autograd: cross_entropy_fwd, or its _py twin for a backend written in Python.
Out3 call_fwd(const Tensor& logits, const Tensor& target, double label_smoothing, int64_t ignore_index,
              const Backend& backend) {
  static const auto fwd = op_handle<FwdSig>("fastformer::cross_entropy_fwd");
  static const auto fwd_py = op_handle<FwdPySig>("fastformer::cross_entropy_fwd_py");
  at::AutoDispatchBelowADInplaceOrView guard;
  return backend ? fwd_py.call(logits, target, label_smoothing, ignore_index, *backend)
                 : fwd.call(logits, target, label_smoothing, ignore_index);
}

struct CrossEntropy : public torch::autograd::Function<CrossEntropy> {
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& target,
                               double label_smoothing, int64_t ignore_index, const Backend& backend) {
    auto [loss, nll, lse] = call_fwd(logits, target, label_smoothing, ignore_index, backend);
    ctx->save_for_backward({logits, target, lse});
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["backend"] = backend_value(backend);
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);  // backward makes zeros only for an unused loss or nll, not for lse
    return {loss, nll, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_first_order("cross_entropy");
    static const auto bwd = op_handle<BwdSig>("fastformer::cross_entropy_bwd");
    static const auto bwd_py = op_handle<BwdPySig>("fastformer::cross_entropy_bwd_py");
    const auto saved = ctx->get_saved_variables();
    const Tensor &logits = saved[0], &target = saved[1], &lse = saved[2];
    const double label_smoothing = ctx->saved_data["label_smoothing"].toDouble();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const Backend backend = backend_of(ctx);
    at::AutoDispatchBelowADInplaceOrView guard;  // no graph to record: straight to the kernel
    // grads[0], grads[1]: (...) of loss and nll, undefined where an output was unused (then zeros).
    const Tensor dloss = grads[0].defined() ? grads[0] : at::zeros_like(lse);
    const Tensor dnll = grads[1].defined() ? grads[1] : at::zeros_like(lse);
    Tensor dlogits = backend ? bwd_py.call(dloss, dnll, logits, target, lse, label_smoothing, ignore_index, *backend)
                             : bwd.call(dloss, dnll, logits, target, lse, label_smoothing, ignore_index);
    return {dlogits, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Out3 cross_entropy_fwd(const Tensor& logits, const Tensor& target, double label_smoothing, int64_t ignore_index) {
  if (!records_graph(logits)) return call_fwd(logits, target, label_smoothing, ignore_index, Backend());
  auto r = CrossEntropy::apply(logits, target, label_smoothing, ignore_index, Backend());
  return {r[0], r[1], r[2]};
}

Out3 cross_entropy_fwd_py(const Tensor& logits, const Tensor& target, double label_smoothing, int64_t ignore_index,
                          c10::string_view backend) {
  const Backend name{std::string(backend)};
  if (!records_graph(logits)) return call_fwd(logits, target, label_smoothing, ignore_index, name);
  auto r = CrossEntropy::apply(logits, target, label_smoothing, ignore_index, name);
  return {r[0], r[1], r[2]};
}

}  // namespace
}  // namespace fastformer::autograd::cross_entropy

TORCH_LIBRARY_IMPL(fastformer, Autograd, m) {
  m.impl("cross_entropy_fwd", TORCH_FN(fastformer::autograd::cross_entropy::cross_entropy_fwd));
  m.impl("cross_entropy_fwd_py", TORCH_FN(fastformer::autograd::cross_entropy::cross_entropy_fwd_py));
}
