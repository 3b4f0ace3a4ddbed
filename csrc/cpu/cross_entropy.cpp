// Label-smoothed cross-entropy over the last dim on the CPU, forward and backward: the training loss over
// the vocabulary without log-probabilities in memory.
//
// logits (..., V) are R rows of V; target (R) int64. Rows are spread over threads with at::parallel_for.
// Forward, per row x (half rows converted into a thread-local float32 buffer, V entries, in L1/L2):
//   sweep 1 (reads x):  m = max x (NaN propagates);
//   sweep 2 (cache):    l = sum e^(x - m) (at::vec's exp_u20), sx = sum x;   lse = m + log l;
//   nll = lse - x[t];   loss = (1 - e) nll + e (lse - sx / V)   (= nll when e = 0: no 0 * inf);
// and loss = nll = 0 where t == ignore_index. DRAM: V sizeof(T) read per row, 3 acc_t written.
// Non-finite logits: a NaN or +inf logit makes lse (and so loss and nll) NaN; a row of only -inf logits
// has lse = -inf and nll NaN (no distribution); a -inf logit elsewhere is a class of probability 0 (its
// smoothing term makes the loss +inf when e > 0, as in PyTorch).
// Backward, per row: g = dloss + dnll, dx = g e^(x - lse) - e dloss / V, and dx[t] -= (1 - e) dloss + dnll;
// zeros where t == ignore_index, NaN where lse is not finite (exp_u20 would turn e^NaN into +inf). Reads x once and writes dx once: 2 V sizeof(T) per row.
// The targets' range is checked by the caller (csrc/ops.h); an out-of-range target still reads nothing: its
// nll is NaN and backward skips its one-hot term.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_ops.h"

namespace fastformer::cpu {
namespace {

template <typename acc_t>
struct RowLoss {
  acc_t loss, nll, lse;
};

// One row's loss, nll and lse from its acc_t logits x (V of them).
template <typename acc_t>
RowLoss<acc_t> row_loss(const acc_t* x, int64_t V, int64_t t, bool ignored, acc_t e) {
  using Vec = at::vec::Vectorized<acc_t>;
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  const acc_t m = vec_max(x, V);
  acc_t lse;
  acc_t sx;
  if (!(m < inf)) {  // a NaN or +inf logit
    lse = std::numeric_limits<acc_t>::quiet_NaN();
    sx = lse;
  } else if (m == -inf) {  // every logit -inf
    lse = -inf;
    sx = -inf;
  } else {
    const Vec vm(m);
    Vec vl(acc_t(0)), vs(acc_t(0));
    int64_t j = 0;
    for (; j + Vec::size() <= V; j += Vec::size()) {
      const Vec v = Vec::loadu(x + j);
      vl = vl + (v - vm).exp_u20();
      vs = vs + v;
    }
    acc_t l = at::vec::vec_reduce_all<acc_t>([](Vec a, Vec b) { return a + b; }, vl);
    sx = at::vec::vec_reduce_all<acc_t>([](Vec a, Vec b) { return a + b; }, vs);
    for (; j < V; ++j) {
      l += std::exp(x[j] - m);
      sx += x[j];
    }
    lse = m + std::log(l);
  }
  if (ignored) return {acc_t(0), acc_t(0), lse};
  const acc_t nll = t >= 0 && t < V ? lse - x[t] : std::numeric_limits<acc_t>::quiet_NaN();
  const acc_t loss = e == acc_t(0) ? nll : (acc_t(1) - e) * nll + e * (lse - sx / static_cast<acc_t>(V));
  return {loss, nll, lse};
}

template <typename scalar_t>
void cross_entropy_fwd_kernel(const scalar_t* logits, const int64_t* target, int64_t R, int64_t V, double smoothing,
                              int64_t ignore_index, at::opmath_type<scalar_t>* loss,
                              at::opmath_type<scalar_t>* nll, at::opmath_type<scalar_t>* lse) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t e = static_cast<acc_t>(smoothing);
  const int64_t grain = std::max<int64_t>(1, 16384 / V);
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> row_buf;
    for (int64_t r = begin; r < end; ++r) {
      const acc_t* x = as_acc(logits + r * V, V, row_buf);
      const RowLoss<acc_t> out = row_loss(x, V, target[r], target[r] == ignore_index, e);
      loss[r] = out.loss;
      nll[r] = out.nll;
      lse[r] = out.lse;
    }
  });
}

template <typename scalar_t>
void cross_entropy_bwd_kernel(const at::opmath_type<scalar_t>* dloss, const at::opmath_type<scalar_t>* dnll,
                              const scalar_t* logits, const int64_t* target, const at::opmath_type<scalar_t>* lse,
                              int64_t R, int64_t V, double smoothing, int64_t ignore_index, scalar_t* dlogits) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const acc_t e = static_cast<acc_t>(smoothing);
  const int64_t grain = std::max<int64_t>(1, 16384 / V);
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> in_buf, out_buf;
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* dx_row = dlogits + r * V;
      const int64_t t = target[r];
      if (t == ignore_index) {
        std::fill(dx_row, dx_row + V, scalar_t(0));
        continue;
      }
      if (!std::isfinite(lse[r])) {  // a NaN or +inf logit (lse NaN), or only -inf ones (lse -inf): NaN row
        std::fill(dx_row, dx_row + V, static_cast<scalar_t>(std::numeric_limits<acc_t>::quiet_NaN()));
        continue;
      }
      const acc_t* x = as_acc(logits + r * V, V, in_buf);
      acc_t* dx = output_row(dx_row, V, out_buf);
      const acc_t g = dloss[r] + dnll[r], c = e * dloss[r] / static_cast<acc_t>(V), shift = lse[r];
      const Vec vg(g), vc(c), vshift(shift);
      int64_t j = 0;
      for (; j + Vec::size() <= V; j += Vec::size()) {
        (vg * (Vec::loadu(x + j) - vshift).exp_u20() - vc).store(dx + j);
      }
      for (; j < V; ++j) dx[j] = g * std::exp(x[j] - shift) - c;
      if (t >= 0 && t < V) dx[t] -= (acc_t(1) - e) * dloss[r] + dnll[r];
      finish_output(dx, dx_row, V);
    }
  });
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> cross_entropy_fwd(const Tensor& logits, const Tensor& target,
                                                     double label_smoothing, int64_t ignore_index) {
  const int64_t V = logits.size(-1), R = target.numel();
  const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  Tensor loss = at::empty(target.sizes(), logits.options().dtype(acc));
  Tensor nll = at::empty_like(loss), lse = at::empty_like(loss);
  if (R == 0) return {loss, nll, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "fastformer_cross_entropy_fwd_cpu",
                                  [&] {
                                    using acc_t = at::opmath_type<scalar_t>;
                                    cross_entropy_fwd_kernel<scalar_t>(
                                        logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), R, V, label_smoothing,
                                        ignore_index, loss.data_ptr<acc_t>(), nll.data_ptr<acc_t>(), lse.data_ptr<acc_t>());
                                  });
  return {loss, nll, lse};
}

Tensor cross_entropy_bwd(const Tensor& dloss, const Tensor& dnll, const Tensor& logits, const Tensor& target,
                         const Tensor& lse, double label_smoothing, int64_t ignore_index) {
  const int64_t V = logits.size(-1), R = target.numel();
  Tensor dlogits = at::empty_like(logits);
  if (R == 0) return dlogits;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "fastformer_cross_entropy_bwd_cpu",
                                  [&] {
                                    using acc_t = at::opmath_type<scalar_t>;
                                    cross_entropy_bwd_kernel<scalar_t>(
                                        dloss.data_ptr<acc_t>(), dnll.data_ptr<acc_t>(), logits.data_ptr<scalar_t>(),
                                        target.data_ptr<int64_t>(), lse.data_ptr<acc_t>(), R, V, label_smoothing,
                                        ignore_index, dlogits.data_ptr<scalar_t>());
                                  });
  return dlogits;
}

}  // namespace fastformer::cpu
