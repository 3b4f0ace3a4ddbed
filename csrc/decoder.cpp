// fastformer._C.CpuDecoder: the incremental decoder of fastformer/nn/decoding.py as one C++ object, for
// float32 on the CPU. It owns what lives across the steps of a beam search (the prepared weights, the
// cross-attention keys/values of each sentence, the self-attention caches) and runs a step as one call of
// the loaded level's decoder_step kernel (csrc/cpu/decoder_step.cpp).
//
// Self-attention caches: per layer one buffer for keys and one for values, each (N0, H, T, Dh) with N0 the
// first step's rows and T the positions decoded. Cache row c holds at position j what live row c computed
// at step j, written once and never moved; a table of slots (N, T) says, for each live row r and earlier
// position j, which cache row holds it. Between steps the live rows continue `parents` of the last step:
// row i's slots become those of row parents[i] (t integers), plus i at position t. A beam reorder, repeated
// parents and sentences leaving the batch included, moves no cached key or value (a copy of the t
// positions of every row and layer would: 12 MB a step at batch 32, beam 4 of the small model).
//
// The weights cross from Python by name (fastformer/nn/layers.py DECODER_LAYER, the one description of the
// decoder layer; fastformer/nn/decoding.py builds the dicts): per layer a dict holding each linear layer's
// "<name>.panels" (packed_linear's layout), or in a quantized model its int8 form (Binder::linear), and
// "<name>.bias", and each LayerNorm's "<name>.weight" and
// "<name>.bias". Each is looked up by its name and checked against the shape its role gives it, and a
// name not bound here is refused: a swapped self_out/cross_q/cross_out (all d x d) cannot get in by
// position, and a weight added to the description cannot be silently left out of the C++ step.
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/kernel_table.h"
#include "cpu_levels.h"

namespace fastformer {
namespace {

using Named = std::map<std::string, Tensor>;

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kChar: return "int8";
    case at::kInt: return "int32";
    default: return c10::toString(t);
  }
}

void check_tensor(const Tensor& t, at::ScalarType dtype, std::vector<int64_t> shape, const std::string& name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.sizes().vec() == shape,
                    "fastformer CpuDecoder: ", name, " must be a contiguous ", dtype_name(dtype),
                    " CPU tensor of shape ", c10::IntArrayRef(shape), ", got ", t.scalar_type(), " ", t.sizes(),
                    " on ", t.device(), t.is_contiguous() ? "" : " (not contiguous)");
}

void check_float(const Tensor& t, std::vector<int64_t> shape, const std::string& name) {
  check_tensor(t, at::kFloat, std::move(shape), name);
}

// Looks weights up by name in one dict, checks each, and at the end that every name was bound.
class Binder {
 public:
  Binder(const Named& weights, std::string where) : weights_(weights), where_(std::move(where)) {}

  template <typename T = float>
  const T* take(const std::string& name, std::vector<int64_t> shape) {
    auto it = weights_.find(name);
    TORCH_CHECK_VALUE(it != weights_.end(), "fastformer CpuDecoder: ", where_, " has no weight \"", name, "\"");
    check_tensor(it->second, c10::CppTypeToScalarType<T>::value, std::move(shape), where_ + " " + name);
    bound_.insert(name);
    return it->second.const_data_ptr<T>();
  }
  // A linear layer d_in -> d_out: float32 packed panels ("<name>.panels") or, in a quantized model, the
  // int8 weight ("<name>.int8_panels", "<name>.int8_scale", "<name>.int8_colsum"; csrc/cpu/int8_linear.cpp);
  // and a bias ("<name>.bias") unless bias is false.
  PackedProjection linear(const std::string& name, int64_t in, int64_t out, bool bias = true) {
    constexpr int64_t P = kPackedLinearPanel;
    PackedProjection w{};
    if (weights_.count(name + ".int8_panels")) {
      TORCH_CHECK_VALUE(in <= 65536, "fastformer CpuDecoder: ", where_, " ", name, ": int8 projections take at "
                        "most 65,536 inputs (the int32 accumulator's range), got ", in);
      w.int8.panels = take<int8_t>(name + ".int8_panels", {(out + P - 1) / P, (in + 3) / 4, P, 4});
      w.int8.scale = take(name + ".int8_scale", {out});
      w.int8.colsum = take<int32_t>(name + ".int8_colsum", {out});
    } else {
      w.panels = take(name + ".panels", {(out + P - 1) / P, in, P});
    }
    if (bias) w.bias = take(name + ".bias", {out});
    return w;
  }
  std::pair<const float*, const float*> norm(const std::string& name, int64_t d) {
    const float* weight = take(name + ".weight", {d});
    return {weight, take(name + ".bias", {d})};
  }
  void done() const {
    for (const auto& [name, tensor] : weights_) {
      TORCH_CHECK_VALUE(bound_.count(name), "fastformer CpuDecoder: ", where_, " holds \"", name,
                        "\", which the C++ decoder step does not use (csrc/decoder.cpp binds the decoder layer's "
                        "weights by name)");
    }
  }

 private:
  const Named& weights_;
  std::string where_;
  std::set<std::string> bound_;
};

// The decoder layer of fastformer/nn/layers.py DECODER_LAYER as the step uses it (d = d_model, f = d_ff);
// the cross-attention's k|v projection is applied by the caller, once per sentence.
DecoderLayerStep bind_layer(const Named& weights, int64_t index, int64_t d, int64_t f) {
  Binder w(weights, "decoder layer " + std::to_string(index));
  DecoderLayerStep layer{};
  const std::pair<const float*, const float*> norms[3] = {w.norm("self_attn_norm", d), w.norm("cross_attn_norm", d),
                                                          w.norm("ffn_norm", d)};
  for (int i = 0; i < 3; ++i) std::tie(layer.norm_weight[i], layer.norm_bias[i]) = norms[i];
  layer.qkv = w.linear("self_attn.qkv_proj", d, 3 * d);
  layer.self_out = w.linear("self_attn.out_proj", d, d);
  layer.cross_q = w.linear("cross_attn.q_proj", d, d);
  layer.cross_out = w.linear("cross_attn.out_proj", d, d);
  layer.fc1 = w.linear("ffn.fc1", d, f);
  layer.fc2 = w.linear("ffn.fc2", f, d);
  w.done();
  return layer;
}

class CpuDecoder {
 public:
  // layers: per layer its weights by name (above); cross: per layer (k, v), each (B, H, S, Dh);
  // src_padding (B, S) bool or none; embed (V, d); positions (>= steps, d); final_norm {"final_norm.weight",
  // "final_norm.bias"}
  // for pre-norm, empty for post-norm; output: the output projection (the embedding) by name, {"output.panels"}
  // or its int8 form {"output.int8_panels", "output.int8_scale", "output.int8_colsum"}; activation: the
  // feed-forward's.
  CpuDecoder(std::vector<Named> layers, std::vector<Tensor> cross, c10::optional<Tensor> src_padding,
             Tensor embed, Tensor positions, Named final_norm, Named output, int64_t beams, int64_t heads,
             int64_t d_ff, bool norm_first, double eps, int64_t steps, const std::string& activation)
      : layers_(std::move(layers)), cross_(std::move(cross)), embed_(std::move(embed)),
        positions_(std::move(positions)), final_norm_(std::move(final_norm)), output_(std::move(output)) {
    TORCH_CHECK_VALUE(beams >= 1 && heads >= 1 && d_ff >= 1 && steps >= 1,
                      "fastformer CpuDecoder: beams, heads, d_ff and steps must be >= 1");
    TORCH_CHECK_VALUE(embed_.dim() == 2, "fastformer CpuDecoder: embed must be (V, d)");
    const int64_t V = embed_.size(0), d = embed_.size(1);
    TORCH_CHECK_VALUE(d % heads == 0, "fastformer CpuDecoder: d_model ", d, " is not divisible by ", heads, " heads");
    TORCH_CHECK_VALUE(activation == "relu", "fastformer CpuDecoder: the decoder step implements the relu "
                      "activation, not \"", activation, "\"");
    TORCH_CHECK_VALUE(!layers_.empty(), "fastformer CpuDecoder: no decoder layers");
    const int64_t L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK_VALUE(static_cast<int64_t>(cross_.size()) == 2 * L,
                      "fastformer CpuDecoder: cross must hold a (k, v) pair per layer");
    TORCH_CHECK_VALUE(norm_first || final_norm_.empty(),
                      "fastformer CpuDecoder: a post-norm decoder has no final LayerNorm");
    check_float(embed_, {V, d}, "embed");
    TORCH_CHECK_VALUE(positions_.dim() == 2 && positions_.size(0) >= steps,
                      "fastformer CpuDecoder: positions must hold >= ", steps, " rows");
    check_float(positions_, {positions_.size(0), d}, "positions");
    const int64_t B = cross_[0].dim() == 4 ? cross_[0].size(0) : -1, S = cross_[0].dim() == 4 ? cross_[0].size(2) : -1;
    for (int64_t l = 0; l < L; ++l) {
      for (int i = 0; i < 2; ++i) {
        check_float(cross_[2 * l + i], {B, heads, S, d / heads}, "layer " + std::to_string(l) + " cross k/v");
      }
    }
    std::pair<const float*, const float*> final{nullptr, nullptr};
    if (norm_first) {
      Binder w(final_norm_, "the final LayerNorm");
      final = w.norm("final_norm", d);
      w.done();
    }
    if (src_padding.has_value()) {
      TORCH_CHECK_VALUE(src_padding->scalar_type() == at::kBool && src_padding->device().is_cpu() &&
                            src_padding->sizes().vec() == std::vector<int64_t>({B, S}),
                        "fastformer CpuDecoder: src_padding must be a bool CPU tensor (", B, ", ", S, ")");
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
    step_.embed_scale = static_cast<float>(std::sqrt(static_cast<double>(d)));
    step_.embed = embed_.const_data_ptr<float>();
    step_.final_norm_weight = final.first;
    step_.final_norm_bias = final.second;
    {
      Binder w(output_, "the output projection");
      step_.output = w.linear("output", d, V, /*bias=*/false);
      w.done();
    }
    step_.int8_variant = 0;
    step_.layers.resize(L);
    for (int64_t l = 0; l < L; ++l) {
      step_.layers[l] = bind_layer(layers_[l], l, d, d_ff);
      DecoderLayerStep& layer = step_.layers[l];
      // Two cache buffers a layer: keys and values.
      for (int i = 0; i < 2; ++i) caches_.push_back(at::empty({B * beams, heads, steps, d / heads}, embed_.options()));
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
                      "fastformer CpuDecoder: last_tokens must be an int64 CPU tensor of shape (", step_.rows, ")");
    TORCH_CHECK_VALUE(step_.position < step_.cache_len, "fastformer CpuDecoder: all ", step_.cache_len,
                      " positions have been decoded");
    const Tensor tokens = last_tokens.contiguous();
    const int64_t* ids = tokens.const_data_ptr<int64_t>();
    for (int64_t r = 0; r < step_.rows; ++r) {
      TORCH_CHECK_VALUE(ids[r] >= 0 && ids[r] < step_.vocab, "fastformer CpuDecoder: token ", ids[r],
                        " is outside [0, ", step_.vocab, ")");
    }
    Tensor logits = at::empty({step_.rows, step_.vocab}, embed_.options());
    step_.tokens = ids;
    step_.slots = slots_.data();
    step_.position_row = positions_.const_data_ptr<float>() + step_.position * step_.d_model;
    step_.logits = logits.mutable_data_ptr<float>();
    cpu_kernels().decoder_step(step_);
    step_.position += 1;
    return logits;
  }

  // The next step's rows continue rows `parents` (N',) of this step; `sentences` (n',): the indices, among
  // this step's live sentences, of those still decoding (none: all of them).
  void select(const Tensor& parents, const c10::optional<Tensor>& sentences) {
    TORCH_CHECK_VALUE(parents.dim() == 1 && parents.scalar_type() == at::kLong && parents.device().is_cpu(),
                      "fastformer CpuDecoder: parents must be a 1-D int64 CPU tensor");
    const int64_t N = step_.rows, next = parents.size(0);
    const Tensor p = parents.contiguous();
    const int64_t* from = p.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < next; ++i) {
      TORCH_CHECK_VALUE(from[i] >= 0 && from[i] < N, "fastformer CpuDecoder: parent ", from[i], " is not a row of ",
                        N);
    }
    if (sentences.has_value()) {
      const int64_t n = sentences->size(0);
      TORCH_CHECK_VALUE(sentences->dim() == 1 && n * step_.beams == next,
                        "fastformer CpuDecoder: ", next, " parents for ", n, " sentences of ", step_.beams, " beams");
      for (Tensor& t : cross_) t = t.index_select(0, *sentences).contiguous();
      if (src_padding_.has_value()) src_padding_ = src_padding_->index_select(0, *sentences).contiguous();
      point_at_cross();
    } else {
      TORCH_CHECK_VALUE(next == N, "fastformer CpuDecoder: ", next, " parents for ", N,
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

  std::vector<Named> layers_;  // kept alive: the step holds pointers into them
  std::vector<Tensor> cross_;
  c10::optional<Tensor> src_padding_;
  Tensor embed_, positions_;
  Named final_norm_;
  Named output_;
  std::vector<Tensor> caches_;  // per layer: keys, values (N0, H, T, Dh)
  std::vector<int64_t> slots_;  // (N, T): the cache row of each live row's earlier positions
  DecoderStep step_{};
};

}  // namespace

void bind_decoder(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<CpuDecoder>(m, "CpuDecoder",
                         "The incremental decoder's state and step for float32 (int8 projections in a quantized model) on the CPU (csrc/decoder.cpp); "
                         "built by fastformer.nn.decoding.IncrementalDecoder")
      .def(py::init<std::vector<Named>, std::vector<Tensor>, c10::optional<Tensor>, Tensor, Tensor, Named, Named,
                    int64_t, int64_t, int64_t, bool, double, int64_t, const std::string&>(),
           py::arg("layers"), py::arg("cross"), py::arg("src_padding"), py::arg("embed"), py::arg("positions"),
           py::arg("final_norm"), py::arg("output"), py::arg("beams"), py::arg("heads"), py::arg("d_ff"),
           py::arg("norm_first"), py::arg("eps"), py::arg("steps"), py::arg("activation"))
      .def("logits", &CpuDecoder::logits, py::arg("last_tokens"),
           "next-token logits (N, V) of the live rows, given each row's token at this position (N,)")
      .def("select", &CpuDecoder::select, py::arg("parents"), py::arg("sentences"),
           "the next step's rows continue rows `parents` of this one; `sentences`: the live sentences kept (None: all)");
}

}  // namespace fastformer
