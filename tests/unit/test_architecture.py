"""The import rules of docs/architecture.md, read from the source (no imports executed): no cycle
between files, each package imports only the layers below it, and the torch-free layers never
name torch. A function-level (lazy) import counts like a top-level one. docs/architecture.md's import
table is this file's table, and its file listing names every file of usp/."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import cache, lru_cache
from pathlib import Path

import pytest

USP = Path(__file__).resolve().parents[2] / "usp"

# package (or module) -> the usp packages it may import (besides itself); the longest name that
# matches a module decides. usp/run/ is the floor every layer stands on: the run directory's files
# (usp.run.files, no usp imports at all), the directory-name rule, the run lock and the check of an
# output target (on usp.errors alone), a checkpoint's checksums (on the files' names); the run's
# state and a sweep's record read those. usp/perf/ is the performance model and the layout it models
# (on usp.errors alone); usp/plan/ builds a plan with it; its calibration fits the model's constants
# to measured runs. launch reaches the engine only to run one rank in-process.
BASE = {"usp.errors", "usp.run", "usp.run.files", "usp.run.names", "usp.run.lock", "usp.run.writable",
        "usp.run.checksums", "usp.run.allocator"}
ALLOWED = {
    "usp.errors": set(),
    "usp.run": set(),
    "usp.run.files": set(),
    "usp.run.allocator": set(),
    "usp.run.names": {"usp.errors"},
    "usp.run.lock": {"usp.errors"},
    "usp.run.writable": {"usp.errors"},
    "usp.run.checksums": {"usp.run.files"},
    "usp.run.state": BASE,
    "usp.run.sweep_record": BASE | {"usp.run.state"},
    "usp.contract": {"usp.errors", "usp.run", "usp.run.files"},
    "usp.config": {"usp.errors", "usp.run", "usp.run.files", "usp.run.writable", "usp.contract"},
    "usp.data": {"usp.errors", "usp.run", "usp.run.files"},
    "usp.models": set(),
    "usp.perf": {"usp.errors", "usp.contract", "usp.run.allocator"},
    "usp.perf.calibration": {"usp.errors", "usp.run.files", "usp.config", "usp.contract", "usp.perf"},
    "usp.plan": BASE | {"usp.config", "usp.contract", "usp.data", "usp.perf"},
    "usp.report": BASE | {"usp.run.state", "usp.run.sweep_record", "usp.config", "usp.contract", "usp.plan"},
    "usp.view": BASE | {"usp.config", "usp.contract", "usp.perf", "usp.plan"},
    "usp.launch": BASE | {"usp.run.state", "usp.run.sweep_record", "usp.config", "usp.contract", "usp.plan",
                          "usp.perf", "usp.data", "usp.engine"},
    "usp.engine": BASE | {"usp.contract", "usp.data", "usp.models"},
    "usp.cli": BASE | {"usp.run.state", "usp.run.sweep_record", "usp.config", "usp.contract", "usp.plan",
                       "usp.perf", "usp.perf.calibration", "usp.data", "usp.launch", "usp.report", "usp.view",
                       "usp.engine"},
}
TORCH_FREE = tuple(p for p in ALLOWED if p not in ("usp.engine", "usp.models"))
DOC = USP.parent / "docs" / "architecture.md"


def _modules() -> dict[str, Path]:
    out = {}
    for path in USP.rglob("*.py"):
        parts = path.relative_to(USP.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:`: those imports never run."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


@cache
def _imports(path: Path) -> set[str]:
    """Every module named by an import statement anywhere in the file (absolute names), except the
    ones only a type checker reads."""
    found = set()
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@lru_cache(maxsize=1)  # read every file once per session
def _usp_edges() -> dict[str, set[str]]:
    """module -> the usp modules (files) it imports. A module's own enclosing packages are left out:
    `from usp.report import trace` inside usp.report names the package only to reach its file."""
    return {name: {m for m in _imports(path) if m in MODULES and m != name and not name.startswith(m + ".")}
            for name, path in MODULES.items()}


def _package(module: str) -> str:
    return next(p for p in sorted(ALLOWED, key=len, reverse=True) if module == p or module.startswith(p + "."))


def test_every_module_belongs_to_a_layer():
    assert all(_package(m) for m in MODULES if m != "usp")


def test_no_import_cycles_between_files():
    graph = _usp_edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == [], f"import cycles: {cycles}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below(package):
    wrong = defaultdict(set)
    for module, targets in _usp_edges().items():
        if module == "usp" or _package(module) != package:
            continue
        for target in targets:
            if target != "usp" and _package(target) not in ALLOWED[package] | {package}:
                wrong[module].add(target)
    assert dict(wrong) == {}, f"imports across the layer rules: {dict(wrong)}"


@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_layers_never_name_torch(package):
    offenders = sorted(m for m, path in MODULES.items() if m != "usp" and _package(m) == package
                       and any(i == "torch" or i.startswith("torch.") for i in _imports(path)))
    assert offenders == [], f"torch imported by a torch-free layer: {offenders}"


def test_the_rule_table_catches_a_wrong_edge(tmp_path):
    """The checks above can fail: a models file importing the engine is reported."""
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from usp.engine.trainer import Trainer\n")
    assert "usp.engine.trainer" in _imports(bad)
    assert _package("usp.engine.trainer") not in ALLOWED["usp.models"]


def _doc_table() -> dict[str, tuple[set[str] | None, bool]]:
    """docs/architecture.md's import table: package -> (what it may import, None for "any of the
    above"; whether it may import torch). "run" stands for the floor of usp/run/ (BASE)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) != 3 or not cells[0].startswith("`usp/"):
            continue
        names = {n.removesuffix(".py").rstrip("/").replace("/", ".") for n in re.findall(r"`([\w/.]+)`", cells[0])}
        may: set[str] | None = set()
        if cells[1].startswith("any of the above"):
            may = None
        elif cells[1] != "nothing from usp":
            for item in re.split(r"[,;]", cells[1]):
                word = item.split()[0]
                may |= BASE if word == "run" else {f"usp.{word.replace('/', '.')}"}
        rows.update({name: (may, cells[2] == "yes") for name in names})
    return rows


def test_the_docs_table_is_this_table():
    doc = _doc_table()
    assert set(doc) == set(ALLOWED) - {"usp.run"}, "a package missing from one of the two tables"
    for package, (may, torch) in doc.items():
        if may is not None:  # usp.run itself is an empty package: the table names its files
            assert may - {"usp.run"} == ALLOWED[package] - {"usp.run"}, package
        assert torch == (package not in TORCH_FREE), package


def _doc_files() -> set[str]:
    """The paths the "Every file" listing of docs/architecture.md names (a tree, two spaces a level)."""
    block = DOC.read_text().split("## Every file", 1)[1].split("```")[1]
    folders: list[str] = []
    found = set()
    for line in block.splitlines():
        token = line.split()[0] if line.strip() else ""
        depth = (len(line) - len(line.lstrip())) // 2
        if not token.startswith("usp/") and (depth > 4 or not token.endswith((".py", ".j2", "/"))):
            continue  # a description's second line
        path = token if token.startswith("usp/") else "".join(folders[:depth]) + token
        if token.endswith("/"):
            folders[depth:] = [path if depth == 0 else token]
        else:
            found.add(path)
    return found


def test_the_docs_list_every_file():
    files = {p.relative_to(USP.parent).as_posix() for p in USP.rglob("*.py") if p.name != "__init__.py"}
    listed = {f for f in _doc_files() if f.endswith(".py") and not f.endswith("/__init__.py")}
    assert sorted(files - listed) == [], "files docs/architecture.md does not list"
    assert sorted(listed - files) == [], "files docs/architecture.md lists that do not exist"


MAX_FUNCTION_LINES = 60


def test_no_function_is_longer_than_60_lines():
    """Long functions get split into named steps (def line to last line, decorators excluded)."""
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {length} lines")
    assert long == [], long


def test_no_two_modules_share_a_name():
    """One name, one meaning: a module's basename is unique under usp/ (package __init__ and __main__
    aside), so `prepare`, `context` or `profile` never mean two things."""
    seen: dict[str, list[str]] = {}
    for path in USP.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(USP)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_the_engine_reads_decisions_and_never_decides():
    """The engine acts on what the plan records (RunPlan.decisions): no engine file imports the rules
    behind them (usp/contract/decide.py), the planner or its performance model."""
    for path in (USP / "engine").rglob("*.py"):
        found = {m for m in _imports(path) if m.startswith(("usp.plan", "usp.perf", "usp.contract.decide"))}
        assert not found, f"{path.relative_to(USP.parent)} imports {sorted(found)}"


def test_a_rank_loads_no_planner_code():
    """What a rank imports, in a fresh interpreter: the worker's module tree holds no usp.plan, usp.perf,
    usp.config or usp.launch module."""
    import json
    import subprocess
    import sys

    code = ("import json, sys, usp.engine.worker; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('usp.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    assert [m for m in loaded if m.startswith(("usp.plan", "usp.perf", "usp.config", "usp.launch"))] == []
    assert "usp.contract.run_plan" in loaded


def test_every_file_the_docs_name_exists():
    """A renamed or deleted module leaves no stale path in README or docs/."""
    docs = [USP.parent / "README.md", *sorted((USP.parent / "docs").glob("*.md"))]
    named = {(doc.name, m.group(0)) for doc in docs for m in re.finditer(r"\busp/[\w/]+\.(?:py|j2)\b", doc.read_text())}
    assert named and [(doc, path) for doc, path in sorted(named) if not (USP.parent / path).exists()] == []
