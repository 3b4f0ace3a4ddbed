"""The package-level API: fastformer.backends(), set_backend, FASTFORMER_BACKEND and backend= precedence.

Which backend ran is observed through the ops' calls (helpers.RecordBackends: the `_py` twins' `backend`
argument, the C++ kernel ops' device).
Everything that changes the process default runs in a fresh interpreter, so it cannot leak into other tests.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fastformer

TESTS = Path(__file__).resolve().parent  # the subprocess imports helpers.py from here

# Runs every op forward and backward on CPU tensors after each step of STEPS (a list of
# (label, statement before the calls, extra keyword arguments)), printing "<label> <op> <backend>"
# for every fastformer op call.
SCRIPT = """
import torch, fastformer
from fastformer import ops
from helpers import RecordBackends

def run(label, extra):
    q, k, v = (torch.randn(1, 2, 3, 8, requires_grad=True) for _ in range(3))
    x, r = (torch.randn(3, 8, requires_grad=True) for _ in range(2))
    w, b = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    t = torch.tensor([0, 7, -100])
    pq = torch.randn(5, 2, 8, requires_grad=True)  # packed sequences of 2 and 3 tokens, one key/value head
    pk, pv = (torch.randn(5, 1, 8, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with RecordBackends() as rec:
        a = ops.attention(q, k, v, causal=True, **extra)
        p = ops.attention_varlen(pq, pk, pv, cu, cu, 3, 3, causal=True, **extra)
        s = ops.softmax(x, scale=2.0, **extra)
        y = ops.layer_norm_residual(x, r, w, b, **extra)
        c = ops.cross_entropy(x, t, label_smoothing=0.1, **extra)
        h = ops.bias_activation(x, b, activation="gelu", **extra)
        (a.sum() + p.sum() + (s * s).sum() + (y * y).sum() + c.sum() + (h * h).sum()).backward()
    for op, backend in rec.calls:
        print(label, op, backend)

for label, statement, extra in {steps!r}:
    exec(statement)
    run(label, extra)
"""

# Every op of csrc/ops.h's list, forward and backward: SCRIPT must call each (tests/test_op_lists.py).
ALL_OPS = {f"{op}_{phase}" for op in fastformer.ops.OPS for phase in ("fwd", "bwd")}


def backends_used(steps, env_backend=None):
    """Runs SCRIPT with ``steps`` in a fresh interpreter; returns {label: the one backend all ops used}."""
    env = {k: v for k, v in os.environ.items() if k != "FASTFORMER_BACKEND"}
    if env_backend is not None:
        env["FASTFORMER_BACKEND"] = env_backend
    code = SCRIPT.format(steps=steps)
    result = subprocess.run([sys.executable, "-c", code], cwd=TESTS, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    calls = {}
    for line in result.stdout.splitlines():
        label, op, backend = line.split()
        calls.setdefault(label, []).append((op, backend))
    used = {}
    for label, _, _ in steps:
        assert {op for op, _ in calls.get(label, [])} == ALL_OPS, f"{label}: expected every op, got {calls}"
        backends = {backend for _, backend in calls[label]}
        assert len(backends) == 1, f"{label}: ops ran on different backends: {calls[label]}"
        used[label] = backends.pop()
    return used


def test_backends_reports_every_backend():
    available = fastformer.backends()
    assert set(available) >= {"torch", "cpu", "cuda", "triton", "cuda_sim"}
    assert all(isinstance(flag, bool) for flag in available.values())
    assert available["torch"] is True and available["cpu"] is True


def test_default_set_backend_and_backend_argument():
    steps = [
        ("default", "", {}),  # CPU tensors, nothing set: the cpu backend
        ("set_torch", "fastformer.set_backend('torch')", {}),
        ("argument_wins", "", {"backend": "cpu"}),  # still set to torch
    ]
    assert backends_used(steps) == {"default": "cpu", "set_torch": "torch", "argument_wins": "cpu"}


def test_environment_variable_and_backend_argument():
    steps = [("environment", "", {}), ("argument_wins", "", {"backend": "cpu"})]
    assert backends_used(steps, env_backend="torch") == {"environment": "torch", "argument_wins": "cpu"}


def test_set_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="nope"):
        fastformer.set_backend("nope")


def test_automatic_gpu_choice_respects_each_backends_limits(monkeypatch):
    # backend=None on a GPU prefers triton (compute capability 8.0+) or cuda (before 8.0), but never one
    # whose limits the call exceeds: head dims over 128 go to torch, rows over triton's MAX_N to cuda.
    # Simulated on CPU tensors: the capability, the availability and the ops are stand-ins.
    import torch

    from fastformer import _dispatch

    MAX_N = pytest.importorskip("fastformer.triton.layer_norm_residual").MAX_N  # triton is installed in CI

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_dispatch, "status", lambda name: (name in ("triton", "cuda", "torch"), ""))
    monkeypatch.setattr(_dispatch, "kernel", lambda op, phase, name, eager=False: lambda *args: name)

    attention = _dispatch._gpu_automatic("attention", torch.device("cuda"), torch.float16, True)
    assert attention(torch.empty(1, 1, 4, 64)) == "triton"
    assert attention(torch.empty(1, 1, 4, 160)) == "torch"
    lnr = _dispatch._gpu_automatic("layer_norm_residual", torch.device("cuda"), torch.float16, True)
    assert lnr(torch.empty(2, 512)) == "triton"
    assert lnr(torch.empty(2, MAX_N + 1)) == "cuda"
    # cross_entropy has no row limit on either GPU backend: triton loops over any vocabulary.
    assert _dispatch._gpu_automatic("cross_entropy", torch.device("cuda"), torch.float16, True)(torch.empty(2, 256000)) == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 0))
    assert _dispatch._gpu_automatic("softmax", torch.device("cuda"), torch.float16, True)(torch.empty(2, 8)) == "cuda"


def test_automatic_gpu_choice_follows_the_measured_table(monkeypatch, tmp_path):
    """tools/gpu_choice.py turns a GPU run's op benchmarks into fastformer/ops/gpu_table.py's rows (the faster
    backend per capability, op and dtype, forward+backward); the dispatcher follows a row where one exists
    and the rule of thumb elsewhere. A synthetic benchmark JSON, read by the tool, written to a copy."""
    import json
    import sys

    import torch

    from fastformer import _dispatch
    from fastformer.ops import gpu_table

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tools"))
    import gpu_choice

    def entry(op, shape, impl, seconds):
        return {"extra_info": {"op": op, "shape": shape, "pass": "fwd+bwd", "impl": impl}, "stats": {"median": seconds}}

    bench = {"fastformer": {"device": "cuda", "compute capability": "9.0", "dtype": "bfloat16", "gpu": "H200",
                            "command": "pytest benchmarks/test_softmax.py"},
             "benchmarks": [entry("softmax", "a", "cuda", 1.0), entry("softmax", "a", "triton", 2.0),
                            entry("softmax", "b", "cuda", 1.0), entry("softmax", "b", "triton", 1.5),
                            entry("attention", "a", "cuda", 3.0), entry("attention", "a", "triton", 1.0),
                            entry("attention", "b", "cuda", 3.0),  # one backend only: not compared
                            entry("attention", "a", "sdpa", 0.5)]}
    rows = gpu_choice.choices(bench)
    assert rows["9.0"]["softmax"]["bfloat16"][0] == ("cuda", "triton")
    assert rows["9.0"]["attention"]["bfloat16"][0] == ("triton", "cuda")
    assert rows["9.0"]["attention"]["bfloat16"][1]["shapes"] == 1
    assert abs(rows["9.0"]["softmax"]["bfloat16"][1]["speedup"] - 3 ** 0.5) < 1e-3  # geometric mean of 2 and 1.5
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    monkeypatch.setattr(gpu_choice, "TABLE", str(tmp_path / "gpu_table.py"))
    (tmp_path / "gpu_table.py").write_text("TABLE = {'8.0': {'softmax': {'float16': (('triton', 'cuda'), {})}}}\n")
    assert gpu_choice.main([str(path), "--write"]) == 0
    namespace = {}
    exec((tmp_path / "gpu_table.py").read_text(), namespace)
    assert set(namespace["TABLE"]) == {"8.0", "9.0"}  # earlier rows of another capability kept

    monkeypatch.setattr(gpu_table, "TABLE", namespace["TABLE"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_dispatch, "status", lambda name: (name in ("triton", "cuda", "torch"), ""))
    monkeypatch.setattr(_dispatch, "kernel", lambda op, phase, name, eager=False: lambda *args: name)
    softmax = _dispatch._gpu_automatic("softmax", torch.device("cuda"), torch.bfloat16, True)
    assert softmax(torch.empty(2, 8)) == "cuda"  # measured: cuda first, against the rule (triton on 9.0)
    assert _dispatch._gpu_automatic("softmax", torch.device("cuda"), torch.float16, True)(torch.empty(2, 8)) == "triton"


def test_package_docstring_names_every_op():
    # help(fastformer) is where a user first reads the API: an op added to csrc/ops.h must appear there.
    from fastformer.ops import OPS

    missing = [op for op in OPS if f"ops.{op}(" not in fastformer.__doc__]
    assert not missing, f"fastformer/__init__.py's docstring does not show {missing}"
