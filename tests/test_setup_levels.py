"""setup.py's FASTFORMER_CPU_LEVELS: the CPU kernel levels a build compiles (docs/install.md, Build switches).

setup.py runs with `--name`: it declares its extensions (which settles the level list) and compiles nothing.
"""
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "setup.py")

pytestmark = pytest.mark.skipif(not os.path.isfile(SETUP), reason="needs the source tree's setup.py")


def run_setup(levels):
    pytest.importorskip("setuptools")  # setup.py's own import (Python 3.12's venv comes without it)
    env = {**os.environ, "FASTFORMER_CPU_LEVELS": levels, "FASTFORMER_FORCE_CUDA": "0"}
    return subprocess.run([sys.executable, SETUP, "--name"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_an_unknown_level_stops_the_build_with_the_list_of_levels():
    done = run_setup("avx2,sse9")
    assert done.returncode != 0
    assert ("FASTFORMER_CPU_LEVELS='avx2,sse9': unknown CPU level sse9; expected a comma-separated list of "
            "default, avx2, avx512") in done.stderr, done.stderr[-3000:]


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the avx levels: x86-64")
def test_the_named_levels_are_built_lowest_first_whatever_their_case_and_spacing():
    done = run_setup(" AVX512, default ")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fastformer: building the CPU kernel levels default, avx512 only" in done.stdout, done.stdout


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the avx levels: x86-64")
def test_native_builds_the_one_level_this_cpu_runs():
    """FASTFORMER_CPU_LEVELS=native (tools/gpu_check.sh's quick build) names the level csrc/cpu_levels.cpp's
    best_cpu_level picks at import on this machine (fastformer.cpu_capability() without an override)."""
    import fastformer
    if os.environ.get("FASTFORMER_CPU_CAPABILITY"):
        pytest.skip("FASTFORMER_CPU_CAPABILITY overrides the level loaded here")
    done = run_setup("native")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"building the CPU kernel levels {fastformer.cpu_capability()} only" in done.stdout, done.stdout
