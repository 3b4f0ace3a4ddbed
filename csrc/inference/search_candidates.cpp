// The beam search's pass over the vocabulary (csrc/inference/beam_search.cpp calls it each step), float32 on the CPU:
// per row of logits (N, V; rows row_stride floats apart), in two reads of the row (row_candidates),
//   lse = m + log(sum_j e^(l_j - m)),  m = max_j l_j   (every token; exponentials in float, summed in float
//                                                       over blocks of 256 (AVX-512) and the blocks in double)
//   the `width` largest logits among the tokens the search may produce (pad and bos never; only eos in a
//   row at its sentence's length limit), best first, ties to the lower token id; -inf entries (tokens
//   not produced) fill the list when fewer than `width` tokens remain.
// A NaN logit is a token the model cannot produce: it is left out of the candidates and of the sum, as a
// -inf logit is (the torch path, fastformer/nn/decoding.py search_candidates, has the same rule; tested in
// tests/nn/test_native_decoding.py).
// The top list is kept sorted; the maximum of each block of 4 vectors is compared with the list's last (the
// threshold) and only a block above it is scanned for insertions, so after the first few blocks the scan is
// 4 vector maxima and a reduction per 64 logits (AVX-512), the row's maximum kept on the way. Rows are split
// over threads.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_ops.h"
#include "cpu/kernel_table.h"

namespace fastformer::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Sorted (value desc, token asc) list of at most `width` entries.
struct TopList {
  float* values;
  int64_t* tokens;
  int64_t width, size = 0;

  float threshold() const { return size < width ? kNegInf : values[width - 1]; }

  // A token scanned in increasing id order: it goes after every entry of equal value.
  void insert(float v, int64_t token) {
    int64_t at = std::min(size, width - 1);
    if (size == width && !(v > values[width - 1])) return;
    while (at > 0 && values[at - 1] < v) {
      values[at] = values[at - 1];
      tokens[at] = tokens[at - 1];
      --at;
    }
    values[at] = v;
    tokens[at] = token;
    size = std::min(size + 1, width);
  }
};

// The row's log-sum-exp without its NaN entries (a rare row: scalar).
double row_lse_without_nan(const float* row, int64_t V) {
  float m = kNegInf;
  for (int64_t j = 0; j < V; ++j) m = std::isnan(row[j]) ? m : std::max(m, row[j]);
  if (!std::isfinite(m)) return m;
  double sum = 0.0;
  for (int64_t j = 0; j < V; ++j) sum += std::isnan(row[j]) ? 0.0 : static_cast<double>(std::exp(row[j] - m));
  return static_cast<double>(m) + std::log(sum);
}

// m: the row's maximum as vec_max gives it (NaN if any logit is NaN), where the caller has it.
double row_lse(const float* row, int64_t V, float m) {
  using Vec = at::vec::Vectorized<float>;
  if (std::isnan(m)) return row_lse_without_nan(row, V);
  if (!std::isfinite(m)) return m;  // +inf: inf, as a log-softmax; -inf: an all -inf row
  // Exponentials summed in float vectors over blocks of 16 vectors (each term <= 1), the blocks in double.
  constexpr int64_t kBlock = 16 * Vec::size();
  const Vec vm(m);
  double sum = 0.0;
  int64_t j = 0;
  for (; j + kBlock <= V; j += kBlock) {
    Vec acc(0.0f);
    for (int64_t i = j; i < j + kBlock; i += Vec::size()) acc = acc + (Vec::loadu(row + i) - vm).exp();
    sum += static_cast<double>(at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, acc));
  }
  for (; j < V; ++j) sum += static_cast<double>(std::exp(row[j] - m));
  return static_cast<double>(m) + std::log(sum);
}

// One row: its candidates (the producible tokens: not pad, not bos) into `top` and its maximum in one pass, then
// the log-sum-exp from that maximum (row_lse's sum). The logits were just written by the output projection: a
// row (232 KB at V = 58,101) is read once from L3 or memory and once more from L2, where the maximum, the sum
// and the candidates each read it (the first from memory). The maximum is the one vec_max gives (NaN if
// any logit is NaN; then row_lse's rules), so the sum and lse are row_lse's exactly.
double row_candidates(const float* row, int64_t V, int64_t pad, int64_t bos, TopList& top) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t kBlock = 4 * Vec::size();
  auto producible = [&](int64_t token) { return token != pad && token != bos; };
  Vec running(kNegInf);
  int64_t j = 0;
  for (; j + kBlock <= V; j += kBlock) {
    const Vec block = at::vec::maximum(at::vec::maximum(Vec::loadu(row + j), Vec::loadu(row + j + Vec::size())),
                                       at::vec::maximum(Vec::loadu(row + j + 2 * Vec::size()),
                                                        Vec::loadu(row + j + 3 * Vec::size())));
    running = at::vec::maximum(running, block);
    const float block_max = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, block);
    if (block_max <= top.threshold()) continue;  // nothing here beats the list's last (a NaN: scan)
    for (int64_t i = j; i < j + kBlock; ++i) {
      if (producible(i) && row[i] > kNegInf) top.insert(row[i], i);
    }
  }
  float m = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, running);
  for (; j < V; ++j) {
    m = std::isnan(row[j]) ? row[j] : std::isnan(m) ? m : std::max(m, row[j]);
    if (producible(j) && row[j] > kNegInf) top.insert(row[j], j);
  }
  return row_lse(row, V, m);
}

}  // namespace

void search_candidates(const float* logits, int64_t N, int64_t V, int64_t row_stride, const bool* only_eos,
                       int64_t pad, int64_t bos, int64_t eos, int64_t width, double* lse, float* top_values,
                       int64_t* top_tokens) {
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = logits + r * row_stride;
      TopList top{top_values + r * width, top_tokens + r * width, width};
      if (only_eos != nullptr && only_eos[r]) {
        lse[r] = row_lse(row, V, vec_max(row, V));
        if (eos >= 0 && eos < V && row[eos] > kNegInf) top.insert(row[eos], eos);
      } else {
        lse[r] = row_candidates(row, V, pad, bos, top);
      }
      // Fewer than width producible finite logits: -inf entries, on the lowest ids not listed.
      for (int64_t token = 0; top.size < width && token < V; ++token) {
        if (std::find(top.tokens, top.tokens + top.size, token) == top.tokens + top.size) {
          top.values[top.size] = kNegInf;
          top.tokens[top.size++] = token;
        }
      }
    }
  });
}

}  // namespace fastformer::cpu
