"""Ctrl-C on a multi-rank run (usp/engine/signals.py, usp/engine/agent.py): every process of the
terminal's process group gets SIGINT; the run ends with exit code 130, one line per rank and one
for the torchrun agent, and no traceback anywhere."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.helpers import USP


@pytest.mark.distributed
def test_ctrl_c_on_two_ranks_exits_130_without_tracebacks(tmp_path):
    run_dir = tmp_path / "runs" / "ctrlc"
    cmd = [USP, "train", "model=tiny", "cluster.procs_per_node=2", "train.steps=500", "train.log_interval=1",
           "train.eval_interval=0", "train.sample_tokens=0", "train.measure_memory=false", "logging.console=plain",
           "train.name=ctrlc", f"train.runs_dir={tmp_path / 'runs'}"]
    # its own session = its own process group, as a terminal's foreground job
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200"}, start_new_session=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    out = proc.communicate(timeout=120)[0]

    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "SignalException" not in out, out[-5000:]
    for rank in (0, 1):
        assert out.count(f"usp: rank {rank} interrupted (Ctrl-C) after step ") == 1, out[-3000:]
    assert "usp: torchrun agent (node 0) interrupted (Ctrl-C)" in out
    assert not list((run_dir / "logs").glob("failure_rank*.json"))  # an interruption is not a failure
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert 2 <= last < 500
