"""usp.run.files.staged, which every command writing where the user points goes through: a failed write
keeps the old target, and without renameat2 (another OS or filesystem) two renames do the swap (the
commands themselves, killed mid-swap: tests/e2e/test_outputs.py)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from usp.run import files as rundir
from usp.run.files import staged


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_staged_keeps_the_old_target_on_failure_and_without_renameat2(tmp_path, monkeypatch):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged(target) as tmp:
        tmp.mkdir()
        (tmp / "new.txt").write_text("half")
        raise RuntimeError("the write failed")
    assert _listing(tmp_path) == ["out"] and _listing(target) == ["old.txt"]

    def no_renameat2(a, b):
        raise OSError(errno.ENOSYS, "renameat2 is not available")

    monkeypatch.setattr(rundir, "_exchange", no_renameat2)  # another OS or filesystem: two renames
    with staged(target) as tmp:
        tmp.mkdir()
        (tmp / "new.txt").write_text("new")
    assert _listing(tmp_path) == ["out"] and _listing(target) == ["new.txt"]
    with staged(target) as tmp:  # a file replaces a directory
        tmp.write_text("a file now")
    assert _listing(tmp_path) == ["out"] and target.read_text() == "a file now"
