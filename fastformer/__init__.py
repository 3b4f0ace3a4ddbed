"""fastformer: the Transformer of "Attention Is All You Need" on fused kernels of its own.

    import fastformer
    from fastformer import ops
    ops.attention(q, k, v, key_padding_mask=..., causal=..., dropout_p=..., backend=None)
    ops.softmax(x, mask=..., scale=...)
    ops.layer_norm_residual(x, residual, weight, bias, eps=..., dropout_p=..., prenorm=...)
    ops.cross_entropy(logits, target, label_smoothing=..., ignore_index=..., return_nll=...)
    ops.OPS                        # the op list (csrc/ops.h); every op also takes backend=
    fastformer.backends()          # which backends run on this machine
    fastformer.set_backend(name)   # process default (also FASTFORMER_BACKEND=name)
    fastformer.cpu_capability()    # the CPU kernels' instruction-set level: avx512, avx2 or default
    fastformer.quantize(model, "int8")  # a copy of a model whose projections run in int8 on the CPU
"""
from fastformer import ops
from fastformer._dispatch import backends, set_backend
from fastformer._ext import cpu_capability

__version__ = "0.1.0"
__all__ = ["ops", "backends", "set_backend", "cpu_capability", "quantize", "__version__"]


def quantize(model, dtype: str = "int8"):
    """A copy of ``model`` (a float32 fastformer.nn.Transformer on the CPU) whose projections run in int8:
    weights per output channel, activations per row at run time (fastformer/nn/quantize.py)."""
    from fastformer.nn.quantize import quantize as _quantize

    return _quantize(model, dtype)

backends()  # resolve availability once, at import, so op calls stay cheap and traceable
