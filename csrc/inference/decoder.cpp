// fastformer._C.CpuDecoder: the incremental decoder of fastformer/nn/decoding.py as one C++ object, for
// float32 on the CPU (int8 projections in a quantized model). It owns what lives across the steps of a beam
// search (the prepared weights, the cross-attention keys/values of each sentence, the self-attention caches)
// and runs a step as one call of the loaded level's decoder_step kernel (csrc/inference/decoder_step.cpp).
//
// Self-attention caches: per layer one buffer for keys and one for values, each (N0, H, T, Dh) with N0 the
// first step's rows and T the positions decoded. Cache row c holds at position j what live row c computed
// at step j, written once and never moved; a table of slots (N, T) says, for each live row r and earlier
// position j, which cache row holds it. A beam reorder or a finished sentence rewrites the slots (N t
// integers), never the caches.
//
// Built from one named structure (a dict, fastformer/nn/decoding.py makes it), every field checked and an
// unknown field refused:
//   sublayers   the decoder layer's description (fastformer/nn/layers.py DECODER_SUBLAYERS), in order: per
//               sublayer (kind, norm name, {role: weight name}); kinds "self_attention" (roles qkv, out),
//               "cross_attention" (q, out; its k|v projection is applied by the caller, once per sentence),
//               "feed_forward" (fc1, fc2)
//   activation  the feed-forward's: "relu", "gelu" or "silu";  norm_first, eps: the LayerNorms' placement
//   heads, d_ff
//   layers      per layer its weights by the description's names: a linear layer's "<name>.panels"
//               (csrc/gemm/gemm.h's float32 layout) or, quantized, its int8 weight by the state dict's names,
//               "<name>.weight", "<name>.weight_scale", "<name>.weight_colsum", and where its module holds one
//               its oneDNN packing "<name>.onednn" (a fastformer._C.OnednnInt8, not a tensor; without it, where
//               oneDNN's products may run, the decoder packs the weight itself, for its own life); and
//               "<name>.bias"; a LayerNorm's "<name>.weight", "<name>.bias". Each is looked up by its name and
//               checked against the shape its role gives it, and a weight the description does not use is
//               refused: a swapped self_out/cross_q/cross_out (all d x d) cannot get in by position, and a
//               weight added to the description cannot be left out silently.
//   final_norm  {"final_norm.weight", "final_norm.bias"} for pre-norm, {} for post-norm
//   embed       the target embedding, which is also the output projection d -> V (tied), by the state dict's
//               names: "embed.weight" (V, d) float32 and its panels "embed.panels", or, quantized, the int8
//               "embed.weight", "embed.weight_scale", "embed.weight_colsum" and "embed.onednn" as above (the
//               lookup dequantizes its rows); and "output_bias" (V,) where the model has one (Marian's
//               final_logits_bias)
//   embed_scale; positions (>= steps, d)
//   cross       per layer (k, v), each (B, H, S, Dh);  src_padding (B, S) bool or None
//   beams, steps
#include <torch/python.h>  // pybind11, tensor casters (torch/extension.h adds the C++ frontend: 16 s to compile)
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#define FASTFORMER_GEMM_CHECKS
#include "cpu/kernel_table.h"
#include "cpu_levels.h"
#include "gemm/gemm.h"
#include "gemm/int8_onednn.h"
#include "inference/inference.h"

namespace fastformer {
namespace {

namespace py = pybind11;
using Pack = std::shared_ptr<OnednnInt8>;
using Named = std::map<std::string, std::variant<Tensor, Pack>>;  // a weight (or its oneDNN packing) by name
constexpr const char* kWho = "fastformer CpuDecoder";

// The fields of the named structure, each taken once; done() refuses the ones not taken.
class Fields {
 public:
  explicit Fields(py::dict fields) : fields_(std::move(fields)) {}

  template <typename T>
  T take(const std::string& key) {
    TORCH_CHECK_VALUE(fields_.contains(key), kWho, ": the description has no field \"", key, "\"");
    taken_.insert(key);
    try {
      return fields_[py::str(key)].cast<T>();
    } catch (const py::cast_error&) {
      TORCH_CHECK_VALUE(false, kWho, ": field \"", key, "\" has the wrong type (",
                        py::str(py::type::of(fields_[py::str(key)])).cast<std::string>(), ")");
    }
  }
  template <typename T>
  c10::optional<T> optional(const std::string& key) {
    if (fields_.contains(key) && fields_[py::str(key)].is_none()) {
      taken_.insert(key);
      return c10::nullopt;
    }
    return take<T>(key);
  }
  void done() const {
    for (const auto& item : fields_) {
      const std::string key = py::str(item.first);
      TORCH_CHECK_VALUE(taken_.count(key), kWho, ": unknown field \"", key, "\" in the description");
    }
  }

 private:
  py::dict fields_;
  std::set<std::string> taken_;
};

// Looks weights up by name in one dict, checks each (csrc/gemm/gemm.cpp's checks), and at the end that
// every name was bound.
class Binder {
 public:
  // int8_variant: the variant the int8 projections will run (gemm.h int8_variant_index; -1: the rule), which
  // decides whether their weights need a oneDNN packing; one not given is made and kept in `made` (the
  // decoder's, so that it lives as long as the decoder).
  Binder(const Named& weights, std::string where, int int8_variant, std::vector<Pack>& made)
      : weights_(weights), where_(std::string(kWho) + ": " + where), int8_variant_(int8_variant), made_(made) {}

  const Tensor& find(const std::string& name) {
    auto it = weights_.find(name);
    TORCH_CHECK_VALUE(it != weights_.end(), where_, " has no weight \"", name, "\"");
    const Tensor* t = std::get_if<Tensor>(&it->second);
    TORCH_CHECK_VALUE(t != nullptr, where_, ": \"", name, "\" must be a tensor, got a oneDNN packing");
    bound_.insert(name);
    return *t;
  }
  // The oneDNN packing "<name>" of an int8 weight, or nullptr where none is given.
  const OnednnInt8* pack(const std::string& name) {
    auto it = weights_.find(name);
    if (it == weights_.end()) return nullptr;
    const Pack* p = std::get_if<Pack>(&it->second);
    TORCH_CHECK_VALUE(p != nullptr && *p != nullptr, where_, ": \"", name, "\" must be a oneDNN packing "
                      "(fastformer._C.OnednnInt8, from int8_prepare)");
    bound_.insert(name);
    return p->get();
  }
  bool has(const std::string& name) const { return weights_.count(name) > 0; }
  // A linear layer in -> out: float32 packed panels ("<name>.panels") or the int8 weight ("<name>.weight",
  // "<name>.weight_scale", "<name>.weight_colsum"; told apart by the scale); a bias by the name `bias` ("": none).
  PackedProjection linear(const std::string& name, int64_t in, int64_t out, const std::string& bias) {
    const c10::optional<Tensor> b = bias.empty() ? c10::nullopt : c10::optional<Tensor>(find(bias));
    if (has(name + ".weight_scale")) {
      const Tensor& weight = find(name + ".weight");
      PackedProjection w = int8_projection(weight, find(name + ".weight_scale"), find(name + ".weight_colsum"), b,
                                           in, out, where_, name, bias, pack(name + ".onednn"));
      if (w.int8.onednn == nullptr && in > 0 && out > 0 && int8_needs_pack(int8_variant_)) {
        made_.push_back(onednn_int8_pack(weight, out, in));
        w.int8.onednn = made_.back().get();
      }
      return w;
    }
    return packed_projection(find(name + ".panels"), b, in, out, where_, name, bias);
  }
  PackedProjection linear(const std::string& name, int64_t in, int64_t out) {
    return linear(name, in, out, name + ".bias");
  }
  std::pair<const float*, const float*> norm(const std::string& name, int64_t d) {
    const Tensor& weight = find(name + ".weight");
    const Tensor& bias = find(name + ".bias");
    check_tensor(weight, at::kFloat, {d}, where_, name + ".weight");
    check_tensor(bias, at::kFloat, {d}, where_, name + ".bias");
    return {weight.const_data_ptr<float>(), bias.const_data_ptr<float>()};
  }
  void done() const {
    for (const auto& [name, tensor] : weights_) {
      TORCH_CHECK_VALUE(bound_.count(name), where_, " holds \"", name, "\", which the decoder layer's description "
                        "does not use (csrc/inference/decoder.cpp binds the weights by the description's names)");
    }
  }

 private:
  const Named& weights_;
  std::string where_;
  int int8_variant_;
  std::vector<Pack>& made_;
  std::set<std::string> bound_;
};

// One sublayer of the description: its kind, its LayerNorm and its weights by role.
struct SublayerSpec {
  SublayerKind kind;
  std::string norm;
  std::map<std::string, std::string> weights;
};

SublayerSpec parse_sublayer(const std::tuple<std::string, std::string, std::map<std::string, std::string>>& given) {
  const auto& [kind, norm, weights] = given;
  static const std::map<std::string, std::pair<SublayerKind, std::set<std::string>>> kinds = {
      {"self_attention", {SublayerKind::kSelfAttention, {"qkv", "out"}}},
      {"cross_attention", {SublayerKind::kCrossAttention, {"q", "out"}}},
      {"feed_forward", {SublayerKind::kFeedForward, {"fc1", "fc2"}}},
  };
  const auto it = kinds.find(kind);
  TORCH_CHECK_VALUE(it != kinds.end(), kWho, ": the step has no sublayer kind \"", kind,
                    "\" (self_attention, cross_attention, feed_forward)");
  std::set<std::string> roles;
  for (const auto& [role, name] : weights) roles.insert(role);
  TORCH_CHECK_VALUE(roles == it->second.second, kWho, ": a ", kind, " sublayer takes the weights ",
                    c10::Join(", ", std::vector<std::string>(it->second.second.begin(), it->second.second.end())),
                    ", got ", c10::Join(", ", std::vector<std::string>(roles.begin(), roles.end())));
  return {it->second.first, norm, weights};
}

Activation parse_activation(const std::string& name) {
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "silu") return Activation::kSilu;
  TORCH_CHECK_VALUE(false, kWho, ": the decoder step implements the activations relu, gelu and silu, not \"", name,
                    "\"");
}

// A layer's sublayers bound to its weights by the description's names (d = d_model, f = d_ff).
DecoderLayerStep bind_layer(const Named& weights, const std::vector<SublayerSpec>& description, int64_t index,
                            int64_t d, int64_t f, int int8_variant, std::vector<Pack>& made) {
  Binder w(weights, "decoder layer " + std::to_string(index), int8_variant, made);
  DecoderLayerStep layer{};
  for (const SublayerSpec& spec : description) {
    SublayerStep sub{};
    sub.kind = spec.kind;
    std::tie(sub.norm_weight, sub.norm_bias) = w.norm(spec.norm, d);
    switch (spec.kind) {
      case SublayerKind::kSelfAttention:
        sub.in = w.linear(spec.weights.at("qkv"), d, 3 * d);
        sub.out = w.linear(spec.weights.at("out"), d, d);
        break;
      case SublayerKind::kCrossAttention:
        sub.in = w.linear(spec.weights.at("q"), d, d);
        sub.out = w.linear(spec.weights.at("out"), d, d);
        break;
      case SublayerKind::kFeedForward:
        sub.in = w.linear(spec.weights.at("fc1"), d, f);
        sub.out = w.linear(spec.weights.at("fc2"), f, d);
        break;
    }
    layer.sublayers.push_back(sub);
  }
  w.done();
  return layer;
}

class CpuDecoder {
 public:
  explicit CpuDecoder(const py::dict& description) {
    Fields f(description);
    const auto given = f.take<std::vector<std::tuple<std::string, std::string, std::map<std::string, std::string>>>>(
        "sublayers");
    std::vector<SublayerSpec> sublayers;
    int self_attentions = 0, cross_attentions = 0;
    for (const auto& s : given) {
      sublayers.push_back(parse_sublayer(s));
      self_attentions += sublayers.back().kind == SublayerKind::kSelfAttention;
      cross_attentions += sublayers.back().kind == SublayerKind::kCrossAttention;
    }
    TORCH_CHECK_VALUE(!sublayers.empty() && self_attentions <= 1 && cross_attentions <= 1, kWho,
                      ": a decoder layer has at least one sublayer and at most one self-attention and one "
                      "cross-attention (one cache and one encoder memory a layer)");
    step_.activation = parse_activation(f.take<std::string>("activation"));
    const bool norm_first = f.take<bool>("norm_first");
    const double eps = f.take<double>("eps");
    const int64_t heads = f.take<int64_t>("heads"), d_ff = f.take<int64_t>("d_ff");
    layers_ = f.take<std::vector<Named>>("layers");
    final_norm_ = f.take<Named>("final_norm");
    embed_ = f.take<Named>("embed");
    const double embed_scale = f.take<double>("embed_scale");
    positions_ = f.take<Tensor>("positions");
    const auto cross = f.take<std::vector<std::pair<Tensor, Tensor>>>("cross");
    const c10::optional<Tensor> src_padding = f.optional<Tensor>("src_padding");
    const int64_t beams = f.take<int64_t>("beams"), steps = f.take<int64_t>("steps");
    f.done();

    TORCH_CHECK_VALUE(beams >= 1 && heads >= 1 && d_ff >= 1 && steps >= 1, kWho,
                      ": beams, heads, d_ff and steps must be >= 1");
    // (V, d) from the embedding's float32 table, or in a quantized model from its int8 weight's scales (V,)
    // and the positions (d)
    // The int8 variant, from FASTFORMER_INT8_PROVIDER (else -1: the rule, per step by its rows).
    step_.int8_variant = int8_variant_index("", kWho);
    Binder embedding(embed_, "the target embedding", step_.int8_variant, packs_);
    const bool int8 = embedding.has("embed.weight_scale");
    const Tensor& table = embedding.find("embed.weight");
    int64_t V = -1, d = -1;
    if (int8) {
      const Tensor& scale = embedding.find("embed.weight_scale");
      TORCH_CHECK_VALUE(scale.dim() == 1 && positions_.dim() == 2, kWho,
                        ": embed.weight_scale must be (V,) and positions (steps, d)");
      V = scale.size(0);
      d = positions_.size(1);
    } else {
      TORCH_CHECK_VALUE(table.dim() == 2, kWho, ": embed.weight must be (V, d)");
      V = table.size(0);
      d = table.size(1);
    }
    TORCH_CHECK_VALUE(d % heads == 0, kWho, ": d_model ", d, " is not divisible by ", heads, " heads");
    TORCH_CHECK_VALUE(!layers_.empty(), kWho, ": no decoder layers");
    const int64_t L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK_VALUE(static_cast<int64_t>(cross.size()) == L, kWho, ": cross must hold a (k, v) pair per layer");
    TORCH_CHECK_VALUE(norm_first || final_norm_.empty(), kWho, ": a post-norm decoder has no final LayerNorm");
    if (!int8) check_tensor(table, at::kFloat, {V, d}, kWho, "embed.weight");
    TORCH_CHECK_VALUE(positions_.dim() == 2 && positions_.size(0) >= steps, kWho, ": positions must hold >= ", steps,
                      " rows");
    check_tensor(positions_, at::kFloat, {positions_.size(0), d}, kWho, "positions");
    const int64_t B = cross[0].first.dim() == 4 ? cross[0].first.size(0) : -1;
    const int64_t S = cross[0].first.dim() == 4 ? cross[0].first.size(2) : -1;
    for (int64_t l = 0; l < L; ++l) {
      check_tensor(cross[l].first, at::kFloat, {B, heads, S, d / heads}, kWho, "layer " + std::to_string(l) + " cross k");
      check_tensor(cross[l].second, at::kFloat, {B, heads, S, d / heads}, kWho, "layer " + std::to_string(l) + " cross v");
      cross_.push_back(cross[l].first);
      cross_.push_back(cross[l].second);
    }
    std::pair<const float*, const float*> final{nullptr, nullptr};
    if (norm_first) {
      Binder w(final_norm_, "the final LayerNorm", step_.int8_variant, packs_);
      final = w.norm("final_norm", d);
      w.done();
    }
    if (src_padding.has_value()) {
      TORCH_CHECK_VALUE(src_padding->scalar_type() == at::kBool && src_padding->device().is_cpu() &&
                            src_padding->sizes().vec() == std::vector<int64_t>({B, S}),
                        kWho, ": src_padding must be a bool CPU tensor (", B, ", ", S, ")");
      src_padding_ = src_padding->contiguous();
    }
    step_.rows = B * beams;
    step_.beams = beams;
    step_.heads = heads;
    step_.head_dim = d / heads;
    step_.d_model = d;
    step_.d_ff = d_ff;
    step_.vocab = V;
    step_.src_len = S;
    step_.position = 0;
    step_.cache_len = steps;
    step_.norm_first = norm_first;
    step_.eps = static_cast<float>(eps);
    step_.embed_scale = static_cast<float>(embed_scale);
    step_.embed = int8 ? nullptr : table.const_data_ptr<float>();
    step_.final_norm_weight = final.first;
    step_.final_norm_bias = final.second;
    step_.output = embedding.linear("embed", d, V, embedding.has("output_bias") ? "output_bias" : "");
    embedding.done();
    step_.layers.resize(L);
    for (int64_t l = 0; l < L; ++l) {
      step_.layers[l] = bind_layer(layers_[l], sublayers, l, d, d_ff, step_.int8_variant, packs_);
      DecoderLayerStep& layer = step_.layers[l];
      // Two cache buffers a layer: keys and values.
      for (int i = 0; i < 2; ++i) caches_.push_back(at::empty({B * beams, heads, steps, d / heads}, positions_.options()));
      layer.k_cache = caches_[2 * l].mutable_data_ptr<float>();
      layer.v_cache = caches_[2 * l + 1].mutable_data_ptr<float>();
    }
    slots_.assign(B * beams * steps, 0);
    point_at_cross();
  }

  // The next-token logits (N, V) of the live rows, whose token at this position is last_tokens (N,).
  Tensor logits(const Tensor& last_tokens) {
    TORCH_CHECK_VALUE(last_tokens.dim() == 1 && last_tokens.size(0) == step_.rows &&
                          last_tokens.scalar_type() == at::kLong && last_tokens.device().is_cpu(),
                      kWho, ": last_tokens must be an int64 CPU tensor of shape (", step_.rows, ")");
    TORCH_CHECK_VALUE(step_.position < step_.cache_len, kWho, ": all ", step_.cache_len,
                      " positions have been decoded");
    const Tensor tokens = last_tokens.contiguous();
    const int64_t* ids = tokens.const_data_ptr<int64_t>();
    for (int64_t r = 0; r < step_.rows; ++r) {
      TORCH_CHECK_VALUE(ids[r] >= 0 && ids[r] < step_.vocab, kWho, ": token ", ids[r],
                        " is outside [0, ", step_.vocab, ")");
    }
    const Tensor logits = logits_view();
    step_.tokens = ids;
    step_.slots = slots_.data();
    step_.position_row = positions_.const_data_ptr<float>() + step_.position * step_.d_model;
    step_.logits = logits.mutable_data_ptr<float>();
    step_.logits_stride = logits.stride(0);
    cpu_kernels().inference.decoder_step(step_);
    step_.position += 1;
    return logits;
  }

  // The next step's rows continue rows `parents` (N',) of this step; `sentences` (n',): the indices, among
  // this step's live sentences, of those still decoding (none: all of them).
  void select(const Tensor& parents, const c10::optional<Tensor>& sentences) {
    TORCH_CHECK_VALUE(parents.dim() == 1 && parents.scalar_type() == at::kLong && parents.device().is_cpu(),
                      kWho, ": parents must be a 1-D int64 CPU tensor");
    const int64_t N = step_.rows, next = parents.size(0);
    const Tensor p = parents.contiguous();
    const int64_t* from = p.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < next; ++i) {
      TORCH_CHECK_VALUE(from[i] >= 0 && from[i] < N, kWho, ": parent ", from[i], " is not a row of ",
                        N);
    }
    if (sentences.has_value()) {
      const int64_t n = sentences->size(0);
      TORCH_CHECK_VALUE(sentences->dim() == 1 && n * step_.beams == next,
                        kWho, ": ", next, " parents for ", n, " sentences of ", step_.beams, " beams");
      for (Tensor& t : cross_) t = t.index_select(0, *sentences).contiguous();
      if (src_padding_.has_value()) src_padding_ = src_padding_->index_select(0, *sentences).contiguous();
      point_at_cross();
    } else {
      TORCH_CHECK_VALUE(next == N, kWho, ": ", next, " parents for ", N,
                        " rows with no sentence leaving");
    }
    // Row i continues row from[i]: its slots are from[i]'s for positions < t - 1, and from[i] at t - 1 (the
    // step just decoded, position t - 1, wrote cache row from[i]).
    const int64_t t = step_.position, T = step_.cache_len;
    std::vector<int64_t> slots(next * T);
    for (int64_t i = 0; i < next; ++i) {
      std::copy_n(slots_.data() + from[i] * T, t, slots.data() + i * T);
      if (t > 0) slots[i * T + t - 1] = from[i];
    }
    slots_ = std::move(slots);
    step_.rows = next;
  }

 private:
  void point_at_cross() {
    for (size_t l = 0; l < step_.layers.size(); ++l) {
      step_.layers[l].cross_k = cross_[2 * l].const_data_ptr<float>();
      step_.layers[l].cross_v = cross_[2 * l + 1].const_data_ptr<float>();
    }
    step_.src_padding = src_padding_.has_value() ? src_padding_->const_data_ptr<bool>() : nullptr;
  }

  // The logits of this step: (N, V), each row padded to whole 64-byte lines (its stride a multiple of 16
  // floats), so that the output projection's 16-column stores and the search's vector loads never straddle two
  // lines (with rows V = 58,101 floats apart most did, and the projection was slower: docs/cpu-kernels.md,
  // "Measured"). One buffer,
  // taken again at each step unless the last step's logits are still held (by Python): fresh pages each step
  // (at::empty of 30 MB at batch 32, beam 4) cost page faults unless malloc keeps freed memory.
  Tensor logits_view() {
    const int64_t stride = (step_.vocab + 15) / 16 * 16;
    if (!logits_buffer_.defined() || logits_buffer_.storage().use_count() > 1 || logits_buffer_.size(0) < step_.rows) {
      logits_buffer_ = at::empty({step_.rows, stride}, positions_.options());
    }
    return logits_buffer_.narrow(0, 0, step_.rows).narrow(1, 0, step_.vocab);
  }

  std::vector<Named> layers_;  // kept alive: the step holds pointers into them (their packs too)
  std::vector<Pack> packs_;    // the oneDNN packings made here, of int8 weights handed over without one
  std::vector<Tensor> cross_;  // per layer k, v
  c10::optional<Tensor> src_padding_;
  Tensor positions_;
  Named final_norm_;
  Named embed_;
  std::vector<Tensor> caches_;  // per layer: keys, values (N0, H, T, Dh)
  std::vector<int64_t> slots_;  // (N, T): the cache row of each live row's earlier positions
  DecoderStep step_{};
  Tensor logits_buffer_;  // (N0 or more, V rounded up to 16)
};

}  // namespace


void bind_decoder(pybind11::module_& m) {
  py::class_<CpuDecoder>(m, "CpuDecoder",
                         "The incremental decoder's state and step for float32 (int8 projections in a quantized "
                         "model) on the CPU (csrc/inference/decoder.cpp); built by "
                         "fastformer.nn.decoding.IncrementalDecoder from one dict (the fields: the file's header)")
      .def(py::init<const py::dict&>(), py::arg("description"))
      .def("logits", &CpuDecoder::logits, py::arg("last_tokens"),
           "next-token logits (N, V) of the live rows, given each row's token at this position (N,)")
      .def("select", &CpuDecoder::select, py::arg("parents"), py::arg("sentences"),
           "the next step's rows continue rows `parents` of this one; `sentences`: the live sentences kept (None: all)");
}

}  // namespace fastformer
