"""An op in one place: fastformer.ops.OPS (the FASTFORMER_OPS list of csrc/ops.h, through fastformer._C) is the
one op list. Code that only needs the names reads OPS; where a test, tool, benchmark or document needs code or
words per op (an input builder, a call, a case, a budget, a kernel's page), this test fails naming the file
and the missing ops, so that a new row in csrc/ops.h leads to every place that must follow, and the
checklist of docs/architecture.md ("Adding an op") stays complete.

The tables are read from the files' source (ast), not imported: importing test modules would run their
module-level parametrization a second time, and benchmarks/ is not importable from tests/.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from fastformer.ops import OPS

ROOT = Path(__file__).resolve().parents[1]

# Files named after each op (<op>, as the docs write it): whoever knows one of them finds the others.
PER_OP_FILES = ("csrc/autograd/<op>.cpp", "csrc/cpu/<op>.cpp", "csrc/cuda/<op>.cuh", "csrc/cuda/<op>.cu",
                "fastformer/ops/<op>.py", "fastformer/triton/<op>.py", "tests/ops/test_<op>.py",
                "tests/ops/test_<op>_matrix.py", "benchmarks/test_<op>.py")

# (file, module-level variable): a dict, list or tuple of literal names, one per op at least; a name is
# "<op>", or "<op>-<detail>" / "<op>+<detail>" for one of several cases of an op.
TABLES = (("tests/ops/test_bad_inputs.py", "VALID_ARGS"), ("tests/ops/test_bad_inputs.py", "WRONG_TYPES"),
          ("tests/ops/test_bad_inputs.py", "BACKWARD_CASES"), ("tests/ops/test_threads.py", "CALLS"),
          ("tests/ops/test_autocast.py", "CALLS"), ("tests/cuda_sim/test_mutations.py", "CASES"),
          ("tests/matrix.py", "SLOW_WORK"), ("benchmarks/test_overhead.py", "CASES"))

# (file, pattern with {op}, what it stands for): per-op code or words found by a pattern.
MENTIONS = (
    ("csrc/op_entry_points.h", r"\b{op}_fwd\(", "the declaration of <op>_fwd"),
    ("csrc/op_entry_points.h", r"\b{op}_bwd\(", "the declaration of <op>_bwd"),
    ("csrc/fastformer.cpp", r'"check_{op}"', "the binding check_<op>"),
    ("csrc/fastformer.cpp", r'"check_{op}_bwd"', "the binding check_<op>_bwd"),
    ("fastformer/ops/reference.py", r"def {op}_fwd\(", "the torch backend's <op>_fwd"),
    ("fastformer/ops/reference.py", r"def {op}_bwd\(", "the torch backend's <op>_bwd"),
    ("fastformer/__init__.py", r"ops\.{op}\(", "the op in help(fastformer)"),
    ("tests/test_api.py", r"ops\.{op}\(", "the op's call in SCRIPT (backend choice)"),
    ("tests/ops/test_bad_inputs.py", r'"{op}": ops\.{op}\(', "the op's call in test_double_backward_raises"),
    ("tests/ops/test_opcheck.py", r'kernel_op\("{op}"', "opcheck of the op's kernels"),
    ("tests/ops/test_nonfinite.py", r"def test_{op}_", "a non-finite input test"),
    ("tests/test_compile.py", r"ops\.{op}\(", "the op under torch.compile"),
    ("tests/gpu/test_cuda_tensors.py", r"def test_{op}\(", "the op on CUDA tensors"),
    ("README.md", r"ops\.{op}\(", "the op in the API"),
    ("docs/architecture.md", r"`{op}_fwd`", "what <op>_fwd returns"),
    ("docs/benchmarks.md", r"benchmarks/test_{op}\.py", "the op's benchmark in the table of files"),
    ("docs/api.md", r"ops\.{op}\(", "the op in the API reference"),
    ("docs/correctness.md", r"\b{op}\b", "the op's rules"),
    ("docs/cpu-kernels.md", r"\b{op}\b", "the op's CPU kernel"),
    ("docs/cuda-kernels.md", r"\b{op}\b", "the op's CUDA kernels"),
    ("docs/triton-kernels.md", r"\b{op}\b", "the op's Triton kernels"),
)

# Gaps known and accepted, each with its reason. An entry that is no longer missing fails the test too,
# so this list shrinks when the gap closes instead of hiding a later one.
ACCEPTED_GAPS: dict[tuple[str, str], str] = {}  # (file, op) -> why the file may lack the op for now


def read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def table_names(path: str, variable: str) -> list[str]:
    """The literal names (dict keys, or list/tuple/set elements) of ``variable = ...`` at the top of ``path``."""
    for node in ast.parse(read(path)).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(getattr(t, "id", None) == variable for t in targets):
            items = node.value.keys if isinstance(node.value, ast.Dict) else getattr(node.value, "elts", None)
            if items is None or not all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
                pytest.fail(f"{path}: {variable} is no dict, list or tuple of literal names; "
                            "update tests/test_op_lists.py")
            return [i.value for i in items]
    pytest.fail(f"{path} has no module-level {variable}; update tests/test_op_lists.py")


def check(path: str, present: set[str], what: str) -> None:
    """Every op of OPS is in ``present``, apart from the accepted gaps of ``path``, which must still be gaps."""
    accepted = {op for (file, op) in ACCEPTED_GAPS if file == path}
    missing = sorted(set(OPS) - present - accepted)
    assert not missing, f"{path}: {what} has no entry for {missing} (docs/architecture.md, 'Adding an op')"
    closed = sorted(accepted & present)
    assert not closed, f"{path} now covers {closed}: remove them from ACCEPTED_GAPS in tests/test_op_lists.py"


def test_the_op_list_is_csrc_ops_h():
    # Everything below is derived from OPS; OPS itself is the FASTFORMER_OPS rows of csrc/ops.h.
    declared = re.findall(r"^\s*X\((\w+),", read("csrc/ops.h"), re.M)
    assert tuple(declared) == OPS, f"csrc/ops.h declares {declared}, fastformer.ops.OPS is {OPS}"


@pytest.mark.parametrize("pattern", PER_OP_FILES)
def test_each_op_has_its_files(pattern):
    missing = [pattern.replace("<op>", op) for op in OPS if not (ROOT / pattern.replace("<op>", op)).exists()]
    assert not missing, f"missing files of ops of csrc/ops.h: {missing}"


@pytest.mark.parametrize("path, variable", TABLES, ids=[f"{p}:{v}" for p, v in TABLES])
def test_each_op_is_in_the_tables(path, variable):
    check(path, {re.split(r"[-+]", name)[0] for name in table_names(path, variable)}, variable)


@pytest.mark.parametrize("path, pattern, what", MENTIONS, ids=[f"{p}:{w}" for p, _, w in MENTIONS])
def test_each_op_is_in_the_per_op_code_and_docs(path, pattern, what):
    text = read(path)
    check(path, {op for op in OPS if re.search(pattern.format(op=re.escape(op)), text)}, what)


def test_each_op_with_dropout_is_in_the_dropout_tests():
    # The ops whose schema (csrc/ops.h) takes dropout_p; tests/ops/test_dropout.py names them in its ids.
    schemas = {op: getattr(torch.ops.fastformer, f"{op}_fwd").default._schema for op in OPS}
    with_dropout = {op for op, schema in schemas.items() if any(a.name == "dropout_p" for a in schema.arguments)}
    assert with_dropout, "no op takes dropout_p: the schema lookup is broken"
    text = read("tests/ops/test_dropout.py")
    missing = sorted(op for op in with_dropout if f'"{op}"' not in text)
    assert not missing, f"tests/ops/test_dropout.py has no test of the dropout of {missing}"
