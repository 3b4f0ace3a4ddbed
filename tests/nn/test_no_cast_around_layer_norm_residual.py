"""A training step under autocast issues no cast around layer_norm_residual (issue 44).

Under ``torch.autocast`` the sublayers return bfloat16 while the residual stream and the LayerNorm
parameters stay float32. layer_norm_residual takes the bfloat16 branch beside the float32 residual as it
comes: its kernels upcast the branch as they read it and write its gradient in bfloat16, and they reduce
dweight and dbias themselves. A dispatch mode records every ATen call of a tiny model's step (forward, loss,
backward, Adam) and fails on any ``_to_copy``/``copy_``/``to`` that makes an input of
``fastformer::layer_norm_residual_fwd`` or takes an output (a gradient) of ``fastformer::layer_norm_residual_bwd``.
(Copies inside an op are not seen by a dispatch mode; the kernels' own tests cover those.)
"""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastformer import ops
from fastformer.nn import Transformer, TransformerConfig

COPIES = {"aten::_to_copy", "aten::copy_", "aten::to"}


class CastsAroundLayerNormResidual(TorchDispatchMode):
    """Records the copies around the layer_norm_residual kernel ops of a step, as they happen.

    Tensors are matched by storage (a view of a copy counts as the copy) while both are alive, and held by
    weak references only: a strong one would change the step (autograd's gradient accumulation steals a
    gradient nobody else holds, and copies one that is held)."""

    def __init__(self):
        super().__init__()
        self.copy_results = []  # (description, weakref to the copy's result)
        self.grads = []  # weakrefs to the outputs of every backward call: dx, dresidual, dweight, dbias
        self.fwd_calls = []  # the dtypes of (x, residual, weight, bias) of every forward call
        self.bwd_calls = 0
        self.offending = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.name()
        if name in COPIES:
            source = args[1] if name == "aten::copy_" else args[0]
            what = f"{name} {source.dtype} -> {out.dtype}"
            if any(storage(source) == storage(g) for g in alive(self.grads)):
                self.offending.append(f"{what} takes a gradient that layer_norm_residual_bwd made")
            self.copy_results.append((what, weakref.ref(out)))
        elif name == "fastformer::layer_norm_residual_fwd":
            self.fwd_calls.append(tuple(t.dtype for t in args[:4]))
            for t in args[:4]:
                self.offending += [f"{what} makes an input of layer_norm_residual_fwd"
                                   for what, ref in self.copy_results
                                   if ref() is not None and storage(ref()) == storage(t)]
        elif name == "fastformer::layer_norm_residual_bwd":
            self.bwd_calls += 1
            self.grads += [weakref.ref(t) for t in out]
        return out


def storage(t):
    return t.untyped_storage().data_ptr()


def alive(refs):
    return [t for t in (r() for r in refs) if t is not None]


def test_autocast_training_step_issues_no_cast_around_layer_norm_residual():
    config = TransformerConfig.tiny()
    model = Transformer(config, backend="cpu").train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    src = torch.randint(config.pad_id + 1, config.vocab_size, (3, 7))
    tgt_in = torch.randint(config.pad_id + 1, config.vocab_size, (3, 6))
    tgt_out = torch.randint(config.pad_id + 1, config.vocab_size, (3, 6))
    with CastsAroundLayerNormResidual() as mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(src, tgt_in)
            loss = ops.cross_entropy(logits, tgt_out, label_smoothing=0.1, ignore_index=config.pad_id).sum()
        loss.backward()
        optimizer.step()
    assert mode.offending == []
    # The step ran the op as intended: every sublayer's fused call, a bfloat16 branch beside the float32
    # stream and parameters, each with its backward.
    sublayers = 2 * config.n_encoder_layers + 3 * config.n_decoder_layers
    assert mode.fwd_calls == [(torch.bfloat16,) + (torch.float32,) * 3] * sublayers
    assert mode.bwd_calls == sublayers
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
