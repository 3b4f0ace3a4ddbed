// fastformer._C: the operator library (schemas of csrc/ops.h, registered with the dispatcher) and the
// pybind11 module. Kernels register for their dispatch keys in their own files: csrc/cpu_levels.cpp (CPU:
// the kernels of csrc/cpu/<op>.cpp, of the instruction-set level chosen at import), csrc/cuda/<op>.cu
// (CUDA), csrc/autograd/<op>.cpp (Autograd); the *_py ops get their implementations and every op its fake
// kernel from Python (fastformer/ops/<op>.py).
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/python.h>  // pybind11, tensor casters (torch/extension.h adds the C++ frontend: 16 s to compile)
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define FASTFORMER_GEMM_CHECKS
#include "attention_grads.h"
#include "cpu/kernel_table.h"
#include "cpu_levels.h"
#include "gemm/gemm.h"
#include "gemm/int8_onednn.h"
#include "ops.h"
#include "optim/optim.h"
#include "triton/plans.h"

#ifndef FASTFORMER_TORCH_VERSION
#define FASTFORMER_TORCH_VERSION "unknown"
#endif

// needs_fixed_stride_order: compiled code (inductor) hands each op its inputs with the strides the fake
// kernels saw when tracing. The CPU attention kernel writes its outputs in its own layout (csrc/cpu/attention.cpp
// rows_like), and the fake kernels state the same rule.
TORCH_LIBRARY(fastformer, m) {
  const std::vector<at::Tag> tags = {at::Tag::needs_fixed_stride_order};
#define FASTFORMER_DEFINE(op, fwd_args, fwd_returns, bwd_args, bwd_returns)                    \
  m.def(#op "_fwd(" fwd_args ") -> " fwd_returns, tags);                                      \
  m.def(#op "_bwd(" bwd_args ") -> " bwd_returns, tags);                                      \
  m.def(#op "_fwd_py(" fwd_args ", str backend) -> " fwd_returns, tags);                      \
  m.def(#op "_bwd_py(" bwd_args ", str backend) -> " bwd_returns, tags);
  FASTFORMER_OPS(FASTFORMER_DEFINE)
#undef FASTFORMER_DEFINE
  // Not an op of the list: a weight's gradient in bf16 training on the CPU (csrc/gemm/weight_grad.cpp), an op so
  // that the profiler and dispatch modes see the GEMM (fastformer/training/copies.py counts it).
  m.def("weight_grad(Tensor dy, Tensor x) -> (Tensor, Tensor)");
}

namespace {

std::vector<std::string> op_names() {
  std::vector<std::string> names;
#define FASTFORMER_NAME(op, ...) names.emplace_back(#op);
  FASTFORMER_OPS(FASTFORMER_NAME)
#undef FASTFORMER_NAME
  return names;
}

// ---- eager entries: fastformer._C.EAGER_FWD[op], the forward op called from Python without the JIT ----
// Python's usual way into a registered op (OpOverload._op) matches the arguments against the schema,
// builds an IValue stack and calls the op boxed (and the autograd kernel unboxes it again): on tiny
// tensors that costs more than the kernel. An eager entry converts the arguments itself and makes the
// dispatcher's typed (unboxed) call of fastformer::<op>_fwd, so every dispatch key (Autograd, autocast,
// CPU, CUDA, Python modes such as FakeTensorMode) still applies. Whatever it does not convert itself (a
// tensor subclass, an active __torch_function__ mode, a number of another Python type, a wrong type,
// keyword arguments) goes to OpOverload._op unchanged, so behaviour and errors stay those of the op.
// fastformer/_dispatch.py uses these entries for the cpu and cuda backends in eager mode; torch.compile
// traces the OpOverload.

// One argument from Python, or false when the call must take the OpOverload.
inline bool from_py(PyObject* o, at::Tensor& out) {
  if (!THPVariable_CheckExact(o)) return false;  // a subclass may define __torch_function__
  out = THPVariable_Unpack(o);
  return true;
}
inline bool from_py(PyObject* o, std::optional<at::Tensor>& out) {
  if (o == Py_None) {
    out = std::nullopt;
    return true;
  }
  at::Tensor t;
  if (!from_py(o, t)) return false;
  out = std::move(t);
  return true;
}
inline bool from_py(PyObject* o, double& out) {
  if (PyFloat_CheckExact(o)) {
    out = PyFloat_AS_DOUBLE(o);
    return true;
  }
  if (PyLong_CheckExact(o)) {  // not bool (a subclass of int): the op's own rules decide about it
    out = PyLong_AsDouble(o);
    if (out == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return true;
  }
  return false;
}
inline bool from_py(PyObject* o, std::optional<double>& out) {
  if (o == Py_None) {
    out = std::nullopt;
    return true;
  }
  double d;
  if (!from_py(o, d)) return false;
  out = d;
  return true;
}
inline bool from_py(PyObject* o, bool& out) {
  if (!PyBool_Check(o)) return false;
  out = o == Py_True;
  return true;
}
inline bool from_py(PyObject* o, int64_t& out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (out == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// A str argument (bias_activation's activation): a view of the Python string's UTF-8 buffer, alive for the call.
inline bool from_py(PyObject* o, c10::string_view& out) {
  if (!PyUnicode_CheckExact(o)) return false;
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(o, &size);
  if (data == nullptr) {
    PyErr_Clear();
    return false;
  }
  out = c10::string_view(data, static_cast<size_t>(size));
  return true;
}

inline bool from_py(PyObject* o, std::optional<at::ScalarType>& out) {
  if (o == Py_None) {
    out = std::nullopt;
    return true;
  }
  if (!THPDtype_Check(o)) return false;
  out = reinterpret_cast<THPDtype*>(o)->scalar_type;
  return true;
}

inline PyObject* to_py(at::Tensor t) { return THPVariable_Wrap(std::move(t)); }
template <typename... T>
PyObject* to_py(std::tuple<T...> values) {
  PyObject* tuple = PyTuple_New(sizeof...(T));
  if (tuple == nullptr) return nullptr;
  bool ok = true;
  std::apply([&](auto&... v) {
    Py_ssize_t i = 0;
    ((ok = ok && [&] {
        PyObject* item = to_py(std::move(v));
        if (item == nullptr) return false;
        PyTuple_SET_ITEM(tuple, i++, item);
        return true;
      }()),
     ...);
  }, values);
  if (!ok) {
    Py_DECREF(tuple);
    return nullptr;
  }
  return tuple;
}

template <typename Signature>
struct Eager;

template <typename R, typename... A>
struct Eager<R(A...)> {
  using Handle = c10::TypedOperatorHandle<R(A...)>;

  // The entry of op `name` ("fastformer::<op>_fwd") as a Python function taking the schema's arguments
  // positionally.
  static py::object make(const std::string& name) {
    auto* state = new State{c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<R(A...)>(),
                            name, nullptr};  // lives as long as the process, as the op does
    static PyMethodDef def{"eager_fwd", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&call)),
                           METH_FASTCALL | METH_KEYWORDS,
                           "the forward op of a fastformer op, called through the dispatcher without the JIT"};
    PyObject* self = PyCapsule_New(state, "fastformer.eager", nullptr);
    if (self == nullptr) throw py::error_already_set();
    PyObject* fn = PyCFunction_NewEx(&def, self, nullptr);
    Py_DECREF(self);
    if (fn == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(fn);
  }

 private:
  struct State {
    Handle op;
    std::string name;
    PyObject* overload;  // torch.ops.fastformer.<op>_fwd.default._op, looked up on first need
  };

  static PyObject* fallback(State* state, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    if (state->overload == nullptr) {
      const std::string op = state->name.substr(state->name.find("::") + 2);
      py::object overload = py::module_::import("torch").attr("ops").attr("fastformer").attr(op.c_str())
                                .attr("default").attr("_op");
      state->overload = overload.release().ptr();
    }
    return PyObject_Vectorcall(state->overload, args, static_cast<size_t>(nargs), kwnames);
  }

  template <size_t... I>
  static PyObject* convert_and_call(State* state, PyObject* const* args, std::index_sequence<I...>) {
    std::tuple<std::decay_t<A>...> values;
    if (!(from_py(args[I], std::get<I>(values)) && ...)) return nullptr;
    R result = [&] {
      pybind11::gil_scoped_release no_gil;
      return state->op.call(std::get<I>(values)...);
    }();
    return to_py(std::move(result));
  }

  static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    HANDLE_TH_ERRORS
    auto* state = static_cast<State*>(PyCapsule_GetPointer(self, "fastformer.eager"));
    if (kwnames == nullptr && nargs == static_cast<Py_ssize_t>(sizeof...(A)) &&
        !at::impl::torch_function_mode_enabled()) {
      if (PyObject* out = convert_and_call(state, args, std::index_sequence_for<A...>{})) return out;
      if (PyErr_Occurred()) return nullptr;
    }
    return fallback(state, args, nargs, kwnames);
    END_HANDLE_TH_ERRORS
  }
};

// The C++ signature of fastformer::<op>_fwd: that of its adapter in csrc/ops.h.
#define FASTFORMER_FWD_SIGNATURE(op) \
  std::remove_pointer_t<decltype(&::fastformer::op##_fwd_op<&::fastformer::cpu::op##_fwd>)>

py::dict eager_forwards() {
  py::dict entries;
#define FASTFORMER_EAGER(op, ...) \
  entries[#op] = Eager<FASTFORMER_FWD_SIGNATURE(op)>::make("fastformer::" #op "_fwd");
  FASTFORMER_OPS(FASTFORMER_EAGER)
#undef FASTFORMER_EAGER
  return entries;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastformer fused kernels: attention, softmax, layer_norm_residual, cross_entropy, bias_activation (C++ CPU "
            "and CUDA)";
  m.attr("TORCH_VERSION") = FASTFORMER_TORCH_VERSION;
  m.attr("OPS") = py::tuple(py::cast(op_names()));
  m.attr("EAGER_FWD") = eager_forwards();  // op -> the forward op's eager entry (see Eager above)
  m.def("best_cpu_level", &fastformer::best_cpu_level,
        "the highest CPU kernel level this CPU supports: avx512, avx2 or default");
  m.def("set_cpu_kernels", &fastformer::set_cpu_kernels, "installs a fastformer._cpu_<level> module's kernel table");
  m.attr("KERNEL_TABLE") = FASTFORMER_KERNEL_TABLE;
  // The decoding GEMMs (csrc/gemm/gemm.h: the layouts, the int8 rule, the checks).
  m.attr("PACKED_LINEAR_PANEL") = fastformer::kPackedLinearPanel;
  m.attr("PACKED_LINEAR_STRIP") = fastformer::kPackedLinearStrip;
  m.def("pack_linear", &fastformer::pack_linear, py::arg("weight"),
        "a float32 weight (n, K) as the panels packed_linear streams: (ceil(n / PACKED_LINEAR_PANEL), "
        "PACKED_LINEAR_PANEL / PACKED_LINEAR_STRIP, K, PACKED_LINEAR_STRIP), W^T's columns in contiguous strips, "
        "zeros past n");
  m.def("int8_weight_shape", &fastformer::int8_weight_shape, py::arg("n"), py::arg("K"),
        "the shape of quantize_int8's packed weight for an (n, K) weight (csrc/gemm/gemm.h): (ceil(n / 32), "
        "ceil(K / 4), 32, 4)");
  m.def("quantize_int8", &fastformer::quantize_int8, py::arg("weight"),
        "a float32 weight (n, K) quantized per output channel (csrc/gemm/gemm.h's rule) -> (weight int8, packed "
        "(ceil(n / 32), ceil(K / 4), 32, 4), weight_scale float32 (n,), weight_colsum int32 (n,))");
  m.def("dequantize_int8", &fastformer::dequantize_int8, py::arg("weight"), py::arg("weight_scale"), py::arg("n"),
        py::arg("K"), "Wq s_w as a float32 (n, K) weight, from quantize_int8's weight and weight_scale");
  m.def("int8_embedding", &fastformer::int8_embedding, py::arg("ids"), py::arg("weight"), py::arg("weight_scale"),
        py::arg("n"), py::arg("K"), "rows ids (int64, any shape) of quantize_int8's weight (n, K), dequantized: "
        "(*ids.shape, K) float32; a quantized model's embedding lookup");
  m.def("packed_linear", &fastformer::packed_linear, py::arg("x"), py::arg("panels"), py::arg("bias"), py::arg("n"),
        "y (M, n) = x (M, K) W^T + bias, float32 on the CPU, W packed by pack_linear: the model's projections at "
        "inference");
  py::class_<fastformer::OnednnInt8, std::shared_ptr<fastformer::OnednnInt8>>(
      m, "OnednnInt8",
      "an int8 weight packed for oneDNN's int8 products (csrc/gemm/int8_onednn.h), made by int8_prepare: a copy, "
      "read-only, freed with its last holder (the int8 module of the weight, a CpuDecoder built on it)")
      .def_property_readonly("n", [](const fastformer::OnednnInt8& w) { return w.n; }, "the weight's outputs")
      .def_property_readonly("K", [](const fastformer::OnednnInt8& w) { return w.K; }, "the weight's inputs")
      .def("__repr__", [](const fastformer::OnednnInt8& w) {
        return "OnednnInt8(n=" + std::to_string(w.n) + ", K=" + std::to_string(w.K) + ")";
      });
  m.def("int8_linear", &fastformer::int8_linear, py::arg("x"), py::arg("weight"), py::arg("weight_scale"),
        py::arg("weight_colsum"), py::arg("bias"), py::arg("n"), py::arg("variant") = "",
        py::arg("onednn") = py::none(),
        "y (M, n) = x (M, K) W^T + bias with W quantized by quantize_int8 and x per row "
        "(csrc/gemm/int8_linear.cpp): a quantized model's projections; variant: one of int8_variants(), \"fastformer\" "
        "(the first) or \"auto\"; \"\": FASTFORMER_INT8_PROVIDER, else auto (the rule: int8_variant_for); onednn: "
        "the weight packed for oneDNN (int8_prepare's), or None: packed for this call where oneDNN's products run");
  m.def("int8_variants", &fastformer::int8_variants,
        "the int8 variants this CPU runs at the loaded level: fastformer's own, best first, then \"onednn\" where torch "
        "has oneDNN");
  m.def("product_variants", &fastformer::product_variants,
        "the tile products' variants this CPU runs at the loaded level (csrc/gemm/products.h): \"fma\", "
        "\"bf16_dot\" where the CPU has AVX512_BF16, \"bf16_emulated\"");
  m.def("tile_product", &fastformer::tile_product, py::arg("a"), py::arg("b"), py::arg("variant"),
        "C (m, n) = a (m, k) b (k, n) on fastformer's CPU micro-kernel by one of product_variants() (a test's hook): "
        "float32/float64 for \"fma\", bfloat16 (C float32) for the bf16 variants");
  m.def("weight_grad", &fastformer::weight_grad, py::arg("dy"), py::arg("x"), py::arg("variant") = "",
        "(dW, db): dW (N, K) float32 = dy (M, N)^T x (M, K) and db (N) float32 = dy's column sums, for bfloat16 CPU "
        "dy and x, summed in float32 on fastformer's CPU micro-kernel (csrc/gemm/weight_grad.cpp): a projection's "
        "gradients in bf16 training; variant: \"\" "
        "(bf16_dot where the CPU has AVX512_BF16, else bf16_emulated) or one of those two (a test's hook)");
  m.def("int8_variant_for", &fastformer::int8_variant_for, py::arg("M"), py::arg("N"), py::arg("K"),
        "the int8 variant a projection y (M, N) = x (M, K) W^T runs: FASTFORMER_INT8_PROVIDER's, else the rule's "
        "(oneDNN's products on a CPU with AMX from 32 rows and 2^22 multiply-adds, the first of int8_variants() "
        "otherwise)");
  m.def("int8_prepare", &fastformer::int8_prepare, py::arg("weight"), py::arg("weight_scale"),
        py::arg("weight_colsum"), py::arg("n"), py::arg("K"), py::arg("variant") = "",
        "quantize_int8's weight (n, K) packed for oneDNN's int8 products (an OnednnInt8, for the caller to keep with "
        "the weight and pass to int8_linear and the CpuDecoder), where the variant (as int8_linear's; \"\": "
        "FASTFORMER_INT8_PROVIDER) is oneDNN's or the rule can choose them; else None");
  m.def("int8_provider", &fastformer::int8_provider, py::arg("variant") = "",
        "the int8 variant a projection bound now runs: `variant` (\"\": FASTFORMER_INT8_PROVIDER, the one place it "
        "is read) as a name of int8_variants() (\"fastformer\": the first), or \"auto\" (the rule per call: "
        "int8_variant_for); ValueError for a variant this CPU does not run");
  m.def("int8_onednn_live", &fastformer::onednn_int8_live,
        "how many OnednnInt8 packs this process holds (made and not yet freed)");
  m.def("int8_onednn_rule", []() { return std::make_pair(fastformer::kOnednnMinRows, fastformer::kOnednnMinProducts); },
        "the rule's least row count and least multiply-adds (M N K) a call for oneDNN's int8 products (on a CPU with "
        "AMX)");
  m.def("int8_onednn_rule_holds", &fastformer::onednn_rule, py::arg("M"), py::arg("N"), py::arg("K"),
        "whether the rule's bounds take oneDNN's int8 products for an M x K by K x N product (on a CPU with AMX; "
        "elsewhere never)");
  m.def("cpu_has_amx_int8", &fastformer::cpu_has_amx_int8, "whether this CPU (and its OS) has AMX's int8 tiles");
  m.def("cpu_has_int8_dot", &fastformer::cpu_has_int8_dot,
        "whether this CPU has VNNI or AMX (int8 products without 16-bit intermediate sums)");
  // The inference room (csrc/inference/inference.h).
  fastformer::bind_decoder(m);
  fastformer::bind_beam_search(m);
  // The triton backend's launch plans (csrc/triton/plans.cpp).
  fastformer::bind_triton_plans(m);
  // The fused Adam step of fastformer.training.optim.Adam (csrc/optim/optim.h).
  m.def("adam_step", &fastformer::adam_step, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("copies"), py::arg("steps"), py::arg("lr"), py::arg("lr_tensor"),
        py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"), py::arg("eps"), py::arg("grad_scale"),
        py::arg("found_inf"),
        "one fused Adam step of every parameter (float32, one device), also writing each parameter's bfloat16 or "
        "float16 copy where copies[k] is a tensor; steps[k] += 1 unless found_inf is nonzero (then nothing changes)");
#ifdef FASTFORMER_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  // The argument checks of csrc/ops.h, for the ops implemented in Python (ValueError on bad input). Tensor
  // arguments come in as optional, so that None reaches the checks (and their "must be a torch.Tensor, got
  // None") as it reaches them through the registered ops, instead of pybind11's TypeError.
  using OptTensor = std::optional<at::Tensor>;
  const auto given = [](const OptTensor& t) { return t.value_or(at::Tensor()); };
  m.def("check_attention",
        [given](const OptTensor& q, const OptTensor& k, const OptTensor& v, const OptTensor& mask, double dropout_p,
                std::optional<double> scale) {
          fastformer::check_attention(given(q), given(k), given(v), mask, dropout_p);
          return fastformer::attention_scale(scale, *q);
        },
        "checks ops.attention's arguments; returns the scale (1/sqrt(D) when None)");
  m.def("check_attention_varlen",
        [given](const OptTensor& q, const OptTensor& k, const OptTensor& v, const OptTensor& cu_seqlens_q,
                const OptTensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p,
                std::optional<double> scale) {
          fastformer::check_attention_varlen(given(q), given(k), given(v), given(cu_seqlens_q), given(cu_seqlens_k),
                                             max_seqlen_q, max_seqlen_k, dropout_p);
          return fastformer::attention_scale(scale, *q);
        },
        "checks ops.attention_varlen's arguments; returns the scale (1/sqrt(D) when None)");
  m.def("check_attention_varlen_bwd", &fastformer::check_attention_varlen_bwd,
        "checks attention_varlen_bwd's arguments");
  m.def("attention_varlen_layout", &fastformer::attention_varlen_layout,
        "a packed (T, H, D) tensor as the varlen kernels read it: itself when its last dim is contiguous and its rows "
        "do not overlap, else a contiguous copy");
  m.def("check_softmax",
        [given](const OptTensor& x, const OptTensor& mask, double scale) {
          fastformer::check_softmax(given(x), mask, scale);
        },
        "checks ops.softmax's arguments");
  m.def("check_layer_norm_residual",
        [given](const OptTensor& x, const OptTensor& residual, const OptTensor& weight, const OptTensor& bias,
                double eps, double dropout_p, const OptTensor& x_bias, std::optional<at::ScalarType> compute_dtype) {
          fastformer::check_layer_norm_residual(given(x), given(residual), given(weight), given(bias), eps, dropout_p,
                                                x_bias, compute_dtype);
        },
        "checks ops.layer_norm_residual's arguments");
  m.def("check_cross_entropy",
        [given](const OptTensor& logits, const OptTensor& target, double label_smoothing, int64_t ignore_index) {
          fastformer::check_cross_entropy(given(logits), given(target), label_smoothing, ignore_index);
        },
        "checks ops.cross_entropy's arguments");
  m.def("check_bias_activation",
        [given](const OptTensor& x, const OptTensor& bias, const std::string& activation, double dropout_p) {
          return fastformer::check_bias_activation(given(x), given(bias), activation, dropout_p);
        },
        "checks ops.bias_activation's arguments; returns the activation's code (an index into ACTIVATIONS)");
  m.def("check_bias_activation_bwd",
        [given](const OptTensor& dy, const OptTensor& saved, const OptTensor& bias, const std::string& activation,
                double dropout_p) {
          return fastformer::check_bias_activation_bwd(given(dy), given(saved), given(bias), activation, dropout_p);
        },
        "checks bias_activation_bwd's arguments; returns the activation's code");
  m.attr("ACTIVATIONS") = py::make_tuple(fastformer::kActivationNames[0], fastformer::kActivationNames[1],
                                         fastformer::kActivationNames[2]);
  m.def("check_attention_bwd", &fastformer::check_attention_bwd, "checks attention_bwd's arguments");
  m.def("attention_packed_kind", &fastformer::attention_packed_kind, py::arg("q"), py::arg("k"), py::arg("v"),
        "attention_bwd's packed_grads for these inputs (csrc/attention_grads.h): 3 where q, k, v are the parts of one "
        "packed projection, 2 where k, v are, else 0");
  // The deferred value checks (csrc/value_checks.h); fastformer/ops/deferred.py is their public face.
  m.def("set_deferred_checks", &fastformer::set_deferred_checks, py::arg("on"), py::arg("device") = py::none(),
        "turns the deferred mode of the GPU value checks on or off (process-wide); on, with a device, allocates "
        "that device's flag now (outside CUDA graph capture)");
  m.def("deferred_checks_enabled", &fastformer::deferred_checks_enabled, "whether the deferred mode is on");
  m.def("check_deferred", &fastformer::check_deferred, py::call_guard<py::gil_scoped_release>(),
        "reads and clears every device's deferred-check flag (one sync per device); ValueError naming each op, "
        "argument and rule found broken since the last call");
  m.def("checked_cu_seqlens", &fastformer::checked_cu_seqlens, py::arg("host"), py::arg("device"), py::arg("total"),
        py::arg("max_seqlen"),
        "a cu_seqlens table made on the host (int32 (B + 1) CPU tensor) for `total` packed rows, checked there and "
        "copied to `device` without waiting; the ops do not read the copy again while it is unchanged");
  m.def("defer_cross_entropy_check",
        [](const at::Tensor& target, int64_t V, int64_t ignore_index) {
          fastformer::defer_target_check(target, V, ignore_index);
        },
        py::arg("target"), py::arg("V"), py::arg("ignore_index"),
        "the deferred check of cross_entropy's targets as device ops, on any device (the GPU path's; for tests)");
  m.def("defer_cu_seqlens_check",
        [](const at::Tensor& cu, const std::string& name, int64_t total, int64_t max_seqlen) {
          TORCH_CHECK_VALUE(name == "cu_seqlens_q" || name == "cu_seqlens_k",
                            "name must be cu_seqlens_q or cu_seqlens_k, got ", name);
          TORCH_CHECK_VALUE(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.size(0) >= 1,
                            "cu must be a 1-D int32 tensor of B + 1 entries");
          fastformer::defer_cu_seqlens_check(cu, name == "cu_seqlens_q" ? fastformer::kCuSeqlensQ
                                                                         : fastformer::kCuSeqlensK,
                                             total, max_seqlen);
        },
        py::arg("cu"), py::arg("name"), py::arg("total"), py::arg("max_seqlen"),
        "the deferred check of a cu_seqlens table as device ops, on any device (the GPU path's; for tests)");
  m.def("check_seed",
        [](const OptTensor& seed, double dropout_p, const at::Tensor& ref, const std::string& op) {
          fastformer::check_seed(seed, dropout_p, ref, op.c_str());
        },
        "checks the dropout seed of attention or layer_norm_residual: a 0-dim int64 tensor on ref's device");
  m.def("check_softmax_bwd", &fastformer::check_softmax_bwd, "checks softmax_bwd's arguments");
  m.def("check_layer_norm_residual_bwd", &fastformer::check_layer_norm_residual_bwd,
        "checks layer_norm_residual_bwd's arguments");
  m.def("check_cross_entropy_bwd", &fastformer::check_cross_entropy_bwd, "checks cross_entropy_bwd's arguments");
  m.def("attention_layout", &fastformer::attention_layout,
        "an attention tensor as the kernels read it: itself when its last dim is contiguous and its rows do not "
        "overlap, else a contiguous copy (the one layout rule of csrc/ops.h)");
  m.attr("GPU_MAX_HEAD_DIM") = fastformer::kGpuMaxHeadDim;
}
