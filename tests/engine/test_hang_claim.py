"""The hang watchdog writes one verdict per stall (usp/engine/observe/hang.py HangWatch._claim): a
rank that was stopped itself detects its own stall when it resumes, on an older beat than the rank
that reported it, and must not report the same stall a second time (a CI run saw two "hung" events
for one SIGSTOP). Under torchft a group that only waits for another group's stuck rank is not hung."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

from usp.engine.observe.hang import Beat, HangWatch
from usp.run.files import hang_path, logs_dir


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


def _waits_for(run_dir, own: dict, other: dict, since: float) -> int | None:
    """HangWatch._stuck_elsewhere of rank 0 of replica group 0, given the groups' verdict files."""
    for group, verdict in ((0, own), (1, other)):
        hang_path(run_dir, group).write_text(json.dumps({"replica_group": group, **verdict}))
    watch = SimpleNamespace(run_dir=run_dir, launch="g0/0", group=0)
    return HangWatch._stuck_elsewhere(watch, Beat(1, "step", 5, since, 0.0, 1.0))  # type: ignore[arg-type]


def test_under_torchft_a_group_with_no_stuck_rank_of_its_own_waits_for_the_group_that_has_one(tmp_path):
    """A group whose every rank waits in torchft's collectives for another group's stopped rank is not
    hung: it trains on once torchft leaves that group out (docs/hangs.md#under-torchft)."""
    logs_dir(tmp_path).mkdir(parents=True)
    since = time.time() - 30
    mine = {"launch": "g0/0", "stuck": [], "detected_at": since + 20}
    theirs = {"launch": "g1/0", "stuck": [1], "detected_at": since + 20}
    assert _waits_for(tmp_path, mine, theirs, since) == 1
    assert _waits_for(tmp_path, {**mine, "stuck": [0]}, theirs, since) is None  # a stuck rank of its own: hung
    assert _waits_for(tmp_path, mine, {**theirs, "stuck": []}, since) is None  # nobody named: hung as before
    assert _waits_for(tmp_path, mine, {**theirs, "detected_at": since - 60}, since) is None  # an older stall
    assert _waits_for(tmp_path, {**mine, "launch": "g0/old"}, theirs, since) is None  # its own verdict is old
