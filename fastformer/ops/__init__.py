"""fastformer's fused ops: ``attention``, ``softmax``, ``layer_norm_residual``.

Each is a torch.library custom op (fake + autograd registered) dispatching to the backend chosen by
``fastformer._dispatch`` (torch, cpu, cuda, triton, cuda_sim).
"""
from fastformer.ops.attention import attention
from fastformer.ops.layer_norm_residual import layer_norm_residual
from fastformer.ops.softmax import softmax

__all__ = ["attention", "softmax", "layer_norm_residual"]
