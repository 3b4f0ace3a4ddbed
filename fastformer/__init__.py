"""fastformer: the Transformer of "Attention Is All You Need" on fused kernels of its own.

    import fastformer
    from fastformer import ops
    ops.attention(q, k, v, key_padding_mask=..., causal=..., dropout_p=..., backend=None)
    ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=..., dropout_p=...)
    ops.softmax(x, mask=..., scale=...)
    ops.layer_norm_residual(x, residual, weight, bias, eps=..., dropout_p=..., prenorm=..., x_bias=..., compute_dtype=...)
    ops.cross_entropy(logits, target, label_smoothing=..., ignore_index=..., return_nll=...)
    ops.bias_activation(x, bias, activation="relu", dropout_p=...)  # dropout(act(x + bias)): relu, gelu, silu
    ops.OPS                        # the op list (csrc/ops.h); every op also takes backend=
    with ops.deferred_checks(): ...  # GPU value checks (targets, cu_seqlens) on the device, no host sync;
    ops.check_deferred()           # ... reported here: ValueError naming the op, argument and rule
    fastformer.backends()          # which backends run on this machine
    fastformer.set_backend(name)   # process default (also FASTFORMER_BACKEND=name)
    fastformer.cpu_capability()    # the CPU kernels' instruction-set level: avx512, avx2 or default
    fastformer.quantize(model, "int8")  # a copy of a model whose projections run in int8 on the CPU
    fastformer.int8_providers()    # which kernel computes the int8 products here (ours, or oneDNN's on AMX)
    model, tokenizer = fastformer.from_transformers(DIR)  # a local MarianMT or M2M-100/NLLB folder
    import fastformer.hf           # registers attn_implementation="fastformer" in transformers
"""
from fastformer import ops
from fastformer._dispatch import backends, set_backend
from fastformer._ext import cpu_capability, int8_providers

__version__ = "0.1.0"
__all__ = ["ops", "backends", "set_backend", "cpu_capability", "int8_providers", "quantize", "from_transformers", "__version__"]


def quantize(model, dtype: str = "int8"):
    """A copy of ``model`` (a float32 fastformer.nn.Transformer on the CPU) whose projections run in int8:
    weights per output channel, activations per row at run time (fastformer/nn/quantize.py)."""
    from fastformer.nn.quantize import quantize as _quantize

    return _quantize(model, dtype)


def from_transformers(directory, backend=None, device="cpu"):
    """``(model, tokenizer)`` of a local transformers MarianMT or M2M-100/NLLB folder, offline: the types
    ``fastformer.checkpoint.load_model`` gives (a ``fastformer.nn.Transformer`` in eval mode and a tokenizer
    with ``encode``/``decode``), which translate, quantize and export take as they are
    (fastformer/hf_convert.py: what maps to what, and what is refused)."""
    from fastformer.hf_convert import from_transformers as _from_transformers

    return _from_transformers(directory, backend=backend, device=device)

backends()  # resolve availability once, at import, so op calls stay cheap and traceable
