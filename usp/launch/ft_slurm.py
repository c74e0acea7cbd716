"""fault_tolerance=torchft on Slurm (docs/fault_tolerance.md): one array job, a task per replica group, and
the lighthouse's own small job. No torch.

The array is submitted held, then the lighthouse's job (which needs the array's id to watch it), then the
array is released. Each task waits for the lighthouse's address in <run_dir>/ft/lighthouse.json, trains
its group, and when its step fails (a rank lost) requeues itself; the lighthouse's job requeues a task that
was cancelled or failed otherwise, until the run completes (cluster.slurm.max_requeues per task). Both
jobs are recorded in job.json, the lighthouse's first: `usp cancel` cancels it before the groups."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from usp.launch import slurm
from usp.launch.slurm_script import render_job, render_lighthouse
from usp.run.files import JOB_SCRIPT, lighthouse_path

LIGHTHOUSE_SCRIPT = "lighthouse.sbatch"


def replica_group_script(plan, plan_path: Path, command: list[str], log_dir: Path) -> str:
    """The array job's script: one task per replica group, each asking for one group's nodes and ranks."""
    ft = plan.fault_tolerance
    group = dataclasses.replace(plan, nodes=ft.group_nodes, procs_per_node=ft.group_procs_per_node,
                                world_size=ft.group_world_size)
    return render_job([group] * ft.replica_groups, [plan_path] * ft.replica_groups, command, log_dir=log_dir,
                      title=f"run {plan.name}: {ft.replica_groups} torchft replica groups",
                      lighthouse_file=lighthouse_path(plan.run_dir))


def submit_replica_groups(plan, plan_path: Path, command: list[str], log_dir: Path, console: Console) -> str:
    run_dir = Path(plan.run_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    lighthouse_path(run_dir).unlink(missing_ok=True)  # a killed lighthouse's address is no one's now
    script = slurm.write_script(replica_group_script(plan, plan_path, command, log_dir), run_dir / JOB_SCRIPT)
    array = slurm._slurm(["sbatch", "--parsable", "--hold", str(script)], "submit the replica groups").strip()
    array = array.split(";")[0]
    try:
        text = render_lighthouse(plan, array, log_dir=log_dir)
        lighthouse_script = slurm.write_script(text, run_dir / LIGHTHOUSE_SCRIPT)
        lighthouse_job = slurm.submit(lighthouse_script, [plan_path], log_dir, run_dir)
        slurm.record(run_dir, array, script, log_dir, [plan_path])  # one run: `usp cancel` cancels every task
        slurm._slurm(["scontrol", "release", array], "release the replica groups")
    except BaseException:
        slurm.cancel(array)
        raise
    console.print(f"[bold green]submitted[/] Slurm job {array}: {plan.fault_tolerance.replica_groups} torchft replica "
                  f"groups (array) of {plan.fault_tolerance.group_world_size} process(es), and the lighthouse's "
                  f"job {lighthouse_job}", highlight=False)
    name = escape(str(run_dir))
    console.print(f"  scripts {escape(str(script))}, {escape(str(lighthouse_script))}\n  output  "
                  f"{escape(str(log_dir))}/slurm-{array}_<group>.out\n  status  usp status {name}\n  cancel  "
                  f"usp cancel {name}", highlight=False, soft_wrap=True)
    return array
