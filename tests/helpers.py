"""Shared by the op tests: the backends and dtypes they run over, input construction, forward+backward runs.

BACKENDS are the kernel backends this build can run on CPU tensors (FASTFORMER_TEST_BACKENDS=cpu,...
narrows them: CI's extra runs at the lower CPU levels and on the oldest torch test the cpu backend
alone); the torch backend is the reference (run in float64). ALL_BACKENDS adds the torch backend itself, whose low-precision runs (torch float32 vs
torch float64) check the harness and its tolerances, and which must reject bad input like the others.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fastformer

_ONLY = os.environ.get("FASTFORMER_TEST_BACKENDS", "").split(",")
BACKENDS = [b for b in ("cpu", "cuda_sim", "triton") if fastformer.backends().get(b) and (_ONLY == [""] or b in _ONLY)]
# Backends compared with the reference: the reference's own low-precision runs and every kernel backend.
ALL_BACKENDS = ["torch"] + BACKENDS

# Backends that execute GPU kernels on the CPU (a SIMT fiber model, the Triton interpreter): orders of
# magnitude slower, so only shapes within these limits run on them.
SLOW_BACKENDS = frozenset({"cuda_sim", "triton"})
SLOW_LIMITS = dict(B=2, H=2, L=33, D=128, rows=16, N=4099)

# Parity cases run on cuda_sim once per schedule seed (the order of warps and lanes between barriers):
# a race that one schedule hides, another shows. The seed reaches the model through the sim_seed mark
# (tests/conftest.py); other cuda_sim tests run under the default seed.
SIM_SEEDS = (1, 2)

_DTYPE_NAMES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
}


def dtypes_for(backend):
    """The dtypes every op supports on ``backend`` (docs/api.md: float64 only on torch and cpu)."""
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    if backend in ("torch", "cpu"):
        dtypes.insert(0, torch.float64)
    return dtypes


# Backends that run float64, for gradcheck.
FLOAT64_BACKENDS = [b for b in ALL_BACKENDS if torch.float64 in dtypes_for(b)]


def dtype_name(dtype):
    return _DTYPE_NAMES[dtype]


def backend_dtype_cases(backends, cases, small, dtypes=None):
    """pytest params (backend, dtype, case) over every backend, its dtypes and the cases.

    ``small(case)`` says whether the case fits SLOW_LIMITS; slow backends only get those cases.
    ``dtypes`` restricts the dtypes (intersected with what the backend supports).
    """
    params = []
    for backend in backends:
        for dtype in dtypes_for(backend):
            if dtypes is not None and dtype not in dtypes:
                continue
            for case in cases:
                if backend in SLOW_BACKENDS and not small(case):
                    continue
                if backend == "cuda_sim":
                    params += [pytest.param(backend, dtype, case, id=f"{backend}@{seed}-{dtype_name(dtype)}-{case}",
                                            marks=pytest.mark.sim_seed(seed)) for seed in SIM_SEEDS]
                    continue
                params.append(pytest.param(backend, dtype, case, id=f"{backend}-{dtype_name(dtype)}-{case}"))
    return params


def backend_dtypes(backends):
    """pytest params (backend, dtype) over every backend and the dtypes it supports."""
    return [pytest.param(b, d, id=f"{b}-{dtype_name(d)}") for b in backends for d in dtypes_for(b)]


def randn(*shape, dtype, scale=1.0, shift=0.0):
    """Normal samples drawn in float64 and rounded to ``dtype`` (the reference upcasts the rounded values)."""
    return (torch.randn(*shape, dtype=torch.float64) * scale + shift).to(dtype)


def upcast(tensors):
    """float64 copies of ``tensors`` (None stays None), detached from any graph."""
    return [None if t is None else t.detach().double() for t in tensors]


def forward_backward(fn, inputs, upstream):
    """Runs ``fn(*inputs)`` on fresh leaves, backpropagates ``upstream`` into its outputs.

    Returns (outputs, gradients of the inputs). The leaves keep the inputs' strides, so non-contiguous
    inputs stay non-contiguous.
    """
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    outputs = fn(*leaves)
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    torch.autograd.backward(outputs, list(upstream))
    return [o.detach() for o in outputs], [leaf.grad for leaf in leaves]


def projection_views(B, H, Lq, Lk, D, pad, dtype, device="cpu"):
    """Attention's q, k, v (B, H, L, D) as models hand them over: q a view of a (B, Lq, H D) projection, k and
    v views of one interleaved (B, Lk, 2, H, D) projection (transformers' and fastformer.nn's fused key/value
    projection); each token's row is followed by ``pad`` NaN elements (row stride H D + pad, 2 H D + pad),
    which a kernel reading outside the rows would spread. Returns the projection buffers and the views."""
    def buffer(L, width):
        x = torch.full((B, L, width + pad), float("nan"), dtype=dtype)
        x[..., :width] = randn(B, L, width, dtype=dtype)
        return x.to(device).requires_grad_()

    xq, xkv = buffer(Lq, H * D), buffer(Lk, 2 * H * D)
    q = xq[..., :H * D].view(B, Lq, H, D).transpose(1, 2)
    kv = xkv[..., :2 * H * D].view(B, Lk, 2, H, D)
    return (xq, xkv), (q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2))


def assert_layout_kept(attention, q, k, v, out, grads, dout):
    """``attention``'s out and grads on the views q, k, v (with upstream ``dout``) are (B, L, H, D) memory, as
    are those of the same call on contiguous copies, and bit-identical to them; except that the gradients of
    the parts of one packed projection are the parts of one packed gradient (csrc/attention_grads.h: the layout
    the fake kernels state, fastformer/ops/attention.py grads_like)."""
    from fastformer._ext import C
    from fastformer.ops.attention import grads_like

    contiguous = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    ref = attention(*contiguous)
    ref_grads = torch.autograd.grad(ref, contiguous, dout.contiguous())
    for t in (out, ref, *ref_grads):  # (B, L, H, D) memory: no copy on the way back to a projection
        assert t.transpose(1, 2).is_contiguous(), t.stride()
    for g, expected in zip(grads, grads_like(q, k, v, C.attention_packed_kind(q, k, v))[0]):
        assert g.stride() == expected.stride(), (g.stride(), expected.stride())
    assert torch.equal(out, ref)
    for g, rg in zip(grads, ref_grads):
        assert torch.equal(g, rg)


def at_offset(t, offset, pad):
    """A 2-D t's values in a fresh buffer, starting `offset` elements in, rows `pad` elements longer than t's (the
    rest NaN): the same matrix at another memory offset and row stride."""
    rows, cols = t.shape
    storage = torch.full((offset + rows * (cols + pad) + 1,), float("nan"), dtype=t.dtype)
    view = storage[offset:offset + rows * (cols + pad)].view(rows, cols + pad)[:, :cols]
    view.copy_(t)
    return view


def same_memory(a, b):
    """Whether a and b are the same elements of the same memory (one data pointer, shape and strides)."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


def padding_mask(B, Lk):
    """(B, Lk) bool key padding mask, True = padding.

    Random scattered padding (about a quarter of the keys) plus, in batch element 1, a padded suffix as
    a real batch of variable-length sentences has. With small Lk this can pad every key of a batch
    element, which the tests then check returns zeros.
    """
    mask = torch.rand(B, Lk) < 0.25
    if B > 1:
        mask[1, Lk // 2 :] = True
    return mask


def visible_keys(B, Lq, Lk, key_padding_mask, causal):
    """(B, 1, Lq, Lk) bool: query i sees key j (not padded; causal bottom-right: j <= i + Lk - Lq)."""
    visible = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    if key_padding_mask is not None:
        visible &= ~key_padding_mask[:, None, None, :]
    if causal:
        i = torch.arange(Lq)[:, None]
        j = torch.arange(Lk)[None, :]
        visible &= j <= i + (Lk - Lq)
    return visible


def kernel_op(op, phase, backend):
    """(OpOverload, trailing arguments) that run ``op``'s ``phase`` on ``backend``: the C++ kernel op
    ``fastformer::<op>_<phase>`` for cpu and cuda, else its ``_py`` twin with the backend's name last."""
    if backend in ("cpu", "cuda"):
        return getattr(torch.ops.fastformer, f"{op}_{phase}").default, ()
    return getattr(torch.ops.fastformer, f"{op}_{phase}_py").default, (backend,)


class RecordBackends(TorchDispatchMode):
    """Records (op name, backend) of every fastformer op called while active: the ``backend`` argument of
    a ``_py`` op, the device type ("cpu", "cuda") of a C++ kernel op; names without the ``_py`` suffix."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if name.startswith("fastformer::"):
            bound = dict(zip((a.name for a in func._schema.arguments), args))
            bound.update(kwargs)
            op = name.split("::")[1]
            if op.endswith("_py"):
                self.calls.append((op[: -len("_py")], bound["backend"]))
            else:
                self.calls.append((op, args[0].device.type))
        return func(*args, **kwargs)


def torch_cross_entropy(logits, target, smoothing, ignore_index):
    """(loss with ``smoothing``, nll) per row by PyTorch's F.cross_entropy(reduction="none"), in the logits'
    dtype: the eager counterpart of ops.cross_entropy(..., return_nll=True)."""
    V = logits.shape[-1]
    flat, flat_target = logits.reshape(-1, V), target.reshape(-1)

    def ce(e):
        return F.cross_entropy(flat, flat_target, reduction="none", label_smoothing=e,
                               ignore_index=ignore_index).reshape(target.shape)

    return ce(smoothing), ce(0.0)
