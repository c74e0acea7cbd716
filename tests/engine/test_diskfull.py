"""A full disk told from other write errors (usp/engine/diskfull.py): errno ENOSPC and its text anywhere
in an exception's chain, and torch's C++ writer error (which loses errno) only when the disk is nearly
full. The run that fills its disk: tests/e2e/test_diskfull.py."""
from __future__ import annotations

import errno
import os
import shutil

from usp.engine.diskfull import is_disk_full
from usp.engine.observe.failure import classify


def test_is_disk_full_reads_errno_and_text_and_a_cpp_error_only_on_a_nearly_full_disk(tmp_path):
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert classify(RuntimeError("rank 0: OSError: [Errno 28] No space left on device")) == "disk full"
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as cause:
            raise RuntimeError("saving failed") from cause
    except RuntimeError as chained:
        assert is_disk_full(chained)  # the cause counts
    cpp = RuntimeError("basic_ios::clear: iostream error")
    assert not is_disk_full(cpp)  # no path to look at
    assert not is_disk_full(cpp, tmp_path)  # a disk with room: something else
    assert not is_disk_full(ValueError("bad value"), tmp_path)


def test_a_cpp_write_error_on_a_nearly_full_disk_is_a_full_disk(small_tmpfs):
    cpp = RuntimeError("basic_ios::clear: iostream error")
    assert not is_disk_full(cpp, small_tmpfs)  # 40 MiB free
    fd = os.open(small_tmpfs / "filler", os.O_CREAT | os.O_WRONLY)
    os.posix_fallocate(fd, 0, shutil.disk_usage(small_tmpfs).free - 100_000)
    os.close(fd)
    assert is_disk_full(cpp, small_tmpfs / "checkpoints" / ".tmp-step_00000010")  # nearly full: that
    assert not is_disk_full(ValueError("bad value"), small_tmpfs)
