"""The measured choice of GPU backend per op (fastformer/_dispatch.py reads it): written by tools/gpu_choice.py
from the op benchmarks of a GPU run (tools/gpu_check.sh); edit by running the tool, not by hand.

TABLE[compute capability][op][dtype] = (backends, fastest first), {"gpu": ..., "command": ...,
"speedup": geometric mean of the slower one's time over the faster one's, forward+backward}.
"""

TABLE = {}
