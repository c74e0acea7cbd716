"""The hang watchdog writes one verdict per stall (usp/engine/observe/hang.py HangWatch._claim): a
rank that was stopped itself detects its own stall when it resumes, on an older beat than the rank
that reported it, and must not report the same stall a second time (a CI run saw two "hung" events
for one SIGSTOP)."""
from __future__ import annotations

import time
from types import SimpleNamespace

from usp.engine.observe.hang import Beat, HangWatch
from usp.run.files import logs_dir


def _claim(run_dir, step: int, since: float) -> bool:
    watch = SimpleNamespace(run_dir=run_dir, launch="job/1")
    return HangWatch._claim(watch, Beat(1, "step", step, since, 0.0, 1.0))  # type: ignore[arg-type]


def test_one_verdict_per_stall_and_a_later_stall_gets_its_own(tmp_path):
    logs_dir(tmp_path).mkdir(parents=True)
    stopped_since = time.time() - 30  # rank 1 was SIGSTOPped in step 4
    waiting_since = time.time() - 20  # rank 0 began step 5 and waits for it in a collective
    assert _claim(tmp_path, 5, waiting_since)  # rank 0 detects first: the verdict is its
    time.sleep(0.05)  # claims seconds apart in a run; here past the file system's timestamp granularity
    assert not _claim(tmp_path, 4, stopped_since)  # rank 1, resumed, detects the same stall: quiet
    assert not _claim(tmp_path, 5, waiting_since)  # another rank stalled at rank 0's beat: quiet
    time.sleep(0.05)
    assert _claim(tmp_path, 9, time.time())  # a stall that began after those claims is a new one
