"""A full disk while the run writes: say "no space left on device" with the path, not torch's
`basic_ios::clear: iostream error` or a 60-line CheckpointException. No torch import."""
from __future__ import annotations

import errno
import shutil
from pathlib import Path

from usp.errors import UspError

_ENOSPC_TEXT = ("no space left on device", f"[errno {errno.ENOSPC}]", "disk quota exceeded")
# torch.save's C++ writer loses errno: with these, a disk (almost) full is the cause
_CPP_WRITE_TEXT = ("basic_ios::clear", "iostream error", "file write failed", "unexpected pos")
NEARLY_FULL_BYTES = 16 * 2**20


class DiskFullError(UspError):
    """ENOSPC (or EDQUOT) while writing `path`."""


def is_disk_full(exc: BaseException, path: Path | None = None) -> bool:
    """Whether exc (or one of its causes, or a rank's failure inside a CheckpointException, which
    carries them as text) is a full disk; a C++ write error counts when `path`'s disk is nearly full."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc).lower()
        if any(t in text for t in _ENOSPC_TEXT):
            return True
        if path is not None and any(t in text for t in _CPP_WRITE_TEXT) and free_bytes(path) < NEARLY_FULL_BYTES:
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def free_bytes(path: Path) -> int:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def disk_full_error(what: str, path: Path, fix: str, key: str | None = None, value: object = None) -> DiskFullError:
    usage = _usage(path)
    return DiskFullError(f"no space left on device: {what} {path}{usage}", key=key, value=value, fix=fix)


def _usage(path: Path) -> str:
    try:
        total = shutil.disk_usage(path if Path(path).exists() else Path(path).parent).total
    except OSError:
        return ""
    return f" ({free_bytes(path) / 2**20:.1f} MiB free of {total / 2**20:.0f} MiB)"
