"""What state a run is in, read from its run directory alone (no torch): `usp status`, `usp train`'s
failure summary, sweeps and `usp report` all ask here.

State: running (a live run lock, usp/run/lock.py: its process is alive, or its heartbeat is
fresh), else completed (summary.json, no failure after it), hung (the hang watchdog's "hung" event
of the latest launch, not followed by a restart or another stop: docs/hangs.md), failed
(logs/failure_rank<R>.json files of the latest launch, not followed by a restart), else stopped
(killed, interrupted or preempted: nothing runs, and it didn't finish). A dead run is never "running". For a failed run
the root cause is the earliest failure that is not a "lost peer" (a rank that lost its
connection only because another one died); ranks of the plan that left no failure file died
without a Python traceback (a signal: the OOM killer, SIGKILL, or torchrun stopping them)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from usp.errors import LaunchError
from usp.run.files import (
    FAILURE_GLOB,
    GROUP_RESTART_EVENT,
    HANG_EVENT,
    HANG_STOP,
    LOST_PEER,
    OLD_STOP_EVENT,
    STOP_EVENT,
    events_path,
    logs_dir,
    metrics_path,
    plan_path,
    read_jsonl,
    summary_path,
)
from usp.run.lock import LockInfo

if TYPE_CHECKING:  # the floor reads plans it is handed; it imports no contract code
    from usp.contract.dims import RankInfo
    from usp.contract.run_plan import RunPlan

RUNNING, COMPLETED, FAILED, STOPPED, HUNG = "running", "completed", "failed", "stopped", "hung"


@dataclass
class FailureReport:
    root: dict | None = None  # the failure that started it (None: only silent ranks / lost peers)
    secondary: list[dict] = field(default_factory=list)  # failures caused by the root one
    silent: list[RankInfo] = field(default_factory=list)  # the plan's ranks with no failure file
    earlier: list[dict] = field(default_factory=list)  # failures before the latest launch or restart
    lost_peer_seen: bool = False

    @property
    def failed(self) -> bool:
        return self.root is not None or bool(self.secondary)


def resolve_run_dir(arg: str | None, runs_dir: str | Path = "runs", any_dir: bool = False) -> Path:
    """RUN_DIR, or the most recently modified directory under ./runs. A given directory that holds
    nothing a launch writes (plan.yaml, logs/, metrics.jsonl, checkpoints/) is refused unless
    `any_dir` (commands that also take a checkpoint directory)."""
    if arg:
        path = Path(arg)
        if not path.is_dir():
            raise LaunchError(f"no run directory {path}", key="RUN_DIR", fix="usp status runs/<name>")
        if not any_dir and not is_run_dir(path):
            raise LaunchError(f"{path} is not a run directory: it has no plan.yaml, logs/, metrics.jsonl or "
                              "checkpoints/", key="RUN_DIR", value=str(path),
                              fix="name the directory `usp train` / `usp submit` printed (runs/<name>)")
        return path
    runs = Path(runs_dir)
    candidates = [p for p in runs.iterdir() if p.is_dir()] if runs.is_dir() else []
    if not candidates:
        raise LaunchError(f"no run directory given and {runs}/ has none", key="RUN_DIR",
                          fix="usp status <run dir> (e.g. runs/<name>)")
    return max(candidates, key=lambda p: p.stat().st_mtime)


def is_run_dir(path: Path) -> bool:
    """Whether a launch has written into `path`."""
    return any(p.exists() for p in (plan_path(path), logs_dir(path), metrics_path(path), path / "checkpoints"))


def _mtime(path: Path) -> float | None:
    return path.stat().st_mtime if path.is_file() else None


def launched_at(run_dir: Path) -> float:
    """When the latest launch wrote plan.yaml (0.0 without one)."""
    return _mtime(plan_path(run_dir)) or 0.0


def read_failures(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted(logs_dir(run_dir).glob(FAILURE_GLOB)):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        record["_path"] = str(path)
        record.setdefault("unix_time", path.stat().st_mtime)
        out.append(record)
    return out


def analyse_failures(run_dir: Path, plan: RunPlan | None) -> FailureReport:
    """Sort the failure files of the latest launch (and attempt) into root cause and consequences."""
    failures = read_failures(run_dir)
    since = launched_at(run_dir)
    restarts = [e for e in read_jsonl(events_path(run_dir)) if e.get("event") == "restart"]
    if restarts:
        since = max(since, max(float(e.get("time", 0)) for e in restarts))
    report = FailureReport()
    active: list[dict] = []
    for f in failures:
        (active if float(f["unix_time"]) >= since - 1.0 else report.earlier).append(f)
    active.sort(key=lambda f: float(f["unix_time"]))
    report.lost_peer_seen = any(f.get("error_class") == LOST_PEER for f in active)
    primary = [f for f in active if f.get("error_class") != LOST_PEER]
    report.root = (primary or active)[0] if active else None
    report.secondary = [f for f in active if f is not report.root]
    if active and plan is not None:
        reported = {int(f.get("rank", -1)) for f in active}
        report.silent = [r for r in plan.ranks if r.rank not in reported]
    return report


def run_state(run_dir: Path, report: FailureReport, lock: LockInfo | None, events: list[dict] | None = None) -> str:
    """RUNNING (a live run lock), COMPLETED (summary.json of this launch, no failure after it),
    HUNG, FAILED or STOPPED. `lock`: read_lock(run_dir) as the caller read it, so a caller that also
    shows the lock shows the one that decided the state; `events`: logs/events.jsonl as it read them.
    A hang comes before the failures: a live rank that lost its stuck peer records one."""
    if lock is not None and lock.live:
        return RUNNING
    latest_failure = max((float(f["unix_time"]) for f in [report.root, *report.secondary] if f), default=0.0)
    done = _mtime(summary_path(run_dir))  # of this launch, not an earlier one
    if done is not None and done >= launched_at(run_dir) - 1.0 and latest_failure <= done:
        return COMPLETED
    events = read_jsonl(events_path(run_dir)) if events is None else events
    if hang_event(events, launched_at(run_dir) - 1.0) is not None:
        return HUNG
    return FAILED if report.failed else STOPPED


def hang_event(events: list[dict], since: float = 0.0) -> dict | None:
    """The hang watchdog's latest "hung" event at or after `since` (unix time), unless a restart (of the
    run, or under torchft of a replica group) or a stop of its own followed it (the stop after a stall
    that cleared is the hang's)."""
    for event in reversed(events):
        kind = event.get("event")
        if kind in ("restart", GROUP_RESTART_EVENT) or (kind in (STOP_EVENT, OLD_STOP_EVENT)
                                                        and event.get("signal") != HANG_STOP):
            return None
        if kind == HANG_EVENT:
            return event if float(event.get("time", 0)) >= since else None
    return None


def hung_since(run_dir: Path, since: float) -> dict | None:
    """hang_event of the run's logs/events.jsonl."""
    return hang_event(read_jsonl(events_path(run_dir)), since)


def stop_event(events: list[dict], since: float = 0.0) -> dict | None:
    """The ranks' stop on a signal, if it is the last event of logs/events.jsonl (as read_jsonl
    reads it) and at or after `since` (unix time): {"step", "signal", "checkpoint", ...}."""
    last = events[-1] if events else None
    if last is None or last.get("event") not in (STOP_EVENT, OLD_STOP_EVENT) or float(last.get("time", 0)) < since:
        return None
    return last


def stopped_since(run_dir: Path, since: float) -> dict | None:
    """stop_event of the run's logs/events.jsonl."""
    return stop_event(read_jsonl(events_path(run_dir)), since)


def is_preemption(stop: dict) -> bool:
    """A stop to requeue on Slurm: SIGUSR1, which the batch script passes on before a time limit
    or a preemption (an old "preempted" line records no signal), or the hang watchdog's stop after a
    stall that cleared. SIGINT and SIGTERM mean stop."""
    return stop.get("signal", "SIGUSR1") in ("SIGUSR1", HANG_STOP)
