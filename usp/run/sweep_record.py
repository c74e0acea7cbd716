"""A sweep's record, runs/<sweep_name>/sweep.json: its model (Sweep, SweepPoint), reading it back,
and the statuses of points that ran as Slurm array tasks. No torch; written by `usp sweep`
(usp/launch/sweep.py), read by it again (resume) and by `usp report`.

runs/<sweep_name>/sweep.json (written atomically after every status change):

    {"version": 1, "name": "s1", "dir": "/abs/runs/s1", "conf": "tiny_demo" | null,
     "launcher": "local",
     "swept": {"cluster.procs_per_node": ["1", "2"], "train.micro_batch": ["4", "8"]},
     "base_overrides": ["train.steps=20"],            # the overrides every point shares
     "created": 1700000000.0, "updated": 1700000100.0,
     "points": [
       {"index": 0, "id": "p00_n1_mb4", "run_name": "s1/p00_n1_mb4",
        "run_dir": "/abs/runs/s1/p00_n1_mb4",          # the point's run directory
        "overrides": ["train.steps=20", "cluster.procs_per_node=1", "train.micro_batch=4"],
        "swept": {"cluster.procs_per_node": "1", "train.micro_batch": "4"},
        "status": "planned",       # planned | rejected | submitted (in a Slurm array) | running | done | failed
        "reason": null,            # rejected: the planner's message; failed: the root cause
        "exit_code": null, "started": null, "finished": null,
        "world_size": 1, "nodes": 1, "params": 950912, "degrees": {"pp": 1, "dp_replicate": 1, ...},
        "micro_batch": 4, "grad_accum": 4, "global_batch": 16,
        "predicted": {"tokens_per_s": 5790.8, "mfu": 0.24, "memory_gib": 0.46, "memory_tensor_gib": 0.15}},
       ...]}

A point's run is composed from `conf` + its `overrides` + `train.name=<id>`, with `train.runs_dir`
set to the sweep's directory (a run name is one directory name, usp/run/names.py): the same config
`usp train conf=... <overrides> train.runs_dir=runs/<sweep_name> train.name=<id>` would build.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from usp.errors import LaunchError
from usp.run.files import SWEEP, metrics_path, summary_path, write_text_atomic
from usp.run.state import analyse_failures

SWEEP_FILE = SWEEP
SWEEP_VERSION = 1


@dataclass
class SweepPoint:
    index: int
    id: str
    overrides: list[str]
    swept: dict[str, str]
    run_name: str
    run_dir: str
    status: str = "planned"
    reason: str | None = None
    exit_code: int | None = None
    started: float | None = None
    finished: float | None = None
    info: dict = field(default_factory=dict)  # world_size, degrees, batch, predicted numbers
    cfg: Any = field(default=None, repr=False)  # composed config, group choices and checked plan:
    choices: dict | None = field(default=None, repr=False)  # what a runner hands to prepare_run
    plan: Any = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {"index": self.index, "id": self.id, "run_name": self.run_name, "run_dir": self.run_dir,
                "overrides": self.overrides, "swept": self.swept, "status": self.status, "reason": self.reason,
                "exit_code": self.exit_code, "started": self.started, "finished": self.finished, **self.info}


@dataclass
class Sweep:
    name: str
    dir: Path
    conf: str | None
    swept: dict[str, list[str]]
    base_overrides: list[str]
    points: list[SweepPoint]
    launcher: str = "local"
    created: float = field(default_factory=time.time)

    @property
    def accepted(self) -> list[SweepPoint]:
        return [p for p in self.points if p.status != "rejected"]

    @property
    def rejected(self) -> list[SweepPoint]:
        return [p for p in self.points if p.status == "rejected"]

    @property
    def path(self) -> Path:
        return self.dir / SWEEP_FILE

    def to_dict(self) -> dict:
        return {"version": SWEEP_VERSION, "name": self.name, "dir": str(self.dir), "conf": self.conf,
                "launcher": self.launcher, "swept": self.swept, "base_overrides": self.base_overrides,
                "created": self.created, "updated": time.time(), "points": [p.to_dict() for p in self.points]}

    def write(self) -> Path:
        write_text_atomic(self.path, json.dumps(self.to_dict(), indent=1) + "\n")
        return self.path


def is_sweep_dir(path) -> bool:
    return (Path(path) / SWEEP_FILE).is_file()


def read_sweep(sweep_dir) -> dict:
    path = Path(sweep_dir) / SWEEP_FILE
    if not path.is_file():
        raise LaunchError(f"no {SWEEP_FILE} in {sweep_dir}", key="SWEEP_DIR", value=str(sweep_dir),
                          fix="a directory written by `usp sweep` (runs/<sweep name>)")
    return json.loads(path.read_text())


def refresh_statuses(sweep_dict: dict) -> dict:
    """Statuses of submitted points from their run directories (summary.json: done; failure
    records: failed; metrics.jsonl: running). The jobs don't write sweep.json: array tasks
    finishing together would race. Returns the updated dict; writes nothing."""
    for point in sweep_dict["points"]:
        if point["status"] not in ("submitted", "running"):
            continue
        run_dir = Path(point["run_dir"])
        if summary_path(run_dir).is_file():
            point["status"] = "done"
        elif analyse_failures(run_dir, None).failed:  # the plan only names the silent ranks
            point["status"], point["reason"] = "failed", f"see usp status {run_dir}"
        elif metrics_path(run_dir).is_file():
            point["status"] = "running"
    return sweep_dict


def layout_text(info: dict, full: bool = True) -> str:
    """dp=2 tp=1 pp=1 cp=1 ep=1 mb=8 ga=1 (dp = dp_replicate x dp_shard) from a point's record;
    full=False leaves out the degrees that are 1."""
    deg = info.get("degrees")
    if not deg:
        return "-"
    dims = {"dp": int(deg.get("dp_replicate", 1)) * int(deg.get("dp_shard", 1)),
            **{d: int(deg.get(d, 1)) for d in ("tp", "pp", "cp", "ep")}}
    parts = [f"{d}={v}" for d, v in dims.items() if full or v > 1]
    return " ".join(parts + [f"mb={info.get('micro_batch')}", f"ga={info.get('grad_accum')}"])
