"""Plain-PyTorch reference of every op: the readable math that every backend is tested against
(in float64), and the ``torch`` backend itself (half inputs are computed in float32).

Each op has ``<op>_fwd`` and ``<op>_bwd`` with the same signature as the kernels'. Backward is
written out by hand (not taken from autograd) so the formulas here are the ones the kernels
implement; tests check them against autograd with torch.autograd.gradcheck.

Dropout draws its mask from the same Philox4x32-10 stream as csrc/philox.h (see there), so a seed
gives the same mask on every backend. A seed is an int or, as the ops pass it, a 0-dim int64 tensor on the
inputs' device (never read on the host: no sync on a GPU).
"""
from __future__ import annotations

import importlib.util
import math

import torch

_MASK32 = 0xFFFFFFFF


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------------
# Philox4x32-10 on int64 tensors holding uint32 values (products split so nothing overflows int64).


def _mul32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for uint32 a (tensor) and b (constant)."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_hi, p_lo = a * b_hi, a * b_lo  # each < 2^48
    low = ((p_hi & 0xFFFF) << 16) + p_lo  # a * b mod 2^48, its low 32 bits are the low word
    high = (p_hi + (p_lo >> 16)) >> 16  # floor(a * b / 2^32)
    return high & _MASK32, low & _MASK32


def philox4x32_10(seed, counter: torch.Tensor) -> list[torch.Tensor]:
    """The four uint32 words (as int64 tensors) of Philox4x32-10 at 64-bit ``counter`` with key ``seed`` (an
    int or a 0-dim int64 tensor)."""
    c0, c1 = counter & _MASK32, (counter >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        hi0, lo0 = _mul32(c0, 0xD2511F53)
        hi2, lo2 = _mul32(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return [c0, c1, c2, c3]


def _keep_words(seed, counter: torch.Tensor, p: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Keep-mask of the 4 elements of each Philox ``counter`` (4 counter + word, flattened in order): a
    word w becomes u = min(w, 2^32 - 1 - w) (csrc/philox.h's int32 reinterpretation, negatives mirrored to
    -x - 1) times ``scale`` = 2^-31 in float32, kept where u >= p (``p`` and ``scale`` float32 tensors,
    so that compiled code computes in float32 too)."""
    words = torch.stack(philox4x32_10(seed, counter), dim=-1).reshape(-1)
    return torch.minimum(words, _MASK32 - words).to(torch.float32) * scale >= p


# Counters per slice of dropout_keep on the CPU: the ~250 int64 operations of Philox then run on 512 KiB
# tensors that stay in cache, faster than one pass over the whole tensor (measured: docs/api.md, "Dropout").
_KEEP_SLICE = 1 << 16
_keep_words_compiled = None


def _keep_words_fused():
    """_keep_words through torch.compile (dynamic shapes, the seed a tensor: one graph for every call),
    for CUDA tensors: the ~250 int64 operations become one kernel instead of ~250 launches, each a full
    pass over the counters."""
    global _keep_words_compiled
    if _keep_words_compiled is None:
        _keep_words_compiled = torch.compile(_keep_words, dynamic=True)
    return _keep_words_compiled


def dropout_keep(seed, numel: int, p: float, device=None) -> torch.Tensor:
    """Bool keep-mask of elements 0 .. numel-1 of a tensor dropped with probability p.

    Element i takes word i % 4 of Philox counter i // 4 (_keep_words): one Philox evaluation per 4
    elements, whose (n/4, 4) words flatten to the elements in order. On the CPU in cache-sized slices,
    eagerly; on a CUDA device in one compiled kernel when Triton is there (torch.compile's GPU code
    generator), else eagerly in one pass."""
    device = torch.device("cpu") if device is None else torch.device(device)
    counters = (numel + 3) // 4
    scale = torch.tensor(4.6566127342e-10, dtype=torch.float32, device=device)
    threshold = torch.tensor(p, dtype=torch.float32, device=device)
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        counter = torch.arange(counters, dtype=torch.int64, device=device)
        seed_t = torch.as_tensor(seed, dtype=torch.int64, device=device)
        return _keep_words_fused()(seed_t, counter, threshold, scale)[:numel]
    keep = torch.empty(numel, dtype=torch.bool, device=device)
    step = _KEEP_SLICE if device.type == "cpu" else max(counters, 1)
    for first in range(0, counters, step):
        counter = torch.arange(first, min(counters, first + step), dtype=torch.int64, device=device)
        words = _keep_words(seed, counter, threshold, scale)[: numel - 4 * first]
        keep[4 * first: 4 * first + words.numel()] = words
    return keep


def _dropout_factor(seed, shape, p: float, dtype, device) -> torch.Tensor | None:
    """1/(1-p) where kept and 0 where dropped, shaped like the dropped tensor; None when p == 0."""
    if p == 0:
        return None
    keep = dropout_keep(seed, math.prod(shape), p, device).reshape(shape)
    one = torch.ones((), dtype=dtype, device=device)
    return keep.to(dtype) * (one / (one - p))


# --------------------------------------------------------------------------------------------------
# attention


def _visible(key_padding_mask, causal: bool, B: int, Lq: int, Lk: int, device) -> torch.Tensor:
    """(B, 1, Lq, Lk) bool: may query i attend to key j."""
    visible = torch.ones(B, 1, Lq, Lk, dtype=torch.bool, device=device)
    if key_padding_mask is not None:
        visible = visible & ~key_padding_mask[:, None, None, :]
    if causal:
        i = torch.arange(Lq, device=device)[:, None]
        j = torch.arange(Lk, device=device)[None, :]
        visible = visible & (j <= i + (Lk - Lq))
    return visible


def _probabilities(q, k, key_padding_mask, causal, scale):
    """softmax(scale q k^T) over visible keys (B, H, Lq, Lk), and the row logsumexp.

    Invisible keys are ignored whatever their scores. A row whose visible scores are all -inf (or that has
    no visible key) gives P = 0 and lse = -inf; a row with a NaN or +inf visible score gives P = NaN and
    lse = NaN (PyTorch's softmax does the same). P comes from torch.softmax (max-subtracted), not from
    e^(s - lse): with lse rounded to the dtype, e^(s - lse) errs by |s| ulp(lse) at large logits.
    """
    B, _, Lq, _ = q.shape
    Lk = k.shape[2]
    visible = _visible(key_padding_mask, causal, B, Lq, Lk, q.device)
    s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))
    empty = torch.isneginf(s).all(-1, keepdim=True)  # nothing visible, or only -inf scores
    s = s.masked_fill(empty, 0.0)
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(s, dim=-1, keepdim=True).masked_fill(empty, float("-inf"))
    lse = lse.masked_fill(p.isnan().any(-1, keepdim=True), float("nan"))  # logsumexp gives +inf for +inf
    return p, lse[..., 0]


def attention_probabilities(q, k, key_padding_mask, causal, scale):
    """softmax(scale q k^T) over the visible keys, (B, H, Lq, Lk), in float32 or float64."""
    acc = _acc_dtype(q.dtype)
    return _probabilities(q.to(acc), k.to(acc), key_padding_mask, causal, scale)[0]


def _expand_heads(t, H: int):
    """k or v (B, H_kv, L, D) as (B, H, L, D): query head h reads kv head h // (H / H_kv) (grouped-query)."""
    return t if t.shape[1] == H else t.repeat_interleave(H // t.shape[1], dim=1)


def _sum_groups(g, H_kv: int):
    """A gradient (B, H, L, D) of the expanded k or v, summed over each group of heads: (B, H_kv, L, D)."""
    B, H, L, D = g.shape
    return g if H == H_kv else g.reshape(B, H_kv, H // H_kv, L, D).sum(2)


def _forward(qa, ka, va, key_padding_mask, causal, scale, drop):
    """out and lse of attention in the accumulation dtype; ``drop(shape)`` gives the dropout factors of the
    probabilities (B, H, Lq, Lk), or None."""
    ka, va = _expand_heads(ka, qa.shape[1]), _expand_heads(va, qa.shape[1])
    p, lse = _probabilities(qa, ka, key_padding_mask, causal, scale)
    factor = drop(p.shape)
    if factor is not None:
        p = p * factor
    return p @ va, lse


def _backward(doa, qa, ka, va, oa, key_padding_mask, causal, scale, drop):
    """dq, dk, dv in the accumulation dtype (dk, dv with k's heads), P recomputed; ``drop`` as in _forward."""
    H_kv = ka.shape[1]
    ka, va = _expand_heads(ka, qa.shape[1]), _expand_heads(va, qa.shape[1])
    p, _ = _probabilities(qa, ka, key_padding_mask, causal, scale)
    factor = drop(p.shape)
    p_dropped = p if factor is None else p * factor
    dv = p_dropped.transpose(-1, -2) @ doa  # dV = (P r)^T dO
    dp = doa @ va.transpose(-1, -2)  # dP = (dO V^T) r
    if factor is not None:
        dp = dp * factor
    delta = (doa * oa).sum(-1, keepdim=True)  # D_i = dO_i . O_i
    ds = p * (dp - delta)  # dS = P (dP - D)
    dq = (ds @ ka) * scale
    dk = (ds.transpose(-1, -2) @ qa) * scale
    return dq, _sum_groups(dk, H_kv), _sum_groups(dv, H_kv)


def attention_fwd(q, k, v, key_padding_mask, causal, dropout_p, scale, seed):
    acc = _acc_dtype(q.dtype)
    drop = lambda shape: _dropout_factor(seed, shape, dropout_p, acc, q.device)  # noqa: E731
    out, lse = _forward(q.to(acc), k.to(acc), v.to(acc), key_padding_mask, causal, scale, drop)
    return out.to(q.dtype), lse


def attention_bwd(dout, q, k, v, out, lse, key_padding_mask, causal, dropout_p, scale, seed, packed_grads):
    """The gradients, contiguous, as attention_bwd's outputs (a packed gradient stacked: ``packed_grads``,
    csrc/attention_grads.h)."""
    from fastformer.ops.attention import packed_outputs

    acc = _acc_dtype(q.dtype)
    drop = lambda shape: _dropout_factor(seed, shape, dropout_p, acc, q.device)  # noqa: E731
    dq, dk, dv = _backward(*(t.to(acc) for t in (dout, q, k, v, out)), key_padding_mask, causal, scale, drop)
    return packed_outputs(dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), packed_grads)


# --------------------------------------------------------------------------------------------------
# attention_varlen: packed sequences, each computed as one dense (1, H, L, D) attention


def dropout_keep_at(seed, index: torch.Tensor, p: float) -> torch.Tensor:
    """The keep-mask of dropout_keep at arbitrary element indices (int64 tensor): element i takes word i % 4
    of Philox counter i // 4, kept where min(w, 2^32 - 1 - w) 2^-31 >= p in float32 (_keep_words)."""
    words = torch.stack(philox4x32_10(seed, index >> 2), dim=-1)
    w = words.gather(-1, (index & 3)[..., None])[..., 0]
    scale = torch.tensor(4.6566127342e-10, dtype=torch.float32, device=index.device)
    return torch.minimum(w, _MASK32 - w).to(torch.float32) * scale >= torch.tensor(p, dtype=torch.float32,
                                                                                   device=index.device)


def _varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k):
    """(b, query rows, key rows) of each packed sequence (the tables read on the host)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(b, slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]


def _as_dense(t, rows: slice, acc):
    """Rows of a packed (T, H, D) tensor as a dense (1, H, L, D) one in the accumulation dtype."""
    return t[rows].to(acc).transpose(0, 1)[None]


def _varlen_drop(seed, p: float, acc, Tq: int, Tk: int, rows: slice, device):
    """Dropout factors of one sequence's probabilities (1, H, Lq, Lk): element (h, i, j) is index
    (h Tq + rows.start + i) Tk + j of the Philox stream (csrc/cpu/attention.cpp's rule for packed sequences)."""
    if p == 0:
        return lambda shape: None

    def drop(shape):
        _, H, Lq, Lk = shape
        h = torch.arange(H, device=device)[:, None, None]
        i = torch.arange(Lq, device=device)[None, :, None]
        j = torch.arange(Lk, device=device)[None, None, :]
        keep = dropout_keep_at(seed, (h * Tq + rows.start + i) * Tk + j, p)[None]
        one = torch.ones((), dtype=acc, device=keep.device)
        return keep.to(acc) * (one / (one - p))
    return drop


def attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p, scale,
                         seed):
    acc = _acc_dtype(q.dtype)
    Tq, H, _ = q.shape
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((H, Tq), float("-inf"), dtype=acc, device=q.device)
    for _, rq, rk in _varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k):
        if rq.stop == rq.start:
            continue
        drop = _varlen_drop(seed, dropout_p, acc, Tq, k.shape[0], rq, q.device)
        o, l = _forward(_as_dense(q, rq, acc), _as_dense(k, rk, acc), _as_dense(v, rk, acc), None, causal, scale, drop)
        out[rq] = o[0].transpose(0, 1).to(q.dtype)
        lse[:, rq] = l[0]
    return out, lse


def attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         dropout_p, scale, seed):
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    for _, rq, rk in _varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k):
        drop = _varlen_drop(seed, dropout_p, acc, q.shape[0], k.shape[0], rq, q.device)
        g = _backward(*(_as_dense(t, r, acc) for t, r in ((dout, rq), (q, rq), (k, rk), (v, rk), (out, rq))), None,
                      causal, scale, drop)
        for grad, dense, rows in zip((dq, dk, dv), g, (rq, rk, rk)):
            grad[rows] = dense[0].transpose(0, 1).to(grad.dtype)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# softmax


def softmax_fwd(x, mask, scale):
    """A row whose entries are all -inf after masking gives zeros; one with a NaN or +inf entry (not
    masked) gives NaN in every column, as torch.softmax does."""
    acc = _acc_dtype(x.dtype)
    a = x.to(acc) * scale
    if mask is not None:
        a = a.masked_fill(mask, float("-inf"))
    empty = torch.isneginf(a).all(-1, keepdim=True)
    y = torch.softmax(a.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return y.to(x.dtype)


def softmax_bwd(dy, y, scale):
    acc = _acc_dtype(y.dtype)
    ya, dya = y.to(acc), dy.to(acc)
    return (scale * ya * (dya - (dya * ya).sum(-1, keepdim=True))).to(y.dtype)


# --------------------------------------------------------------------------------------------------
# layer_norm_residual


def layer_norm_residual_fwd(x, residual, weight, bias, eps, dropout_p, seed, x_bias, compute_dtype):
    """y, s in residual's dtype (the stream's), s = residual + dropout(x + x_bias); x may be float16 or bfloat16
    beside a float32 residual and is upcast here, as the kernels upcast it when they read it, and x_bias (any
    floating dtype) with it. y_c = y.to(compute_dtype), or empty (0,) when compute_dtype is residual's dtype."""
    acc = _acc_dtype(residual.dtype)
    drop = _dropout_factor(seed, x.shape, dropout_p, acc, x.device)
    branch = x.to(acc) if x_bias is None else x.to(acc) + x_bias.to(acc)
    s = residual.to(acc) + (branch if drop is None else branch * drop)
    s = s.to(residual.dtype).to(acc)  # normalize the s that is returned, so backward rebuilds the same xhat
    mean = s.mean(-1)
    rstd = torch.rsqrt(s.var(-1, unbiased=False) + eps)
    y = ((s - mean[..., None]) * rstd[..., None] * weight.to(acc) + bias.to(acc)).to(residual.dtype)
    y_c = y.to(compute_dtype) if compute_dtype != residual.dtype else residual.new_empty(0)
    return y, s.to(residual.dtype), mean, rstd, y_c


def layer_norm_residual_bwd(dy, ds, s, weight, mean, rstd, dropout_p, seed, dx_dtype, dy_c, x_bias):
    """dx in dx_dtype (x's), dresidual in s's dtype, dweight and dbias in weight's, dx_bias = sum over rows of
    dx in x_bias's dtype (empty (0,) without x_bias); dy_c (the gradient of y_c) adds to dy."""
    acc = _acc_dtype(s.dtype)
    dya = dy.to(acc) if dy_c is None else dy.to(acc) + dy_c.to(acc)
    xhat = (s.to(acc) - mean[..., None]) * rstd[..., None]
    g = dya * weight.to(acc)
    d_s = rstd[..., None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if ds is not None:
        d_s = d_s + ds.to(acc)
    drop = _dropout_factor(seed, s.shape, dropout_p, acc, s.device)
    dx = d_s.clone() if drop is None else d_s * drop  # a separate tensor: outputs must not alias
    rows = tuple(range(s.dim() - 1))  # empty for a 1-D input, where sum(()) would reduce every dim
    dweight = (dya * xhat).sum(rows) if rows else dya * xhat
    dbias = dya.sum(rows) if rows else dya.clone()
    if x_bias is None:
        dx_bias = weight.new_empty(0)
    else:
        dx_bias = (dx.sum(rows) if rows else dx.clone()).to(x_bias.dtype)
    return dx.to(dx_dtype), d_s.to(s.dtype), dweight.to(weight.dtype), dbias.to(weight.dtype), dx_bias


# --------------------------------------------------------------------------------------------------
# cross_entropy


def _gathered(target, ignore_index, V):
    """(ignored, outside, index): the rows whose target is ignore_index, those whose other target is outside
    [0, V) (refused by the checks, csrc/ops.h, but perhaps only after this ran: a deferred check on a GPU), and
    an index in [0, V) for every row to gather or scatter at (0 for both kinds), so that no target reaches
    gather or scatter outside the row (a device-side assert on a GPU)."""
    ignored = target == ignore_index
    outside = ~ignored & ((target < 0) | (target >= V))
    return ignored, outside, target.masked_fill(ignored | outside, 0)


def cross_entropy_fwd(logits, target, label_smoothing, ignore_index):
    """Per row of logits (..., V): loss = (1 - e) nll + e (lse - mean x), nll = lse - x[target], lse; loss
    and nll are 0 where target == ignore_index, NaN where the target is outside [0, V) (as in the kernels).
    A NaN or +inf logit makes the row's lse NaN."""
    acc = _acc_dtype(logits.dtype)
    x = logits.to(acc)
    lse = torch.logsumexp(x, dim=-1)
    lse = lse.masked_fill(torch.isposinf(x).any(-1), float("nan"))  # logsumexp gives +inf there
    ignored, outside, index = _gathered(target, ignore_index, x.shape[-1])
    x_t = x.gather(-1, index[..., None])[..., 0]
    nll = (lse - x_t).masked_fill(outside, float("nan"))
    loss = nll if label_smoothing == 0 else (1 - label_smoothing) * nll + label_smoothing * (lse - x.mean(-1))
    return loss.masked_fill(ignored, 0.0), nll.masked_fill(ignored, 0.0), lse


def cross_entropy_bwd(dloss, dnll, logits, target, lse, label_smoothing, ignore_index):
    """dlogits = (dloss + dnll) softmax(x) - ((1 - e) dloss + dnll) onehot(target) - e dloss / V, zero
    where target == ignore_index; a target outside [0, V) has no one-hot column."""
    acc = _acc_dtype(logits.dtype)
    x = logits.to(acc)
    V = x.shape[-1]
    ignored, outside, index = _gathered(target, ignore_index, V)
    dloss, dnll = dloss.to(acc), dnll.to(acc)
    dx = torch.exp(x - lse[..., None])  # softmax(x); updated in place below (one (R, V) buffer)
    dx.mul_((dloss + dnll)[..., None]).sub_((label_smoothing * dloss / V)[..., None])
    onehot = ((1 - label_smoothing) * dloss + dnll).masked_fill(outside, 0.0)[..., None]
    dx.scatter_add_(-1, index[..., None], -onehot)
    return dx.masked_fill_(ignored[..., None], 0.0).to(logits.dtype)


# --------------------------------------------------------------------------------------------------
# bias_activation


def _act(code: int, h: torch.Tensor) -> torch.Tensor:
    """The activation of ``code`` (csrc/activation.h: 0 relu, 1 gelu exact, 2 silu) of h."""
    if code == 0:
        return torch.relu(h)
    if code == 1:
        return 0.5 * h * (1.0 + torch.erf(h * math.sqrt(0.5)))
    return h * torch.sigmoid(h)


def _act_grad(code: int, h: torch.Tensor) -> torch.Tensor:
    """act'(h) of gelu (Phi(h) + h phi(h)) and silu (s (1 + h (1 - s)), s = sigmoid(h))."""
    if code == 1:
        return 0.5 * (1.0 + torch.erf(h * math.sqrt(0.5))) + h * torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)
    s = torch.sigmoid(h)
    return s * (1.0 + h * (1.0 - s))


def bias_activation_fwd(x, bias, activation, dropout_p, seed):
    """y = dropout(act(x + bias)) in x's dtype, computed in float32 (float64 for float64 x); activation is the
    code of csrc/activation.h; the dropout element index is the flat row-major index in x."""
    acc = _acc_dtype(x.dtype)
    y = _act(activation, x.to(acc) + bias.to(acc))
    drop = _dropout_factor(seed, x.shape, dropout_p, acc, x.device)
    return (y if drop is None else y * drop).to(x.dtype)


def bias_activation_bwd(dy, saved, bias, activation, dropout_p, seed):
    """dx in saved's dtype, dbias (summed over the rows) in bias's. saved is the forward's y for relu (dz = dy /
    (1 - p) where y > 0), its x for gelu and silu (h = x + bias, the mask regenerated from the seed)."""
    acc = _acc_dtype(saved.dtype)
    s = saved.to(acc)
    if activation == 0:
        dz = torch.where(s > 0, dy.to(acc) / (1.0 - dropout_p), 0.0)
    else:
        dz = dy.to(acc) * _act_grad(activation, s + bias.to(acc))
        drop = _dropout_factor(seed, saved.shape, dropout_p, acc, saved.device)
        dz = dz if drop is None else dz * drop
    rows = tuple(range(saved.dim() - 1))  # empty for a 1-D input, where sum(()) would reduce every dim
    dbias = dz.sum(rows) if rows else dz.clone()  # a separate tensor: outputs must not alias
    return dz.to(saved.dtype), dbias.to(bias.dtype)
