"""A process started as `python -m usp.engine.<entry>` imports torch with Python's garbage collector
paused (usp/engine/__init__.py, usp/engine/startup_gc.py). Its `__main__` block must turn the
collector back on first thing, or the rank would train with no cyclic collection at all. (A real
rank's log says the collector is on: tests/e2e/test_training.py.)"""
from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "usp" / "engine"


def _main_blocks() -> dict[Path, ast.If]:
    out = {}
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
                out[path] = node
    return out


def test_every_engine_entry_turns_the_collector_back_on_before_anything_else():
    blocks = _main_blocks()
    assert {p.stem for p in blocks} >= {"worker", "agent", "verify_worker", "meta_build"}
    for path, block in blocks.items():
        assert ast.unparse(block.body[0]) == "freeze_imports()", f"{path}: `__main__` must call freeze_imports() first"
