"""The eager entries of the forward ops (fastformer._C.EAGER_FWD, csrc/fastformer.cpp): the public functions'
way into the cpu and cuda kernels. They call the dispatcher's typed op without the JIT's argument matching
(the call overhead of issue 36); whatever they do not convert themselves must reach the OpOverload
unchanged, so that tensor subclasses and __torch_function__ modes see the op, __torch_dispatch__ modes see
it through the dispatcher, and bad arguments raise what the op raises."""
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fastformer import _dispatch, ops
from fastformer._ext import C
from fastformer.ops._registry import OPS
from helpers import BACKENDS

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend is not among the tested backends")


def calls():
    """op -> (public call on x, x): small CPU inputs."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    x = torch.randn(3, 5)
    logits, target = torch.randn(3, 7), torch.tensor([1, 6, 0])
    w, b = torch.randn(5), torch.randn(5)
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)  # attention_varlen: 2 sequences of 2 and 1 rows
    return {
        "attention": lambda t: ops.attention(t, k, v, causal=True),
        "attention_varlen": lambda t: ops.attention_varlen(t, k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 2, 2,
                                                           causal=True),
        "softmax": lambda t: ops.softmax(t, mask=torch.tensor([False, True, False, False, False]), scale=2),
        "layer_norm_residual": lambda t: ops.layer_norm_residual(t, x, w, b),
        "cross_entropy": lambda t: ops.cross_entropy(t, target, label_smoothing=0.1),
        "bias_activation": lambda t: ops.bias_activation(t, b, activation="silu"),
    }, {"attention": q, "attention_varlen": q[0].transpose(0, 1), "softmax": x, "layer_norm_residual": x, "cross_entropy": logits,
        "bias_activation": x}


def test_every_op_has_an_eager_entry():
    assert set(C.EAGER_FWD) == set(OPS)
    for op in OPS:
        assert _dispatch.kernel(op, "fwd", "cpu", eager=True) is C.EAGER_FWD[op]


def test_eager_entry_matches_the_op():
    x, r, w, b = torch.randn(4, 6), torch.randn(4, 6), torch.randn(6), torch.randn(6)
    args = (x, r, w, b, 1e-5, 0.0, None, torch.randn(6), torch.bfloat16)
    ours = C.EAGER_FWD["layer_norm_residual"](*args)
    theirs = torch.ops.fastformer.layer_norm_residual_fwd(*args)
    assert isinstance(ours, tuple) and len(ours) == 5 and ours[4].dtype == torch.bfloat16
    for a, t in zip(ours, theirs):
        assert torch.equal(a, t)
    # an int where the schema takes a float, and a Python int seed-less call: converted like the op does
    assert torch.equal(C.EAGER_FWD["softmax"](x, None, 1), torch.ops.fastformer.softmax_fwd(x, None, 1.0))
    # keyword arguments and a wrong count go to the op, which names the problem
    with pytest.raises((TypeError, RuntimeError)):
        C.EAGER_FWD["softmax"](x, None)
    assert torch.equal(C.EAGER_FWD["softmax"](x, mask=None, scale=1.0), torch.ops.fastformer.softmax_fwd(x, None, 1.0))


class Tagged(torch.Tensor):
    """A tensor subclass that records the functions __torch_function__ sees."""
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", OPS)
def test_tensor_subclass_sees_the_op(op):
    public, inputs = calls()
    Tagged.seen = []
    public[op](inputs[op].as_subclass(Tagged))
    assert getattr(torch.ops.fastformer, f"{op}_fwd").default in Tagged.seen


@pytest.mark.parametrize("op", OPS)
def test_torch_function_mode_sees_the_op(op):
    public, inputs = calls()
    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        public[op](inputs[op])
    assert getattr(torch.ops.fastformer, f"{op}_fwd").default in seen


@pytest.mark.parametrize("op", OPS)
def test_torch_dispatch_mode_sees_the_op(op):
    public, inputs = calls()
    seen = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    expected = public[op](inputs[op])
    with Mode():
        got = public[op](inputs[op])
    assert getattr(torch.ops.fastformer, f"{op}_fwd").default in seen
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_errors_are_python_exceptions():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="residual"):
        C.EAGER_FWD["layer_norm_residual"](x, torch.randn(3, 4), torch.randn(5), torch.randn(5), 1e-5, 0.0, None,
                                           None, None)
    with pytest.raises(ValueError, match="dropout_p"):
        ops.layer_norm_residual(x, x, torch.randn(5), torch.randn(5), dropout_p=1.5)
    with pytest.raises(ValueError, match="outside the classes"):
        ops.cross_entropy(torch.randn(3, 7), torch.tensor([1, 7, 0]))
    with pytest.raises(ValueError, match="outside the classes"):
        ops.cross_entropy(torch.randn(3, 7), torch.tensor([1, 0, -2, 0, 0, 0])[::2])  # non-contiguous target


def test_python_callbacks_run_while_the_entry_has_released_the_gil():
    # The entry releases the GIL around the op; saved-tensor hooks and anomaly mode call Python from
    # inside it (they take the GIL back).
    x, r, w, b = (torch.randn(*shape, requires_grad=True) for shape in ((4, 8), (4, 8), (8,), (8,)))
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = ops.layer_norm_residual(x, r, w, b)
    assert packed
    y.sum().backward()
    with pytest.warns(UserWarning), torch.autograd.detect_anomaly():
        ops.softmax(x).sum().backward()
    assert x.grad is not None
