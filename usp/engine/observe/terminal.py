"""A terminal that goes away (an ssh session drops, a terminal window closes) must not fail the run.

Once the terminal is gone, every write to it fails with EIO. Measured before this module: a
two-rank `usp train` whose terminal closed stopped at the next step with a checkpoint (torchrun's
ranks get SIGTERM when usp dies), and then each rank failed on its next console write ("OSError:
[Errno 5] Input/output error" in logs/failure_rank<N>.json), so the run read as failed, not stopped.

`survive_a_lost_terminal()` wraps sys.stdout and sys.stderr: the first write or flush that fails
because the terminal is gone points that file descriptor at /dev/null, and the run goes on without
console output (logs/rank_<N>.log and metrics.jsonl keep everything). Every engine entry process
calls it from usp/engine/__init__.py; `usp train` too (no torch here). SIGHUP itself is a stop
signal (usp/engine/signals.py)."""
from __future__ import annotations

import errno
import os
import sys

GONE = (errno.EIO, errno.EPIPE, errno.ENXIO)  # a hung-up terminal; a closed pipe


class _Survivor:
    """A text stream whose writes and flushes outlive the terminal behind it."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._drop_terminal(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._drop_terminal(exc)

    def _drop_terminal(self, exc: OSError) -> None:
        if exc.errno not in GONE:
            raise exc
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())  # what the stream still buffers goes to /dev/null too
        os.close(null)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_a_lost_terminal() -> None:
    """From here on this process's console output can't fail it (idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Survivor):
            setattr(sys, name, _Survivor(stream))
