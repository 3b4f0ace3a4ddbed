// Entry points of the C++ CPU kernels and what the kernel files share. The kernel files are compiled once
// per instruction-set level into the modules fastformer._cpu_<level> (csrc/cpu/level_module.cpp); the CPU
// dispatch key of fastformer::<op>_<fwd|bwd> calls the chosen level's entry points (csrc/cpu_levels.cpp)
// through the adapters of csrc/ops.h, which check the caller's arguments, forward and backward (ValueError),
// and pass contiguous tensors: the entry points rely on them and check nothing again.
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <new>
#include <tuple>
#include <vector>

namespace fastformer::cpu {

using at::Tensor;

#include "op_entry_points.h"

// The dropout seed's value, read on the host from the 0-dim int64 CPU tensor (csrc/ops.h check_seed; no
// sync on the CPU), for the kernels that take it by value; 0 without a seed (no dropout).
inline uint64_t seed_value(const c10::optional<Tensor>& seed) {
  return seed.has_value() ? static_cast<uint64_t>(*seed->const_data_ptr<int64_t>()) : 0;
}

// Work buffers of the kernels: std::vector with storage aligned to 64 bytes (a cache line, one AVX-512
// vector), so that a work item sees the same buffer alignment whichever thread runs it. malloc gives each
// thread's arena its own offsets modulo 64, and the BLAS the attention's tile products call may pick its
// code path (and with it the order of a dot product's additions) by its operands' alignment: results then
// changed with the thread count (reported: CPU attention on an AVX-512 Intel Xeon, float32 outputs a few
// ulps apart between 1 and 2 threads; tests/ops/test_threads.py).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::size_t kAlign = 64;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + kAlign - 1) / kAlign * kAlign;  // aligned_alloc wants a multiple
    void* p = std::aligned_alloc(kAlign, bytes == 0 ? kAlign : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using Buffer = std::vector<T, CacheLineAllocator<T>>;

// max(a, b) that propagates NaN whichever side it is on (std::max keeps its first argument when either
// is NaN); at::vec::maximum propagates NaN too.
template <typename T>
inline T nan_max(T a, T b) {
  return (a > b || std::isnan(a)) ? a : b;
}

// The running max of a softmax row, turned into NaN when a logit is NaN or +inf: every e^(a - m) and the
// sum then become NaN, so the whole row is NaN (the rule of every backend, PyTorch's softmax included).
template <typename T>
inline T poison_unbounded(T m) {
  return m < std::numeric_limits<T>::infinity() ? m : std::numeric_limits<T>::quiet_NaN();
}

// Vectorized helpers over a float/double buffer of length n (ATen's at::vec, tail handled by count).
// vec_max propagates NaN.
template <typename T>
inline T vec_max(const T* x, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  T m = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  if (n >= Vec::size()) {
    Vec vm = Vec::loadu(x);
    for (j = Vec::size(); j + Vec::size() <= n; j += Vec::size()) vm = at::vec::maximum(vm, Vec::loadu(x + j));
    m = at::vec::vec_reduce_all<T>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, vm);
  }
  for (; j < n; ++j) m = nan_max(m, x[j]);
  return m;
}

template <typename T>
inline T vec_sum(const T* x, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  Vec acc(T(0));
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) acc = acc + Vec::loadu(x + j);
  T s = at::vec::vec_reduce_all<T>([](Vec a, Vec b) { return a + b; }, acc);
  for (; j < n; ++j) s += x[j];
  return s;
}

template <typename T>
inline T vec_dot(const T* x, const T* y, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  Vec acc(T(0));
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) acc = at::vec::fmadd(Vec::loadu(x + j), Vec::loadu(y + j), acc);
  T s = at::vec::vec_reduce_all<T>([](Vec a, Vec b) { return a + b; }, acc);
  for (; j < n; ++j) s += x[j] * y[j];
  return s;
}

// y[0:n] += a * x[0:n]
template <typename T>
inline void vec_axpy(T a, const T* x, T* y, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  const Vec va(a);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) at::vec::fmadd(va, Vec::loadu(x + j), Vec::loadu(y + j)).store(y + j);
  for (; j < n; ++j) y[j] += a * x[j];
}

// y[0:n] *= a
template <typename T>
inline void vec_scale(T a, T* y, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  const Vec va(a);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (va * Vec::loadu(y + j)).store(y + j);
  for (; j < n; ++j) y[j] *= a;
}

// Element-type conversion of a row into / out of the accumulation buffer.
template <typename src_t, typename dst_t>
inline void convert_row(const src_t* src, dst_t* dst, int64_t n) {
  if constexpr (std::is_same_v<src_t, dst_t>) {
    std::memcpy(dst, src, n * sizeof(src_t));
  } else {
    at::vec::convert(src, dst, n);
  }
}

// n elements of src as acc_t: src itself when the types agree, else converted into buffer.
template <typename scalar_t, typename acc_t>
inline const acc_t* as_acc(const scalar_t* src, int64_t n, Buffer<acc_t>& buffer) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return src;
  } else {
    if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
    convert_row(src, buffer.data(), n);
    return buffer.data();
  }
}

// Where to compute an output row of n elements: dst itself when the types agree, else buffer (then
// finish_output converts it into dst).
template <typename scalar_t, typename acc_t>
inline acc_t* output_row(scalar_t* dst, int64_t n, Buffer<acc_t>& buffer) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return dst;
  } else {
    if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
    return buffer.data();
  }
}

template <typename scalar_t, typename acc_t>
inline void finish_output(const acc_t* row, scalar_t* dst, int64_t n) {
  if constexpr (!std::is_same_v<scalar_t, acc_t>) convert_row(row, dst, n);
}

}  // namespace fastformer::cpu
