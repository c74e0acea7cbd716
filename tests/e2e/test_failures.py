"""Failures of real runs: gloo's own errors classified (timeout, lost peer), a run whose loss blows up
ends with the root cause, a SIGKILLed rank named by `usp status`, and an unwritable checkpoint
directory refused before launch (records and `usp status` on files: tests/unit and tests/engine)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, USP, run_usp, usp_cli
from usp.engine.observe.failure import LOST_PEER, PYTHON, TIMEOUT

GLOO_SCRIPT = textwrap.dedent("""
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist
    from usp.engine.observe.failure import classify
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=1))
    second = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    if rank == 1:  # never joins the first collective, then dies
        time.sleep(1.3)
        os._exit(0)
    out = []
    for group in (None, second):
        try:
            dist.all_reduce(torch.ones(2), group=group)
        except Exception as exc:
            out.append([classify(exc), str(exc)[:300]])
        time.sleep(0.7)
    print(json.dumps(out), flush=True)
    os._exit(0)
""")


@pytest.mark.distributed
def test_classify_real_gloo_errors(tmp_path):
    """A peer that never joins a collective (timeout), then one that has died (lost peer)."""
    script = tmp_path / "gloo_errors.py"
    script.write_text(GLOO_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    peer = subprocess.Popen([sys.executable, str(script), "1", str(port)], env=env)
    try:
        main = subprocess.run([sys.executable, str(script), "0", str(port)], env=env, capture_output=True,
                              text=True, timeout=60)
    finally:
        peer.wait(timeout=30)
    results = json.loads(main.stdout.strip().splitlines()[-1])
    assert [r[0] for r in results] == [TIMEOUT, LOST_PEER], results


FAST_TRAIN = ["data.tokenizer=bytes", "model.dim=32", "model.ffn_dim=64", "train.seq_len=32", "train.global_batch=4",
              "train.eval_batches=1", "train.sample_tokens=0", "logging.console=plain", "train.log_interval=1"]


def test_train_that_fails_prints_the_root_cause(tmp_path):
    """A real run (one rank, in-process) whose loss blows up: nan_policy=stop raises, the worker
    records it, and `usp train` ends with the failure summary."""
    proc = run_usp("train", f"train.runs_dir={tmp_path}", "train.name=boom", *FAST_TRAIN, "train.steps=6",
                   "optimizer.lr=1e30", "optimizer.warmup_steps=0", "optimizer.grad_clip=0")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    rec = json.loads((tmp_path / "boom" / "logs" / "failure_rank0.json").read_text())
    assert rec["error_class"] == PYTHON and rec["last_completed_step"] is not None
    assert "root cause" in proc.stderr and "failing rank" in proc.stderr and "usp status" in proc.stderr
    log = (tmp_path / "boom" / "logs" / "rank_0.log").read_text()
    assert "FAILED (Python error)" in log and "Traceback" in log  # the traceback stays in the log ...
    assert_short_failure(proc.stdout + proc.stderr, tmp_path / "boom")  # ... not on the console
    assert "lower optimizer.lr, or train.nan_policy=skip" in " ".join(proc.stderr.split())  # the fix, in the summary
    status = usp_cli("status", str(tmp_path / "boom"), cwd=tmp_path)
    assert status.returncode == 1 and rec["exception_type"] in status.stdout


def assert_short_failure(out: str, run_dir: Path) -> None:
    """usp's failure summary first, then one line saying where the tracebacks are; no rank's or
    torchrun's traceback, torch log line or warning on the console."""
    assert "Traceback" not in out and "[rank0]" not in out and "ChildFailedError" not in out, out[-5000:]
    assert not re.search(r"^[IWE]\d{4} \d", out, re.MULTILINE) and "Warning" not in out, out[-5000:]
    tail = out[out.index("root cause"):].strip().splitlines()
    assert "usp: training exited with code 1; tracebacks and per-rank logs in" in " ".join(tail[-2:])
    assert str(run_dir / "logs") in " ".join(" ".join(tail[-2:]).split())


@pytest.mark.distributed
def test_two_ranks_that_fail_print_the_root_cause_first_and_leave_tracebacks_in_the_logs(tmp_path):
    """Both ranks of a DDP run stop on a NaN: the console has usp's summary, not ~60 lines of the
    ranks' tracebacks and torchrun's report; each rank's log has its traceback."""
    proc = run_usp("train", "conf=tiny_ddp", f"train.runs_dir={tmp_path}", "train.name=boom2", *FAST_TRAIN,
                   "train.steps=6", "optimizer.lr=1e30", "optimizer.warmup_steps=0", "optimizer.grad_clip=0")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert_short_failure(out, tmp_path / "boom2")
    assert re.search(r"then: rank [01]: Python error after step 1", out), out[-4000:]  # the other rank, one line
    for rank in (0, 1):
        log = (tmp_path / "boom2" / "logs" / f"rank_{rank}.log").read_text()
        assert "Traceback" in log and "NonFiniteLoss" in log


def _pids_with_env(marker: str, rank: int) -> list[int]:
    """Processes started by this test (they inherit `marker` in their environment) with RANK=rank."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker.encode() in env and f"RANK={rank}".encode() in env:
            found.append(int(proc.name))
    return found


@pytest.mark.distributed
def test_sigkilled_rank_is_named_by_status(tmp_path):
    """Two ranks under torchrun; rank 1 gets SIGKILL mid-run (what the OOM killer does). Rank 0
    records a lost peer; `usp status` names rank 1 as the one that died without a traceback."""
    marker = f"USP_TEST_MARKER={os.getpid()}-{time.time()}"
    env = dict(os.environ, COLUMNS="200", **dict([marker.split("=", 1)]))
    cmd = [USP, "train", "conf=tiny_ddp", "train.steps=100000",
           f"train.runs_dir={tmp_path}", *FAST_TRAIN, "logging.console=quiet", "train.eval_interval=0",
           "checkpoint.enabled=false"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "tiny_ddp" / "logs" / "rank_1.log"
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not (log.is_file() and "step 2 " in log.read_text()):
            time.sleep(0.2)
        victims = _pids_with_env(marker, 1)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "rank(s) 1 died without a Python traceback" in err and "likely root cause" in err
    rec = json.loads((tmp_path / "tiny_ddp" / "logs" / "failure_rank0.json").read_text())
    assert rec["error_class"] == LOST_PEER, rec["message"]
    assert not (tmp_path / "tiny_ddp" / "logs" / "failure_rank1.json").exists()
    status = usp_cli("status", str(tmp_path / "tiny_ddp"), cwd=tmp_path)
    assert status.returncode == 1 and "rank 0: lost peer" in status.stdout and "dp_replicate=1" in status.stdout


def test_train_refuses_unwritable_checkpoint_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = run_usp("train", f"train.runs_dir={tmp_path / 'runs'}", f"checkpoint.dir={blocker / 'ckpt'}",
                   "logging.console=plain")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "checkpoint.dir" in proc.stderr and str(blocker / "ckpt") in proc.stderr and "fix:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
