"""Per-test seeding. The backend and dtype lists the tests run over live in helpers.py (BACKENDS,
ALL_BACKENDS, dtypes_for), so test modules import them from there: `from helpers import BACKENDS`.
"""
import zlib

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist (``-n``), each worker takes its share of the cores for torch's threads: two workers
    of two threads each on two cores made OpenMP's barriers wait for descheduled threads. The results do not
    depend on the thread count (tests/test_threads.py sets it where it matters)."""
    import os

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, torch.get_num_threads() // int(workers)))
    # torch.compile's caches are keyed without the fake kernels of custom ops: a cache that an earlier build of
    # fastformer filled can hand back code compiled for other output strides. Each session compiles afresh.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        import atexit
        import shutil
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastformer-tests-inductor-")
        atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)


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


def pytest_report_header(config):
    """Which part of the peer matrices runs (tests/matrix.py, FASTFORMER_MATRIX_SHARD)."""
    import os

    shard = os.environ.get("FASTFORMER_MATRIX_SHARD")
    return (f"peer matrices: shard {shard} (FASTFORMER_MATRIX_SHARD; unset it for every case)" if shard
            else "peer matrices: every case (FASTFORMER_MATRIX_SHARD=K/N runs one shard of N)")


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands its peer-matrix results to the controller (workeroutput)."""
    import sys

    matrix = sys.modules.get("matrix")
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and matrix is not None:
        workeroutput["matrix_results"] = [[*key, ratio] for key, ratio in matrix.RESULTS.items()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: a worker's peer-matrix results, merged (the largest ratio of each key)."""
    rows = getattr(node, "workeroutput", {}).get("matrix_results", [])
    if rows:
        import matrix

        for op, backend, dtype, ratio in rows:
            matrix.RESULTS[(op, backend, dtype)] = max(matrix.RESULTS[(op, backend, dtype)], ratio)


def pytest_terminal_summary(terminalreporter):
    """The peer matrices' largest error/bound ratios (tests/matrix.py), when any ran."""
    import sys

    matrix = sys.modules.get("matrix")
    if matrix is None or not matrix.RESULTS:
        return
    terminalreporter.section("peer matrices: largest error / bound per op, backend, dtype")
    for line in matrix.summary():
        terminalreporter.write_line(line)
