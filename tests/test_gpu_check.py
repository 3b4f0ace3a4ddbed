"""tools/gpu_check.sh's control flow on the CPU, with fake steps (issue 51): the check a lent GPU machine runs
must leave a report that says what happened when its build fails, when a step runs out of time, and when the
step table is cut off mid-way, and part 2 must add to part 1's report rather than replace it.

A fake ``python`` first on PATH stands in for every GPU step (it says "a GPU is here", builds in no time,
passes the tests, writes a step table, ...), each made to fail or hang on demand, and hands every other
command to the real Python; a fake ``nvidia-smi`` names a device. What is checked is the report the script
leaves and the commands it ran, not the fake figures.
"""
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >>"$FAKE_LOG"
out=""
prev=""
for a in "$@"; do [[ $prev == --out ]] && out=$a; prev=$a; done
if [[ $1 == -c ]]; then
  case "$2" in
    *"torch.cuda.is_available()"*) exit 0 ;;
    *"get_device_capability"*) echo 9.0 ;;
    *"import platform, torch"*) echo "- torch (fake)" ;;
    *"from fastformer.ops import OPS"*) echo "benchmarks/test_attention.py" ;;
    *"backends().get('cuda')"*) exit 0 ;;
    *) exec "$REAL_PYTHON" "$@" ;;
  esac
  exit
fi
case "$*" in
  *"-m pip install"*)
    if [[ $FAKE_BUILD == fail ]]; then echo "error: the fake build failed"; exit 1; fi
    echo "Successfully installed fastformer" ;;
  *"tools/step_table.py"*)
    printf '| model | target tokens/s |\n|---|---:|\n| fake row of %s | 1,000 |\n' "$(basename "$out")" >"$out"
    if [[ $FAKE_STEP_TABLE == hang ]]; then
      trap 'echo "**Incomplete: interrupted.**" >>"$out"; exit 130' INT
      sleep 60 & wait
    fi ;;
  *"--benchmark-json"*)
    if [[ $FAKE_BENCH == hang ]]; then sleep 60 & wait; fi
    echo "3 passed in 0.1s" ;;
  *"-m pytest"*) echo "7 passed in 0.1s" ;;
  *"tools/gpu_choice.py"*) echo "compute capability 9.0, attention, bfloat16: triton first (1.25x over cuda, 5 shapes)" ;;
  *"tools/profile_step.py"*) echo "## fake profile" >"$out" ;;
  *"-m fastformer.train"*)
    echo '{"run_dir": "r", "steps": 5, "train_minutes": 0.5, "tokens_per_s": 1000.0, "precision": "bf16", "test_bleu": 1.0, "test_chrf": 2.0, "peak_rss_gib": 1.0}' ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
"""


def check(tmp_path, *args, seconds, **fake):
    """Runs the script with the fakes; returns (exit status, report text, the commands the fake python saw)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python", FAKE_PYTHON), ("nvidia-smi", "#!/bin/sh\necho 'Fake GPU, 1.0, 80 GiB, 9.0'\n")):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    report = tmp_path / "gpu.md"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "REAL_PYTHON": sys.executable,
           "FAKE_LOG": str(tmp_path / "calls.log"), "GPU_CHECK_LOGS": str(tmp_path / "logs"),
           "GPU_CHECK_MIRROR": str(tmp_path / "mirror"), "GPU_CHECK_SECONDS": str(seconds), "GPU_CHECK_MIN_STEP": "1",
           "FAKE_BUILD": "ok", "FAKE_STEP_TABLE": "ok", "FAKE_BENCH": "ok",
           **{f"FAKE_{k.upper()}": v for k, v in fake.items()}}
    done = subprocess.run(["bash", str(SCRIPT), *args, str(report)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=seconds + 60)
    calls = (tmp_path / "calls.log").read_text() if (tmp_path / "calls.log").exists() else ""
    return done.returncode, (report.read_text() if report.exists() else ""), calls, done


def status(report: str, step: str) -> str:
    """The status cell of a step's row in the report's table."""
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith(f"| {step} |")]
    assert len(rows) == 1, (step, report)
    return rows[0][1]


def test_a_failed_build_stops_the_check_and_says_so(tmp_path):
    rc, report, calls, done = check(tmp_path, "--part", "1", seconds=120, build="fail")
    assert rc == 1, done.stdout + done.stderr
    assert status(report, "build") == "failed (exit 1)"
    assert "the build did not finish" in report and "every later step needs it" in report
    assert "tests/gpu" not in calls and "step_table" not in calls  # nothing ran on a broken build
    assert "FASTFORMER_CPU_LEVELS=native" in report  # one CPU level: the quick build
    assert (tmp_path / "mirror" / "build.log").read_text().startswith("error: the fake build failed")


def test_part_1_keeps_a_step_table_cut_off_by_the_deadline_and_part_2_adds_to_it(tmp_path):
    """Part 1: correctness right after the build, then the step table, here cut off by the deadline: its rows
    so far and its own "incomplete" mark are in the report. Part 2 on the same logs: the build is reused, the
    benchmarks time out, so no backend table is computed from their partial data, and the steps after them are
    skipped for want of time; part 1's rows and table are still in the report."""
    rc, report, calls, done = check(tmp_path, "--part", "1", seconds=6, step_table="hang")
    assert rc == 0, done.stdout + done.stderr
    assert status(report, "build") == "ok" and status(report, "correctness") == "ok"
    assert status(report, "step table").startswith("timed out after")
    assert "| fake row of step_table.md | 1,000 |" in report and "**Incomplete: interrupted.**" in report
    assert "- correctness: 7 passed" in report
    order = [line for line in calls.splitlines() if "-m pip" in line or "pytest" in line or "step_table" in line]
    assert "-m pip" in order[0] and "tests/gpu/test_triton_plans_on_cuda.py" in order[1] and "step_table" in order[2]
    assert "--rows fastformer" in order[2] and "compile" not in calls  # the compiling rows wait for part 2

    (tmp_path / "calls.log").unlink()
    rc, report, calls, done = check(tmp_path, "--part", "2", seconds=8, bench="hang")
    assert rc == 0, done.stdout + done.stderr
    assert status(report, "build (part 2)") == "already built by part 1" and "-m pip" not in calls
    assert status(report, "step table").startswith("timed out after")  # part 1's row is kept
    assert status(report, "step table 2") == "ok" and "--rows graphs,compile" in calls
    assert "| fake row of step_table.md |" in report and "| fake row of step_table_2.md |" in report
    assert status(report, "benchmarks").startswith("timed out after")
    assert status(report, "backend table").startswith("not computed: the benchmarks did not complete")
    assert "gpu_choice" not in calls
    assert status(report, "train") == "skipped: out of time"


def test_part_2_reports_the_backend_table_without_writing_the_tracked_file(tmp_path):
    table = ROOT / "fastformer" / "ops" / "gpu_table.py"
    before = table.read_bytes()
    rc, report, calls, done = check(tmp_path, "--part", "2", seconds=120)
    assert rc == 0, done.stdout + done.stderr
    assert status(report, "benchmarks") == "ok" and status(report, "backend table") == "ok"
    assert "  - compute capability 9.0, attention, bfloat16: triton first (1.25x over cuda, 5 shapes)" in report
    assert "--write" not in calls and table.read_bytes() == before
    for step in ("tests/gpu", "profile", "call overhead", "train"):
        assert status(report, step) == "ok", step
    assert "- train (" in report and "1000 target tokens/s" in report
    assert "### fake profile" in report.splitlines()  # the profile's headings one level down


def test_an_unknown_part_is_refused(tmp_path):
    rc, _, _, done = check(tmp_path, "--part", "3", seconds=10)
    assert rc == 2 and "--part takes 1, 2 or all" in done.stderr
