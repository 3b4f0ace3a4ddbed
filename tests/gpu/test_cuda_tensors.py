"""Every op on CUDA tensors, on the GPU backends (cuda, triton), against the float64 reference on the CPU.

These run only where a CUDA device is visible (CI has none: there the same kernels run on the CPU, the
CUDA ones through cuda_sim and the Triton ones in the interpreter, tests/ops). Shapes include the
translation sizes and odd lengths that the simulated runs are too slow for.
Run on a GPU machine with: ``python -m pytest tests/gpu -q`` (without TRITON_INTERPRET).
"""
import pytest
import torch

import fastformer
from fastformer import ops
from fastformer._ext import C

from helpers import (assert_layout_kept, dtype_name, forward_backward, padding_mask, projection_views, randn, same_memory, upcast,
                     visible_keys)
from tolerances import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_BACKENDS = [b for b in ("cuda", "triton") if fastformer.backends().get(b)]


def gpu_dtypes(backend):
    dtypes = [torch.float32, torch.float16]
    if torch.cuda.is_available() and (backend == "triton" or torch.cuda.get_device_capability() >= (8, 0)):
        dtypes.append(torch.bfloat16)
    return dtypes


def params(cases):
    return [pytest.param(b, d, c, id=f"{b}-{dtype_name(d)}-{c}") for b in GPU_BACKENDS for d in gpu_dtypes(b)
            for c in cases]


def cuda(tensors):
    return [None if t is None else t.cuda() for t in tensors]


def cpu(tensors):
    return [t.cpu() for t in tensors]


# (B, H, Lq, Lk, D, mask kind)
ATTENTION_CASES = [
    (1, 1, 1, 1, 16, "none"),
    (2, 3, 97, 97, 40, "padding"),
    (2, 2, 113, 113, 64, "causal"),
    (2, 2, 113, 97, 128, "both"),
    (2, 2, 1, 97, 128, "causal"),
    (2, 2, 33, 9, 64, "both"),
    (16, 8, 128, 128, 64, "padding"),
    (4, 8, 256, 256, 64, "both"),
    (1, 4, 1024, 1024, 64, "causal"),
    (3, 2, 77, 77, 7, "padding"),
]


@pytest.mark.parametrize("backend,dtype,case", params(ATTENTION_CASES))
def test_attention(backend, dtype, case):
    B, H, Lq, Lk, D, kind = case
    q, k, v = (randn(B, H, L, D, dtype=dtype) for L in (Lq, Lk, Lk))
    dout = randn(B, H, Lq, D, dtype=dtype)
    mask = padding_mask(B, Lk) if kind in ("padding", "both") else None
    causal = kind in ("causal", "both")
    gpu_mask = None if mask is None else mask.cuda()

    def fn(backend, m):
        return lambda q, k, v: ops.attention(q, k, v, key_padding_mask=m, causal=causal, backend=backend)

    (out,), grads = forward_backward(fn(backend, gpu_mask), cuda([q, k, v]), cuda([dout]))
    (ref,), ref_grads = forward_backward(fn("torch", mask), upcast([q, k, v]), upcast([dout]))
    assert_close(out.cpu(), ref, dtype, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), cpu(grads), ref_grads):
        assert_close(g, rg, dtype, name)
    visible = visible_keys(B, Lq, Lk, mask, causal)
    empty = (~visible.any(-1)).expand(B, H, Lq)
    assert (out.cpu()[empty] == 0).all() and (grads[0].cpu()[empty] == 0).all()


# (B, H, Lq, Lk, D, mask kind, pad): pad NaN elements after each token's row of the projection buffers
# (tests/helpers.py projection_views): 1 breaks every vector alignment, 4 the 16-byte one of 16-bit types.
LAYOUT_CASES = [(2, 3, 97, 97, 40, "padding", 0), (2, 2, 1, 97, 64, "causal", 1), (4, 8, 128, 128, 64, "both", 4),
                (2, 2, 113, 77, 20, "both", 1)]


@pytest.mark.parametrize("backend,dtype,case", params(LAYOUT_CASES))
def test_attention_reads_and_writes_projection_layout(backend, dtype, case):
    """q, k, v as views of (B, L, H, D) projections (k and v interleaved, rows at strides that break vector
    alignment) are read in place (csrc/ops.h attention_layout passes them as they are) and out, dq, dk, dv
    come back in (B, L, H, D) memory, bit-identical to the results for contiguous copies, and within
    tolerance of the float64 reference: tests/ops test_kernels_read_and_write_transformers_layout at GPU sizes."""
    B, H, Lq, Lk, D, kind, pad = case
    causal = kind in ("causal", "both")
    mask = padding_mask(B, Lk) if kind in ("padding", "both") else None
    gpu_mask = None if mask is None else mask.cuda()
    _, (q, k, v) = projection_views(B, H, Lq, Lk, D, pad, dtype, device="cuda")
    assert all(same_memory(C.attention_layout(t), t) for t in (q, k, v))
    out = ops.attention(q, k, v, key_padding_mask=gpu_mask, causal=causal, backend=backend)
    dout = randn(B, Lq, H, D, dtype=dtype).cuda().transpose(1, 2)  # (B, L, H, D) memory, as a projection's grad
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_layout_kept(lambda *qkv: ops.attention(*qkv, key_padding_mask=gpu_mask, causal=causal, backend=backend),
                       q, k, v, out, grads, dout)
    (expected,), expected_grads = forward_backward(
        lambda q, k, v: ops.attention(q, k, v, key_padding_mask=mask, causal=causal, backend="torch"),
        upcast(cpu([q, k, v])), upcast(cpu([dout])))
    assert_close(out.cpu(), expected, dtype, "out")
    for name, g, eg in zip(("dq", "dk", "dv"), cpu(grads), expected_grads):
        assert_close(g, eg, dtype, name)



# (B, H, H_kv, Lq, Lk, D, mask kind): grouped-query (H_kv < H) and multi-query (H_kv = 1) attention, k and v read
# at kv head h / (H / H_kv) in place; dk, dv (B, H_kv, Lk, D).
GQA_CASES = [(2, 8, 2, 113, 97, 64, "both"), (3, 6, 1, 1, 77, 128, "causal"), (2, 4, 2, 256, 256, 40, "padding")]


@pytest.mark.parametrize("backend,dtype,case", params(GQA_CASES))
def test_attention_grouped_query_heads(backend, dtype, case):
    B, H, H_kv, Lq, Lk, D, kind = case
    q, dout = (randn(B, H, Lq, D, dtype=dtype) for _ in range(2))
    k, v = (randn(B, H_kv, Lk, D, dtype=dtype) for _ in range(2))
    mask = padding_mask(B, Lk) if kind in ("padding", "both") else None
    causal = kind in ("causal", "both")
    gpu_mask = None if mask is None else mask.cuda()

    def fn(backend, m):
        return lambda q, k, v: ops.attention(q, k, v, key_padding_mask=m, causal=causal, backend=backend)

    (out,), grads = forward_backward(fn(backend, gpu_mask), cuda([q, k, v]), cuda([dout]))
    (ref,), ref_grads = forward_backward(fn("torch", mask), upcast([q, k, v]), upcast([dout]))
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    assert_close(out.cpu(), ref, dtype, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), cpu(grads), ref_grads):
        assert_close(g, rg, dtype, name)


def cu_seqlens(lengths):
    """int32 (B + 1) row offsets of packed sequences of these lengths (CPU)."""
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


# (query lengths, key lengths or None: self-attention, H, H_kv, D, causal): packed sequences with empty and
# one-token ones and ones spanning many tiles, grouped-query heads.
VARLEN_CASES = [((97, 0, 1, 113), None, 4, 2, 64, True), ((7, 300, 33), (50, 129, 0), 6, 1, 40, False),
                ((256, 17), None, 8, 8, 128, True), ((1, 1, 1), (97, 5, 64), 4, 1, 16, True),
                ((1000, 3, 500), None, 2, 2, 7, True)]


def varlen(backend, case, device, **kwargs):
    lens_q, lens_k, H, H_kv, D, causal = case
    lens_k = lens_q if lens_k is None else lens_k
    cu_q, cu_k = cu_seqlens(lens_q).to(device), cu_seqlens(lens_k).to(device)
    return lambda q, k, v: ops.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                backend=backend, **kwargs)


def varlen_inputs(case, dtype):
    lens_q, lens_k, H, H_kv, D, _ = case
    lens_k = lens_q if lens_k is None else lens_k
    q, dout = (randn(sum(lens_q), H, D, dtype=dtype) for _ in range(2))
    k, v = (randn(sum(lens_k), H_kv, D, dtype=dtype) for _ in range(2))
    return q, k, v, dout


@pytest.mark.parametrize("backend,dtype,case", params(VARLEN_CASES))
def test_attention_varlen(backend, dtype, case):
    q, k, v, dout = varlen_inputs(case, dtype)
    (out,), grads = forward_backward(varlen(backend, case, "cuda"), cuda([q, k, v]), cuda([dout]))
    (ref,), ref_grads = forward_backward(varlen("torch", case, "cpu"), upcast([q, k, v]), upcast([dout]))
    assert out.is_contiguous() and all(g.is_contiguous() for g in grads)
    assert_close(out.cpu(), ref, dtype, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), cpu(grads), ref_grads):
        assert_close(g, rg, dtype, name)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_attention_varlen_dropout_matches_cpu_mask(backend):
    # Element (b, h, i, j) has Philox index (h Tq + cu_seqlens_q[b] + i) Tk + j on every backend.
    case = ((97, 0, 40), (30, 7, 64), 4, 2, 64, True)
    q, k, v, dout = varlen_inputs(case, torch.float32)
    torch.manual_seed(11)
    (out,), grads = forward_backward(varlen(backend, case, "cuda", dropout_p=0.3), cuda([q, k, v]), cuda([dout]))
    seed = device_seed(11)
    cu_q, cu_k = cu_seqlens(case[0]), cu_seqlens(case[1])
    (rout,), rgrads = forward_backward(
        lambda q, k, v: torch.ops.fastformer.attention_varlen_fwd(q, k, v, cu_q, cu_k, 97, 64, True, 0.3, None,
                                                                  seed)[0], [q, k, v], [dout])
    assert_close(out.cpu(), rout.double(), torch.float32, "out")
    for g, r in zip(grads, rgrads):
        assert_close(g.cpu(), r.double(), torch.float32, "grad")

# (rows, N, mask)
SOFTMAX_CASES = [(1, 1, False), (7, 97, True), (4096, 64, True), (256, 1024, True), (33, 1025, True),
                 (8, 5000, True), (2, 40000, False)]


@pytest.mark.parametrize("backend,dtype,case", params(SOFTMAX_CASES))
def test_softmax(backend, dtype, case):
    rows, n, masked = case
    x = randn(rows, n, dtype=dtype, scale=3.0)
    dy = randn(rows, n, dtype=dtype)
    mask = torch.rand(rows, n) < 0.3 if masked else None
    if masked and rows > 1:
        mask[1] = True  # a fully masked row gives zeros
    gpu_mask = None if mask is None else mask.cuda()
    (y,), (dx,) = forward_backward(lambda x: ops.softmax(x, mask=gpu_mask, scale=0.6, backend=backend), cuda([x]), cuda([dy]))
    (ry,), (rdx,) = forward_backward(lambda x: ops.softmax(x, mask=mask, scale=0.6, backend="torch"), upcast([x]), upcast([dy]))
    assert_close(y.cpu(), ry, dtype, "y")
    assert_close(dx.cpu(), rdx, dtype, "dx")


def test_softmax_broadcast_mask():
    for backend in GPU_BACKENDS:
        x = randn(2, 4, 33, 33, dtype=torch.float32)
        mask = torch.rand(2, 1, 1, 33) < 0.3
        y = ops.softmax(x.cuda(), mask=mask.cuda(), backend=backend)
        assert_close(y.cpu(), ops.softmax(x.double(), mask=mask, backend="torch"), torch.float32, backend)


def device_seed(manual_seed):
    """The dropout seed an op on CUDA tensors draws after torch.manual_seed(manual_seed): one draw of the CUDA
    generator (fastformer/ops/_registry.py dropout_seed), as a CPU tensor for the CPU kernels."""
    torch.manual_seed(manual_seed)
    return torch.randint(0, 2**62, (), dtype=torch.int64, device="cuda").cpu()


def lnr_with_seed(seed, p, prenorm):
    """layer_norm_residual through the registered op (CPU kernels and C++ autograd) with the seed ``seed``."""
    def run(x, residual, weight, bias):
        y, s, _, _, _ = torch.ops.fastformer.layer_norm_residual_fwd(x, residual, weight, bias, 1e-5, p, seed, None,
                                                                     None)
        return (y, s) if prenorm else y
    return run


# (rows, N, dropout_p, prenorm)
LNR_CASES = [(1, 1, 0.0, False), (7, 97, 0.0, True), (4096, 512, 0.0, False), (4096, 512, 0.1, True),
             (64, 1024, 0.0, False), (3, 4099, 0.0, True), (300, 16384, 0.0, False)]


@pytest.mark.parametrize("backend,dtype,case", params(LNR_CASES))
def test_layer_norm_residual(backend, dtype, case):
    rows, n, p, prenorm = case
    x, res = randn(rows, n, dtype=dtype), randn(rows, n, dtype=dtype, shift=0.5)
    w, b = randn(n, dtype=dtype, shift=1.0), randn(n, dtype=dtype)
    ups = [randn(rows, n, dtype=dtype) for _ in range(2 if prenorm else 1)]

    def fn(backend):
        return lambda *t: ops.layer_norm_residual(*t, dropout_p=p, prenorm=prenorm, backend=backend)

    torch.manual_seed(5)
    outs, grads = forward_backward(fn(backend), cuda([x, res, w, b]), cuda(ups))
    # Dropout draws the same mask on every backend for the same seed value: the CPU kernel (float32) given
    # the seed the op drew on the GPU is the reference of the dropped run; without dropout the float64
    # torch reference is.
    if p > 0:
        routs, rgrads = forward_backward(lnr_with_seed(device_seed(5), p, prenorm), [t.float() for t in (x, res, w, b)],
                                         [u.float() for u in ups])
        routs, rgrads = [t.double() for t in routs], [t.double() for t in rgrads]
    else:
        routs, rgrads = forward_backward(fn("torch"), upcast([x, res, w, b]), upcast(ups))
    for name, o, r in zip(("y", "s"), cpu(outs), routs):
        assert_close(o, r, dtype, name)
    for name, g, r in zip(("dx", "dres", "dw", "db"), cpu(grads), rgrads):
        assert_close(g, r, dtype, name)


# (rows, N, activation, dropout_p)
BIAS_ACT_CASES = [(1, 1, "relu", 0.0), (7, 97, "gelu", 0.0), (113, 113, "silu", 0.1), (4096, 1024, "relu", 0.1),
                  (4096, 4096, "gelu", 0.1), (300, 2048, "silu", 0.0)]


@pytest.mark.parametrize("backend,dtype,case", params(BIAS_ACT_CASES))
def test_bias_activation(backend, dtype, case):
    # x in the compute dtype, bias the float32 master bias; with dropout the CPU kernel (float32) given the
    # seed the op drew on the GPU is the reference, without it the float64 torch reference.
    rows, n, activation, p = case
    x, b, dy = randn(rows, n, dtype=dtype, scale=2.0), randn(n, dtype=torch.float32), randn(rows, n, dtype=dtype)

    def fn(backend):
        return lambda x, b: ops.bias_activation(x, b, activation=activation, dropout_p=p, backend=backend)

    torch.manual_seed(5)
    (y,), grads = forward_backward(fn(backend), cuda([x, b]), cuda([dy]))
    if p > 0:
        seed = device_seed(5)
        run = lambda x, b: torch.ops.fastformer.bias_activation_fwd(x, b, activation, p, seed)  # noqa: E731
        (ref,), rgrads = forward_backward(run, [x.float(), b], [dy.float()])
        ref, rgrads = ref.double(), [g.double() for g in rgrads]
    else:
        (ref,), rgrads = forward_backward(fn("torch"), upcast([x, b]), upcast([dy]))
    assert_close(y.cpu(), ref, dtype, "y")
    for name, g, r, d in zip(("dx", "dbias"), cpu(grads), rgrads, (dtype, torch.float32)):
        assert_close(g, r, d, name)


@pytest.mark.parametrize("backend,dtype,case", [p for p in params(LNR_CASES) if p.values[1] != torch.float32])
def test_layer_norm_residual_half_branch(backend, dtype, case):
    # Autocast's case: a float16/bfloat16 branch beside a float32 residual, weight and bias. y, s and the
    # gradients of residual, weight and bias are float32; dx has the branch's dtype.
    rows, n, p, prenorm = case
    x, res = randn(rows, n, dtype=dtype), randn(rows, n, dtype=torch.float32, shift=0.5)
    w, b = randn(n, dtype=torch.float32, shift=1.0), randn(n, dtype=torch.float32)
    ups = [randn(rows, n, dtype=torch.float32) for _ in range(2 if prenorm else 1)]

    def fn(backend):
        return lambda *t: ops.layer_norm_residual(*t, dropout_p=p, prenorm=prenorm, backend=backend)

    torch.manual_seed(5)
    outs, grads = forward_backward(fn(backend), cuda([x, res, w, b]), cuda(ups))
    # The float64 reference on the same device: the dropout seed comes from the same generator.
    torch.manual_seed(5)
    routs, rgrads = forward_backward(fn("torch"), cuda(upcast([x, res, w, b])), cuda(upcast(ups)))
    for name, o, r in zip(("y", "s"), cpu(outs), cpu(routs)):
        assert_close(o, r, torch.float32, name)
    for name, g, r, d in zip(("dx", "dres", "dw", "db"), cpu(grads), cpu(rgrads), (dtype,) + (torch.float32,) * 3):
        assert_close(g, r, d, name)


# (rows, V, label_smoothing, ignore_index): V multiples of 8 take the CUDA kernels' 16-byte packs.
CE_CASES = [(1, 1, 0.0, -100), (7, 97, 0.1, -100), (4096, 512, 0.1, 0), (256, 1000, 0.0, -100), (33, 1025, 1.0, 0),
            (300, 4099, 0.1, -100), (64, 32000, 0.1, 0), (16, 50257, 0.0, -100), (2, 250000, 0.1, -100)]


@pytest.mark.parametrize("backend,dtype,case", params(CE_CASES))
def test_cross_entropy(backend, dtype, case):
    rows, V, e, ignore_index = case
    x = randn(rows, V, dtype=dtype, scale=2.0)
    target = torch.randint(0, V, (rows,))
    target[torch.rand(rows) < 0.25] = ignore_index
    if rows > 1:
        target[0] = ignore_index
    ups = [randn(rows, dtype=torch.float32) for _ in range(2)]

    def fn(backend, t):
        return lambda x: ops.cross_entropy(x, t, label_smoothing=e, ignore_index=ignore_index, return_nll=True,
                                           backend=backend)

    (loss, nll), (dx,) = forward_backward(fn(backend, target.cuda()), cuda([x]), cuda(ups))
    (rloss, rnll), (rdx,) = forward_backward(fn("torch", target), upcast([x]), upcast(ups))
    assert loss.dtype == nll.dtype == torch.float32  # whatever the logits' dtype
    assert_close(loss.cpu(), rloss, torch.float32, "loss")
    assert_close(nll.cpu(), rnll, torch.float32, "nll")
    assert_close(dx.cpu(), rdx, dtype, "dx")
    ignored = target == ignore_index
    assert (loss.cpu()[ignored] == 0).all() and (dx.cpu()[ignored] == 0).all()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("view", ["offset", "transposed"])
def test_cross_entropy_misaligned_and_strided(backend, view):
    # offset: contiguous rows one element past a 16-byte boundary, V a multiple of 8: the CUDA kernels must
    # leave their 16-byte packs; transposed: a strided view (copied contiguous by the op).
    rows, V = 33, 1000
    x = randn(rows, V, dtype=torch.float16) if view == "offset" else randn(V, rows, dtype=torch.float16).t()
    target = torch.randint(0, V, (rows,))
    target[3] = -100
    ups = [randn(rows, dtype=torch.float32) for _ in range(2)]

    def fn(backend, t):
        return lambda x: ops.cross_entropy(x, t, label_smoothing=0.1, return_nll=True, backend=backend)

    if view == "offset":
        gx = torch.empty(rows * V + 1, dtype=x.dtype, device="cuda")[1:].view(rows, V).copy_(x)
        assert gx.is_contiguous() and gx.data_ptr() % 16 != 0
    else:
        gx = x.cuda()  # keeps the strides
        assert not gx.is_contiguous()
    (loss, nll), (dx,) = forward_backward(fn(backend, target.cuda()), [gx], cuda(ups))
    (rloss, rnll), (rdx,) = forward_backward(fn("torch", target), upcast([x]), upcast(ups))
    assert_close(loss.cpu(), rloss, torch.float32, "loss")
    assert_close(nll.cpu(), rnll, torch.float32, "nll")
    assert_close(dx.cpu(), rdx, torch.float16, "dx")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_attention_dropout_matches_cpu_mask(backend):
    B, H, L, D = 2, 4, 97, 64
    q, k, v = (randn(B, H, L, D, dtype=torch.float32) for _ in range(3))
    dout = randn(B, H, L, D, dtype=torch.float32)
    mask = padding_mask(B, L)
    # The op on CUDA tensors draws its seed from the CUDA generator; the CPU kernel is given that seed value.
    torch.manual_seed(11)
    out, grads = forward_backward(
        lambda q, k, v: ops.attention(q, k, v, key_padding_mask=mask.cuda(), dropout_p=0.3, backend=backend),
        cuda([q, k, v]), cuda([dout]))
    seed = device_seed(11)
    rout, rgrads = forward_backward(
        lambda q, k, v: torch.ops.fastformer.attention_fwd(q, k, v, mask, False, 0.3, None, seed)[0], [q, k, v],
        [dout])
    assert_close(out[0].cpu(), rout[0].double(), torch.float32, "out")
    for g, r in zip(grads, rgrads):
        assert_close(g.cpu(), r.double(), torch.float32, "grad")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_bad_inputs_raise(backend):
    q = torch.randn(2, 2, 8, 16, device="cuda")
    with pytest.raises((ValueError, RuntimeError)):
        ops.attention(q, q, q[..., :8], backend=backend)
    with pytest.raises((ValueError, RuntimeError)):
        ops.attention(q.cpu(), q.cpu(), q.cpu(), backend=backend)
    with pytest.raises((ValueError, RuntimeError)):
        ops.softmax(q, mask=torch.zeros(3, dtype=torch.bool, device="cuda"), backend=backend)
    logits, target = torch.randn(4, 10, device="cuda"), torch.tensor([0, 9, 10, -100], device="cuda")
    with pytest.raises(ValueError, match="outside the classes"):
        ops.cross_entropy(logits, target, backend=backend)  # 10 is not a class of V = 10
    with pytest.raises(ValueError):
        ops.cross_entropy(logits, target.cpu(), backend=backend)
    if backend == "cuda":
        with pytest.raises((ValueError, RuntimeError), match="128"):
            big = torch.randn(1, 1, 4, 160, device="cuda")
            ops.attention(big, big, big, backend="cuda")


def test_default_backend_on_cuda_tensors():
    x = torch.randn(4, 8, device="cuda")
    major, _ = torch.cuda.get_device_capability()
    expected = ("triton", "cuda") if major >= 8 else ("cuda", "triton")
    from fastformer import _dispatch

    chosen = _dispatch.resolve("softmax", None, x.device, x.dtype)
    assert chosen == next(b for b in expected + ("torch",) if fastformer.backends()[b])


@pytest.mark.parametrize("numel", [1, 7, 97, 12345])
def test_reference_dropout_mask_on_cuda_matches_cpu(numel):
    # The torch backend draws the mask on CUDA through torch.compile (one kernel), on the CPU eagerly in
    # slices: the same bits.
    from fastformer.ops import reference

    for seed, p in ((0, 0.1), (12345678901234, 0.5), (-5, 0.9)):
        assert torch.equal(reference.dropout_keep(seed, numel, p, "cuda").cpu(), reference.dropout_keep(seed, numel, p))


def dropout_step(backend, p=0.5):
    """Static inputs and a step of attention and layer_norm_residual with dropout, forward and backward, whose
    outputs show the masks: q = 0 and v = identity make attention's output the dropped probabilities (so
    dv = out^T dout exactly when backward used the forward's mask); residual = 0 makes s = dropout(x), and
    upstream dy = 0, ds = 1 make dx = r, the keep-factors (zero exactly where s is)."""
    B, H, L = 2, 2, 33
    q = torch.zeros(B, H, L, L, device="cuda", requires_grad=True)
    k = randn(B, H, L, L, dtype=torch.float32).cuda().requires_grad_()
    v = torch.eye(L, device="cuda").expand(B, H, L, L).contiguous().requires_grad_()
    dout = randn(B, H, L, L, dtype=torch.float32).cuda()
    x = (torch.rand(64, 96, device="cuda") + 0.5).requires_grad_()
    zeros, ones = torch.zeros_like(x), torch.ones_like(x)
    weight, bias = torch.ones(96, device="cuda"), torch.zeros(96, device="cuda")

    def step():
        out = ops.attention(q, k, v, causal=True, dropout_p=p, backend=backend)
        dv = torch.autograd.grad(out, (q, k, v), dout)[2]
        y, s = ops.layer_norm_residual(x, zeros, weight, bias, dropout_p=p, prenorm=True, backend=backend)
        dx = torch.autograd.grad((y, s), (x,), (zeros, ones))[0]
        return out, dv, s, dx

    return step, dout


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_dropout_in_a_cuda_graph_draws_new_masks_on_every_replay(backend):
    # The seed is drawn on the device by torch's CUDA generator into a tensor the kernels read: under graph
    # capture torch advances the generator's Philox offset on every replay, so each replay draws new masks
    # (a host-drawn seed would be frozen into the graph: every replay the same mask), and each replay's
    # backward regenerates its own forward's masks. No step synchronizes with the host, the kernels' launchers
    # included: set_sync_debug_mode("error") raises on any synchronizing call.
    step, dout = dropout_step(backend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (Triton compiles, allocator pools)
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    replays = []
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")
        try:
            static = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            graph.replay()
            replays.append([t.detach().clone() for t in static])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for out, dv, s, dx in replays:
        torch.testing.assert_close(dv, out.transpose(-1, -2) @ dout)  # backward used the forward's mask
        assert torch.equal(dx != 0, s != 0), "layer_norm_residual's backward mask is not its forward's"
        assert 0.3 < (s != 0).float().mean().item() < 0.7
    (out0, _, s0, _), (out1, _, s1, _) = replays
    assert not torch.equal(out0 != 0, out1 != 0), "two replays drew the same attention mask"
    assert not torch.equal(s0 != 0, s1 != 0), "two replays drew the same layer_norm_residual mask"


# ---- value checks without host synchronization (csrc/value_checks.h, fastformer/ops/deferred.py) ----

@pytest.fixture
def sync_free():
    """A context in which any synchronizing CUDA call raises (torch.cuda.set_sync_debug_mode("error"))."""
    import contextlib

    @contextlib.contextmanager
    def no_sync():
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    ops.check_deferred()
    yield no_sync
    ops.check_deferred()


def value_checked_step(backend, target, cu_q, cu_k, Tq, Tk, max_q, max_k):
    """cross_entropy and attention_varlen forward and backward on CUDA tensors (the calls whose checks read
    values): their outputs."""
    logits = torch.randn(target.shape[0], 10, device="cuda", requires_grad=True)
    loss = ops.cross_entropy(logits, target, backend=backend)
    q = torch.randn(Tq, 4, 64, device="cuda", requires_grad=True)
    k, v = (torch.randn(Tk, 2, 64, device="cuda", requires_grad=True) for _ in range(2))
    out = ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend=backend)
    (loss.sum() + out.float().sum()).backward()
    return loss, out


def good_tables():
    return cu_seqlens((5, 0, 7)).cuda(), cu_seqlens((6, 2, 7)).cuda()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_deferred_value_checks_make_no_sync(backend, sync_free):
    target = torch.tensor([0, 9, -100, 3], device="cuda")
    with ops.deferred_checks():
        value_checked_step(backend, target, *good_tables(), 12, 15, 7, 7)  # warm-up: compiles, plans, the flag
        cu_q, cu_k = good_tables()  # new tables: checked again, on the device
        with sync_free():
            for _ in range(2):  # a table checked once is not checked again
                value_checked_step(backend, target.clone(), cu_q, cu_k, 12, 15, 7, 7)
    assert ops.check_deferred() is None


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_a_table_checked_at_the_call_is_read_once(backend, sync_free):
    # Outside the mode the first call reads the table (a sync); the same tensor, unchanged, is not read again:
    # the per-layer calls of a forward and their backward.
    target = torch.tensor([0, 9, -100, 3], device="cuda")
    cu_q, cu_k = good_tables()
    value_checked_step(backend, target, cu_q, cu_k, 12, 15, 7, 7)
    q = torch.randn(12, 4, 64, device="cuda", requires_grad=True)
    k, v = (torch.randn(15, 2, 64, device="cuda", requires_grad=True) for _ in range(2))
    with sync_free():
        out = ops.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, causal=True, backend=backend)
        out.float().sum().backward()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_deferred_bad_values_raise_from_check_deferred(backend, sync_free):
    # A bad target and a bad table go through the ops without an error (the kernels stay in bounds: NaN loss,
    # clamped rows), and check_deferred() names them; outside the mode the same calls raise at once.
    bad_target = torch.tensor([0, 10, -100, 3], device="cuda")  # 10 is not a class of V = 10
    bad_q = torch.tensor([0, 5, 3, 12], dtype=torch.int32, device="cuda")  # decreases
    _, good_k = good_tables()
    with ops.deferred_checks():
        value_checked_step(backend, torch.tensor([0, 9, -100, 3], device="cuda"), *good_tables(), 12, 15, 7, 7)
        with sync_free():  # after a warm-up (compiles, plans, the flag)
            loss, _ = value_checked_step(backend, bad_target, bad_q, good_k, 12, 15, 7, 7)
    assert loss[1].isnan() and not loss[[0, 2, 3]].isnan().any()
    with pytest.raises(ValueError, match=r"cross_entropy: a target outside \[0, V\) and not ignore_index was passed "
                                         r"since the last check_deferred\(\) \(checked on cuda:\d, deferred\).*"
                                         r"attention_varlen: a cu_seqlens_q that decreases"):
        ops.check_deferred()
    assert ops.check_deferred() is None
    with pytest.raises(ValueError, match="outside the classes"):
        value_checked_step(backend, bad_target, *good_tables(), 12, 15, 7, 7)
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        value_checked_step(backend, torch.tensor([0, 9, -100, 3], device="cuda"), bad_q.clone(), good_k, 12, 15, 7, 7)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_deferred_checks_are_captured_in_a_cuda_graph(backend, sync_free):
    # In the mode a captured step carries its checks: every replay checks the static inputs it reads.
    target = torch.tensor([0, 9, -100, 3], device="cuda")
    logits = torch.randn(4, 10, device="cuda")
    with ops.deferred_checks():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                ops.cross_entropy(logits, target, backend=backend)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = ops.cross_entropy(logits, target, backend=backend)
    assert ops.check_deferred() is None
    target.copy_(torch.tensor([0, 10, -100, 3]))
    with sync_free():
        graph.replay()
    with pytest.raises(ValueError, match="cross_entropy: a target outside"):
        ops.check_deferred()
    target.copy_(torch.tensor([0, 9, -100, 3]))
    graph.replay()
    assert ops.check_deferred() is None and not loss.isnan().any()
