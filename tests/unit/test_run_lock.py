"""The run lock's own rules (usp/run/lock.py): exclusive across processes, stale locks told apart, and a
held run directory refused by `usp submit` and `usp plan --save` (racing `usp train` processes:
tests/e2e/test_run_lock.py)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import usp_cli
from usp.run import lock as runlock


def test_lock_is_exclusive_and_released(tmp_path):
    lock = runlock.acquire(tmp_path, say=lambda m: None)
    info = runlock.read_lock(tmp_path)
    assert info is not None and info.live and info.record["pid"] == os.getpid()
    other = subprocess.run([sys.executable, "-c", f"from usp.run import lock; lock.acquire({str(tmp_path)!r})"],
                           capture_output=True, text=True)  # another process: refused
    assert other.returncode == 1 and "LaunchError" in other.stderr and f"pid {os.getpid()}" in other.stderr
    assert "train.name" in other.stderr
    for adopted in (runlock.acquire(tmp_path, token=lock.token),  # the engine's rank 0: the launcher's lock
                    runlock.acquire(tmp_path)):  # this process runs it again (a sweep, one point after another)
        assert adopted.token == lock.token and not adopted.owned
        adopted.release()
    assert runlock.read_lock(tmp_path) is not None  # adopting never removes it
    lock.release()
    assert runlock.read_lock(tmp_path) is None


def _write_lock(run_dir: Path, **record) -> None:
    (run_dir / runlock.LOCK).write_text(json.dumps({"token": "t", "started": time.time(), **record}))


def test_stale_locks(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    _write_lock(tmp_path, pid=dead.pid, host=socket.gethostname())
    assert not runlock.read_lock(tmp_path).live  # dead pid on this host
    _write_lock(tmp_path, pid=os.getpid(), host=socket.gethostname(), pid_start="1")
    assert not runlock.read_lock(tmp_path).live  # a reused pid: another process
    _write_lock(tmp_path, pid=1, host="elsewhere", slurm_job="77")
    info = runlock.read_lock(tmp_path)
    assert info.live and "Slurm job 77" in info.owner()  # another host: live while its heartbeat is fresh
    old = time.time() - runlock.STALE_AFTER_S - 5
    os.utime(tmp_path / runlock.LOCK, (old, old))
    assert not runlock.read_lock(tmp_path).live
    said: list[str] = []
    runlock.acquire(tmp_path, say=said.append).release()
    assert "taking over the stale run lock" in said[0] and "Slurm job 77" in said[0] and "no heartbeat" in said[0]


def test_submit_and_plan_save_refuse_a_run_dir_held_by_a_live_run(tmp_path):
    run_dir = tmp_path / "runs" / "held"
    run_dir.mkdir(parents=True)
    lock = runlock.acquire(run_dir, say=lambda m: None)
    try:
        proc = usp_cli("submit", "cluster=local_slurm", "train.name=held", "--dry-run", cwd=tmp_path)
        assert proc.returncode == 2 and "in use by a live run" in proc.stderr, proc.stdout + proc.stderr
        saved = usp_cli("plan", "train.name=held", "--save", cwd=tmp_path)
        assert saved.returncode == 2 and "in use by a live run" in saved.stderr, saved.stdout + saved.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == [runlock.LOCK]  # nothing written
    finally:
        lock.release()
