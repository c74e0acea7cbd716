"""One live run per run directory (usp/runlock.py): real `usp train` processes racing for one
train.name, a killed run that `usp status` must not call running, and the lock's own rules."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import SESSION_CACHE, run_usp, usp_cli
from usp import runlock

FAST = ["data.tokenizer=bytes", "model.dim=32", "model.ffn_dim=64", "train.seq_len=32", "train.global_batch=4",
        "train.eval_batches=1", "train.sample_tokens=0", "logging.console=plain", "train.log_interval=1",
        "train.eval_interval=0", "checkpoint.enabled=false"]
USP = str(Path(sys.executable).parent / "usp")


def _spawn(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, USP_CACHE_DIR=str(SESSION_CACHE), COLUMNS="200")
    return subprocess.Popen([USP, "train", f"train.runs_dir={tmp_path}", "train.name=x", *FAST, *overrides],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []  # torn: raises


def _status(tmp_path: Path) -> subprocess.CompletedProcess:
    return usp_cli("status", str(tmp_path / "x"), cwd=tmp_path)


@pytest.mark.slow
def test_two_concurrent_trains_one_refused_then_killed_run_is_stopped_and_taken_over(tmp_path):
    run_dir = tmp_path / "x"
    first, second = _spawn(tmp_path, "train.steps=100000"), _spawn(tmp_path, "train.steps=100000")
    try:
        deadline = time.time() + 120
        while first.poll() is None and second.poll() is None:
            assert time.time() < deadline, "neither launch was refused"
            time.sleep(0.1)
        refused, running = (first, second) if first.poll() is not None else (second, first)
        out = refused.stdout.read()
        assert refused.returncode == 2, out[-3000:]
        assert "in use by a live run" in out and f"pid {running.pid}" in out and socket.gethostname() in out
        assert "Traceback" not in out
        while len(_metrics(run_dir)) < 3:  # the other one trains on
            assert running.poll() is None and time.time() < deadline, running.stdout.read()[-3000:]
            time.sleep(0.1)
        status = _status(tmp_path)
        assert "running (pid" in status.stdout, status.stdout
        lock = json.loads((run_dir / "run.lock").read_text())
        assert lock["pid"] == running.pid and lock["host"] == socket.gethostname() and lock["started"] > 0
        # heartbeat: rank 0 keeps touching the lock
        beat = (run_dir / "run.lock").stat().st_mtime
        while (run_dir / "run.lock").stat().st_mtime == beat:
            assert time.time() - beat < 3 * runlock.HEARTBEAT_S, "no heartbeat"
            time.sleep(0.2)
        os.killpg(running.pid, signal.SIGKILL)  # no cleanup: the lock stays behind, its pid dead
        running.wait(timeout=30)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    steps = [r["step"] for r in _metrics(run_dir)]  # every line parses: not torn
    assert steps == list(range(1, len(steps) + 1))
    assert (run_dir / "run.lock").exists()
    status = _status(tmp_path)
    assert "stopped" in status.stdout and "is not running" in status.stdout and "running (" not in status.stdout
    # a new launch takes the stale lock over, says so, finishes, and gives it back
    done = run_usp("train", f"train.runs_dir={tmp_path}", "train.name=x", *FAST, "train.steps=3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "taking over the stale run lock" in done.stdout and f"pid {running.pid}" in done.stdout
    assert not (run_dir / "run.lock").exists()
    assert "completed" in _status(tmp_path).stdout


def test_lock_is_exclusive_and_released(tmp_path):
    lock = runlock.acquire(tmp_path, say=lambda m: None)
    info = runlock.read_lock(tmp_path)
    assert info is not None and info.live and info.record["pid"] == os.getpid()
    other = subprocess.run([sys.executable, "-c", f"from usp import runlock; runlock.acquire({str(tmp_path)!r})"],
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
