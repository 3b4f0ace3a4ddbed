"""The model's projections: ``Linear`` (an ``nn.Linear``) and ``linear(x, weight, bias)``, which at inference
on the CPU in float32 run fastformer's own GEMM on the weight packed once into column panels.

``fastformer._C.packed_linear`` (csrc/gemm/packed_linear.cpp, built per CPU level) streams W^T as
(ceil(out / P), P / S, in, S) panels (P = PACKED_LINEAR_PANEL columns a panel, in strips of S =
PACKED_LINEAR_STRIP contiguous columns), with ``at::vec`` fused multiply-adds (the decoding benchmark,
benchmarks/test_decoding.py, times the decoder built on it beside one on torch's GEMM; no generated table
times the two GEMMs alone). It is used where no gradient can be wanted: grad disabled (``torch.no_grad``,
``inference_mode``: translation, evaluation), not under autocast, not while ``torch.compile`` traces, x
float32 on the CPU. Everywhere else, training included, ``F.linear``.

The panels are one more copy of the weight, made at the first such call and kept (keyed on the weight
tensor, weakly) until the weight changes in place (its version counter moves: an optimizer step) or is
replaced; they are not part of the state dict.

``Embedding`` (an ``nn.Embedding``) is the model's token table; ``project(h, bias)`` is the output projection
tied to it (h E^T + b).

Training in bfloat16 or float16 (issue 52): ``set_compute_dtype(model, dtype)`` gives every projection weight and
bias (and each embedding table, for ``project``) a copy in that dtype, kept beside the float32 parameter: under
autocast to that dtype the projections multiply the copies (``compute_linear``), so no forward casts a weight;
the optimizer (fastformer/training/optim.py) writes each copy in the pass that updates its parameter. A copy
is tagged with its parameter's version counter when written; a parameter changed in place by anything else
(``load_state_dict``, ``copy_``, another optimizer) has moved on, and its copy is written again at its next use.
The weight's gradient reaches the float32 parameter from a product with a float32 output, summed in float32:
on CUDA ``mm`` with ``out_dtype``; on the CPU in bfloat16 fastformer's own (the op
``torch.ops.fastformer.weight_grad``, csrc/gemm/weight_grad.cpp, which also sums the bias's gradient as it reads
dy), since ATen multiplies bfloat16 into bfloat16 only there (autograd would cast that gradient: one cast and one
rounding to bfloat16 per weight per micro-batch, as under plain autocast; and a float32 sum of dy casts all of
dy first). float16 on the CPU keeps those casts.

A model quantized by ``fastformer.quantize(model, "int8")`` (fastformer/nn/quantize.py) has ``Int8Linear``
projections in place of ``Linear`` and ``Int8Embedding`` tables in place of ``Embedding``: the same state dict
names (``weight``, ``bias``) plus ``weight_scale`` and ``weight_colsum``, the int8 weight in the kernel's
packed layout, no float copy kept. The three parts of an int8 weight carry these names everywhere: the
state dict, ``Int8Weight`` here, csrc/gemm/gemm.h's ``Int8Weight`` and the C++ decoder's dict. The same rule
picks ``fastformer._C.int8_linear`` (csrc/gemm/int8_linear.cpp: int8 weights, activations quantized per row),
and elsewhere ``F.linear`` on the weight dequantized for that call. The packed layouts and the quantization
rule are C++'s (csrc/gemm/gemm.h): ``C.pack_linear``, ``C.quantize_int8``, ``C.dequantize_int8``.

Each projection module answers for itself: ``module(x)`` (``project(h, bias)`` for a table) applies it, float
or int8, and ``module.bind(name)`` gives its weights under the names the C++ decoder binds them by
(csrc/inference/decoder.cpp Binder::linear): "<name>.panels" (and "<name>.bias") for a float projection,
"<name>.weight", "<name>.weight_scale", "<name>.weight_colsum" (and "<name>.onednn", "<name>.bias") for an int8
one. Nothing outside this file asks which kind a module is.

The int8 modules share ``Int8Module``: the three buffers, and the module's binding to an int8 provider
(csrc/gemm/int8_linear.cpp's table), made at quantization and at ``load_state_dict``, again at the first call
after the weight tensor is replaced: the variant ``FASTFORMER_INT8_PROVIDER`` forces then (read once there, as
the C++ decoder reads it once when built; ``C.int8_provider``), else the rule's per call, and, where that
provider can run oneDNN's products (a CPU with AMX, or oneDNN forced: csrc/gemm/int8_onednn.h), the weight packed
for them (``C.int8_prepare``: a ``C.OnednnInt8``, "<name>.onednn"), as torch's quantized Linear holds its
``LinearPackedParams``; freed with the module, not in the state dict. A weight changed in place some other way
(``module.weight.copy_``), or a provider forced after quantization, needs
``fastformer.nn.quantize.pack_for_providers``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from fastformer._ext import C

_PANELS = WeakIdKeyDictionary()  # weight -> (its (data_ptr, version, shape) when packed, panels)


class Int8Weight(NamedTuple):
    """A weight (out, in) quantized to int8 per output channel, as ``C.quantize_int8`` returns it: an int8
    module's buffers, by their state dict names."""
    weight: Tensor         # int8 (ceil(out / P), ceil(in / 4), P, 4): Wq in the kernel's layout (csrc/gemm/gemm.h)
    weight_scale: Tensor   # float32 (out,): s_w, W ~ Wq s_w
    weight_colsum: Tensor  # int32 (out,): sum_k Wq[n, k]


INT8_BUFFERS = Int8Weight._fields  # the tensors of an int8 weight: its module's buffers


def pack_panels(weight: Tensor) -> Tensor:
    """An (out, in) float32 weight as the column panels of W^T that ``fastformer._C.packed_linear`` streams
    (``C.pack_linear``: the layout of csrc/gemm/gemm.h)."""
    return C.pack_linear(weight)


def packed_panels(weight: Tensor) -> Optional[Tensor]:
    """``pack_panels(weight)``, cached until the weight changes; None unless it is a 2-D float32 CPU tensor.
    A change is seen by the weight's version counter; a weight made under torch.inference_mode has none (it
    cannot change outside inference mode): its panels are kept until the weight is replaced, as torch's own
    packed weights are (an in-place change made inside inference mode is not seen)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    key = (weight.data_ptr(), None if weight.is_inference() else weight._version, tuple(weight.shape))
    cached = _PANELS.get(weight)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        panels = pack_panels(weight.detach())
    _PANELS[weight] = (key, panels)
    return panels


def packed_applies(x: Tensor) -> bool:
    """Whether a projection of x may take the packed kernel: float32 on the CPU, grad disabled, no
    autocast, not traced by torch.compile."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling())


_COMPUTE = WeakIdKeyDictionary()  # parameter -> [its copy in the compute dtype, the parameter's version then]


def set_compute_dtype(model: nn.Module, dtype: Optional[torch.dtype]) -> dict[nn.Parameter, Tensor]:
    """Gives the float projections of ``model`` (``Linear`` weights and biases, ``Embedding`` tables) copies in
    ``dtype`` (bfloat16 or float16), used under autocast to that dtype; ``None`` drops them. Returns parameter ->
    copy, for the optimizer that keeps them current (fastformer.training.optim.Adam)."""
    copies = {}
    for module in model.modules():
        if isinstance(module, (Linear, Embedding)):
            for param in (module.weight, getattr(module, "bias", None)):
                if param is None:
                    continue
                if dtype is None:
                    _COMPUTE.pop(param, None)
                    continue
                if dtype not in (torch.bfloat16, torch.float16):
                    raise ValueError(f"set_compute_dtype: dtype must be torch.bfloat16, torch.float16 or None, "
                                     f"got {dtype}")
                with torch.no_grad():
                    copy = param.detach().to(dtype)
                _COMPUTE[param] = [copy, param._version]
                copies[param] = copy
    return copies


def compute_copy(param: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """The copy of ``param`` in ``dtype`` kept by ``set_compute_dtype``, written again first if the parameter has
    changed in place since it was last written; None without one (or of another dtype)."""
    entry = _COMPUTE.get(param) if param is not None else None
    if entry is None or entry[0].dtype != dtype:
        return None
    if entry[1] != param._version:
        with torch.no_grad():
            entry[0].copy_(param.detach())
        entry[1] = param._version
    return entry[0]


def mark_compute_copies_current(params) -> None:
    """Records that the copies of ``params`` were written from their current values (by the optimizer, whose own
    in-place update may have moved the version counters)."""
    for param in params:
        entry = _COMPUTE.get(param)
        if entry is not None:
            entry[1] = param._version


def _weight_grads(dy: Tensor, x: Tensor, bias: bool) -> tuple[Tensor, Optional[Tensor]]:
    """(dy (M, out)^T x (M, in), the column sums of dy when ``bias``): in float32 where there is a product with a
    float32 output for these dtypes (CUDA: ATen's; CPU bfloat16: fastformer's, which sums db as it reads dy), else
    dW in dy's dtype (autograd then casts it to the parameter's float32)."""
    if dy.device.type == "cpu" and dy.dtype == torch.bfloat16 and x.dtype == torch.bfloat16:
        dw, db = torch.ops.fastformer.weight_grad(dy, x)
        return dw, db if bias else None
    db = dy.sum(0, dtype=torch.float32) if bias else None
    if dy.device.type == "cuda":
        return torch.mm(dy.t(), x, out_dtype=torch.float32), db
    return dy.t() @ x, db


@torch.library.register_fake("fastformer::weight_grad")
def _weight_grad_fake(dy: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    return (dy.new_empty((dy.shape[1], x.shape[1]), dtype=torch.float32),
            dy.new_empty((dy.shape[1],), dtype=torch.float32))


class _ComputeLinear(torch.autograd.Function):
    """y = x Wc^T + bc with Wc, bc the compute-dtype copies of the float32 parameters W, b; the gradients go to W
    and b (float32). Saves x and Wc (both in the compute dtype)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], weight_c: Tensor,
                bias_c: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(x, weight_c)
        ctx.has_bias = bias is not None
        return F.linear(x, weight_c, bias_c)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight_c = ctx.saved_tensors
        dx = dy @ weight_c if ctx.needs_input_grad[0] else None
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dw, db = None, None
        want_db = ctx.has_bias and ctx.needs_input_grad[2]
        if ctx.needs_input_grad[1]:
            dw, db = _weight_grads(dy2, x2, want_db)
        elif want_db:
            db = dy2.sum(0, dtype=torch.float32)
        return dx, dw, db, None, None


def compute_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Optional[Tensor]:
    """x W^T + b on the compute-dtype copies of W and b, when autocast runs in their dtype (not under
    torch.compile, which traces plain autocast); None where it does not apply. x is cast to that dtype first
    if it is not in it."""
    device = x.device.type
    if torch.compiler.is_compiling() or not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    weight_c = compute_copy(weight, dtype)
    if weight_c is None:
        return None
    bias_c = compute_copy(bias, dtype)
    if bias is not None and bias_c is None:  # a bias kept elsewhere (Marian's output bias): cast, (out,) only
        bias_c = bias.detach().to(dtype)
    with torch.autocast(device, enabled=False):
        return _ComputeLinear.apply(x.to(dtype), weight, bias, weight_c, bias_c)


def product(module: nn.Module, x: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """A projection whose bias is added by the op that consumes it (ops.bias_activation, the branch bias of
    ops.layer_norm_residual): (x W^T, b) for a ``Linear`` with a bias, its compute-dtype copies under autocast;
    (module(x), None), the bias added already, where the packed or int8 kernels add it in their own epilogue
    (``packed_applies``) or the module has no bias to hand over."""
    if isinstance(module, Linear) and module.bias is not None and not packed_applies(x):
        y = compute_linear(x, module.weight, None)
        return (F.linear(x, module.weight) if y is None else y), module.bias
    return module(x), None


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x (..., in) W^T + b: ``F.linear``, or the packed kernel where ``packed_applies(x)``."""
    if packed_applies(x):
        panels = packed_panels(weight)
        if panels is not None:
            out = weight.shape[0]
            y = C.packed_linear(x.reshape(-1, x.shape[-1]), panels, None if bias is None else bias.detach(), out)
            return y.view(*x.shape[:-1], out)
    return F.linear(x, weight, bias)


def _with_bias(named: dict[str, object], name: str, bias: Optional[Tensor]) -> dict[str, object]:
    if bias is not None:
        named[name + ".bias"] = bias
    return named


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose inference runs ``linear`` above."""

    def forward(self, x: Tensor) -> Tensor:
        y = compute_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias) if y is None else y

    def bind(self, name: str) -> dict[str, object]:
        """The C++ decoder's entries: "<name>.panels" (the packed weight) and "<name>.bias" where there is one."""
        return _with_bias({name + ".panels": packed_panels(self.weight)}, name, self.bias)

    def to_int8(self, quantize: bool = True) -> "Int8Linear":
        """This projection quantized (``Int8Linear.from_float``), or an empty one of its shape to load into."""
        return Int8Linear.from_float(self, quantize)


class Embedding(nn.Embedding):
    """``nn.Embedding`` (same parameter, same state dict) whose table is also a projection: ``project(h, bias)``
    = h E^T + b through ``linear`` above (the Transformer's output projection, tied to its target embedding)."""

    quantization = None

    def project(self, h: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        """h (..., dim) -> (..., num_embeddings)."""
        y = compute_linear(h, self.weight, bias)
        return linear(h, self.weight, bias) if y is None else y

    def bind(self, name: str) -> dict[str, object]:
        """The C++ decoder's entries: "<name>.weight" (the table, for lookups) and "<name>.panels" (for ``project``)."""
        return {name + ".weight": self.weight.detach(), name + ".panels": packed_panels(self.weight)}

    def to_int8(self, quantize: bool = True) -> "Int8Embedding":
        """This table quantized (``Int8Embedding.from_float``), or an empty one of its shape to load into."""
        return Int8Embedding.from_float(self, quantize)


class Int8Module(nn.Module):
    """What the int8 modules share: a weight (out, in) quantized to int8, as buffers (``INT8_BUFFERS``: the state
    dict); its binding to an int8 provider, not in the state dict (see the top of this file); the int8
    projection (``project``) and the C++ decoder's entries (``bind``)."""

    def __init__(self, out: int, inp: int):
        super().__init__()
        self.int8_shape = (out, inp)
        # empty (zeros), in the layout C++ owns (csrc/gemm/gemm.h int8_weight_shape), for load_state_dict
        self.register_buffer("weight", torch.zeros(C.int8_weight_shape(out, inp), dtype=torch.int8))
        self.register_buffer("weight_scale", torch.zeros(out))
        self.register_buffer("weight_colsum", torch.zeros(out, dtype=torch.int32))
        self._binding = (None, "auto", None)  # (the weight tensor bound, its variant, its C.OnednnInt8 or None)

    def _quantize_from(self, weight: Tensor) -> None:
        """The buffers set to ``C.quantize_int8`` of a float (out, in) weight, and bound (``pack``)."""
        for name, tensor in zip(INT8_BUFFERS, C.quantize_int8(weight.detach().float().cpu())):
            setattr(self, name, tensor)
        self.pack()

    def pack(self) -> "Int8Module":
        """Binds the module to the int8 provider of now: the variant ``FASTFORMER_INT8_PROVIDER`` forces (read here,
        once), else "auto" (the rule, per call); and packs the weight for oneDNN's products where that provider
        can run them (``C.int8_prepare``: a CPU with AMX, or oneDNN forced), else drops any packing. Returns the
        module."""
        out, inp = self.int8_shape
        variant = C.int8_provider()
        onednn = C.int8_prepare(self.weight, self.weight_scale, self.weight_colsum, out, inp, variant)
        self._binding = (self.weight, variant, onednn)
        return self

    def _bound(self) -> tuple[Tensor, str, Optional[object]]:
        if self._binding[0] is not self.weight:  # replaced since, or never bound
            self.pack()
        return self._binding

    @property
    def provider(self) -> str:
        """The int8 variant this module's products run: a name of ``C.int8_variants()``, or "auto" (the rule)."""
        return self._bound()[1]

    @property
    def onednn(self):
        """The weight's oneDNN packing (a ``C.OnednnInt8``) or None; bound first if the weight tensor is not the
        one bound."""
        return self._bound()[2]

    def project(self, x: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        """x (..., in) Wq^T + b: the int8 kernel (``C.int8_linear``, this module's provider) where
        ``packed_applies(x)``, else ``F.linear`` on the weight dequantized for this call."""
        out, inp = self.int8_shape
        if packed_applies(x):
            _, variant, onednn = self._bound()
            y = C.int8_linear(x.reshape(-1, x.shape[-1]), self.weight, self.weight_scale, self.weight_colsum,
                              None if bias is None else bias.detach(), out, variant, onednn)
            return y.view(*x.shape[:-1], out)
        dequantized = C.dequantize_int8(self.weight, self.weight_scale, out, inp)
        return F.linear(x, dequantized.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def bind(self, name: str) -> dict[str, object]:
        """The C++ decoder's entries: "<name>.weight", "<name>.weight_scale", "<name>.weight_colsum", and
        "<name>.onednn" where the module holds a oneDNN packing."""
        named = {f"{name}.{field}": getattr(self, field) for field in INT8_BUFFERS}
        if self.onednn is not None:
            named[name + ".onednn"] = self.onednn
        return named

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.pack()  # the weight loaded (copied into the same tensor, or assigned) bound anew

    def __getstate__(self):
        # A copy (copy.deepcopy, pickle) takes no binding: it binds its own at its first call.
        state = super().__getstate__()
        state["_binding"] = (None, "auto", None)
        return state


class Int8Linear(Int8Module):
    """A projection of a quantized model: y = x W^T + b with W (out, in) held as int8 per output channel.
    Its state dict: ``weight`` int8 in the kernel's packed layout (ceil(out / P), ceil(in / 4), P, 4),
    ``weight_scale`` float32 (out,), ``weight_colsum`` int32 (out,) and ``bias`` float32 (out,) or none; all
    buffers (nothing to train), about a quarter of the float32 bytes. ``Int8Linear(in, out, bias)`` makes an
    empty one for ``load_state_dict``; ``Int8Linear.quantize(weight, bias)`` quantizes a float32 weight;
    ``from_float`` does either for a ``Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(out_features, in_features)
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def quantize(cls, weight: Tensor, bias: Optional[Tensor] = None) -> "Int8Linear":
        """The int8 form of a float32 (out, in) weight and its bias (``C.quantize_int8``: csrc/gemm/gemm.h)."""
        out, inp = weight.shape
        module = cls(inp, out, bias is not None)
        module._quantize_from(weight)
        if bias is not None:
            module.bias = bias.detach().float().cpu().clone()
        return module

    @classmethod
    def from_float(cls, linear: Linear, quantize: bool = True) -> "Int8Linear":
        """``linear`` quantized, or (``quantize=False``) an empty module of its shape for ``load_state_dict``."""
        if quantize:
            return cls.quantize(linear.weight, linear.bias)
        return cls(linear.in_features, linear.out_features, linear.bias is not None)

    def forward(self, x: Tensor) -> Tensor:
        return self.project(x, self.bias)

    def bind(self, name: str) -> dict[str, object]:
        """``Int8Module.bind`` and "<name>.bias" where there is one."""
        return _with_bias(super().bind(name), name, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


class Int8Embedding(Int8Module):
    """A quantized model's ``Embedding``: the (num, dim) table in int8, per row, by the projections' rule and in
    their packed layout (``C.quantize_int8``: csrc/gemm/gemm.h), as CTranslate2's int8 quantizes its embeddings.
    A lookup dequantizes the rows it reads (``C.int8_embedding``); ``project(h, bias)`` is the int8 projection
    on the same weight (``C.int8_linear``: the tied output projection). Its state dict: ``weight`` int8
    (packed), ``weight_scale`` float32 (num,) and ``weight_colsum`` int32 (num,), no float copy.
    ``Int8Embedding(num, dim)`` makes an empty one for ``load_state_dict``; ``Int8Embedding.quantize(weight)``
    quantizes a float32 table; ``from_float`` does either for an ``Embedding``."""

    quantization = "int8"

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    @classmethod
    def quantize(cls, weight: Tensor) -> "Int8Embedding":
        num, dim = weight.shape
        module = cls(num, dim)
        module._quantize_from(weight)
        return module

    @classmethod
    def from_float(cls, embedding: Embedding, quantize: bool = True) -> "Int8Embedding":
        """``embedding`` quantized, or (``quantize=False``) an empty module of its shape for ``load_state_dict``."""
        if quantize:
            return cls.quantize(embedding.weight)
        return cls(embedding.num_embeddings, embedding.embedding_dim)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (any shape, int64 in [0, num)) -> (*tokens.shape, dim) float32."""
        return C.int8_embedding(tokens, self.weight, self.weight_scale, self.num_embeddings, self.embedding_dim)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A source table saved by 9aea6a7's code has no weight_colsum (it was never a projection): the int8
        # values' sums per row, from the packed weight (csrc/gemm/gemm.h: zeros past dim and past num).
        weight = state_dict.get(prefix + "weight")
        if prefix + "weight_colsum" not in state_dict and weight is not None and weight.dim() == 4:
            state_dict[prefix + "weight_colsum"] = weight.sum((1, 3), dtype=torch.int32).reshape(-1)[: self.num_embeddings]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"
