"""ops.attention_varlen (packed sequences) and grouped-query ops.attention against the float64 references.

Packed cases draw B sequences of given query and key lengths (zero- and one-token sequences among them),
pack them (flash-attn's convention: q (Tq, H, D), k and v (Tk, H_kv, D), int32 cu_seqlens (B + 1)), and compare
forward and backward on every backend and dtype with the torch backend in float64. The torch reference itself
is checked sequence by sequence against ops.attention's reference on each sequence alone (independent code:
dense tensors, no tables), and packed against padded: the same sentences through ops.attention with a key
padding mask give the same rows. Grouped-query attention (H_kv < H) is checked against multi-head attention
on K and V repeated per group, gradients summed per group.
"""
from dataclasses import dataclass

import pytest
import torch

from fastformer import ops
from helpers import (
    ALL_BACKENDS,
    BACKENDS,
    FLOAT64_BACKENDS,
    SLOW_BACKENDS,
    backend_dtype_cases,
    forward_backward,
    kernel_op,
    randn,
    upcast,
)
from tolerances import assert_close


@dataclass(frozen=True)
class Case:
    lens_q: tuple
    lens_k: tuple | None  # None: the query lengths (self-attention)
    H: int
    H_kv: int
    D: int
    causal: bool = False
    scale: float | None = None

    @property
    def keys(self):
        return self.lens_q if self.lens_k is None else self.lens_k

    def __str__(self):
        k = "" if self.lens_k is None else "k" + "-".join(map(str, self.lens_k))
        mask = "-causal" if self.causal else ""
        return f"q{'-'.join(map(str, self.lens_q))}{k}H{self.H}kv{self.H_kv}d{self.D}{mask}"


def small(case):
    """Within the slow (simulated GPU, interpreted Triton) backends' limits."""
    return sum(case.lens_q) <= 80 and sum(case.keys) <= 80 and case.H <= 4


CASES = [
    Case((1,), None, 1, 1, 16),
    Case((5, 0, 1, 7), None, 2, 2, 16, causal=True),  # an empty and a one-token sequence
    Case((7, 3), (2, 9), 2, 1, 40),  # cross-attention, multi-query
    Case((3, 17, 0, 1), (5, 9, 4, 0), 4, 2, 64, causal=True),  # Lq > Lk, a key-less query sequence: zeros
    Case((9, 33), None, 4, 1, 40, causal=True, scale=0.3),
    Case((0, 0), (3, 0), 2, 2, 16),  # no query at all
    Case((17, 2), (1, 31), 2, 2, 128, causal=True),
    # Bigger, odd shapes: several query tiles and key blocks per sequence, spread lengths.
    Case((97, 1, 113, 7), None, 4, 2, 40, causal=True),
    Case((113, 0, 64), (97, 5, 129), 3, 1, 64),
    Case((200, 8, 33, 1, 150), None, 2, 2, 128, causal=True),
]


def pack(lengths):
    """int32 cu_seqlens (B + 1) of sequences of these lengths."""
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def make_inputs(case, dtype):
    Tq, Tk = sum(case.lens_q), sum(case.keys)
    q = randn(Tq, case.H, case.D, dtype=dtype)
    k = randn(Tk, case.H_kv, case.D, dtype=dtype)
    v = randn(Tk, case.H_kv, case.D, dtype=dtype)
    dout = randn(Tq, case.H, case.D, dtype=dtype)
    return q, k, v, dout


def varlen_fn(backend, case, **kwargs):
    cu_q, cu_k = pack(case.lens_q), pack(case.keys)
    max_q, max_k = max(case.lens_q), max(case.keys)
    return lambda q, k, v: ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=case.causal,
                                                scale=case.scale, backend=backend, **kwargs)


def per_sequence(case, q, k, v, dout):
    """The same computation sequence by sequence through ops.attention's torch reference on dense (1, H, L, D)
    tensors, K and V repeated per group (multi-head): out, dq, dk, dv packed again."""
    group = case.H // case.H_kv
    outs, dqs, dks, dvs = [], [], [], []
    cq, ck = pack(case.lens_q).tolist(), pack(case.keys).tolist()
    for b in range(len(case.lens_q)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        dense = [t[r].transpose(0, 1)[None] for t, r in ((q, rq), (k, rk), (v, rk), (dout, rq))]
        dense[1], dense[2] = (t.repeat_interleave(group, dim=1) for t in dense[1:3])
        (out,), (dq, dk, dv) = forward_backward(
            lambda q, k, v: ops.attention(q, k, v, causal=case.causal, scale=case.scale, backend="torch"),
            dense[:3], [dense[3]])
        dk, dv = (g.reshape(1, case.H_kv, group, *g.shape[2:]).sum(2) for g in (dk, dv))
        for acc, t in zip((outs, dqs, dks, dvs), (out, dq, dk, dv)):
            acc.append(t[0].transpose(0, 1))
    return [torch.cat(ts) for ts in (outs, dqs, dks, dvs)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_reference_matches_dense_attention_per_sequence(case):
    q, k, v, dout = make_inputs(case, torch.float64)
    (out,), grads = forward_backward(varlen_fn("torch", case), [q, k, v], [dout])
    expected = per_sequence(case, q, k, v, dout)
    for name, actual, exp in zip(("out", "dq", "dk", "dv"), [out, *grads], expected):
        assert_close(actual, exp, torch.float64, name)


@pytest.mark.parametrize("backend,dtype,case", backend_dtype_cases(BACKENDS, CASES, small), )
def test_attention_varlen_matches_reference(backend, dtype, case):
    q, k, v, dout = make_inputs(case, dtype)
    (out,), grads = forward_backward(varlen_fn(backend, case), [q, k, v], [dout])
    (expected,), expected_grads = forward_backward(varlen_fn("torch", case), upcast([q, k, v]), upcast([dout]))
    assert_close(out, expected, dtype, "out")
    for name, g, eg in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_close(g, eg, dtype, name)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_query_without_visible_key_is_zero(backend):
    # Sequence 1 has queries but no keys; causal with Lq > Lk: the first queries of sequence 0 see nothing.
    case = Case((9, 4), (3, 0), 2, 1, 16, causal=True)
    q, k, v, dout = make_inputs(case, torch.float32)
    (out,), (dq, dk, dv) = forward_backward(varlen_fn(backend, case), [q, k, v], [dout])
    blind = torch.zeros(13, dtype=torch.bool)
    blind[:6] = True  # query i of sequence 0 sees key j iff j <= i + 3 - 9
    blind[9:] = True
    assert (out[blind] == 0).all() and (dq[blind] == 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_packed_equals_padded(backend):
    # The same sentences as a padded batch through ops.attention (key padding mask, self-attention, causal):
    # every real row agrees with the packed result, forward and backward.
    lens, H, D = (7, 1, 12, 4), 2, 16
    L, B = max(lens), len(lens)
    case = Case(lens, None, H, H, D, causal=False)
    q, k, v, dout = make_inputs(case, torch.float32)
    (packed,), packed_grads = forward_backward(varlen_fn(backend, case), [q, k, v], [dout])
    pad = torch.arange(L)[None, :] >= torch.tensor(lens)[:, None]  # (B, L) True = padding
    cu = pack(lens).tolist()

    def padded(t):  # (T, H, D) -> (B, H, L, D), zeros at padding
        out = t.new_zeros(B, L, H, D)
        for b in range(B):
            out[b, : lens[b]] = t[cu[b]: cu[b + 1]]
        return out.transpose(1, 2)

    (dense,), dense_grads = forward_backward(
        lambda q, k, v: ops.attention(q, k, v, key_padding_mask=pad, backend=backend),
        [padded(q), padded(k), padded(v)], [padded(dout)])
    for name, a, b in zip(("out", "dq", "dk", "dv"), [packed, *packed_grads], [dense, *dense_grads]):
        torch.testing.assert_close(padded(a), b.masked_fill(pad[:, None, :, None], 0.0), atol=2e-5, rtol=2e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("H,H_kv", [(4, 2), (6, 1)])
def test_grouped_query_attention_is_repeated_heads(backend, H, H_kv):
    # ops.attention with k, v of H_kv heads == ops.attention on k, v repeated per group (the copies GQA avoids),
    # dk and dv summed over each group.
    B, Lq, Lk, D, group = 2, 9, 13, 40 if backend not in SLOW_BACKENDS else 16, H // H_kv
    q, dout = randn(B, H, Lq, D, dtype=torch.float32), randn(B, H, Lq, D, dtype=torch.float32)
    k, v = randn(B, H_kv, Lk, D, dtype=torch.float32), randn(B, H_kv, Lk, D, dtype=torch.float32)
    mask = torch.zeros(B, Lk, dtype=torch.bool)
    mask[1, -4:] = True
    run = lambda q, k, v: ops.attention(q, k, v, key_padding_mask=mask, causal=True, backend=backend)  # noqa: E731
    (out,), (dq, dk, dv) = forward_backward(run, [q, k, v], [dout])
    rep = [t.repeat_interleave(group, dim=1) for t in (k, v)]
    (eout,), (edq, edk, edv) = forward_backward(run, [q, *rep], [dout])
    assert dk.shape == k.shape and dv.shape == v.shape
    torch.testing.assert_close(out, eout, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq, edq, atol=1e-5, rtol=1e-5)
    for g, e in ((dk, edk), (dv, edv)):
        torch.testing.assert_close(g, e.reshape(B, H_kv, group, Lk, D).sum(2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_strided_heads_of_a_packed_projection(backend):
    # q, k, v as the heads of one (T, 3, H, D) projection: read in place, same results as contiguous copies.
    case = Case((5, 0, 11), None, 2, 2, 16, causal=True)
    T = sum(case.lens_q)
    qkv = randn(T, 3, case.H, case.D, dtype=torch.float32)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    dout = randn(T, case.H, case.D, dtype=torch.float32)
    (out,), grads = forward_backward(varlen_fn(backend, case), [q, k, v], [dout])
    (eout,), egrads = forward_backward(varlen_fn(backend, case), [q.contiguous(), k.contiguous(), v.contiguous()],
                                       [dout])
    torch.testing.assert_close(out, eout, atol=0, rtol=0)
    for g, e in zip(grads, egrads):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_follows_the_shared_rule(backend):
    # The same seed drops the same probabilities on every backend: the element index (h Tq + cu_q[b] + i) Tk + j.
    case = Case((5, 0, 9, 3), (7, 2, 9, 0), 2, 1, 16, causal=True)
    q, k, v, dout = make_inputs(case, torch.float32)
    results = []
    for b in ("torch", backend):
        torch.manual_seed(7)
        results.append(forward_backward(varlen_fn(b, case, dropout_p=0.3), [q, k, v], [dout]))
    (ref,), ref_grads = results[0]
    (out,), grads = results[1]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for g, e in zip(grads, ref_grads):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=2e-5)
    # and something was dropped: without dropout the output differs
    (plain,), _ = forward_backward(varlen_fn(backend, case), [q, k, v], [dout])
    assert (plain - out).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_sequences_with_dropout(backend):
    # Sequences over several query tiles and key blocks of the GPU kernels (and their interpreted tiles of 32),
    # starting at rows that are no multiple of a tile, grouped-query, causal and dropout (Tk a multiple of 4:
    # the Triton kernels' one Philox evaluation per 4 probabilities); max_seqlen_k above the longest.
    case = Case((70, 0, 45, 40), (66, 3, 50, 41), 4, 2, 16, causal=True)
    q, k, v, dout = make_inputs(case, torch.float32)
    cu_q, cu_k = pack(case.lens_q), pack(case.keys)

    def run(name):
        torch.manual_seed(11)  # the dropout seed's draw
        return forward_backward(lambda q, k, v: ops.attention_varlen(q, k, v, cu_q, cu_k, 70, 72, causal=True,
                                                                     dropout_p=0.2, backend=name), [q, k, v], [dout])

    (ref,), ref_grads = run("torch")
    (out,), grads = run(backend)
    for name, g, e in zip(("out", "dq", "dk", "dv"), [out, *grads], [ref, *ref_grads]):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=2e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
def test_gradcheck_float64(backend):
    case = Case((3, 0, 4), (2, 3, 5), 2, 1, 8, causal=True)
    q, k, v, _ = make_inputs(case, torch.float64)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(varlen_fn(backend, case), inputs, eps=1e-6, atol=1e-5)


# The cuda launchers pick the tensor-core kernels (csrc/cuda/attention_mma.cuh) for 16-bit inputs on compute
# capability 8.0 and newer and the SIMT kernels (attention.cuh) below; cuda_sim plays 8.0 by default. Here both
# generations on packed sequences with grouped-query heads (several query tiles and key blocks per sequence,
# empty and key-less sequences, dropout): each must match the float64 reference run with the same seed, and
# the two must not be the same computation (the choice really switched).
MMA_CASES = [Case((40, 0, 3, 17), (9, 4, 0, 30), 4, 2, 16, causal=True),
             Case((70, 1), None, 2, 1, 64, causal=True, scale=0.3),
             Case((33, 2), (20, 47), 3, 3, 40)]


@pytest.mark.skipif("cuda_sim" not in ALL_BACKENDS, reason="cuda_sim is not among the tested backends (no C++ "
                    "compiler, or FASTFORMER_TEST_BACKENDS)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("case", MMA_CASES, ids=str)
def test_cuda_sim_runs_the_simt_and_the_tensor_core_kernels(dtype, dropout_p, case):
    from fastformer import cuda_sim

    q, k, v, dout = make_inputs(case, dtype)
    torch.manual_seed(7)
    (ref,), ref_grads = forward_backward(varlen_fn("torch", case, dropout_p=dropout_p), upcast([q, k, v]),
                                         upcast([dout]))
    results = {}
    for capability in (60, 80):
        torch.manual_seed(7)
        with cuda_sim.compute_capability(capability):
            (out,), grads = forward_backward(varlen_fn("cuda_sim", case, dropout_p=dropout_p), [q, k, v], [dout])
        assert_close(out, ref, dtype, f"out (sm_{capability})")
        for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert_close(g, rg, dtype, f"{name} (sm_{capability})")
        results[capability] = [out, *grads]
    assert any(not torch.equal(a, b) for a, b in zip(results[60], results[80])), "both runs took the same kernels"


@pytest.mark.skipif("cuda_sim" not in ALL_BACKENDS, reason="cuda_sim is not among the tested backends (no C++ "
                    "compiler, or FASTFORMER_TEST_BACKENDS)")
@pytest.mark.parametrize("capability", [60, 80])
def test_cuda_sim_bad_table_stays_in_bounds(capability):
    """The kernels clamp each sequence into [0, T] (a table's check may be deferred, or skipped during CUDA graph
    capture: csrc/value_checks.h): a table running past the totals, given to the launcher directly, reads and
    writes only in bounds; clamped, this one describes the same two sequences and an empty third."""
    from fastformer import cuda_sim

    case = Case((5, 6), (4, 7), 2, 1, 16)
    q, k, v, _ = make_inputs(case, torch.float16)
    cu_q, cu_k = pack(case.lens_q), pack(case.keys)
    bad_q = torch.tensor([0, 5, 1 << 30, -7], dtype=torch.int32)  # sequences 1 and 2 run past the end
    bad_k = torch.tensor([0, 4, 1 << 30, -7], dtype=torch.int32)
    fwd = cuda_sim.entry("attention_varlen", "fwd")
    with cuda_sim.compute_capability(capability):
        good = fwd(q, k, v, cu_q, cu_k, 6, 7, False, 0.0, 0.25, None)
        bad = fwd(q, k, v, bad_q, bad_k, 1 << 20, 1 << 20, False, 0.0, 0.25, None)
    for a, b in zip(bad, good):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.skipif("triton" not in ALL_BACKENDS, reason="triton is not among the tested backends")
def test_triton_bad_table_stays_in_bounds():
    """The Triton kernels clamp each sequence into [0, T] too (fastformer/triton/attention.py _sequence): the
    table of test_cuda_sim_bad_table_stays_in_bounds, forward and backward, given to the kernels directly."""
    from fastformer.triton.attention_varlen import attention_varlen_bwd, attention_varlen_fwd

    case = Case((5, 6), (4, 7), 2, 1, 16)
    q, k, v, dout = make_inputs(case, torch.float32)
    cu_q, cu_k = pack(case.lens_q), pack(case.keys)
    bad_q = torch.tensor([0, 5, 1 << 30, -7], dtype=torch.int32)
    bad_k = torch.tensor([0, 4, 1 << 30, -7], dtype=torch.int32)
    results = []
    for tq, tk in ((cu_q, cu_k), (bad_q, bad_k)):  # max_seqlen 6, 7: the interpreter's grid stays small
        out, lse = attention_varlen_fwd(q, k, v, tq, tk, 6, 7, False, 0.0, 0.25, None)
        results.append((out, lse, *attention_varlen_bwd(dout, q, k, v, out, lse, tq, tk, 6, 7, False, 0.0, 0.25,
                                                        None)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def good_args():
    case = Case((3, 4), (5, 2), 4, 2, 8)
    q, k, v, _ = make_inputs(case, torch.float32)
    return dict(q=q, k=k, v=v, cu_seqlens_q=pack(case.lens_q), cu_seqlens_k=pack(case.keys), max_seqlen_q=4,
                max_seqlen_k=5)


BAD = {
    "cu_seqlens_q int64": (dict(cu_seqlens_q=lambda a: a["cu_seqlens_q"].long()), "cu_seqlens_q must be int32"),
    "cu_seqlens_k 2-D": (dict(cu_seqlens_k=lambda a: a["cu_seqlens_k"][None]), "cu_seqlens_k must be 1-D"),
    "cu_seqlens_q on meta": (dict(cu_seqlens_q=lambda a: a["cu_seqlens_q"].to("meta")), "cu_seqlens_q is on meta"),
    "not starting at 0": (dict(cu_seqlens_q=lambda a: torch.tensor([1, 3, 7], dtype=torch.int32)),
                          r"cu_seqlens_q\[0\] must be 0"),
    "decreasing": (dict(cu_seqlens_k=lambda a: torch.tensor([0, 4, 3, 7], dtype=torch.int32),
                        cu_seqlens_q=lambda a: torch.tensor([0, 3, 3, 7], dtype=torch.int32)),
                   "cu_seqlens_k must be non-decreasing"),
    "last is not the total": (dict(cu_seqlens_k=lambda a: torch.tensor([0, 5, 6], dtype=torch.int32)),
                              "the last entry of cu_seqlens_k is 6 but the packed tensor has 7 rows"),
    "max_seqlen_q too small": (dict(max_seqlen_q=3), "more than max_seqlen_q = 3"),
    "max_seqlen_k negative": (dict(max_seqlen_k=-1), "max_seqlen_k must be >= 0"),
    "sequence counts differ": (dict(cu_seqlens_k=lambda a: torch.tensor([0, 7], dtype=torch.int32), max_seqlen_k=7),
                               "cu_seqlens_q has 2 sequences but cu_seqlens_k has 1"),
    "heads not a multiple": (dict(q=lambda a: a["q"][:, :3]), "q has 3 heads and k and v"),
    "q 4-D": (dict(q=lambda a: a["q"][None]), "q must be 3-D"),
    "head dims differ": (dict(k=lambda a: a["k"][..., :4], v=lambda a: a["v"][..., :4]), "same head dim"),
    "k and v differ": (dict(v=lambda a: a["v"][:-1]), "must have the same shape"),
    "dtype mix": (dict(k=lambda a: a["k"].double()), "k has dtype"),
    "cu_seqlens None": (dict(cu_seqlens_q=None), "cu_seqlens_q must be a torch.Tensor"),
    "max_seqlen a float": (dict(max_seqlen_q=4.0), "max_seqlen_q must be an int"),
    "dropout_p 1": (dict(dropout_p=1.0), r"dropout_p must be a number in \[0, 1\)"),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("name", BAD)
def test_bad_input_raises_value_error_naming_it(backend, name):
    changes, message = BAD[name]
    args = good_args()
    for key, change in changes.items():
        args[key] = change(args) if callable(change) else change
    with pytest.raises(ValueError, match=message):
        ops.attention_varlen(**args, backend=backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_direct_backward_call_is_checked(backend):
    # The registered backward op checks its arguments too (lse of the wrong shape).
    args = good_args()
    op, extra = kernel_op("attention_varlen", "bwd", backend)
    q = args["q"]
    with pytest.raises(ValueError, match="lse must be"):
        op(q, q, args["k"], args["v"], q, torch.zeros(q.shape[0], q.shape[1]), args["cu_seqlens_q"],
           args["cu_seqlens_k"], 4, 5, False, 0.0, None, None, *extra)


def test_opcheck_and_compile():
    case = Case((5, 0, 3), (2, 4, 6), 2, 1, 16, causal=True)
    q, k, v, dout = make_inputs(case, torch.float32)
    cu_q, cu_k = pack(case.lens_q), pack(case.keys)
    for backend in ("cpu", "torch"):
        op, extra = kernel_op("attention_varlen", "fwd", backend)
        torch.library.opcheck(op, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu_q, cu_k, 5, 6,
                                   True, 0.0, None, None, *extra))
    fn = varlen_fn("cpu", case)
    compiled = torch.compile(fn, fullgraph=True)
    (out,), grads = forward_backward(compiled, [q, k, v], [dout])
    (eout,), egrads = forward_backward(fn, [q, k, v], [dout])
    torch.testing.assert_close(out, eout, atol=0, rtol=0)
    for g, e in zip(grads, egrads):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
