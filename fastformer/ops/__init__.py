"""fastformer's fused ops: ``attention``, ``attention_varlen``, ``softmax``, ``layer_norm_residual``, ``cross_entropy``,
``bias_activation``.

Each is declared once in C++ (csrc/ops.h): ``fastformer::<op>_fwd``/``_bwd`` with C++ kernels for the CPU
and CUDA dispatch keys, and ``_py`` twins for the backends written in Python (torch, triton, cuda_sim),
autograd in C++; fake kernels and the twins' implementations are registered by the op modules here.
``fastformer._dispatch`` picks the op for a call. ``OPS`` is the op list, from C++. ``deferred_checks()`` and
``check_deferred()`` (fastformer/ops/deferred.py): the value checks of GPU calls without host synchronization.
"""
from fastformer.ops._registry import OPS
from fastformer.ops.attention import attention
from fastformer.ops.attention_varlen import attention_varlen
from fastformer.ops.bias_activation import bias_activation
from fastformer.ops.cross_entropy import cross_entropy
from fastformer.ops.deferred import check_deferred, deferred_checks
from fastformer.ops.layer_norm_residual import layer_norm_residual
from fastformer.ops.softmax import softmax

__all__ = ["OPS", "attention", "attention_varlen", "softmax", "layer_norm_residual", "cross_entropy",
           "bias_activation", "deferred_checks", "check_deferred"]
