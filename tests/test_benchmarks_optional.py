"""The benchmark suite runs with any subset of its optional packages (issue 45): with transformers and
ctranslate2 unimportable, as if not installed (a sitecustomize.py on PYTHONPATH puts a finder first on
sys.meta_path that refuses them), pytest collects benchmarks/ without an error, the modules that need
transformers skip with a reason naming the package and its extra, and test_decoding.py runs without its
CTranslate2 contender and names it under "not compared". One pytest process on the smoke sizes, one
decoding case selected (a few seconds)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BLOCKER = '''import sys


class NotInstalled:
    """Refuses to import the optional packages named in FASTFORMER_TEST_NOT_INSTALLED."""

    names = set(__import__("os").environ["FASTFORMER_TEST_NOT_INSTALLED"].split(","))

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
'''


def test_benchmarks_run_without_transformers_and_ctranslate2(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, FASTFORMER_TEST_NOT_INSTALLED="transformers,ctranslate2",
               PYTHONPATH=os.pathsep.join(p for p in (str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("PYTEST_ADDOPTS", None)
    case = "test_decoding[tiny-threads1-1-1-float32]"  # size, threads, batch, beam, compute
    done = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/", "--benchmark-disable", "--bench-sizes",
                           "smoke", "-k", case, "-p", "no:cacheprovider", "-rs", "-q"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "1 passed" in out, out[-4000:]  # (an error in collecting any module fails the run: exit code 2)
    for module in ("test_hf_decoding.py", "test_hf_training_step.py", "test_hf_finetune_step.py"):
        skipped = [line for line in out.splitlines() if line.startswith("SKIPPED") and module in line]
        assert skipped and "transformers is not installed: pip install '.[hf]'" in skipped[0], out[-4000:]
    assert "not compared: ctranslate2 is not installed: pip install '.[ctranslate2]'" in out, out[-4000:]


def test_each_optional_package_has_the_extra_its_skip_names():
    # the reasons name an extra of pyproject.toml that brings the package; the test extra brings every
    # comparison's package, as README's benchmark line says
    import ast
    import re

    harness = ast.parse((ROOT / "benchmarks" / "harness.py").read_text(encoding="utf-8"))
    optional = next(ast.literal_eval(node.value) for node in harness.body if isinstance(node, ast.Assign)
                    and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["OPTIONAL"])
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    extras = {name: body for name, body in re.findall(r"^(\w+) = \[(.*?)\]", pyproject, re.M | re.S)}
    for package, extra in optional.items():
        assert f'"{package}' in extras[extra], f"the {extra} extra does not bring {package}"
        if package != "triton":  # (PyPI's CUDA build of torch brings triton)
            assert f'"{package}' in extras["test"], f"the test extra does not bring {package}"
    assert '"pytest-benchmark' in extras["test"]
