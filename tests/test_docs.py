"""The docs name only what exists: every repository path that README.md and docs/*.md name, and every
csrc/ path that a source comment names, is a file or folder of this repository; no file cites a document
outside it; docs/cpu-kernels.md's tile sizes are the code's constants; docs/architecture.md's source tree
names every folder and source file of the repository (csrc/, fastformer/, tools/ file by file)."""
import itertools
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = ("csrc", "fastformer", "tests", "benchmarks", "tools", "docs", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./{},<>-]*[\w}>])" % "|".join(re.escape(p) for p in OURS))
from fastformer.ops import OPS  # the op list of csrc/ops.h: `<op>` in a doc's path stands for each
# Made by the build or by a tool, named on purpose: the extension, the shipped sources, the GPU report
# (tools/gpu_check.sh writes it on a GPU machine).
BUILT = {"fastformer/_C.so", "fastformer/_csrc", "docs/gpu-report.md", "docs/results/gpu.md"}


def tracked(*suffixes):
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in files if f.endswith(suffixes)]


def expand(path: str) -> list[str]:
    """``a/b.{h,cpp}`` -> ``a/b.h``, ``a/b.cpp``; ``<op>`` -> each op."""
    parts = re.split(r"\{([^}]*)\}", path.replace("<op>", "{%s}" % ",".join(OPS)))
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def named_paths(text: str, prefixes=OURS) -> set[str]:
    found = set()
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".,")
        if path.startswith(prefixes):
            found.update(p for p in expand(path) if "<" not in p)  # other placeholders name no one file
    return found - BUILT


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = tracked(".cpp", ".h", ".cu", ".cuh", ".py")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_name_existing_paths(doc):
    missing = sorted(p for p in named_paths(doc.read_text(encoding="utf-8")) if not (ROOT / p).exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_source_comments_name_existing_csrc_files():
    missing = sorted(f"{src.relative_to(ROOT)}: {p}" for src in SOURCES
                     for p in named_paths(src.read_text(encoding="utf-8"), prefixes=("csrc/",))
                     if not (ROOT / p).exists())
    assert not missing, missing


def test_nothing_cites_a_document_outside_the_repository():
    citing = [str(f.relative_to(ROOT)) for f in tracked(".py", ".md", ".cpp", ".h", ".cu", ".cuh", ".toml")
              if f != pathlib.Path(__file__).resolve() and "DESIGN.md" in f.read_text(encoding="utf-8")]
    assert not citing, f"these cite DESIGN.md, which is not in the repository: {citing}"


def test_readme_fits_its_budget():
    # README is the front door (what fastformer is, install, the two commands, the API, the backends, the
    # headline results); the reference and the full result tables live in docs/ (issue 45)
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= 250, f"README.md has {lines} lines, over its budget of 250: move the details into docs/"


def test_readme_names_the_benchmark_command_and_its_extra():
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "`pytest benchmarks/ --benchmark-only`" in readme
    assert '`pip install ".[test]"` brings every comparison' in readme


def test_readme_cpu_attention_tiles_are_the_codes():
    code = (ROOT / "csrc/cpu/attention_kernels.h").read_text()  # attention and attention_varlen
    readme = (ROOT / "docs" / "cpu-kernels.md").read_text(encoding="utf-8")
    for name in ("kBlockQ", "kBlockK"):
        value = re.search(rf"constexpr int64_t {name} = (\d+);", code).group(1)
        assert f"`{name} = {value}`" in readme, f"docs/cpu-kernels.md does not give {name} = {value}"


RESULTS = sorted((ROOT / "docs" / "results").glob("*.md"))


@pytest.mark.parametrize("result", RESULTS, ids=lambda p: p.name)
def test_generated_results_name_their_provenance(result):
    # Every measured figure of the docs comes from a file a command wrote (tools/readme_results.py lists
    # them), and its first line names the machine, the commit, the date and the command.
    first = result.read_text(encoding="utf-8").splitlines()[0]
    assert re.search(r"commit [0-9a-f]{7}", first), f"{result.name}: no commit in its first line: {first}"
    assert re.search(r"\d{4}-\d{2}-\d{2}", first) and re.search(r"`[^`]+`", first), \
        f"{result.name}: its first line must give the date and the command: {first}"


def test_readme_results_block_is_generated():
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_results", ROOT / "tools" / "readme_results.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert tool.replace_block(readme) == readme, \
        "README.md's results block differs from docs/results/: run python tools/readme_results.py"


# docs/architecture.md's "Source tree" block, checked both ways against the repository. An entry is a line that
# starts in the first column: its first word is a path (a folder ends with /), the rest describes it, and lines
# indented below continue the description. A description names more paths: repository paths (csrc/...), and
# bare file names (common.h), which live in the entry's folder (else at the top of the repository). `<op>`
# stands for each op of OPS, so a folder of per-op files is named by one pattern.
FILE_NAME = re.compile(r"(?<![\w./<>-])([\w<>-]+\.(?:h|cpp|cu|cuh|py|sh|md|toml))(?![\w/])")


def source_tree() -> list[tuple[str, str]]:
    """[(entry path, description)] of docs/architecture.md's source tree block."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"^## Source tree\n.*?^```\n(.*?)^```", text, re.M | re.S)
    assert block, "docs/architecture.md has no source tree block (a ``` block under '## Source tree')"
    entries = []
    for line in block.group(1).splitlines():
        if line[:1].strip():
            path, _, description = line.partition(" ")
            entries.append((path, description.strip()))
        elif line.strip():
            assert entries, f"docs/architecture.md's source tree opens with an indented line: {line!r}"
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
    return entries


def tree_paths() -> dict[str, str]:
    """{repository path: the entry that names it}: every path the source tree names, patterns expanded."""
    named = {}
    for entry, description in source_tree():
        folder = entry.rstrip("/") if entry.endswith("/") else entry.rpartition("/")[0]
        for path in [entry.rstrip("/"), *(m.group(1).rstrip(".,") for m in PATH.finditer(description))]:
            named.update((p, entry) for p in expand(path))
        for name in FILE_NAME.findall(description):
            for p in expand(name):
                local = f"{folder}/{p}" if folder else p
                named[local if (ROOT / local).exists() or not (ROOT / p).exists() else p] = entry
    return {p: entry for p, entry in named.items() if "<" not in p}  # other placeholders name no one file


def test_source_tree_names_existing_paths():
    missing = sorted(f"{p} (in the entry {entry})" for p, entry in tree_paths().items() if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md's source tree names paths that do not exist: {missing}"


def test_source_tree_names_every_folder_and_source():
    """Every folder that holds a tracked file, every file under csrc/, fastformer/ and tools/ (an __init__.py
    through its folder) and every module of benchmarks/ other than the test_*.py files is named by the tree
    (a folder also through a path in it): so a new folder, source or tool that nobody placed there fails."""
    named = set(tree_paths())
    folders = named | {str(parent) for p in named for parent in pathlib.PurePosixPath(p).parents}
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    unnamed = sorted({str(pathlib.PurePosixPath(f).parent) + "/" for f in files if "/" in f} - {f + "/" for f in folders})
    for f in files:
        path = pathlib.PurePosixPath(f)
        if f in named or not (f.startswith(("csrc/", "fastformer/", "tools/")) or
                              (path.parent.name == "benchmarks" and not path.name.startswith("test_"))):
            continue
        if path.name == "__init__.py" and str(path.parent) in folders:
            continue
        unnamed.append(f)
    assert not unnamed, f"docs/architecture.md's source tree does not name: {unnamed}"
