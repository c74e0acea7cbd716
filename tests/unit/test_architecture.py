"""The import rules of docs/architecture.md, read from the source (no imports executed): no cycle
between files, each package imports only the layers below it, and the torch-free layers never
name torch. A function-level (lazy) import counts like a top-level one."""
from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache, lru_cache
from pathlib import Path

import pytest

USP = Path(__file__).resolve().parents[2] / "usp"

# package -> the usp packages it may import (besides itself). usp.errors and usp.rundir are the
# floor every layer stands on (with usp.names, the directory-name rule, and usp.runlock, the run
# lock, and usp.writable, the check of an output target, all on usp.errors alone); launch reaches the
# engine only to run one rank in-process. usp.cli_examples is the --help examples' text.
BASE = {"usp.errors", "usp.rundir", "usp.names", "usp.runlock", "usp.writable"}
ALLOWED = {
    "usp.errors": set(),
    "usp.rundir": set(),
    "usp.names": {"usp.errors"},
    "usp.runlock": {"usp.errors"},
    "usp.writable": {"usp.errors"},
    "usp.cli_examples": set(),
    "usp.runstate": BASE,
    "usp.sweeprecord": BASE | {"usp.runstate"},
    "usp.config": {"usp.errors", "usp.rundir", "usp.writable"},
    "usp.data": {"usp.errors", "usp.rundir"},
    "usp.models": set(),
    "usp.plan": BASE | {"usp.config", "usp.data"},
    "usp.report": BASE | {"usp.runstate", "usp.sweeprecord", "usp.config", "usp.plan"},
    "usp.launch": BASE | {"usp.runstate", "usp.sweeprecord", "usp.config", "usp.plan", "usp.data", "usp.engine"},
    "usp.engine": BASE | {"usp.plan", "usp.data", "usp.models"},
    "usp.cli": BASE | {"usp.cli_examples", "usp.runstate", "usp.sweeprecord", "usp.config", "usp.plan", "usp.data",
                       "usp.launch", "usp.report", "usp.engine"},
}
TORCH_FREE = ("usp.errors", "usp.rundir", "usp.names", "usp.runlock", "usp.writable", "usp.cli_examples",
              "usp.runstate", "usp.sweeprecord",
              "usp.config", "usp.plan", "usp.launch", "usp.report", "usp.cli")


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
