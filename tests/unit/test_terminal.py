"""A terminal that goes away must not fail the run (usp/engine/observe/terminal.py): writes to it
then go to /dev/null. Anything else that fails a write still fails it."""
from __future__ import annotations

import errno
import os
import pty

import pytest

from usp.engine.observe.terminal import _Survivor


def test_writes_to_a_terminal_that_went_away_go_nowhere():
    master, slave = pty.openpty()
    stream = _Survivor(os.fdopen(slave, "w", buffering=1))
    stream.write("shown\n")
    assert os.read(master, 100) == b"shown\r\n"
    os.close(master)  # the session is gone: writes to its terminal now fail
    with pytest.raises(OSError) as err:
        os.write(slave, b"x")
    assert err.value.errno == errno.EIO
    assert stream.write("step 3 ...\n") == len("step 3 ...\n")  # no error
    stream.flush()
    assert os.readlink(f"/proc/self/fd/{slave}") == os.devnull
    stream.close()


def test_a_full_disk_is_not_a_lost_terminal():
    raw = open("/dev/full", "w")  # every write: ENOSPC
    stream = _Survivor(raw)
    stream.write("x" * 10)
    with pytest.raises(OSError) as err:
        stream.flush()
    assert err.value.errno == errno.ENOSPC
    assert os.readlink(f"/proc/self/fd/{raw.fileno()}") == "/dev/full"
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, raw.fileno())  # let the buffered text go before closing
    os.close(null)
    raw.close()
