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


def check_new_output(target, *, force: bool, key: str, inputs=(), own=None) -> Path:
    """`target` (a file or a directory a command is about to write) may be written: it doesn't
    exist yet, or `force` says to replace it. Never, even with force: a path that is, holds or lies
    inside one of the command's `inputs` (the implicit ones too: calibrate's archs CSV), except inside
    `own` (the directory the command writes by default within a run it reads, RUN/report); a
    checkpoint, or inside one; a run directory, or a directory holding one or a checkpoint; the
    working directory. Its parent must take a file."""
    target = Path(target).expanduser()
    _refuse_inputs(target, key, inputs, own)
    _refuse_checkpoint(target, key)
    if os.path.lexists(target):
        what = "a directory" if target.is_dir() else "a file"
        if not force:
            raise UspError(f"{what} already exists there; usp replaces nothing without --force", key=key,
                           value=str(target), fix=f"another {key}, or add --force to replace it (the old one is "
                           "kept until the new one is complete)")
        _refuse_run_data(target, key)
    check_writable_dir(target.parent, key, str(target), f"{key} <a path in a writable directory>")
    return target


def _refuse_inputs(target: Path, key: str, inputs, own) -> None:
    for given in inputs:
        path = Path(given).expanduser()
        if _inside(path, target):
            why = "is" if path.resolve() == target.resolve() else "holds"
            raise UspError(f"{target} {why} this command's input {path}: --force never replaces an input",
                           key=key, value=str(target), fix=f"another {key}, outside {path}")
        if _inside(target, path) and not (own is not None and _inside(target, Path(own).expanduser())):
            default = f" (or leave {key} out: the default, {own}, is usp's own)" if own is not None else ""
            raise UspError(f"{target} lies inside {path}, which this command reads: usp writes nothing into its "
                           "input", key=key, value=str(target), fix=f"another {key}, outside {path}{default}")


def _refuse_checkpoint(target: Path, key: str) -> None:
    for path in (target, *target.parents):
        if _is_checkpoint(path):
            raise UspError(f"{target} is {'a checkpoint' if path == target else f'inside the checkpoint {path}'}: "
                           "usp writes nothing there", key=key, value=str(target), fix=f"another {key}")


def _refuse_run_data(target: Path, key: str) -> None:
    """What --force still never replaces: a run directory, checkpoints, the working directory."""
    if _inside(Path.cwd(), target):
        raise UspError(f"--force would replace {target}, which holds the working directory", key=key,
                       value=str(target), fix=f"another {key}, outside it")
    if not target.is_dir():
        return
    held = next((p.parent for pattern in ("plan.yaml", "*/plan.yaml") for p in target.glob(pattern)), None)
    held = held or next((p.parent for pattern in ("*/manifest.json", "*/*/manifest.json", "*/*/*/manifest.json")
                         for p in target.glob(pattern) if _is_checkpoint(p.parent)), None)
    if held is not None:
        what = "a run directory" if (held / "plan.yaml").is_file() and not _is_checkpoint(held) else "a checkpoint"
        raise UspError(f"--force would replace {target}, which holds {what} ({held})", key=key, value=str(target),
                       fix=f"another {key}; remove a run's files yourself if you mean to")


def _is_checkpoint(path: Path) -> bool:
    """A usp checkpoint directory: step_<N> with its manifest.json (or a save in progress)."""
    return path.name.startswith(("step_", ".tmp-step_")) and path.is_dir() and (
        (path / "manifest.json").is_file() or (path / ".metadata").is_file() or path.name.startswith(".tmp-"))


def _inside(path: Path, directory: Path) -> bool:
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents
