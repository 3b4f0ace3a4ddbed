"""Per-test seeding. The backend and dtype lists the tests run over live in helpers.py (BACKENDS,
ALL_BACKENDS, dtypes_for), so test modules import them from there: `from helpers import BACKENDS`.
"""
import zlib

import pytest
import torch


@pytest.fixture(autouse=True)
def seed_torch(request):
    """Seeds torch from the test's id: every test draws fresh random inputs, reproducibly."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return seed


@pytest.fixture(autouse=True)
def cuda_sim_schedule(request):
    """Sets the cuda_sim schedule seed of a test marked ``sim_seed(n)`` (helpers.SIM_SEEDS), restoring it after."""
    marker = request.node.get_closest_marker("sim_seed")
    if marker is None:
        yield
        return
    from fastformer import cuda_sim

    before = cuda_sim.schedule_seed()
    cuda_sim.set_schedule_seed(marker.args[0])
    yield
    cuda_sim.set_schedule_seed(before)
