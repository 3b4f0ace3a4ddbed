// The entry points every C++ backend defines, declared once for all of them: csrc/cpu/cpu_ops.h includes
// this file inside namespace fastformer::cpu, csrc/cuda/cuda_ops.h inside fastformer::cuda (so it has
// no include guard, on purpose: no #pragma once). The includer provides ATen, c10::optional, <tuple> and `using at::Tensor`.
// Half types' statistics (lse, mean, rstd) are float32; float64 inputs (cpu only) keep float64.
// seed (attention, layer_norm_residual): the dropout seed, a 0-dim int64 tensor on the inputs' device (csrc/ops.h
// check_seed), given when dropout_p > 0; the CUDA kernels read it from device memory, the CPU ones on the host.

// attention: q (B, H, Lq, D), k/v (B, H_kv, Lk, D) (H a multiple of H_kv), key_padding_mask (B, Lk) bool.
// Returns out (B, H, Lq, D) and the row logsumexp lse (B, H, Lq) in the accumulation dtype.
std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const c10::optional<Tensor>& key_padding_mask, bool causal,
                                         double dropout_p, double scale, const c10::optional<Tensor>& seed);
std::tuple<Tensor, Tensor, Tensor> attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                 const Tensor& v, const Tensor& out, const Tensor& lse,
                                                 const c10::optional<Tensor>& key_padding_mask, bool causal,
                                                 double dropout_p, double scale, const c10::optional<Tensor>& seed,
                                                 int64_t packed_grads);  // csrc/attention_grads.h

// attention_varlen: packed sequences, q (Tq, H, D), k/v (Tk, H_kv, D), sequence b at rows cu_seqlens_q[b] ..
// cu_seqlens_q[b + 1] of q (int32, B + 1) and cu_seqlens_k[b] .. of k and v. Returns out (Tq, H, D) and lse
// (H, Tq) in the accumulation dtype.
std::tuple<Tensor, Tensor> attention_varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                                double dropout_p, double scale, const c10::optional<Tensor>& seed);
std::tuple<Tensor, Tensor, Tensor> attention_varlen_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                        const Tensor& v, const Tensor& out, const Tensor& lse,
                                                        const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                        int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                                        double dropout_p, double scale,
                                                        const c10::optional<Tensor>& seed);

// softmax over the last dim of x (..., N); mask is bool and broadcastable to x.
Tensor softmax_fwd(const Tensor& x, const c10::optional<Tensor>& mask, double scale);
Tensor softmax_bwd(const Tensor& dy, const Tensor& y, double scale);

// layer_norm_residual over the last dim of (..., N): returns y, s = residual + dropout(x + x_bias), mean, rstd
// and y_c, with y and s in residual's dtype (x may be float16 or bfloat16 beside a float32 residual: csrc/ops.h
// lnr_branch_dtype_ok; x_bias (N,) is any floating dtype, or absent) and y_c = y rounded to compute_dtype,
// written by the same pass (empty (0,) when compute_dtype is residual's dtype: no extra output). Backward
// takes the gradients of y (dy) and y_c (dy_c, optional; they add) and writes dx in dx_dtype (x's),
// dresidual in s's dtype, dweight and dbias in weight's, and dx_bias = sum over rows of dx in x_bias's dtype
// (empty (0,) without x_bias), each by the kernels themselves.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layer_norm_residual_fwd(
    const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias, double eps, double dropout_p,
    const c10::optional<Tensor>& seed, const c10::optional<Tensor>& x_bias, at::ScalarType compute_dtype);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> layer_norm_residual_bwd(
    const Tensor& dy, const c10::optional<Tensor>& ds, const Tensor& s, const Tensor& weight, const Tensor& mean,
    const Tensor& rstd, double dropout_p, const c10::optional<Tensor>& seed, at::ScalarType dx_dtype,
    const c10::optional<Tensor>& dy_c, const c10::optional<Tensor>& x_bias);

// cross_entropy over the last dim of logits (..., V) for int64 target (...): returns per-row loss (label-
// smoothed), nll and the row logsumexp lse, shaped like target, in the accumulation dtype; a row whose
// target is ignore_index has loss = nll = 0. Backward: dlogits = (dloss + dnll) softmax(logits)
// - ((1 - e) dloss + dnll) onehot(target) - e dloss / V, zero in ignored rows.
std::tuple<Tensor, Tensor, Tensor> cross_entropy_fwd(const Tensor& logits, const Tensor& target,
                                                     double label_smoothing, int64_t ignore_index);
Tensor cross_entropy_bwd(const Tensor& dloss, const Tensor& dnll, const Tensor& logits, const Tensor& target,
                         const Tensor& lse, double label_smoothing, int64_t ignore_index);

// bias_activation over the last dim of x (..., N): y = dropout(act(x + bias)) in x's dtype, computed in the
// accumulation dtype (float32; float64 for float64 x); bias (N,) of any floating dtype; activation a code of
// csrc/activation.h; dropout element index = the flat row-major index of the element in x. Backward from saved
// = y (relu: dz = dy (y > 0) / (1 - p), no seed needed) or x (gelu, silu: h = x + bias and the mask again):
// dx in saved's dtype, dbias = sum over rows of dz in bias's dtype, in a fixed order.
Tensor bias_activation_fwd(const Tensor& x, const Tensor& bias, int64_t activation, double dropout_p,
                           const c10::optional<Tensor>& seed);
std::tuple<Tensor, Tensor> bias_activation_bwd(const Tensor& dy, const Tensor& saved, const Tensor& bias,
                                               int64_t activation, double dropout_p,
                                               const c10::optional<Tensor>& seed);
