"""Output targets the user names (`usp plan --save`'s run directory, `usp export --out`, `usp config
cp`'s destination): checked by writing a real temporary file there before any work, so a read-only
mount, a missing permission or a file where a directory is expected is one clear error, not a
traceback after minutes of work. No torch."""
from __future__ import annotations

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
