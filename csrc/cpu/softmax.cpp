// Masked, scaled softmax over the last dim on the CPU, forward and backward.
//
// x is viewed as R rows of N; rows are spread over threads with at::parallel_for. Forward, per row, in a
// thread-local acc_t row buffer a (N entries, in L1/L2):
//   sweep 1 (reads x): a = scale * x, masked entries -> -inf (a vector blend with the row's mask bits),
//                      m = max a accumulated on the way;
//   sweep 2 (cache):   a = e^(a - m) (at::vec's exp_u20 polynomial, well inside float32's tolerance), l = sum a;
//   sweep 3 (writes y): y = a / l.
// DRAM sees 2 N sizeof(T) (+ N mask bytes) per row. A row whose entries are all masked (or -inf) has
// m = -inf and returns zeros; a row with a NaN or +inf entry that is not masked has m = NaN or +inf (the
// max propagates NaN) and returns NaN in every column, as torch.softmax does.
// Backward: dx = scale * y * (dy - sum(dy * y)); reads y, dy and writes dx once.
// The mask is expanded to x's shape as a view (stride 0 on broadcast dims, any strides). A cursor walks
// the rows' mask offsets (one division per thread, not per row), and the row's mask is turned into
// all-ones / all-zeros bit patterns of acc_t width only when the mask row changes: a key padding mask
// (B, 1, 1, L) is converted once per H * L rows.
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/cpu_ops.h"

namespace fastformer::cpu {
namespace {

// Layout of a bool mask expanded to x's shape: the leading dims of x and the mask's strides there.
struct MaskRows {
  const bool* base = nullptr;
  std::vector<int64_t> sizes, strides;
  int64_t col_stride = 1;
};

// Walks the mask offsets of consecutive rows r, r + 1, ... (an odometer over the leading dims).
class MaskCursor {
 public:
  MaskCursor(const MaskRows& m, int64_t r) : m_(m), index_(m.sizes.size()) {
    for (int64_t d = static_cast<int64_t>(m.sizes.size()) - 1; d >= 0; --d) {
      index_[d] = r % m.sizes[d];
      offset_ += index_[d] * m.strides[d];
      r /= m.sizes[d];
    }
  }
  const bool* row() const { return m_.base + offset_; }
  void next() {
    for (int64_t d = static_cast<int64_t>(index_.size()) - 1; d >= 0; --d) {
      offset_ += m_.strides[d];
      if (++index_[d] < m_.sizes[d]) return;
      offset_ -= m_.sizes[d] * m_.strides[d];
      index_[d] = 0;
    }
  }

 private:
  const MaskRows& m_;
  std::vector<int64_t> index_;
  int64_t offset_ = 0;
};

template <typename scalar_t>
void softmax_fwd_kernel(const scalar_t* x, const MaskRows& mask, scalar_t* y, int64_t R, int64_t N, double scale) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  using bits_t = std::conditional_t<sizeof(acc_t) == 4, int32_t, int64_t>;  // acc_t's width, for blendv
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> a(N), in_buf, out_buf;
    std::vector<bits_t> bits(mask.base != nullptr ? N : 0);  // -1 (all ones) where masked, else 0
    const acc_t* vbits = reinterpret_cast<const acc_t*>(bits.data());
    const bool* bits_of = nullptr;  // the mask row `bits` holds
    bool any_masked = false;
    MaskCursor cursor(mask, mask.base != nullptr ? begin : 0);
    const Vec vscale(static_cast<acc_t>(scale)), vneg_inf(neg_inf);
    for (int64_t r = begin; r < end; ++r) {
      if (mask.base != nullptr) {
        const bool* mr = cursor.row();
        cursor.next();
        if (mr != bits_of) {
          bits_of = mr;
          bits_t any = 0;
          for (int64_t j = 0; j < N; ++j) {
            bits[j] = -static_cast<bits_t>(mr[j * mask.col_stride]);
            any |= bits[j];
          }
          any_masked = any != 0;
        }
      }
      // Sweep 1 (reads x): a = scale * x, masked -> -inf; m = max a.
      const acc_t* xr = as_acc(x + r * N, N, in_buf);
      Vec vmax(neg_inf);
      int64_t j = 0;
      for (; j + Vec::size() <= N; j += Vec::size()) {
        Vec v = Vec::loadu(xr + j) * vscale;
        if (any_masked) v = Vec::blendv(v, vneg_inf, Vec::loadu(vbits + j));
        v.store(a.data() + j);
        vmax = at::vec::maximum(vmax, v);
      }
      acc_t m = at::vec::vec_reduce_all<acc_t>([](Vec p, Vec q) { return at::vec::maximum(p, q); }, vmax);
      for (; j < N; ++j) {
        a[j] = any_masked && bits[j] != 0 ? neg_inf : static_cast<acc_t>(scale) * xr[j];
        m = nan_max(m, a[j]);
      }
      scalar_t* yr = y + r * N;
      if (m == neg_inf) {  // fully masked row (or only -inf logits): zeros
        std::fill(yr, yr + N, scalar_t(0));
        continue;
      }
      if (!(m < std::numeric_limits<acc_t>::infinity())) {  // a NaN or +inf logit (not masked): the row is NaN
        std::fill(yr, yr + N, static_cast<scalar_t>(std::numeric_limits<acc_t>::quiet_NaN()));
        continue;
      }
      // Sweep 2 (cache): a = e^(a - m), l = sum a.
      const Vec vm(m);
      Vec vsum(acc_t(0));
      for (j = 0; j + Vec::size() <= N; j += Vec::size()) {
        const Vec e = (Vec::loadu(a.data() + j) - vm).exp_u20();
        e.store(a.data() + j);
        vsum = vsum + e;
      }
      acc_t sum = at::vec::vec_reduce_all<acc_t>([](Vec p, Vec q) { return p + q; }, vsum);
      for (; j < N; ++j) {
        a[j] = std::exp(a[j] - m);
        sum += a[j];
      }
      // Sweep 3 (writes y): y = a / l.
      acc_t* out = output_row(yr, N, out_buf);
      const Vec vinv(acc_t(1) / sum);
      for (j = 0; j + Vec::size() <= N; j += Vec::size()) (Vec::loadu(a.data() + j) * vinv).store(out + j);
      for (; j < N; ++j) out[j] = a[j] / sum;
      finish_output(out, yr, N);
    }
  });
}

template <typename scalar_t>
void softmax_bwd_kernel(const scalar_t* dy, const scalar_t* y, scalar_t* dx, int64_t R, int64_t N, double scale) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> y_buf, dy_buf, out_buf;
    for (int64_t r = begin; r < end; ++r) {
      const acc_t* yr = as_acc(y + r * N, N, y_buf);
      const acc_t* gr = as_acc(dy + r * N, N, dy_buf);
      const acc_t dot = vec_dot(yr, gr, N);  // sum(dy * y)
      acc_t* out = output_row(dx + r * N, N, out_buf);
      const Vec vdot(dot), vscale(static_cast<acc_t>(scale));
      int64_t j = 0;
      for (; j + Vec::size() <= N; j += Vec::size()) {
        (vscale * Vec::loadu(yr + j) * (Vec::loadu(gr + j) - vdot)).store(out + j);
      }
      for (; j < N; ++j) out[j] = static_cast<acc_t>(scale) * yr[j] * (gr[j] - dot);
      finish_output(out, dx + r * N, N);
    }
  });
}

}  // namespace

Tensor softmax_fwd(const Tensor& x, const c10::optional<Tensor>& mask, double scale) {
  const int64_t N = x.size(-1), R = N == 0 ? 0 : x.numel() / N;
  MaskRows rows;
  if (mask.has_value()) {
    // The mask's strides broadcast to x's shape (0 along broadcast dims), as mask->expand(x.sizes()) would
    // give them, without the view op (its dispatch costs more than a tiny softmax).
    const Tensor& m = *mask;
    const int64_t lead = x.dim() - m.dim();  // leading dims of x that the mask lacks
    const auto stride = [&](int64_t d) {      // d: a dim of x
      const int64_t md = d - lead;
      return md < 0 || m.size(md) == 1 ? int64_t(0) : m.stride(md);
    };
    rows.base = m.data_ptr<bool>();
    for (int64_t d = 0; d + 1 < x.dim(); ++d) {
      rows.sizes.push_back(x.size(d));
      rows.strides.push_back(stride(d));
    }
    rows.col_stride = x.dim() == 0 ? 1 : stride(x.dim() - 1);
  }
  Tensor y = at::empty_like(x);
  if (R == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fastformer_softmax_fwd_cpu", [&] {
    softmax_fwd_kernel<scalar_t>(x.data_ptr<scalar_t>(), rows, y.data_ptr<scalar_t>(), R, N, scale);
  });
  return y;
}

Tensor softmax_bwd(const Tensor& dy, const Tensor& y, double scale) {
  const int64_t N = y.dim() == 0 ? 1 : y.size(-1), R = N == 0 ? 0 : y.numel() / N;
  Tensor dx = at::empty_like(y);
  if (R == 0) return dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "fastformer_softmax_bwd_cpu", [&] {
    softmax_bwd_kernel<scalar_t>(dy.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), R, N, scale);
  });
  return dx;
}

}  // namespace fastformer::cpu
