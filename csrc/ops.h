// The fastformer operator library, declared once: the op table, the argument checks every backend
// shares, and the adapters that turn a registered op's arguments into a backend's entry points.
//
// Each op of FASTFORMER_OPS is registered twice from one schema (csrc/fastformer.cpp):
//   fastformer::<op>_<phase>     kernels in C++: csrc/cpu/<op>.cpp (CPU key), csrc/cuda/<op>.cu (CUDA key)
//   fastformer::<op>_<phase>_py  the same arguments + `str backend`: torch, triton and cuda_sim, implemented
//                                in Python (fastformer/ops/<op>.py)
// Autograd for both (csrc/autograd/<op>.cpp) and the fake kernels (Python) sit on top.
//
// Caller errors raise c10::ValueError (Python ValueError) through TORCH_CHECK_VALUE, from these checks
// alone, forward and backward: the adapters below call them for the C++ kernels, the _py twins call them
// (through fastformer._C.check_*) for the backends written in Python. The entry points rely on them and
// check only their own limits (the GPU head-dim bound, 32-bit grid and index limits, dtypes a GPU lacks)
// and, cheaply, that the tensors they index are on their device and contiguous. The two checks that read
// tensor values (cross_entropy's targets, attention_varlen's tables) are csrc/value_checks.h's: on a GPU they
// read the host at the call, or, in the deferred mode, run on the device and raise from check_deferred().
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "activation.h"
#include "value_checks.h"

// X(op, forward arguments, forward returns, backward arguments, backward returns): the one list of ops.
// Adding an op: its row here, its kernel files, its Python module (fastformer/ops/<op>.py).
#define FASTFORMER_OPS(X)                                                                                      \
  X(attention,                                                                                                 \
    "Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, bool causal, float dropout_p, float? scale, "     \
    "Tensor? seed",                                                                                            \
    "(Tensor, Tensor)",                                                                                        \
    "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_padding_mask, "            \
    "bool causal, float dropout_p, float? scale, Tensor? seed, int packed_grads",                              \
    "(Tensor, Tensor, Tensor)")                                                                                \
  X(attention_varlen,                                                                                          \
    "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "              \
    "int max_seqlen_k, bool causal, float dropout_p, float? scale, Tensor? seed",                             \
    "(Tensor, Tensor)",                                                                                        \
    "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "                 \
    "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, float dropout_p, float? scale, "    \
    "Tensor? seed",                                                                                            \
    "(Tensor, Tensor, Tensor)")                                                                                \
  X(softmax, "Tensor x, Tensor? mask, float scale", "Tensor", "Tensor dy, Tensor y, float scale", "Tensor")    \
  X(layer_norm_residual,                                                                                       \
    "Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps, float dropout_p, Tensor? seed, "       \
    "Tensor? x_bias, ScalarType? compute_dtype",                                                               \
    "(Tensor, Tensor, Tensor, Tensor, Tensor)",                                                                \
    "Tensor dy, Tensor? ds, Tensor s, Tensor weight, Tensor mean, Tensor rstd, float dropout_p, "              \
    "Tensor? seed, ScalarType? dx_dtype, Tensor? dy_c, Tensor? x_bias",                                        \
    "(Tensor, Tensor, Tensor, Tensor, Tensor)")                                                               \
  X(cross_entropy, "Tensor logits, Tensor target, float label_smoothing, int ignore_index",                    \
    "(Tensor, Tensor, Tensor)",                                                                                \
    "Tensor dloss, Tensor dnll, Tensor logits, Tensor target, Tensor lse, float label_smoothing, "             \
    "int ignore_index",                                                                                        \
    "Tensor")                                                                                                  \
  X(bias_activation, "Tensor x, Tensor bias, str activation, float dropout_p, Tensor? seed", "Tensor",         \
    "Tensor dy, Tensor saved, Tensor bias, str activation, float dropout_p, Tensor? seed", "(Tensor, Tensor)")

namespace fastformer {

using at::Tensor;

// The largest attention head dim of the GPU kernels (cuda and triton); cpu and torch take any.
constexpr int64_t kGpuMaxHeadDim = 128;
using OptTensor = std::optional<Tensor>;

// ---- argument checks (every backend) ----

// A tensor argument that was given: None reaches a `Tensor` argument of the registered ops as an
// undefined tensor (the public functions turn every other wrong Python type into a ValueError,
// fastformer/ops/_registry.py check_types).
inline void check_given(const Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), "fastformer ", op, ": ", name, " must be a torch.Tensor, got None");
}

inline void check_floating(const Tensor& t, const char* op, const char* name) {
  const auto d = t.scalar_type();
  TORCH_CHECK_VALUE(d == at::kFloat || d == at::kDouble || d == at::kHalf || d == at::kBFloat16, "fastformer ", op,
                    ": ", name, " must be float16, bfloat16, float32 or float64, got ", d);
}

// t has ref's dtype and device.
inline void check_like(const Tensor& t, const char* name, const Tensor& ref, const char* ref_name, const char* op) {
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), "fastformer ", op, ": ", name, " has dtype ",
                    t.scalar_type(), " but ", ref_name, " has ", ref.scalar_type(), "; cast them to one dtype");
  TORCH_CHECK_VALUE(t.device() == ref.device(), "fastformer ", op, ": ", name, " is on ", t.device(), " but ",
                    ref_name, " is on ", ref.device());
}

inline void check_bool_mask(const Tensor& m, const char* name, const Tensor& ref, const char* op) {
  TORCH_CHECK_VALUE(m.scalar_type() == at::kBool, "fastformer ", op, ": ", name,
                    " must be a bool tensor (True = masked), got ", m.scalar_type());
  TORCH_CHECK_VALUE(m.device() == ref.device(), "fastformer ", op, ": ", name, " is on ", m.device(),
                    " but the inputs are on ", ref.device());
}

inline void check_dropout(double p, const char* op) {
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, "fastformer ", op, ": dropout_p must be a number in [0, 1), got ", p);
}

// Grouped-query attention: H query heads share H_kv key/value heads, query head h reading kv head
// h / (H / H_kv) (H_kv = H: multi-head, H_kv = 1: multi-query). H must be a multiple of H_kv.
inline void check_head_groups(int64_t H, int64_t H_kv, const char* op, const char* kv) {
  TORCH_CHECK_VALUE(H_kv == H || (H_kv > 0 && H % H_kv == 0), "fastformer ", op, ": q has ", H, " heads and ", kv,
                    " has ", H_kv, "; the query heads must be a multiple of the key/value heads (grouped-query "
                    "attention)");
}

// What the attention ops check alike: q, k, v given, of `rank` dims (q shaped q_shape, k and v kv_shape in the
// messages), q floating, k and v of q's dtype and device and of one shape.
inline void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t rank, const char* q_shape,
                      const char* kv_shape, const char* op) {
  check_given(q, op, "q");
  check_given(k, op, "k");
  check_given(v, op, "v");
  TORCH_CHECK_VALUE(q.dim() == rank, "fastformer ", op, ": q must be ", rank, "-D ", q_shape, ", got shape ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == rank, "fastformer ", op, ": k must be ", rank, "-D ", kv_shape, ", got shape ",
                    k.sizes());
  TORCH_CHECK_VALUE(v.dim() == rank, "fastformer ", op, ": v must be ", rank, "-D ", kv_shape, ", got shape ",
                    v.sizes());
  check_floating(q, op, "q");
  check_like(k, "k", q, "q", op);
  check_like(v, "v", q, "q", op);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "fastformer ", op, ": k ", k.sizes(), " and v ", v.sizes(),
                    " must have the same shape");
}

// q (B, H, Lq, D); k, v (B, H_kv, Lk, D) with H a multiple of H_kv; key_padding_mask (B, Lk) bool.
inline void check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& key_padding_mask,
                            double dropout_p) {
  constexpr const char* op = "attention";
  check_qkv(q, k, v, 4, "(B, H, L, D)", "(B, H_kv, L, D)", op);
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(3) == q.size(3), "fastformer attention: q ", q.sizes(),
                    " and k ", k.sizes(), " must agree in batch and head dim");
  check_head_groups(q.size(1), k.size(1), "attention", "k and v (B, H_kv, Lk, D)");
  if (key_padding_mask.has_value()) {
    check_bool_mask(*key_padding_mask, "key_padding_mask", q, op);
    TORCH_CHECK_VALUE(key_padding_mask->dim() == 2 && key_padding_mask->size(0) == q.size(0) &&
                          key_padding_mask->size(1) == k.size(2),
                      "fastformer attention: key_padding_mask must have shape (B, Lk) = (", q.size(0), ", ",
                      k.size(2), "), got ", key_padding_mask->sizes());
  }
  check_dropout(dropout_p, op);
}

// A cu_seqlens table of attention_varlen: int32 (B + 1) on q's device, for B sequences of a packed tensor
// of `total` rows: sequence b is rows cu[b]:cu[b+1]. Its values (0 first, non-decreasing, no sequence longer
// than max_seqlen, `total` last) are checked by check_cu_seqlens_values (csrc/value_checks.h: on the host,
// or on the device in the deferred mode; a GPU table once while it is unchanged); the kernels clamp every
// sequence into [0, total), so that a table that gets past the check cannot make them read or write out of
// bounds.
inline void check_cu_seqlens(const Tensor& cu, const SeqlensTable& table, int64_t total, int64_t max_seqlen,
                             const Tensor& q) {
  constexpr const char* op = "attention_varlen";
  check_given(cu, op, table.name);
  TORCH_CHECK_VALUE(cu.scalar_type() == at::kInt, "fastformer attention_varlen: ", table.name,
                    " must be int32 (flash-attn's convention), got ", cu.scalar_type());
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 1, "fastformer attention_varlen: ", table.name,
                    " must be 1-D (B + 1), got shape ", cu.sizes());
  TORCH_CHECK_VALUE(cu.device() == q.device(), "fastformer attention_varlen: ", table.name, " is on ", cu.device(),
                    " but q is on ", q.device(), "; cu_seqlens live on q's device");
  TORCH_CHECK_VALUE(max_seqlen >= 0, "fastformer attention_varlen: ", table.max_name, " must be >= 0, got ",
                    max_seqlen);
  check_cu_seqlens_values(cu, table, total, max_seqlen);
}

// q (Tq, H, D); k, v (Tk, H_kv, D) with H a multiple of H_kv; cu_seqlens_q, cu_seqlens_k int32 (B + 1).
inline void check_attention_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                                   const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                   double dropout_p) {
  constexpr const char* op = "attention_varlen";
  check_qkv(q, k, v, 3, "(Tq, H, D)", "(Tk, H_kv, D)", op);
  TORCH_CHECK_VALUE(k.size(2) == q.size(2), "fastformer attention_varlen: q ", q.sizes(), " and k ", k.sizes(),
                    " must have the same head dim");
  check_head_groups(q.size(1), k.size(1), op, "k and v (Tk, H_kv, D)");
  check_cu_seqlens(cu_seqlens_q, kCuSeqlensQ, q.size(0), max_seqlen_q, q);
  check_cu_seqlens(cu_seqlens_k, kCuSeqlensK, k.size(0), max_seqlen_k, q);
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) == cu_seqlens_k.size(0), "fastformer attention_varlen: cu_seqlens_q has ",
                    cu_seqlens_q.size(0) - 1, " sequences but cu_seqlens_k has ", cu_seqlens_k.size(0) - 1,
                    "; query sequence b attends to key sequence b");
  check_dropout(dropout_p, op);
}

// A scale must be finite in the kernels' arithmetic: float64 for float64 inputs, float32 for the others
// (1e39 is a finite double but +inf in float32, which would turn every score into +-inf or NaN).
inline void check_scale(double scale, const Tensor& x, const char* op) {
  TORCH_CHECK_VALUE(std::isfinite(scale), "fastformer ", op, ": scale must be a finite number, got ", scale);
  TORCH_CHECK_VALUE(x.scalar_type() == at::kDouble || std::abs(scale) <= std::numeric_limits<float>::max(),
                    "fastformer ", op, ": scale ", scale, " overflows float32, the arithmetic of ", x.scalar_type(),
                    " inputs (|scale| <= ", std::numeric_limits<float>::max(), ")");
}

// The attention scale: the caller's (finite in the kernels' arithmetic), else 1/sqrt(D) (1 for D = 0,
// where nothing is scaled and the output is empty).
inline double attention_scale(std::optional<double> scale, const Tensor& q) {
  if (scale.has_value()) {
    check_scale(*scale, q, "attention");
    return *scale;
  }
  const int64_t D = q.size(-1);
  return D > 0 ? 1.0 / std::sqrt(static_cast<double>(D)) : 1.0;
}

// x (..., N); mask bool, broadcastable to x.
inline void check_softmax(const Tensor& x, const OptTensor& mask, double scale) {
  constexpr const char* op = "softmax";
  check_given(x, op, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, "fastformer softmax: x must have at least one dimension");
  check_floating(x, op, "x");
  if (mask.has_value()) {
    check_bool_mask(*mask, "mask", x, op);
    TORCH_CHECK_VALUE(at::is_expandable_to(mask->sizes(), x.sizes()), "fastformer softmax: mask of shape ",
                      mask->sizes(), " does not broadcast to x's shape ", x.sizes());
  }
  check_scale(scale, x, op);
}

// layer_norm_residual's branch dtype rule: the branch x (and so its gradient dx) has the residual stream's
// dtype, or is float16/bfloat16 beside a float32 residual stream (autocast's sublayer output beside the
// float32 stream: the kernels upcast it as they read it, no cast before the op).
inline bool lnr_branch_dtype_ok(at::ScalarType branch, at::ScalarType stream) {
  return branch == stream || (stream == at::kFloat && (branch == at::kHalf || branch == at::kBFloat16));
}

// x_bias (N,): the branch's bias, added to x before dropout; any floating dtype (a float32 master bias beside
// a bfloat16 branch), on x's device.
inline void check_lnr_x_bias(const OptTensor& x_bias, int64_t N, const Tensor& ref) {
  if (!x_bias.has_value()) return;
  constexpr const char* op = "layer_norm_residual";
  check_given(*x_bias, op, "x_bias");
  check_floating(*x_bias, op, "x_bias");
  TORCH_CHECK_VALUE(x_bias->device() == ref.device(), "fastformer layer_norm_residual: x_bias is on ",
                    x_bias->device(), " but the inputs are on ", ref.device());
  TORCH_CHECK_VALUE(x_bias->dim() == 1 && x_bias->size(0) == N, "fastformer layer_norm_residual: x_bias must have "
                    "shape (", N, ",), got ", x_bias->sizes());
}

// compute_dtype: the dtype of the extra normalized output y_c (the next GEMM's input): float16, bfloat16, or
// the stream's own dtype (None and the stream's dtype: no extra output).
inline void check_lnr_compute_dtype(std::optional<at::ScalarType> compute_dtype, at::ScalarType stream) {
  TORCH_CHECK_VALUE(!compute_dtype.has_value() || *compute_dtype == at::kHalf || *compute_dtype == at::kBFloat16 ||
                        *compute_dtype == stream,
                    "fastformer layer_norm_residual: compute_dtype must be torch.float16, torch.bfloat16 or the "
                    "residual's dtype ", stream, ", got ", compute_dtype.value_or(stream));
}

// x, residual (..., N); weight, bias (N,) in residual's dtype; x in residual's dtype or, beside a float32
// residual, float16 or bfloat16 (lnr_branch_dtype_ok); x_bias and compute_dtype as above.
inline void check_layer_norm_residual(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                      const Tensor& bias, double eps, double dropout_p, const OptTensor& x_bias,
                                      std::optional<at::ScalarType> compute_dtype) {
  constexpr const char* op = "layer_norm_residual";
  check_given(x, op, "x");
  check_given(residual, op, "residual");
  check_given(weight, op, "weight");
  check_given(bias, op, "bias");
  check_floating(x, op, "x");
  check_floating(residual, op, "residual");
  TORCH_CHECK_VALUE(lnr_branch_dtype_ok(x.scalar_type(), residual.scalar_type()),
                    "fastformer layer_norm_residual: x has dtype ", x.scalar_type(), " but residual has ",
                    residual.scalar_type(), "; x must have residual's dtype, or be float16 or bfloat16 beside a "
                    "float32 residual");
  TORCH_CHECK_VALUE(x.device() == residual.device(), "fastformer layer_norm_residual: x is on ", x.device(),
                    " but residual is on ", residual.device());
  check_like(weight, "weight", residual, "residual", op);
  check_like(bias, "bias", residual, "residual", op);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0,
                    "fastformer layer_norm_residual: x must be (..., N) with N > 0, got ", x.sizes());
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "fastformer layer_norm_residual: residual ", residual.sizes(),
                    " must have x's shape ", x.sizes());
  const int64_t N = x.size(-1);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == N, "fastformer layer_norm_residual: weight must have shape (",
                    N, ",), got ", weight.sizes());
  TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == N, "fastformer layer_norm_residual: bias must have shape (", N,
                    ",), got ", bias.sizes());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "fastformer layer_norm_residual: eps must be a finite number >= 0, got ",
                    eps);
  check_dropout(dropout_p, op);
  check_lnr_x_bias(x_bias, N, x);
  check_lnr_compute_dtype(compute_dtype, residual.scalar_type());
}


// logits (..., V) with V > 0; target (...) int64, each entry in [0, V) or ignore_index. The targets' range is
// checked once per call by check_target_values (csrc/value_checks.h: on the host, or on the device in the
// deferred mode), so that no kernel is asked for a logit that is not there; the kernels still never read one
// (an out-of-range target gives NaN), for what gets past the check (deferred, or skipped during capture).
inline void check_cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing,
                                int64_t ignore_index) {
  check_given(logits, "cross_entropy", "logits");
  check_given(target, "cross_entropy", "target");
  check_floating(logits, "cross_entropy", "logits");
  TORCH_CHECK_VALUE(logits.dim() >= 1 && logits.size(-1) > 0,
                    "fastformer cross_entropy: logits must be (..., V) with V > 0 classes, got shape ", logits.sizes());
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong, "fastformer cross_entropy: target must be int64 class "
                    "indices, got ", target.scalar_type());
  TORCH_CHECK_VALUE(target.device() == logits.device(), "fastformer cross_entropy: target is on ", target.device(),
                    " but logits are on ", logits.device());
  TORCH_CHECK_VALUE(target.sizes() == logits.sizes().slice(0, logits.dim() - 1),
                    "fastformer cross_entropy: target must have logits' shape without the class dim, ",
                    logits.sizes().slice(0, logits.dim() - 1), ", got ", target.sizes());
  TORCH_CHECK_VALUE(std::isfinite(label_smoothing) && label_smoothing >= 0.0 && label_smoothing <= 1.0,
                    "fastformer cross_entropy: label_smoothing must be a number in [0, 1], got ", label_smoothing);
  if (target.numel() > 0) check_target_values(target, logits.size(-1), ignore_index);
}

// bias_activation's activation names, indexed by their code (csrc/activation.h).
constexpr const char* kActivationNames[] = {"relu", "gelu", "silu"};

// The code of an activation name (csrc/activation.h), or ValueError naming `activation`.
inline int64_t activation_code(c10::string_view name) {
  for (int64_t code = 0; code < 3; ++code) {
    if (name == c10::string_view(kActivationNames[code])) return code;
  }
  TORCH_CHECK_VALUE(false, "fastformer bias_activation: activation must be one of 'relu', 'gelu', 'silu', got '",
                    std::string(name.data(), name.size()), "'");
  return -1;
}

// bias (N,) of any floating dtype on t's device, N = t.size(-1).
inline void check_bias_of(const Tensor& bias, const Tensor& t, const char* t_name) {
  constexpr const char* op = "bias_activation";
  check_given(bias, op, "bias");
  check_floating(bias, op, "bias");
  TORCH_CHECK_VALUE(bias.device() == t.device(), "fastformer bias_activation: bias is on ", bias.device(), " but ",
                    t_name, " is on ", t.device());
  TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == t.size(-1), "fastformer bias_activation: bias must have shape (",
                    t.size(-1), ",) (", t_name, "'s last dim), got ", bias.sizes());
}

// x (..., N) floating; bias (N,) of any floating dtype (typically the float32 master bias beside a float16 or
// bfloat16 x); activation one of kActivationNames. Returns the activation's code.
inline int64_t check_bias_activation(const Tensor& x, const Tensor& bias, c10::string_view activation,
                                     double dropout_p) {
  constexpr const char* op = "bias_activation";
  check_given(x, op, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, "fastformer bias_activation: x must be (..., N) with at least one dimension, got ",
                    "a 0-dim tensor");
  check_floating(x, op, "x");
  check_bias_of(bias, x, "x");
  const int64_t code = activation_code(activation);
  check_dropout(dropout_p, op);
  return code;
}

// ---- backward arguments ----
// Autograd hands the backward ops what the forward made; these checks guard a direct caller of the
// registered backward ops (torch.ops.fastformer.<op>_bwd), so that no kernel of any backend reads out of
// bounds. Saved statistics (attention's lse, layer_norm_residual's mean and rstd, cross_entropy's lse)
// and the losses' gradients are in the accumulation dtype: float32, float64 for float64 inputs.

// t is given and has ref's dtype, device and shape.
inline void check_same(const Tensor& t, const char* name, const Tensor& ref, const char* ref_name, const char* op) {
  check_given(t, op, name);
  check_like(t, name, ref, ref_name, op);
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), "fastformer ", op, ": ", name, " has shape ", t.sizes(), " but ",
                    ref_name, " has ", ref.sizes());
}

// t is given, of shape `shape`, in the accumulation dtype of ref's dtype, on ref's device.
inline void check_stats(const Tensor& t, const char* name, at::IntArrayRef shape, const Tensor& ref, const char* op) {
  check_given(t, op, name);
  const auto acc = at::toOpMathType(ref.scalar_type());
  TORCH_CHECK_VALUE(t.scalar_type() == acc && t.device() == ref.device() && t.sizes() == shape, "fastformer ", op,
                    ": ", name, " must be ", acc, " of shape ", shape, " on ", ref.device(), ", got ", t.scalar_type(),
                    " of shape ", t.sizes(), " on ", t.device());
}

// packed_grads (csrc/attention_grads.h): 0, or 2 (dk, dv the parts of one gradient: k and v of one shape), or 3
// (dq, dk, dv: q, k and v of one shape).
inline void check_attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& lse, const OptTensor& key_padding_mask,
                                double dropout_p, int64_t packed_grads) {
  check_attention(q, k, v, key_padding_mask, dropout_p);
  check_same(dout, "dout", q, "q", "attention");
  check_same(out, "out", q, "q", "attention");
  check_stats(lse, "lse", q.sizes().slice(0, 3), q, "attention");
  TORCH_CHECK_VALUE(packed_grads == 0 || (packed_grads == 2 && k.sizes() == v.sizes()) ||
                        (packed_grads == 3 && q.sizes() == k.sizes() && k.sizes() == v.sizes()),
                    "fastformer attention: packed_grads must be 0, 2 (k and v of one shape) or 3 (q, k and v of one "
                    "shape), got ", packed_grads, " for q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
}

inline void check_attention_varlen_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens_q,
                                       const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                       double dropout_p) {
  check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p);
  check_same(dout, "dout", q, "q", "attention_varlen");
  check_same(out, "out", q, "q", "attention_varlen");
  check_stats(lse, "lse", {q.size(1), q.size(0)}, q, "attention_varlen");  // (H, Tq), flash-attn's layout
}

inline void check_softmax_bwd(const Tensor& dy, const Tensor& y) {
  check_given(y, "softmax", "y");
  TORCH_CHECK_VALUE(y.dim() >= 1, "fastformer softmax: y must have at least one dimension");
  check_floating(y, "softmax", "y");
  check_same(dy, "dy", y, "y", "softmax");
}

// dx_dtype: x's dtype, the dtype dx is written in (None: s's dtype); lnr_branch_dtype_ok beside s's.
// dy_c: the gradient of the compute-dtype output y_c (float16 or bfloat16, s's shape), added to dy's;
// x_bias: the forward's (dx_bias is returned in its dtype).
inline void check_layer_norm_residual_bwd(const Tensor& dy, const OptTensor& ds, const Tensor& s, const Tensor& weight,
                                          const Tensor& mean, const Tensor& rstd, double dropout_p,
                                          std::optional<at::ScalarType> dx_dtype, const OptTensor& dy_c,
                                          const OptTensor& x_bias) {
  constexpr const char* op = "layer_norm_residual";
  check_given(s, op, "s");
  TORCH_CHECK_VALUE(s.dim() >= 1 && s.size(-1) > 0, "fastformer layer_norm_residual: s must be (..., N) with N > 0, got ",
                    s.sizes());
  check_floating(s, op, "s");
  TORCH_CHECK_VALUE(!dx_dtype.has_value() || lnr_branch_dtype_ok(*dx_dtype, s.scalar_type()),
                    "fastformer layer_norm_residual: dx_dtype is ", dx_dtype.value_or(s.scalar_type()),
                    " but s has dtype ", s.scalar_type(), "; dx_dtype must be s's dtype, or float16 or bfloat16 "
                    "beside a float32 s");
  check_same(dy, "dy", s, "s", op);
  if (ds.has_value()) check_same(*ds, "ds", s, "s", op);
  check_given(weight, op, "weight");
  check_like(weight, "weight", s, "s", op);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == s.size(-1), "fastformer layer_norm_residual: weight must ",
                    "have shape (", s.size(-1), ",), got ", weight.sizes());
  check_stats(mean, "mean", s.sizes().slice(0, s.dim() - 1), s, op);
  check_stats(rstd, "rstd", s.sizes().slice(0, s.dim() - 1), s, op);
  check_dropout(dropout_p, op);
  if (dy_c.has_value()) {
    check_given(*dy_c, op, "dy_c");
    TORCH_CHECK_VALUE((dy_c->scalar_type() == at::kHalf || dy_c->scalar_type() == at::kBFloat16) &&
                          dy_c->scalar_type() != s.scalar_type(),
                      "fastformer layer_norm_residual: dy_c (the gradient of the compute-dtype output) must be "
                      "float16 or bfloat16 beside a ", s.scalar_type(), " s, got ", dy_c->scalar_type());
    TORCH_CHECK_VALUE(dy_c->device() == s.device() && dy_c->sizes() == s.sizes(), "fastformer layer_norm_residual: "
                      "dy_c must have s's shape ", s.sizes(), " on ", s.device(), ", got ", dy_c->sizes(), " on ",
                      dy_c->device());
  }
  check_lnr_x_bias(x_bias, s.size(-1), s);
}

// saved: the forward's output y for relu, its input x for gelu and silu (csrc/autograd/bias_activation.cpp);
// dy of saved's dtype, device and shape; bias (N,). Returns the activation's code.
inline int64_t check_bias_activation_bwd(const Tensor& dy, const Tensor& saved, const Tensor& bias,
                                         c10::string_view activation, double dropout_p) {
  constexpr const char* op = "bias_activation";
  check_given(saved, op, "saved");
  TORCH_CHECK_VALUE(saved.dim() >= 1, "fastformer bias_activation: saved must be (..., N) with at least one dimension");
  check_floating(saved, op, "saved");
  check_same(dy, "dy", saved, "saved", op);
  check_bias_of(bias, saved, "saved");
  const int64_t code = activation_code(activation);
  check_dropout(dropout_p, op);
  return code;
}

inline void check_cross_entropy_bwd(const Tensor& dloss, const Tensor& dnll, const Tensor& logits,
                                    const Tensor& target, const Tensor& lse) {
  constexpr const char* op = "cross_entropy";
  check_given(logits, op, "logits");
  check_given(target, op, "target");
  check_floating(logits, op, "logits");
  TORCH_CHECK_VALUE(logits.dim() >= 1 && logits.size(-1) > 0,
                    "fastformer cross_entropy: logits must be (..., V) with V > 0 classes, got shape ", logits.sizes());
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong && target.device() == logits.device() &&
                        target.sizes() == logits.sizes().slice(0, logits.dim() - 1),
                    "fastformer cross_entropy: target must be int64 of shape ", logits.sizes().slice(0, logits.dim() - 1),
                    " on ", logits.device(), ", got ", target.scalar_type(), " of shape ", target.sizes(), " on ",
                    target.device());
  check_stats(dloss, "dloss", target.sizes(), logits, op);
  check_stats(dnll, "dnll", target.sizes(), logits, op);
  check_stats(lse, "lse", target.sizes(), logits, op);
}

// The dropout seed (attention, layer_norm_residual): a 0-dim int64 tensor on the inputs' device (a CPU tensor
// for CPU inputs), drawn per call by the public functions (fastformer/ops/_registry.py dropout_seed); needed
// when dropout_p > 0, unused otherwise. It reaches every backend as that tensor: the GPU kernels (CUDA and
// Triton, and cuda_sim's CPU run of the CUDA ones) read it from memory, so a call never reads it on the
// host (a sync on a GPU) and a captured CUDA graph, whose replays rewrite the tensor in place (torch's CUDA
// generator), draws a new mask on every replay; the CPU kernels read its value on the host (no sync there).
// A seed on another device or of another dtype or shape is refused, not moved: a copy to the device would
// be a host-driven step of every call, and a CPU value copied during graph capture is frozen into the graph.
inline void check_seed(const OptTensor& seed, double dropout_p, const Tensor& ref, const char* op) {
  if (!seed.has_value()) {
    TORCH_CHECK_VALUE(!(dropout_p > 0.0), "fastformer ", op, ": dropout_p = ", dropout_p,
                      " needs a seed, a 0-dim int64 tensor on ", ref.device(), "; got None");
    return;
  }
  TORCH_CHECK_VALUE(seed->dim() == 0 && seed->scalar_type() == at::kLong && seed->device() == ref.device(),
                    "fastformer ", op, ": seed must be a 0-dim int64 tensor on ", ref.device(),
                    " (the inputs' device), got dtype ", seed->scalar_type(), ", shape ", seed->sizes(), " on ",
                    seed->device());
}

inline OptTensor contiguous(const OptTensor& t) {
  return t.has_value() ? OptTensor(t->contiguous()) : std::nullopt;
}

// attention's (B, H, L, D) tensors as its kernels take them, one rule for every device: the kernels (CPU:
// csrc/cpu/attention.cpp; CUDA and cuda_sim: csrc/cuda/attention.cu; Triton: fastformer/triton/attention.py)
// read rows at any row, head and batch stride, so a tensor whose last dim is contiguous and whose rows do not
// overlap (a BLAS leading dimension >= D) passes as it is (transformers' q, k, v and the model's: views of
// (B, L, H, D) projections); any other is copied to a contiguous tensor.
inline Tensor attention_layout(const Tensor& t) {
  const bool rows =
      t.dim() == 4 && t.stride(3) == 1 && (t.size(2) <= 1 || t.stride(2) >= std::max<int64_t>(1, t.size(3)));
  return rows ? t : t.contiguous();
}

// attention_varlen's packed (T, H, D) tensors as its kernels take them: rows at any row and head stride with
// the last dim contiguous and rows that do not overlap (e.g. the heads of a packed (T, 3, H, D) projection)
// pass as they are; any other is copied to a contiguous tensor.
inline Tensor attention_varlen_layout(const Tensor& t) {
  const bool rows =
      t.dim() == 3 && t.stride(2) == 1 && (t.size(0) <= 1 || t.stride(0) >= std::max<int64_t>(1, t.size(2)));
  return rows ? t : t.contiguous();
}

// ---- adapters: registered op -> entry points of a backend (csrc/op_entry_points.h) ----
// Each checks the caller's arguments (the dropout seed: check_seed), makes the tensors contiguous (a no-op
// when they are; attention: attention_layout), resolves the default scale and calls the backend's function
// Impl.

template <auto Impl>
std::tuple<Tensor, Tensor> attention_fwd_op(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const OptTensor& key_padding_mask, bool causal, double dropout_p,
                                            std::optional<double> scale, const OptTensor& seed) {
  check_attention(q, k, v, key_padding_mask, dropout_p);
  check_seed(seed, dropout_p, q, "attention");
  return Impl(attention_layout(q), attention_layout(k), attention_layout(v), contiguous(key_padding_mask), causal,
              dropout_p, attention_scale(scale, q), seed);
}

template <auto Impl>
std::tuple<Tensor, Tensor, Tensor> attention_bwd_op(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                    const Tensor& v, const Tensor& out, const Tensor& lse,
                                                    const OptTensor& key_padding_mask, bool causal, double dropout_p,
                                                    std::optional<double> scale, const OptTensor& seed,
                                                    int64_t packed_grads) {
  check_attention_bwd(dout, q, k, v, out, lse, key_padding_mask, dropout_p, packed_grads);
  check_seed(seed, dropout_p, q, "attention");
  return Impl(attention_layout(dout), attention_layout(q), attention_layout(k), attention_layout(v),
              attention_layout(out), lse.contiguous(), contiguous(key_padding_mask), causal, dropout_p,
              attention_scale(scale, q), seed, packed_grads);
}

template <auto Impl>
std::tuple<Tensor, Tensor> attention_varlen_fwd_op(const Tensor& q, const Tensor& k, const Tensor& v,
                                                   const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                   int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                                   double dropout_p, std::optional<double> scale,
                                                   const OptTensor& seed) {
  check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p);
  check_seed(seed, dropout_p, q, "attention_varlen");
  return Impl(attention_varlen_layout(q), attention_varlen_layout(k), attention_varlen_layout(v),
              cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k, causal, dropout_p,
              attention_scale(scale, q), seed);
}

template <auto Impl>
std::tuple<Tensor, Tensor, Tensor> attention_varlen_bwd_op(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                           const Tensor& v, const Tensor& out, const Tensor& lse,
                                                           const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                           int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                                           double dropout_p, std::optional<double> scale,
                                                           const OptTensor& seed) {
  check_attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dropout_p);
  check_seed(seed, dropout_p, q, "attention_varlen");
  return Impl(attention_varlen_layout(dout), attention_varlen_layout(q), attention_varlen_layout(k),
              attention_varlen_layout(v), attention_varlen_layout(out), lse.contiguous(), cu_seqlens_q.contiguous(),
              cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k, causal, dropout_p, attention_scale(scale, q),
              seed);
}

template <auto Impl>
Tensor softmax_fwd_op(const Tensor& x, const OptTensor& mask, double scale) {
  check_softmax(x, mask, scale);
  return Impl(x.contiguous(), mask, scale);
}

template <auto Impl>
Tensor softmax_bwd_op(const Tensor& dy, const Tensor& y, double scale) {
  check_softmax_bwd(dy, y);
  return Impl(dy.contiguous(), y.contiguous(), scale);
}

// layer_norm_residual: compute_dtype reaches the entry points resolved, None as the residual's dtype (the
// entry points then write no y_c and return it empty).
template <auto Impl>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layer_norm_residual_fwd_op(
    const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias, double eps, double dropout_p,
    const OptTensor& seed, const OptTensor& x_bias, std::optional<at::ScalarType> compute_dtype) {
  check_layer_norm_residual(x, residual, weight, bias, eps, dropout_p, x_bias, compute_dtype);
  check_seed(seed, dropout_p, x, "layer_norm_residual");
  return Impl(x.contiguous(), residual.contiguous(), weight.contiguous(), bias.contiguous(), eps, dropout_p, seed,
              contiguous(x_bias), compute_dtype.value_or(residual.scalar_type()));
}

template <auto Impl>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layer_norm_residual_bwd_op(
    const Tensor& dy, const OptTensor& ds, const Tensor& s, const Tensor& weight, const Tensor& mean,
    const Tensor& rstd, double dropout_p, const OptTensor& seed, std::optional<at::ScalarType> dx_dtype,
    const OptTensor& dy_c, const OptTensor& x_bias) {
  check_layer_norm_residual_bwd(dy, ds, s, weight, mean, rstd, dropout_p, dx_dtype, dy_c, x_bias);
  check_seed(seed, dropout_p, s, "layer_norm_residual");
  return Impl(dy.contiguous(), contiguous(ds), s.contiguous(), weight.contiguous(), mean.contiguous(),
              rstd.contiguous(), dropout_p, seed, dx_dtype.value_or(s.scalar_type()), contiguous(dy_c),
              contiguous(x_bias));
}

template <auto Impl>
std::tuple<Tensor, Tensor, Tensor> cross_entropy_fwd_op(const Tensor& logits, const Tensor& target,
                                                        double label_smoothing, int64_t ignore_index) {
  check_cross_entropy(logits, target, label_smoothing, ignore_index);
  return Impl(logits.contiguous(), target.contiguous(), label_smoothing, ignore_index);
}

template <auto Impl>
Tensor cross_entropy_bwd_op(const Tensor& dloss, const Tensor& dnll, const Tensor& logits, const Tensor& target,
                            const Tensor& lse, double label_smoothing, int64_t ignore_index) {
  check_cross_entropy_bwd(dloss, dnll, logits, target, lse);
  return Impl(dloss.contiguous(), dnll.contiguous(), logits.contiguous(), target.contiguous(), lse.contiguous(),
              label_smoothing, ignore_index);
}

// bias_activation: the entry points take the activation's code (csrc/activation.h).
template <auto Impl>
Tensor bias_activation_fwd_op(const Tensor& x, const Tensor& bias, c10::string_view activation, double dropout_p,
                              const OptTensor& seed) {
  const int64_t code = check_bias_activation(x, bias, activation, dropout_p);
  check_seed(seed, dropout_p, x, "bias_activation");
  return Impl(x.contiguous(), bias.contiguous(), code, dropout_p, seed);
}

template <auto Impl>
std::tuple<Tensor, Tensor> bias_activation_bwd_op(const Tensor& dy, const Tensor& saved, const Tensor& bias,
                                                  c10::string_view activation, double dropout_p,
                                                  const OptTensor& seed) {
  const int64_t code = check_bias_activation_bwd(dy, saved, bias, activation, dropout_p);
  check_seed(seed, dropout_p, saved, "bias_activation");
  return Impl(dy.contiguous(), saved.contiguous(), bias.contiguous(), code, dropout_p, seed);
}

}  // namespace fastformer

// Registers a backend's entry points (namespace NS holding <op>_fwd / <op>_bwd) for one op under the
// dispatch key of the enclosing TORCH_LIBRARY_IMPL block.
#define FASTFORMER_IMPL_OP(m, NS, op)                              \
  m.impl(#op "_fwd", &::fastformer::op##_fwd_op<&NS::op##_fwd>); \
  m.impl(#op "_bwd", &::fastformer::op##_bwd_op<&NS::op##_bwd>)
