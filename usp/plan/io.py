"""Reading and writing plan.yaml. Writes are atomic (temp file + rename) so a crash never
leaves a half-written plan for the engine to read."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give it the mode a plain open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_plan(plan, path: Path | None = None) -> Path:
    path = Path(path or Path(plan.run_dir) / "plan.yaml")
    header = "# usp run plan: derived from the config below; the engine reads only this file.\n"
    write_text_atomic(path, header + yaml.safe_dump(plan.to_dict(), sort_keys=False, width=110))
    return path


def read_plan(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)
