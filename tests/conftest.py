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
