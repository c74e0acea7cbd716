"""Slurm jobs of a run: write job.sbatch, submit it, and find it again for status, cancel and
logs. No torch. Talks to Slurm only through its commands (sbatch, scontrol, scancel).

<dir>/job.json (a run dir, or a sweep dir for a job array) records every submission:
{"jobs": [{"job_id": "12", "script": ".../job.sbatch", "log_dir": ".../logs",
           "plans": [".../plan.yaml", ...], "submitted_at": 1700000000.0}, ...]}"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from usp.errors import LaunchError
from usp.run.files import JOB_RECORD, read_jobs, write_text_atomic

_FIELD = re.compile(r"(\w+)=(\S*)")


class SlurmMissing(LaunchError):
    """A Slurm client command (sbatch, scontrol, ...) is not installed here."""


def write_script(text: str, path: Path) -> Path:
    write_text_atomic(path, text)
    path.chmod(0o755)
    return path


def submit(script: Path, plans: list[Path], log_dir: Path, record_dir: Path) -> str:
    """sbatch the script; record and return the job id."""
    log_dir.mkdir(parents=True, exist_ok=True)  # sbatch won't create the --output directory
    out = _slurm(["sbatch", "--parsable", str(script)], "submit the job")
    job_id = out.strip().split(";")[0]  # --parsable prints "<id>" or "<id>;<cluster>"
    if not job_id.isdigit():
        raise LaunchError(f"sbatch printed no job id: {out.strip()!r}", key="cluster.slurm",
                          fix=f"submit by hand to see why: sbatch {script}")
    record(record_dir, job_id, script, log_dir, plans)
    return job_id


def record(record_dir: Path, job_id: str, script: Path, log_dir: Path, plans: list[Path]) -> None:
    """Append a submission to <record_dir>/job.json."""
    jobs = read_jobs(record_dir)
    jobs.append({"job_id": job_id, "script": str(script), "log_dir": str(log_dir),
                 "plans": [str(p) for p in plans], "submitted_at": time.time()})
    write_text_atomic(record_dir / JOB_RECORD, json.dumps({"jobs": jobs}, indent=1) + "\n")


def find_job(run_dir: Path) -> tuple[dict, int | None] | None:
    """The newest job that ran this run dir, and its array index (None: not an array). A run of
    a sweep is recorded in the sweep dir above it."""
    run_dir = Path(run_dir).resolve()
    for where in (run_dir, run_dir.parent):
        for job in reversed(read_jobs(where)):
            plans = [Path(p).resolve().parent for p in job["plans"]]
            if run_dir in plans:
                return job, (plans.index(run_dir) if len(plans) > 1 else None)
            if where == run_dir:  # a sweep dir itself
                return job, None
    return None


def job_states(job_id: str) -> list[dict]:
    """One dict per job (per array task) from `scontrol show job -o`: JobState, Reason,
    Restarts, RunTime, NodeList, ExitCode, ArrayTaskId... [] once Slurm has forgotten the job."""
    try:
        out = _slurm(["scontrol", "show", "job", "-o", job_id], "read the job state")
    except LaunchError as exc:
        if "Invalid job id" in str(exc):
            return []
        raise
    return [dict(_FIELD.findall(line)) for line in out.splitlines() if line.strip()]


# Once a job is in one of these states it will not run again (a requeue passes through PENDING).
FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def active_tasks(job: dict, index: int | None = None) -> list[str]:
    """The job's (array) tasks that are still queued or running, as "<id>" or "<id>_<task>"; []
    when Slurm's commands are missing here (nothing can be running that this machine submitted)."""
    try:
        states = job_states(job["job_id"])
    except SlurmMissing:
        return []
    out = []
    for s in states:
        task = s.get("ArrayTaskId")
        if index is not None and task is not None and task != str(index):
            continue
        if s.get("JobState") not in FINISHED_STATES:
            out.append(f"{s.get('ArrayJobId', job['job_id'])}_{task}" if task else s.get("JobId", job["job_id"]))
    return out


def refuse_if_active(run_dir: Path) -> None:
    """A run (or sweep) directory whose job is still queued or running can't take a new
    submission: the new plan.yaml would be what that job's next requeue reads."""
    run_dir = Path(run_dir)
    # every submission of this run or sweep: (job, array index or None)
    jobs: list[tuple[dict, int | None]] = [(job, None) for job in read_jobs(run_dir)]
    found = find_job(run_dir)
    if found and found[1] is not None:  # a point of a sweep: its array task
        jobs.append(found)
    live = [task for job, index in jobs for task in active_tasks(job, index)]
    if live:
        raise LaunchError(f"{run_dir} still has Slurm job(s) {', '.join(live)} queued or running; a new "
                          "submission would replace the plan that job resumes from", key="train.name",
                          value=run_dir.name, fix=f"wait for it (usp status {run_dir}), cancel it (usp cancel "
                          f"{run_dir}), or pick another name (train.name=... / --name)")


_UNHEALTHY = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWERED_DOWN")


def unhealthy_nodes(nodelist: str) -> dict[str, str]:
    """{node: state} for the nodes of `nodelist` that Slurm marks down, drained, failing or not
    responding (`*`); {} when all are healthy or Slurm can't be asked."""
    try:
        out = _slurm(["scontrol", "show", "node", "-o", nodelist], "read the node states")
    except LaunchError:
        return {}
    bad = {}
    for line in out.splitlines():
        fields = dict(_FIELD.findall(line))
        state = fields.get("State", "")
        if any(word in state for word in _UNHEALTHY) or state.endswith("*"):
            bad[fields.get("NodeName", "?")] = state
    return bad


def requeue(job_id: str) -> None:
    _slurm(["scontrol", "requeue", job_id], "requeue the job")


def cancel(job_id: str) -> None:
    _slurm(["scancel", job_id], "cancel the job")


def log_file(job: dict, index: int | str | None) -> Path:
    """The batch output of a job (of one array task when index is given)."""
    name = f"slurm-{job['job_id']}_{index}.out" if index is not None else f"slurm-{job['job_id']}.out"
    return Path(job["log_dir"]) / name


def _slurm(cmd: list[str], what: str) -> str:
    if shutil.which(cmd[0]) is None:
        raise SlurmMissing(f"`{cmd[0]}` not found: can't {what} without the Slurm client commands",
                          key="cluster.launcher", value="slurm",
                          fix="run on a Slurm login node, `scripts/local_slurm.sh start` for a local test cluster, "
                              "or --dry-run to only write the script")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LaunchError(f"`{' '.join(cmd)}` failed: {(proc.stderr or proc.stdout).strip()}",
                          key="cluster.slurm", fix="check the cluster.slurm settings (partition, account, time)")
    return proc.stdout
