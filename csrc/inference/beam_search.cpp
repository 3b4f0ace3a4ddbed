// fastformer._C.BeamSearch: the bookkeeping of the beam search of fastformer/nn/decoding.py (greedy is
// beam 1), one step a call, on the host. The rules (pinned by tests/nn/test_model_decoding.py, and by
// tests/nn/test_fast_decoding.py against the search of earlier commits):
//   - N = n K live rows: beam k of the i-th live sentence is row i K + k;
//   - per row, the search's view of the next token: lse (the log-softmax normaliser over the whole
//     vocabulary) and its best `width` = min(2 K, V) logits among the tokens it may produce (never pad or
//     bos; only eos at a sentence's last allowed position, floor(a n + b)): step_logits computes them with
//     the level's search_candidates kernel (float32 CPU logits), step_candidates takes them from elsewhere
//     (fastformer/nn/decoding.py computes them with torch ops on any device, in the kernel's order: ties to
//     the lower token id);
//   - candidate = score(row) + logit - lse, in float64; a sentence's best 2 K of its K width candidates,
//     best first (ties to the lower row, then the better-ranked logit);
//   - walking them: an eos among the best K ends a hypothesis with score / ((5 + len) / 6)^alpha, len
//     counting the eos (GNMT's length penalty); other tokens extend a beam, until K beams; a -inf
//     candidate stops the walk;
//   - a sentence stops when K hypotheses have finished, at its length limit, or with no beam left;
//     otherwise beams short of K are filled with idle copies of the first (score -inf);
//   - a sentence that stops with no finished hypothesis (every candidate -inf or NaN: a model whose logits
//     are NaN, e.g. NaN weights, or whose eos is -inf at the limit) ends with one empty hypothesis of
//     score -inf, so that every sentence has a best hypothesis; the other sentences are unaffected;
//   - every row starts from the start token (the config's decoder start: bos, or pad for Marian); the
//     `forced` tokens (NLLB's target language) are the only candidates of the first steps, each with
//     log-probability 0 (transformers' forced_bos_token_id), whatever the logits say.
// Memory: a step reads lse (N) and the candidates (N, width); the prefixes of the live rows are kept as
// token lists and copied from their parents each step (N t ints).
#include <torch/python.h>  // pybind11, tensor casters (torch/extension.h adds the C++ frontend: 16 s to compile)

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "cpu/kernel_table.h"
#include "cpu_levels.h"

namespace fastformer {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

class BeamSearch {
 public:
  BeamSearch(std::vector<int64_t> max_len, int64_t beams, double alpha, int64_t vocab, int64_t pad, int64_t bos,
             int64_t eos, c10::optional<int64_t> start, std::vector<int64_t> forced)
      : max_len_(std::move(max_len)), K_(beams), alpha_(alpha), V_(vocab), pad_(pad), bos_(bos), eos_(eos),
        start_(start.value_or(bos)), forced_(std::move(forced)), finished_(max_len_.size()) {
    TORCH_CHECK_VALUE(beams >= 1, "fastformer BeamSearch: beams must be >= 1, got ", beams);
    TORCH_CHECK_VALUE(vocab >= 1, "fastformer BeamSearch: vocab must be >= 1, got ", vocab);
    for (const int64_t token : forced_) {
      TORCH_CHECK_VALUE(token >= 0 && token < vocab, "fastformer BeamSearch: forced token ", token,
                        " is outside the vocabulary [0, ", vocab, ")");
    }
    const int64_t B = static_cast<int64_t>(max_len_.size());
    active_.resize(B);
    std::iota(active_.begin(), active_.end(), 0);
    prefixes_.assign(B * K_, {});
    scores_.assign(B * K_, 0.0);
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t k = 1; k < K_; ++k) scores_[i * K_ + k] = kNegInf;  // step 0: expand the first beam only
    }
  }

  int64_t width() const { return std::min<int64_t>(2 * K_, V_); }
  int64_t rows() const { return static_cast<int64_t>(active_.size()) * K_; }

  // (N,) bool: rows whose sentence is at its last allowed position (only eos may follow).
  Tensor at_limit() const {
    Tensor out = at::empty({rows()}, at::TensorOptions().dtype(at::kBool));
    bool* p = out.mutable_data_ptr<bool>();
    for (size_t i = 0; i < active_.size(); ++i) {
      for (int64_t k = 0; k < K_; ++k) p[i * K_ + k] = step_ >= max_len_[active_[i]];
    }
    return out;
  }

  // (N, t + 1) int64: the start token, then each live row's tokens.
  Tensor tokens() const {
    Tensor out = at::empty({rows(), step_ + 1}, at::TensorOptions().dtype(at::kLong));
    int64_t* p = out.mutable_data_ptr<int64_t>();
    for (int64_t r = 0; r < rows(); ++r) {
      p[r * (step_ + 1)] = start_;
      std::copy(prefixes_[r].begin(), prefixes_[r].end(), p + r * (step_ + 1) + 1);
    }
    return out;
  }

  // A step from float32 CPU logits (N, V); returns whether any sentence goes on. Rows may lie further apart
  // than V (the C++ decoder's logits: rows padded to whole cache lines), read in place.
  bool step_logits(const Tensor& logits) {
    TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(0) == rows() && logits.size(1) == V_ &&
                          logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
                      "fastformer BeamSearch: logits must be a float32 CPU tensor (", rows(), ", ", V_, "), got ",
                      logits.scalar_type(), " ", logits.sizes(), " on ", logits.device());
    const int64_t N = rows(), w = width();
    if (step_ < static_cast<int64_t>(forced_.size())) return step_forced();
    const Tensor l = logits.stride(1) == 1 && logits.stride(0) >= V_ ? logits : logits.contiguous();
    Tensor lse = at::empty({N}, l.options().dtype(at::kDouble));
    Tensor top = at::empty({N, w}, l.options());
    Tensor top_tokens = at::empty({N, w}, l.options().dtype(at::kLong));
    const Tensor limit = at_limit();
    cpu_kernels().inference.search_candidates(l.const_data_ptr<float>(), N, V_, l.stride(0),
                                              limit.const_data_ptr<bool>(), pad_, bos_, eos_, w,
                                              lse.mutable_data_ptr<double>(), top.mutable_data_ptr<float>(),
                                              top_tokens.mutable_data_ptr<int64_t>());
    return step_candidates(lse, top.to(at::kDouble), top_tokens);
  }

  // A forced step: every row's only candidate is forced_[step_], with log-probability 0.
  bool step_forced() {
    const int64_t N = rows(), w = width();
    Tensor lse = at::zeros({N}, at::TensorOptions().dtype(at::kDouble));
    Tensor top = at::full({N, w}, kNegInf, at::TensorOptions().dtype(at::kDouble));
    Tensor tokens = at::full({N, w}, eos_, at::TensorOptions().dtype(at::kLong));
    top.select(1, 0).fill_(0.0);
    tokens.select(1, 0).fill_(forced_[step_]);
    return advance(lse, top, tokens);
  }

  // A step from lse (N,) float64, the best logits (N, width) float64 and their tokens (N, width) int64 (ignored
  // at a forced step).
  bool step_candidates(const Tensor& lse_in, const Tensor& top_in, const Tensor& tokens_in) {
    if (step_ < static_cast<int64_t>(forced_.size())) return step_forced();
    return advance(lse_in, top_in, tokens_in);
  }

 private:
  // The step itself, from the rows' candidates (step_candidates' arguments).
  bool advance(const Tensor& lse_in, const Tensor& top_in, const Tensor& tokens_in) {
    const int64_t N = rows(), w = width();
    TORCH_CHECK_VALUE(lse_in.sizes().vec() == std::vector<int64_t>({N}) &&
                          top_in.sizes().vec() == std::vector<int64_t>({N, w}) &&
                          tokens_in.sizes().vec() == std::vector<int64_t>({N, w}),
                      "fastformer BeamSearch: expected lse (", N, ",) and candidates (", N, ", ", w, "), got ",
                      lse_in.sizes(), ", ", top_in.sizes(), ", ", tokens_in.sizes());
    const Tensor lse_t = lse_in.to(at::kCPU, at::kDouble).contiguous();
    const Tensor top_t = top_in.to(at::kCPU, at::kDouble).contiguous();
    const Tensor tok_t = tokens_in.to(at::kCPU, at::kLong).contiguous();
    const double* lse = lse_t.const_data_ptr<double>();
    const double* top = top_t.const_data_ptr<double>();
    const int64_t* tok = tok_t.const_data_ptr<int64_t>();
    const double penalty = std::pow((5.0 + static_cast<double>(step_) + 1.0) / 6.0, alpha_);
    const int64_t n = static_cast<int64_t>(active_.size()), per = K_ * w, best_count = std::min(2 * K_, per);

    std::vector<double> candidates(per);
    std::vector<int64_t> order(per);
    std::vector<int64_t> still, kept, parents, next_tokens;
    std::vector<double> next_scores;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = active_[i];
      for (int64_t c = 0; c < per; ++c) {
        const int64_t row = i * K_ + c / w;
        const double logit = top[row * w + c % w];  // -inf: no token (also in a row whose lse is -inf)
        candidates[c] = logit == kNegInf ? kNegInf : scores_[row] + (logit - lse[row]);
      }
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + best_count, order.end(), [&](int64_t a, int64_t b) {
        return candidates[a] > candidates[b] || (candidates[a] == candidates[b] && a < b);
      });
      std::vector<std::pair<int64_t, int64_t>> beams;  // (row, token)
      std::vector<double> beam_scores;
      int64_t ended = static_cast<int64_t>(finished_[s].size());
      for (int64_t rank = 0; rank < best_count; ++rank) {
        const int64_t c = order[rank], row = i * K_ + c / w, token = tok[row * w + c % w];
        const double score = candidates[c];
        if (static_cast<int64_t>(beams.size()) == K_ || score == kNegInf) break;
        if (token == eos_) {
          if (rank < K_) {  // an eos among the best K candidates ends a hypothesis
            finished_[s].emplace_back(prefixes_[row], score / penalty);
            ++ended;
          }
          continue;
        }
        beams.emplace_back(row, token);
        beam_scores.push_back(score);
      }
      if (ended >= K_ || step_ >= max_len_[s] || beams.empty()) continue;  // the sentence is done
      while (static_cast<int64_t>(beams.size()) < K_) {  // idle beams
        beams.emplace_back(beams[0].first, eos_);
        beam_scores.push_back(kNegInf);
      }
      still.push_back(s);
      kept.push_back(i);
      for (int64_t k = 0; k < K_; ++k) {
        parents.push_back(beams[k].first);
        next_tokens.push_back(beams[k].second);
        next_scores.push_back(beam_scores[k]);
      }
    }
    step_ += 1;
    if (still.empty()) {
      active_.clear();
      return false;
    }
    std::vector<std::vector<int64_t>> prefixes(parents.size());
    for (size_t r = 0; r < parents.size(); ++r) {
      prefixes[r].reserve(step_);
      prefixes[r] = prefixes_[parents[r]];
      prefixes[r].push_back(next_tokens[r]);
    }
    prefixes_ = std::move(prefixes);
    scores_ = std::move(next_scores);
    parents_ = at::tensor(parents, at::TensorOptions().dtype(at::kLong));
    sentences_ = static_cast<int64_t>(still.size()) == n
                     ? c10::optional<Tensor>()
                     : c10::optional<Tensor>(at::tensor(kept, at::TensorOptions().dtype(at::kLong)));
    active_ = std::move(still);
    return true;
  }

 public:
  // Per sentence of the batch, its finished hypotheses (tokens without bos/eos, score), best first, at most K;
  // at least one: a sentence none finished (no candidate was ever finite) gets the empty one, score -inf.
  std::vector<std::vector<std::pair<std::vector<int64_t>, double>>> hypotheses() const {
    auto out = finished_;
    for (auto& hyps : out) {
      if (hyps.empty()) hyps.emplace_back(std::vector<int64_t>(), kNegInf);
      std::stable_sort(hyps.begin(), hyps.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
      if (static_cast<int64_t>(hyps.size()) > K_) hyps.resize(K_);
    }
    return out;
  }

  Tensor parents() const { return parents_; }
  c10::optional<Tensor> sentences() const { return sentences_; }

 private:
  std::vector<int64_t> max_len_;
  int64_t K_;
  double alpha_;
  int64_t V_, pad_, bos_, eos_, start_;
  std::vector<int64_t> forced_;  // the tokens of the first steps
  std::vector<std::vector<std::pair<std::vector<int64_t>, double>>> finished_;
  std::vector<int64_t> active_;                 // batch index of each live sentence
  std::vector<std::vector<int64_t>> prefixes_;  // (N) tokens of each live row, bos excluded
  std::vector<double> scores_;                  // (N) sums of log-probabilities
  Tensor parents_;                              // (N',) rows of the last step the live rows continue
  c10::optional<Tensor> sentences_;             // live sentences kept by the last step (none: all)
  int64_t step_ = 0;
};

}  // namespace

void bind_beam_search(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<BeamSearch>(m, "BeamSearch",
                         "The beam search's bookkeeping, one step a call (csrc/inference/beam_search.cpp); driven by "
                         "fastformer.nn.decoding.beam_search")
      .def(py::init<std::vector<int64_t>, int64_t, double, int64_t, int64_t, int64_t, int64_t, c10::optional<int64_t>,
                    std::vector<int64_t>>(),
           py::arg("max_len"), py::arg("beams"), py::arg("alpha"), py::arg("vocab"), py::arg("pad"), py::arg("bos"),
           py::arg("eos"), py::arg("start") = py::none(), py::arg("forced") = std::vector<int64_t>(),
           "start: the decoder's first token (default bos); forced: the tokens of the first steps")
      .def_property_readonly("width", &BeamSearch::width, "candidates a row offers: min(2 beams, vocab)")
      .def_property_readonly("rows", &BeamSearch::rows, "live rows N")
      .def("at_limit", &BeamSearch::at_limit, "(N,) bool: rows at their sentence's last allowed position")
      .def("tokens", &BeamSearch::tokens, "(N, t + 1) int64: the start token and each live row's tokens")
      .def("step_logits", &BeamSearch::step_logits, py::arg("logits"),
           "one step from float32 CPU logits (N, V); False when every sentence is done")
      .def("step_candidates", &BeamSearch::step_candidates, py::arg("lse"), py::arg("top_logits"),
           py::arg("top_tokens"), "one step from each row's log-softmax normaliser and best width logits")
      .def_property_readonly("parents", &BeamSearch::parents, "(N',) the rows of the last step the live rows continue")
      .def_property_readonly("sentences", &BeamSearch::sentences,
                             "the live sentences the last step kept (None: all of them)")
      .def("hypotheses", &BeamSearch::hypotheses,
           "per sentence, its finished (tokens, score), best first; ([], -inf) for a sentence none finished");
}

}  // namespace fastformer
