"""`usp cancel`, `usp logs` and the Slurm part of `usp status`, for a run (or sweep) directory.
No torch."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from usp.errors import LaunchError
from usp.launch import slurm
from usp.run.files import logs_dir, rank_log, read_jobs
from usp.run.state import resolve_run_dir


def cancel_run(run_dir_arg: str | None, console: Console | None = None) -> list[str]:
    console = console or Console()
    run_dir = resolve_run_dir(run_dir_arg)
    found = slurm.find_job(run_dir)
    if found is None:
        raise LaunchError(f"{run_dir} has no Slurm job (job.json): it was not submitted with usp",
                          key="RUN_DIR", value=str(run_dir), fix="a run started with cluster=<slurm group>; "
                          "a local run stops with Ctrl-C")
    job, index = found
    if index is not None:  # one point of a sweep: its array task
        targets = [f"{job['job_id']}_{index}"]
    else:  # a run or a sweep: every submission of it still queued or running (a sweep may have several arrays)
        targets = [j["job_id"] for j in read_jobs(run_dir) or [job] if slurm.active_tasks(j)]
    if not targets:
        console.print(f"nothing to cancel: no Slurm job of {escape(str(run_dir))} is queued or running "
                      f"(usp status {escape(str(run_dir))})", highlight=False)
    for target in targets:
        slurm.cancel(target)
        console.print(f"cancelled Slurm job {target} ({escape(str(run_dir))})", highlight=False)
    return targets


def show_logs(run_dir_arg: str | None, rank: int | None = None, tail: int = 0, follow: bool = False) -> Path:
    """Print the batch output of the run's newest Slurm job, or a rank's log (logs/rank_<N>.log,
    also the only log of a local run)."""
    run_dir = resolve_run_dir(run_dir_arg)
    found = slurm.find_job(run_dir)
    if found is not None and found[1] is None and len(found[0]["plans"]) > 1:
        first = Path(found[0]["plans"][0]).parent
        raise LaunchError(f"{run_dir} is a sweep: each of its points has its own log", key="RUN_DIR",
                          value=str(run_dir), fix=f"usp logs {first} (one point; `usp report {run_dir}` for all)")
    if rank is None and found is not None:
        path = slurm.log_file(*found)
    else:
        path = rank_log(run_dir, rank or 0)
    if not path.is_file():
        what = "no output yet (the job may still be pending: usp status)" if found else "no such log"
        raise LaunchError(f"{path}: {what}", key="--rank" if rank is not None else "RUN_DIR",
                          value=rank if rank is not None else str(run_dir), fix=f"ls {logs_dir(run_dir)}")
    _print_file(path, tail, follow)
    return path


def slurm_table(run_dir: Path) -> Table | None:
    """The run's newest Slurm job as seen by scontrol; None when it was not submitted to Slurm."""
    found = slurm.find_job(run_dir)
    if found is None:
        return None
    job, index = found
    table = Table(title=f"slurm job {job['job_id']}", title_justify="left")
    for col in ("task", "state", "reason", "restarts", "run time", "nodes", "exit code"):
        table.add_column(col)
    try:
        states = slurm.job_states(job["job_id"])
    except LaunchError as exc:
        table.add_row("-", "unknown", escape(str(exc).splitlines()[0]), "", "", "", "")
        return table
    if index is not None:
        states = [s for s in states if s.get("ArrayTaskId") == str(index)] or states
    if not states:
        table.add_row("-", "finished", "no longer known to Slurm (see the run's state above)", "", "", "", "")
    for s in states:
        table.add_row(s.get("ArrayTaskId", "-"), s.get("JobState", "?"), s.get("Reason", ""), s.get("Restarts", ""),
                      s.get("RunTime", ""), s.get("NodeList", ""), s.get("ExitCode", ""))
    return table


def _print_file(path: Path, tail: int, follow: bool) -> None:
    with open(path, errors="replace") as f:
        lines = f.readlines()
        sys.stdout.writelines(lines[-tail:] if tail else lines)
        sys.stdout.flush()
        try:
            while follow:
                line = f.readline()
                if line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                else:
                    time.sleep(0.5)
        except KeyboardInterrupt:
            pass
