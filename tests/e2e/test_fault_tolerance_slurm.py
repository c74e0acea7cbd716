"""fault_tolerance=torchft on the local Slurm controller (scripts/local_slurm.sh): `usp submit` makes the
lighthouse's job and an array of 2 replica groups (2 FSDP ranks each, one node each). `scancel` of one
group's task: the lighthouse's job requeues it, it rejoins and heals, while the other group trains on."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.test_slurm import job_state, slurm, wait_for  # noqa: F401 - slurm is a fixture
from tests.helpers import run_usp
from usp.run.files import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

# the survivor trains on alone for ~40 s at 0.13 s a step (the dev VM); the requeued group took ~17 s to return
STEPS = 300


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


@pytest.mark.timeout(900)
def test_scancel_of_one_replica_group_it_is_requeued_and_rejoins(slurm, tmp_path):  # noqa: F811
    r = run_usp("submit", "conf=tiny_demo", "fault_tolerance=torchft", "cluster=local_slurm", "cluster.nodes=2",
                "cluster.procs_per_node=2", "parallelism.dp_replicate=2", "parallelism.dp_shard=2",
                f"train.steps={STEPS}", "train.log_interval=1", "train.eval_interval=0", "train.sample_tokens=0",
                "logging.console=plain", "train.measure_memory=false", "checkpoint.interval=50",
                f"train.runs_dir={tmp_path}", "train.name=ft", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = tmp_path / "ft"
    jobs = [j["job_id"] for j in json.loads((run_dir / "job.json").read_text())["jobs"]]
    lighthouse, array = jobs  # the lighthouse's job first: `usp cancel` stops it before the groups
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not any(x["step"] >= 8 for x in _records(run_dir)):
            time.sleep(0.5)
        assert any(x["step"] >= 8 for x in _records(run_dir)), "the groups never trained"
        cancelled_at = max(x["step"] for x in _records(run_dir))
        subprocess.run(["scancel", f"{array}_1"], check=True)
        state = wait_for(f"{array}_0", timeout=600)
        lh = wait_for(lighthouse, timeout=120)
    finally:
        subprocess.run(["scancel", lighthouse, array])
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "0", state  # the survivor was never restarted
    assert lh["JobState"] == "COMPLETED", lh
    assert job_state(f"{array}_1").get("Restarts") == "1"
    records = _records(run_dir)
    assert [x["step"] for x in records] == list(range(1, STEPS + 1))
    after = [x for x in records if x["step"] > cancelled_at]
    assert any(x["participants"] == 1 for x in after), "no step without the cancelled group"
    back = [x["step"] for x in after if x["participants"] == 2]
    assert back and back[-1] == STEPS, "the cancelled group never rejoined"
    assert all(x["replica_spread"] is not None and x["replica_spread"] <= 1e-12 for x in records
               if x["step"] >= min(back))
    out = (run_dir / "logs" / f"slurm-{lighthouse}.out").read_text()
    assert f"replica group 1 (job {array}_1) ended CANCELLED before the run completed: requeueing it" in out
    gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:]) if b["step"] > cancelled_at]
    print(f"slurm: cancelled after step {cancelled_at}, rejoined at step {min(back)}, survivor's longest step gap "
          f"{max(gaps):.2f} s")
    assert max(gaps) <= 15.0, gaps
