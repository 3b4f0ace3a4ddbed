"""Non-finite and degenerate inputs: one rule on every backend (docs/correctness.md, "Non-finite and degenerate input").

- softmax: with a = scale * x and masked entries -inf, a row of only -inf gives zeros; a row with a NaN or
  +inf entry that is not masked gives NaN in every column (torch.softmax's answer); masked entries are
  never read into the result, whatever they hold.
- attention: the same rule per query row over its visible scores (out and lse NaN, or zeros and lse -inf);
  NaN or inf in a padded K row leaves the output and dV exact. A NaN in a padded V row (forward, P V) or
  K row (backward, dQ = dS K) is multiplied by a zero: each row of the result is then either its true
  value or NaN, so padded K/V must hold finite values (a cache allocated with torch.empty does not).
- attention_varlen: the same rule per packed query row; a non-finite key or value row reaches only the
  queries of its own sequence that see it, never a neighbouring sequence's rows or gradients.
- layer_norm_residual: a row holding NaN or +-inf is NaN; the other rows are untouched.
- cross_entropy: a NaN or +inf logit makes the row's loss and nll NaN; a row of only -inf logits has NaN
  nll (and loss); a -inf logit that is not the target is a class of probability 0: the loss stays finite
  (the row without that class) when label_smoothing is 0 and is +inf when it is not (its smoothing term);
  a -inf target logit gives +inf nll and loss. Ignored rows give 0 and a zero gradient, whatever they hold.
- scale must be finite in the kernels' arithmetic (float32 for every dtype but float64); head dim 0 gives
  the empty result, as PyTorch's SDPA does.
Backward follows by arithmetic: rows that saw a NaN get NaN gradients, the other rows stay exact.
"""
import math

import pytest
import torch

from fastformer import ops
from helpers import ALL_BACKENDS, backend_dtypes, forward_backward, randn, upcast
from tolerances import assert_close

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
@pytest.mark.parametrize("N", [1, 7, 33, 97, 1025])
def test_softmax_nonfinite_logits(backend, dtype, N):
    # Row 0: NaN, row 1: +inf, row 2: -inf (acts as masked), row 3: NaN where masked, row 4: all -inf,
    # row 5: untouched. The bad column moves with N so it falls in vector bodies and tails alike.
    col = (N * 5) // 7
    x = randn(6, N, dtype=dtype)
    x[0, col], x[1, col], x[2, col], x[3, col] = NAN, INF, -INF, NAN
    x[4] = -INF
    mask = torch.zeros(6, N, dtype=torch.bool)
    mask[3, col] = True
    dy = randn(6, N, dtype=dtype)
    (y,), (dx,) = forward_backward(lambda x: ops.softmax(x, mask=mask, backend=backend), [x], [dy])
    assert y[0].isnan().all() and y[1].isnan().all(), "an unmasked NaN or +inf must make the whole row NaN"
    assert dx[0].isnan().all() and dx[1].isnan().all()
    assert (y[4] == 0).all() and (dx[4] == 0).all(), "a row of -inf logits must give zeros"
    assert y[2, col] == 0 and y[3, col] == 0, "a -inf or masked entry must get probability 0"
    # Rows 2, 3 and 5 are the softmax of their finite entries (2 and 3 with `col` masked).
    clean = x.clone()
    clean[2:4, col] = 0.0
    clean_mask = mask.clone()
    clean_mask[2, col] = True
    good = [2, 3, 5] if N > 1 else [5]
    (ref,), (ref_dx,) = forward_backward(lambda x: ops.softmax(x, mask=clean_mask, backend="torch"),
                                         upcast([clean]), upcast([dy]))
    assert_close(y[good], ref[good], dtype, "y")
    assert_close(dx[good], ref_dx[good], dtype, "dx")


def _attention_inputs(dtype, D=16, L=33):
    q, k, v = (randn(2, 2, L, D, dtype=dtype) for _ in range(3))
    k[..., 0] = k[..., 0].abs() + 0.5  # so an infinite q[..., 0] gives every score of its row one sign
    return q, k, v, randn(2, 2, L, D, dtype=dtype)


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
@pytest.mark.parametrize("causal", [False, True])
def test_attention_nonfinite_scores(backend, dtype, causal):
    q, k, v, dout = _attention_inputs(dtype)
    bad = {(0, 0, 3): NAN, (0, 1, 20): INF, (1, 0, 31): -INF}  # NaN, +inf and -inf scores in three rows
    for (b, h, i), value in bad.items():
        q[b, h, i, 0] = value
    (out,), (dq, dk, dv) = forward_backward(
        lambda q, k, v: ops.attention(q, k, v, causal=causal, backend=backend), [q, k, v], [dout])
    assert out[0, 0, 3].isnan().all() and out[0, 1, 20].isnan().all(), "a NaN or +inf score must make the row NaN"
    assert dq[0, 0, 3].isnan().all() and dq[0, 1, 20].isnan().all()
    assert (out[1, 0, 31] == 0).all() and (dq[1, 0, 31] == 0).all(), "a row of -inf scores must give zeros"
    # Every other query row (of these heads, and all of the other heads) is exact.
    rows = torch.ones(2, 2, 33, dtype=torch.bool)
    for b, h, i in bad:
        rows[b, h, i] = False
    clean = q.clone()
    clean[..., 0] = torch.where(rows, q[..., 0], 0.0)
    (ref,), (ref_dq, ref_dk, ref_dv) = forward_backward(
        lambda q, k, v: ops.attention(q, k, v, causal=causal, backend="torch"), upcast([clean, k, v]), upcast([dout]))
    assert_close(out[rows], ref[rows], dtype, "out")
    assert_close(dq[rows], ref_dq[rows], dtype, "dq")
    # The one head with no bad row has exact dk, dv too.
    assert_close(dk[1, 1], ref_dk[1, 1], dtype, "dk")
    assert_close(dv[1, 1], ref_dv[1, 1], dtype, "dv")


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_attention_ignores_padded_keys_whatever_they_hold(backend, dtype, value):
    q, k, v, dout = _attention_inputs(dtype)
    mask = torch.zeros(2, 33, dtype=torch.bool)
    mask[0, 5] = mask[1, 30:] = True
    poisoned = k.clone()
    poisoned[0, :, 5] = value
    poisoned[1, :, 30:] = value
    (out,), (dq, _, dv) = forward_backward(
        lambda q, k, v: ops.attention(q, k, v, key_padding_mask=mask, backend=backend), [q, poisoned, v], [dout])
    (ref,), (ref_dq, _, ref_dv) = forward_backward(
        lambda q, k, v: ops.attention(q, k, v, key_padding_mask=mask, backend="torch"), upcast([q, k, v]),
        upcast([dout]))
    assert_close(out, ref, dtype, "out")
    assert_close(dv, ref_dv, dtype, "dv")
    # dQ = dS K multiplies the padded row by a zero dS, like P V in the forward: true values or NaN.
    finite = torch.isfinite(dq).all(-1)
    assert_close(dq[finite], ref_dq[finite], dtype, "dq (finite rows)")


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
def test_attention_nan_in_padded_values(backend, dtype):
    # Documented, not fixed: P V multiplies the padded row's NaN by a zero probability. Each output row is
    # its true value or NaN, never a wrong finite number.
    q, k, v, _ = _attention_inputs(dtype)
    mask = torch.zeros(2, 33, dtype=torch.bool)
    mask[0, 7] = True
    poisoned = v.clone()
    poisoned[0, :, 7] = NAN
    out = ops.attention(q, k, poisoned, key_padding_mask=mask, backend=backend)
    ref = ops.attention(*upcast([q, k, v]), key_padding_mask=mask, backend="torch")
    assert torch.isfinite(out[1]).all(), "a batch element without the NaN must stay finite"
    finite = torch.isfinite(out).all(-1)
    assert_close(out[finite], ref[finite], dtype, "finite rows")


# attention_varlen: self-attention over packed sequences of 9, 0, 13, 11 and 6 tokens, 2 query heads sharing
# 1 key/value head (grouped-query). Sequence b is rows VARLEN_CU[b]:VARLEN_CU[b + 1].
VARLEN_LENS, VARLEN_H, VARLEN_H_KV = (9, 0, 13, 11, 6), 2, 1
VARLEN_CU = torch.tensor([0, 9, 9, 22, 33, 39], dtype=torch.int32)


def _varlen(causal, backend):
    def run(q, k, v):
        return ops.attention_varlen(q, k, v, VARLEN_CU, VARLEN_CU, max(VARLEN_LENS), max(VARLEN_LENS), causal=causal,
                                    backend=backend)
    return run


def _varlen_inputs(dtype, D=16):
    T = sum(VARLEN_LENS)
    q, dout = randn(T, VARLEN_H, D, dtype=dtype), randn(T, VARLEN_H, D, dtype=dtype)
    k, v = randn(T, VARLEN_H_KV, D, dtype=dtype), randn(T, VARLEN_H_KV, D, dtype=dtype)
    return q, k, v, dout


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
@pytest.mark.parametrize("causal", [False, True])
def test_attention_varlen_nonfinite_query_rows(backend, dtype, causal):
    # The attention rule per packed query row: a NaN or +inf score makes the row NaN, a row of -inf scores
    # gives zeros; every other row, and the dk, dv of a sequence with no bad query, stay exact.
    q, k, v, dout = _varlen_inputs(dtype)
    k[..., 0] = k[..., 0].abs() + 0.5  # so an infinite q[..., 0] gives every score of its row one sign
    bad = {(3, 0): NAN, (21, 1): INF, (22, 0): -INF}  # (packed row, head): sequence 0, last of 2, first of 3
    for (i, h), value in bad.items():
        q[i, h, 0] = value
    (out,), (dq, dk, dv) = forward_backward(_varlen(causal, backend), [q, k, v], [dout])
    assert out[3, 0].isnan().all() and out[21, 1].isnan().all(), "a NaN or +inf score must make the row NaN"
    assert dq[3, 0].isnan().all() and dq[21, 1].isnan().all()
    assert (out[22, 0] == 0).all() and (dq[22, 0] == 0).all(), "a row of -inf scores must give zeros"
    rows = torch.ones(sum(VARLEN_LENS), VARLEN_H, dtype=torch.bool)
    for i, h in bad:
        rows[i, h] = False
    clean = q.clone()
    clean[..., 0] = torch.where(rows, q[..., 0], 0.0)
    (ref,), (ref_dq, ref_dk, ref_dv) = forward_backward(_varlen(causal, "torch"), upcast([clean, k, v]),
                                                        upcast([dout]))
    assert_close(out[rows], ref[rows], dtype, "out")
    assert_close(dq[rows], ref_dq[rows], dtype, "dq")
    # Sequence 4 (rows 33:39) holds no bad query: its keys' gradients are exact, next to sequence 3's NaN.
    assert_close(dk[33:], ref_dk[33:], dtype, "dk of sequence 4")
    assert_close(dv[33:], ref_dv[33:], dtype, "dv of sequence 4")
    # Sequence 0's dk, dv: the NaN query row reaches every key it sees (all of them, or keys 0..3 when causal).
    assert dk[:4].isnan().all() and dv[:4].isnan().all()


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("which", ["k", "v"])
def test_attention_varlen_poisoned_key_stays_in_its_sequence(backend, dtype, causal, value, which):
    # A non-finite key or value row poisons the query rows of its own sequence that see it, nothing else:
    # sequence 2 (rows 9:22), packed between poisoned sequences 0 and 3, is exact (out, dq, dk, dv), and so
    # are the rows of sequence 0 that causal masking hides the key from (the rule of a masked key).
    q, k, v, dout = _varlen_inputs(dtype)
    q[..., 0] = q[..., 0].abs() + 0.1  # scores against an all-inf key row: +inf and -inf terms, so NaN
    q[..., 1] = -q[..., 1].abs() - 0.1
    poisoned = {"k": k, "v": v}[which].clone()
    poisoned[5] = value  # key 5 of sequence 0: seen by queries 5.. when causal
    poisoned[22] = value  # key 0 of sequence 3: seen by all its queries
    inputs = [q, poisoned, v] if which == "k" else [q, k, poisoned]
    (out,), (dq, dk, dv) = forward_backward(_varlen(causal, backend), inputs, [dout])
    (ref,), (ref_dq, ref_dk, ref_dv) = forward_backward(_varlen(causal, "torch"), upcast([q, k, v]), upcast([dout]))
    seen = torch.zeros(sum(VARLEN_LENS), dtype=torch.bool)
    seen[5 if causal else 0: 9] = True
    seen[22:33] = True
    assert not torch.isfinite(out[seen]).any(), "every query that sees a non-finite key or value row is non-finite"
    clean = slice(9, 22)
    for name, a, e in (("out", out, ref), ("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert_close(a[clean], e[clean], dtype, f"{name} of sequence 2")
    assert_close(out[33:], ref[33:], dtype, "out of sequence 4")
    if causal:
        hidden = slice(0, 5)  # queries 0..4 of sequence 0 do not see key 5
        if which == "k":  # a masked K row: out exact; dQ = dS K multiplies it by 0: true values or NaN
            assert_close(out[hidden], ref[hidden], dtype, "out of the queries the key is hidden from")
            finite = torch.isfinite(dq[hidden]).all(-1)
            assert_close(dq[hidden][finite], ref_dq[hidden][finite], dtype, "dq (finite rows)")
        else:  # a masked V row: P V multiplies it by 0, each row its true value or NaN
            finite = torch.isfinite(out[hidden]).all(-1)
            assert_close(out[hidden][finite], ref[hidden][finite], dtype, "out (finite rows)")


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_layer_norm_residual_nonfinite_rows(backend, dtype, value):
    x, residual = randn(5, 97, dtype=dtype), randn(5, 97, dtype=dtype)
    weight, bias = randn(97, dtype=dtype, shift=1.0), randn(97, dtype=dtype)
    x[1, 13] = value
    y = ops.layer_norm_residual(x, residual, weight, bias, backend=backend)
    assert y[1].isnan().all(), "a row holding NaN or inf must normalize to NaN"
    rows = [0, 2, 3, 4]
    ref = ops.layer_norm_residual(*upcast([x[rows], residual[rows], weight, bias]), backend="torch")
    assert_close(y[rows], ref, dtype, "y")


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_bias_activation_nonfinite_elements(backend, dtype, activation):
    # NaN stays NaN through every activation (relu too, as torch.relu), +inf stays +inf; -inf gives 0 for relu
    # and NaN for gelu and silu (-inf times 0, as F.gelu and F.silu give); every other element is untouched.
    x = randn(5, 97, dtype=dtype)
    bias = randn(97, dtype=torch.float32)
    x[1, 13], x[2, 40], x[3, 96] = NAN, INF, -INF
    y = ops.bias_activation(x, bias, activation=activation, backend=backend)
    ref = ops.bias_activation(*upcast([x, bias]), activation=activation, backend="torch")
    assert y[1, 13].isnan() and y[2, 40] == INF
    assert (y[3, 96] == 0 if activation == "relu" else y[3, 96].isnan())
    finite = torch.isfinite(x)
    assert_close(y[finite], ref[finite], dtype, "y")


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
def test_scale_that_overflows_the_arithmetic_is_refused(backend, dtype):
    x = randn(3, 7, dtype=dtype)
    q = randn(1, 1, 3, 8, dtype=dtype)
    if dtype == torch.float64:  # 1e39 is a float64 number: computed, not refused
        assert torch.isfinite(ops.softmax(x, scale=1e39, backend=backend)).all()
        return
    with pytest.raises(ValueError, match="overflows float32"):
        ops.softmax(x, scale=1e39, backend=backend)
    with pytest.raises(ValueError, match="overflows float32"):
        ops.attention(q, q, q, scale=-1e39, backend=backend)
    ops.softmax(x, scale=3e38, backend=backend)  # the largest float32 scales are taken


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
@pytest.mark.parametrize("causal", [False, True])
def test_attention_head_dim_zero(backend, dtype, causal):
    # PyTorch's SDPA returns the empty (B, H, Lq, 0) result; so does every backend, gradients included.
    q, k, v = (torch.empty(2, 3, L, 0, dtype=dtype) for L in (5, 7, 7))
    (out,), (dq, dk, dv) = forward_backward(
        lambda q, k, v: ops.attention(q, k, v, causal=causal, backend=backend), [q, k, v],
        [torch.empty(2, 3, 5, 0, dtype=dtype)])
    assert out.shape == (2, 3, 5, 0) and out.dtype == dtype
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("backend,dtype", backend_dtypes(ALL_BACKENDS))
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("V", [1, 7, 97, 1000, 1025])
def test_cross_entropy_nonfinite_logits(backend, dtype, smoothing, V):
    # Row 0: NaN, row 1: +inf, row 2: -inf not at the target, row 3: all -inf, row 4: NaN in an ignored
    # row, row 5: -inf at the target, row 6: untouched. The bad column moves with V so it falls in vector
    # bodies, packs and tails alike. With V = 1 the only class is the target: no row 2.
    col = (V * 5) // 7
    x = randn(7, V, dtype=dtype, scale=2.0)
    target = torch.randint(0, V, (7,))
    target[[0, 1, 5]] = col
    target[2] = (col + 1) % V
    target[4] = -100
    x[0, col], x[1, col], x[4, col], x[5, col] = NAN, INF, NAN, -INF
    if V > 1:
        x[2, col] = -INF
    x[3] = -INF
    upstream = [randn(7, dtype=torch.float64 if dtype == torch.float64 else torch.float32) for _ in range(2)]

    def fn(backend):
        return lambda x: ops.cross_entropy(x, target, label_smoothing=smoothing, return_nll=True, backend=backend)

    (loss, nll), (dx,) = forward_backward(fn(backend), [x], upstream)
    nan_rows = [0, 1, 3] if V > 1 else [0, 1, 3, 5]  # V = 1: row 5 is a row of only -inf
    for row in nan_rows:
        assert loss[row].isnan() and nll[row].isnan(), f"row {row}: a NaN, +inf or all -inf row must give NaN"
    assert loss[4] == 0 and nll[4] == 0 and (dx[4] == 0).all(), "an ignored row must give 0, whatever it holds"
    # Rows 2 (V > 1), 5 (V > 1) and 6 have finite gradients, those of the reference; rows 2 and 6 finite nll.
    good = [2, 6] if V > 1 else [6]
    (ref_loss, ref_nll), (ref_dx,) = forward_backward(fn("torch"), upcast([x]), upcast(upstream))
    assert_close(nll[good], ref_nll[good], loss.dtype, "nll")
    assert_close(dx[good], ref_dx[good], dtype, "dx")
    assert_close(loss[6:], ref_loss[6:], loss.dtype, "loss")
    if V > 1:
        assert nll[5] == INF and loss[5] == INF, "a -inf target logit must give +inf"
        assert_close(dx[5], ref_dx[5], dtype, "dx of the -inf target's row")
        if smoothing == 0:
            assert dx[2, col] == 0, "a -inf logit gets probability 0"
            # Row 2 is the row without its -inf class.
            keep = [c for c in range(V) if c != col]
            clean_target = target[2:3] - (target[2:3] > col).long()
            clean_nll = ops.cross_entropy(x[2:3, keep].double(), clean_target, backend="torch")
            assert_close(loss[2:3], clean_nll, loss.dtype, "loss without the -inf class")
        else:
            assert loss[2] == INF, "a -inf logit's smoothing term makes the loss +inf"
    for row in nan_rows:  # NaN in, NaN out: never an infinity or a finite number
        assert dx[row].isnan().all(), f"row {row}: a row with NaN loss must get NaN gradients, got {dx[row]}"
