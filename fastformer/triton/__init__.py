"""Triton kernels for fastformer's ops (backend ``triton``): one module per op.

On GPUs they are compiled by Triton (Volta and newer, where tl.dot reaches the tensor cores). With
TRITON_INTERPRET=1 set before triton is imported, the same kernels run on CPU tensors in Triton's
interpreter: that is how CI executes them (no GPU anywhere in this project's CI).
"""
import os

import torch

try:
    import triton  # noqa: F401
except ImportError as exc:  # the dispatcher reports this as the reason the backend is unavailable
    raise ImportError(f"triton is not installed ({exc}); pip install triton") from exc

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not INTERPRET and not torch.cuda.is_available():
    raise ImportError("triton needs a CUDA GPU, or TRITON_INTERPRET=1 (set before import) to run its "
                      "interpreter on CPU tensors")
