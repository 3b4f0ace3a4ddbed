// Masked, scaled softmax over the last dim on the CPU, forward and backward.
//
// x is viewed as R rows of N; rows are spread over threads with at::parallel_for. Per row:
//   a = scale * x (masked -> -inf) into a thread-local float row buffer,
//   m = max a; a = e^(a - m) with the sum l accumulated; y = a / l.
// Only the first sweep reads x and only the last writes y; the others run over the buffer while it sits
// in L1/L2 (N floats), so DRAM sees 2 N sizeof(T) (+ N mask bytes) per row. A row whose entries are all
// masked has m = -inf and returns zeros.
// Backward: dx = scale * y * (dy - sum(dy * y)); reads y, dy and writes dx once.
// The mask is expanded to x's shape as a view (stride 0 on broadcast dims, any strides), so the row's
// mask pointer is found by unravelling the row index over x's leading dims.
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_ops.h"

namespace fastformer::cpu {
namespace {

// Offsets of each row's mask within an expanded (strided) bool mask of x's shape.
struct MaskRows {
  const bool* base = nullptr;
  std::vector<int64_t> sizes, strides;  // leading dims of x, and the mask's strides there
  int64_t col_stride = 1;
  const bool* row(int64_t r) const {
    int64_t offset = 0;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
      offset += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return base + offset;
  }
};

template <typename scalar_t>
void softmax_fwd_kernel(const scalar_t* x, const MaskRows& mask, scalar_t* y, int64_t R, int64_t N, double scale) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> a(N), in_buf, out_buf;
    const Vec vscale(static_cast<acc_t>(scale));
    for (int64_t r = begin; r < end; ++r) {
      // Sweep 1 (reads x): a = scale * x, masked -> -inf.
      const acc_t* xr = as_acc(x + r * N, N, in_buf);
      int64_t j = 0;
      for (; j + Vec::size() <= N; j += Vec::size()) (Vec::loadu(xr + j) * vscale).store(a.data() + j);
      for (; j < N; ++j) a[j] = static_cast<acc_t>(scale) * xr[j];
      if (mask.base != nullptr) {
        const bool* mr = mask.row(r);
        if (mask.col_stride == 1) {
          for (j = 0; j < N; ++j) a[j] = mr[j] ? neg_inf : a[j];
        } else {
          for (j = 0; j < N; ++j) a[j] = mr[j * mask.col_stride] ? neg_inf : a[j];
        }
      }
      // Sweep 2 (cache): m = max a.  Sweep 3 (cache): a = e^(a - m), l = sum a.  Sweep 4 (writes y): a / l.
      const acc_t m = vec_max(a.data(), N);
      scalar_t* yr = y + r * N;
      if (m == neg_inf) {  // fully masked row
        std::fill(yr, yr + N, scalar_t(0));
        continue;
      }
      const Vec vm(m);
      Vec vsum(acc_t(0));
      for (j = 0; j + Vec::size() <= N; j += Vec::size()) {
        const Vec e = (Vec::loadu(a.data() + j) - vm).exp();
        e.store(a.data() + j);
        vsum = vsum + e;
      }
      acc_t sum = at::vec::vec_reduce_all<acc_t>([](Vec p, Vec q) { return p + q; }, vsum);
      for (; j < N; ++j) {
        a[j] = std::exp(a[j] - m);
        sum += a[j];
      }
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
    std::vector<acc_t> y_buf, dy_buf, out_buf;
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
  check_cpu_contiguous(x, "x");
  check_float_dtype(x, "x");
  TORCH_CHECK(x.dim() >= 1, "fastformer softmax: x must have at least one dimension");
  const int64_t N = x.size(-1), R = N == 0 ? 0 : x.numel() / N;
  MaskRows rows;
  Tensor m;
  if (mask.has_value()) {
    TORCH_CHECK(mask->device().is_cpu() && mask->scalar_type() == at::kBool,
                "fastformer softmax: mask must be a bool CPU tensor");
    TORCH_CHECK(at::infer_size(mask->sizes(), x.sizes()) == x.sizes(),
                "fastformer softmax: mask of shape ", mask->sizes(), " does not broadcast to x's shape ", x.sizes());
    m = mask->expand(x.sizes());  // a view: stride 0 along broadcast dims
    rows.base = m.data_ptr<bool>();
    for (int64_t d = 0; d + 1 < x.dim(); ++d) {
      rows.sizes.push_back(x.size(d));
      rows.strides.push_back(m.stride(d));
    }
    rows.col_stride = m.stride(-1);
  }
  Tensor y = at::empty_like(x);
  if (R == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fastformer_softmax_fwd_cpu", [&] {
    softmax_fwd_kernel<scalar_t>(x.data_ptr<scalar_t>(), rows, y.data_ptr<scalar_t>(), R, N, scale);
  });
  return y;
}

Tensor softmax_bwd(const Tensor& dy, const Tensor& y, double scale) {
  check_cpu_contiguous(dy, "dy");
  check_cpu_contiguous(y, "y");
  check_float_dtype(y, "y");
  TORCH_CHECK(dy.sizes() == y.sizes() && dy.scalar_type() == y.scalar_type(),
              "fastformer softmax: dy and y must have the same shape and dtype");
  const int64_t N = y.dim() == 0 ? 1 : y.size(-1), R = N == 0 ? 0 : y.numel() / N;
  Tensor dx = at::empty_like(y);
  if (R == 0) return dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "fastformer_softmax_bwd_cpu", [&] {
    softmax_bwd_kernel<scalar_t>(dy.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), R, N, scale);
  });
  return dx;
}

}  // namespace fastformer::cpu
