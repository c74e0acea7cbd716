"""A full disk during a run (usp/engine/diskfull.py): a small tmpfs as the runs directory, filled by
another process once training has started. The run says "no space left on device" with the path,
removes its partial checkpoint and records the failure, instead of torch's
`basic_ios::clear: iostream error` or a CheckpointException traceback."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.helpers import USP, usp_cli


def test_a_full_disk_during_the_run_says_so_and_records_the_failure(small_tmpfs):
    run_dir = small_tmpfs / "full"
    cmd = [USP, "train", "model=tiny", "train.steps=40", "train.log_interval=1", "train.eval_interval=0",
           "train.sample_tokens=0", "train.measure_memory=false", "logging.console=plain", "checkpoint.interval=3",
           "checkpoint.keep_last=1", f"train.runs_dir={small_tmpfs}", "train.name=full"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    deadline = time.time() + 180
    while not (run_dir / "metrics.jsonl").exists():  # training has started: the pre-launch space check passed
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    fd = os.open(small_tmpfs / "filler", os.O_CREAT | os.O_WRONLY)  # another process fills the disk
    os.posix_fallocate(fd, 0, shutil.disk_usage(small_tmpfs).free - 300_000)  # room for logs, not a checkpoint
    os.close(fd)
    out = proc.communicate(timeout=300)[0]

    assert proc.returncode == 1, out[-3000:]
    assert f"no space left on device: writing checkpoint step 3 to {run_dir / 'checkpoints'}" in out, out[-3000:]
    assert "basic_ios" not in out and "Traceback" not in out and "CheckpointException" not in out, out[-5000:]
    record = json.loads((run_dir / "logs" / "failure_rank0.json").read_text())
    assert record["error_class"] == "disk full" and record["last_completed_step"] == 3
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # the partial checkpoint is gone
    status = usp_cli("status", str(run_dir), cwd=Path(small_tmpfs))
    assert status.returncode == 1 and "disk full" in status.stdout, status.stdout
