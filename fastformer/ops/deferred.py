"""Deferred value checks: GPU calls of the ops that never wait for the host.

Two checks read tensor values, not only shapes: cross_entropy's targets (each in [0, V) or ``ignore_index``)
and attention_varlen's ``cu_seqlens`` tables (0 first, non-decreasing, no sequence longer than max_seqlen,
the packed total last). On CPU tensors they read the values where they are, at the call. On GPU tensors
reading them is a copy to the host and a sync: the host waits for every queued kernel, once per call (a GPU
table once while the same tensor comes back unchanged: the per-layer calls of one forward and their backward
share one read). That gives an eager caller a clear error at the call.

Inside ``deferred_checks()`` the GPU checks run on the device instead: each reduces its "broken" condition
there and ORs it into a small int32 flag per device (device ops only, fixed shapes; no host read), so the
host runs ahead of the kernels, and a CUDA graph captured in the mode carries the checks into every
replay. ``check_deferred()`` reads every flag at once (one sync) and raises a ValueError naming the op, the
argument and the rule broken since its last call. Meanwhile nothing reads out of bounds: a kernel gives an
out-of-range target a NaN loss without reading a logit for it, and clamps every sequence of a bad table into
the packed tensor (csrc/value_checks.h).

    with fastformer.ops.deferred_checks():
        for step in range(n):
            loss = train_step()                 # no host synchronization from the checks
            if step % 100 == 0:
                print(loss.item())              # the host waits here anyway ...
                fastformer.ops.check_deferred() # ... so reading the flags costs nothing more

The mode is process-wide (autograd runs backward on threads of its own). The checks' C++ is
csrc/value_checks.cpp.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from fastformer._ext import C


@contextlib.contextmanager
def deferred_checks(enabled: bool = True) -> Iterator[None]:
    """Within the block (process-wide), the value checks of GPU tensors run on the device and report through
    ``check_deferred()`` instead of reading the host at each call; ``enabled=False`` turns the mode off within
    the block. The previous mode comes back at the end. Entering allocates the current CUDA device's flag when
    CUDA is in use, so that a graph capture that is the mode's first use checks too: a flag is never allocated
    inside a capture (its memory would be the graph's), and a capture without one leaves the values unchecked."""
    previous = C.deferred_checks_enabled()
    device = torch.device("cuda", torch.cuda.current_device()) if enabled and torch.cuda.is_initialized() else None
    C.set_deferred_checks(enabled, device)
    try:
        yield
    finally:
        C.set_deferred_checks(previous)


def check_deferred() -> None:
    """Raises ValueError if a deferred check found a bad value since the last call (naming the op, the argument
    and the rule), else returns None. Reads and clears every device's flag: one sync per device that has one
    (its current stream's queued work first); nothing when no deferred check ever ran."""
    C.check_deferred()
