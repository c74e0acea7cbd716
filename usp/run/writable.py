"""Output targets the user names (`usp plan --save`'s run directory, `usp export --out`, `usp config
cp`'s destination, `usp calibrate --out`, `usp report --out`): checked before any work, so a
read-only mount, a missing permission or a file where a directory is expected is one clear error,
not a traceback after minutes of work, and something the user already has there is never replaced
without --force (the replacement itself goes through usp.run.files.staged: the old one stays until the
new one is whole). No torch."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from usp.errors import UspError


def check_writable_dir(directory: Path, key: str, value: object, fix: str) -> Path:
    """Create `directory` if needed and prove a file can be written in it."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(prefix=".usp-write-test-", dir=directory):
            pass
    except OSError as exc:
        blocker = next((p for p in [directory, *directory.parents] if p.exists() and not p.is_dir()), None)
        reason = f"{blocker} is a file, not a directory" if blocker else (exc.strerror or str(exc))
        raise UspError(f"can't write a file in {directory}: {reason}", key=key, value=value, fix=fix) from None
    return directory


def check_new_output(target, *, force: bool, key: str, inputs=()) -> Path:
    """`target` (a file or a directory a command is about to write) may be written: it doesn't
    exist yet, or `force` says to replace it. Even with force, never a directory holding the
    command's `inputs` or the working directory. Its parent must take a file."""
    target = Path(target).expanduser()
    if os.path.lexists(target):
        what = "a directory" if target.is_dir() else "a file"
        if not force:
            raise UspError(f"{what} already exists there; usp replaces nothing without --force", key=key,
                           value=str(target), fix=f"another {key}, or add --force to replace it (the old one is "
                           "kept until the new one is complete)")
        held = [(Path(p), "this command's input") for p in inputs] + [(Path.cwd(), "the working directory")]
        for path, role in held:
            if _inside(path, target):
                raise UspError(f"--force would replace {target}, which holds {path} ({role})", key=key,
                               value=str(target), fix=f"another {key}, outside it")
    check_writable_dir(target.parent, key, str(target), f"{key} <a path in a writable directory>")
    return target


def _inside(path: Path, directory: Path) -> bool:
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents
