"""`usp submit` / `usp train cluster=<slurm group>`: the planned run becomes
<run_dir>/job.sbatch and, unless --dry-run, a Slurm job. No torch."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from usp.launch import slurm
from usp.launch.slurm_script import check_slurm_settings, default_log_dir, render_job
from usp.run.files import JOB_SCRIPT, LOGS


def check_submittable(plan) -> None:
    """Before plan.yaml is written: settings sbatch would reject, and a job of this run that is
    still queued or running (its next requeue would read the new plan)."""
    check_slurm_settings(plan.config.cluster)
    slurm.refuse_if_active(Path(plan.run_dir))


def submit_run(plan, plan_path: Path, command: list[str], *, dry_run: bool = False,
               console: Console | None = None) -> str | None:
    """Write the batch script next to plan.yaml and sbatch it. Returns the job id (None: dry run)."""
    console = console or Console()
    run_dir = Path(plan.run_dir)
    log_dir = default_log_dir(plan)
    if plan.fault_tolerance is not None and not dry_run:
        from usp.launch.ft_slurm import submit_replica_groups

        return submit_replica_groups(plan, plan_path, command, log_dir, console)
    if plan.fault_tolerance is not None:
        from usp.launch.ft_slurm import replica_group_script

        text = replica_group_script(plan, plan_path, command, log_dir)
    else:
        text = render_job([plan], [plan_path], command, log_dir=log_dir)
    script = slurm.write_script(text, run_dir / JOB_SCRIPT)
    if dry_run:
        log_dir.mkdir(parents=True, exist_ok=True)  # for a later `sbatch job.sbatch` (slurm.submit makes it too)
        print(text, end="", flush=True)  # plain, so it can be copied or piped
        console.print(escape(f"dry run: wrote {script} (not submitted). The data is not prepared: submit "
                             f"with the same command without --dry-run (or `usp prepare-data` first, then "
                             f"sbatch {script})"),
                      highlight=False, soft_wrap=True)
        return None
    job_id = slurm.submit(script, [plan_path], log_dir, run_dir)
    name = escape(str(run_dir))
    console.print(f"[bold green]submitted[/] Slurm job {job_id}: {plan.nodes} node(s) x {plan.procs_per_node} "
                  f"process(es)", highlight=False)
    output = slurm.log_file({"job_id": job_id, "log_dir": str(log_dir)}, None)
    console.print(f"  script  {escape(str(script))}\n  output  {escape(str(output))}"
                  f"\n  ranks   {name}/{LOGS}/rank_<N>.log\n  follow  usp logs {name}\n  status  usp status {name}"
                  f"\n  cancel  usp cancel {name}", highlight=False, soft_wrap=True)
    return job_id
