"""One live run per run directory (usp/run/lock.py): real `usp train` processes racing for one
train.name, and a killed run that `usp status` must not call running (the lock's own rules:
tests/unit/test_run_lock.py)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import USP, run_usp, usp_cli, usp_env
from usp.run import lock as runlock

FAST = ["data.tokenizer=bytes", "model.dim=32", "model.ffn_dim=64", "train.seq_len=32", "train.global_batch=4",
        "train.eval_batches=1", "train.sample_tokens=0", "logging.console=plain", "train.log_interval=1",
        "train.eval_interval=0", "checkpoint.enabled=false"]


def _spawn(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    env = usp_env()
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
