"""A local multi-rank launch whose rank 0 finds its port taken is launched again on a new port.

torchrun picks rank 0's port by binding port 0 and closing it; rank 0 binds it again only after
importing torch, and any process may take it in between (seen in CI as EADDRINUSE when two test
workers launched at once). The collision here is real: the test reads the port from torchrun's
own log and takes it before rank 0 can."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import USP
from usp.engine.observe.failure import record_failure
from usp.rundir import read_plan
from usp.runlock import read_lock
from usp.runstate import COMPLETED, analyse_failures, port_taken_since, run_state

QUIET = ["logging.console=plain", "train.sample_tokens=0", "train.eval_interval=0", "train.measure_memory=false"]


@pytest.mark.distributed
def test_taken_rank0_port_is_launched_again(tmp_path):
    env = dict(os.environ, LOGLEVEL="INFO", COLUMNS="200")  # LOGLEVEL: torchrun logs the port it picked
    proc = subprocess.Popen([USP, "train", f"train.runs_dir={tmp_path}", "train.name=port", "cluster=local_cpu2",
                             "train.steps=2", *QUIET], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    ports: list[int] = []
    lines: list[str] = []
    taken = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            found = re.search(r"master_port=(\d+)", line)
            if found:
                ports.append(int(found.group(1)))
                if taken is None:
                    taken = socket.create_server(("", ports[0]))  # before rank 0 has imported torch
        code = proc.wait(timeout=300)
    finally:
        if taken is not None:
            taken.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    assert code == 0, out[-4000:]
    assert len(ports) == 2 and ports[1] != ports[0], ports
    assert "launching again on a new port" in out
    run_dir = tmp_path / "port"
    failure = json.loads((run_dir / "logs" / "failure_rank0.json").read_text())
    assert "address already in use" in failure["message"].lower() and failure["last_completed_step"] is None
    report = analyse_failures(run_dir, read_plan(run_dir / "plan.yaml"))
    assert run_state(run_dir, report, read_lock(run_dir)) == COMPLETED


def _record(run_dir: Path, message: str, step: int | None) -> None:
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        record_failure(run_dir, {"ranks": []}, 0, exc, step)


def test_only_a_port_taken_before_the_first_step_counts(tmp_path):
    (tmp_path / "logs").mkdir()
    start = time.time()
    taken = ("The server socket has failed to listen on any local network address. port: 29500, useIpv6: false, "
             "code: -98, name: EADDRINUSE, message: address already in use")
    _record(tmp_path, "shapes do not match", None)
    assert not port_taken_since(tmp_path, start)
    _record(tmp_path, taken, 3)  # the run had trained: not a launch problem to retry
    assert not port_taken_since(tmp_path, start)
    _record(tmp_path, taken, None)
    assert port_taken_since(tmp_path, start)
    assert not port_taken_since(tmp_path, time.time() + 1)  # an earlier launch's failure
