"""`usp sweep ... cluster=<slurm group>`: the accepted points of a sweep become one Slurm job
array (`--array=0-N[%max]`), each task reading its own plan.yaml. Points that ask for
different nodes x processes can't share an array: one array per shape. No torch.

Point statuses in sweep.json become `submitted` (with `slurm_job` = "<array id>_<task>");
usp.run.sweep_record.refresh_statuses later reads each run directory (summary.json: done; failure
records: failed) so reports see what the jobs did."""
from __future__ import annotations

import io
from collections import defaultdict

from rich.console import Console
from rich.markup import escape

from usp.errors import UspError, one_line
from usp.launch import slurm
from usp.launch.checkpoints import RunAlreadyDone
from usp.launch.slurm_script import check_slurm_settings, render_job
from usp.run.files import JOB_SCRIPT, logs_dir


def submit_sweep_slurm(sweep, console: Console | None = None, *, max_parallel: int = 0,
                       dry_run: bool = False) -> int:
    """Prepare every accepted point (plan.yaml, data) and submit one array per node shape.
    Returns the number of points that could not be prepared."""
    from usp.launch.pre_launch import prepare_run

    console = console or Console()
    first = sweep.accepted[0].cfg.cluster
    check_slurm_settings(first)  # before any plan is written
    groups, failed = defaultdict(list), 0
    for point in sweep.accepted:
        if point.status == "done":
            continue
        try:
            plan, plan_path = prepare_run(point.cfg, point.choices, console=Console(file=io.StringIO()),
                                          plan=point.plan, prepare_data=not dry_run, hold_lock=False)
        except UspError as exc:
            point.status, point.reason, failed = "failed", one_line(exc), failed + 1
            continue
        except RunAlreadyDone:  # its checkpoint is at train.steps already
            point.status = "done"
            continue
        groups[(plan.nodes, plan.procs_per_node)].append((point, plan, plan_path))
    log_dir = logs_dir(sweep.dir)
    for _n, ((nodes, procs), members) in enumerate(sorted(groups.items())):
        script_name = JOB_SCRIPT if len(groups) == 1 else f"job_{nodes}x{procs}.sbatch"
        text = render_job([m[1] for m in members], [m[2] for m in members],
                          ["usp", "sweep", *([f"conf={sweep.conf}"] if sweep.conf else []), *sweep.base_overrides,
                           *(f"{k}={','.join(v)}" for k, v in sweep.swept.items())],
                          log_dir=log_dir, title=f"sweep {sweep.name}, {len(members)} task(s)",
                          array_limit=max_parallel)
        script = slurm.write_script(text, sweep.dir / script_name)
        if dry_run:
            console.print(escape(f"dry run: wrote {script} ({len(members)} task(s)); submit it with: sbatch {script}"),
                          highlight=False, soft_wrap=True)
            continue
        job_id = slurm.submit(script, [m[2] for m in members], log_dir, sweep.dir)
        for task, (point, _, _) in enumerate(members):
            point.status, point.reason = "submitted", None
            point.info["slurm_job"] = f"{job_id}_{task}" if len(members) > 1 else job_id  # one task: no array
        console.print(f"[bold green]submitted[/] Slurm job array {job_id}: {len(members)} task(s) of {nodes} node(s) "
                      f"x {procs} process(es)" + (f", at most {max_parallel} at once" if max_parallel else ""),
                      highlight=False)
        output = slurm.log_file({"job_id": job_id, "log_dir": str(log_dir)}, "<task>" if len(members) > 1 else None)
        console.print(escape(f"  script {script}\n  output {output}\n"
                             f"  status usp status {sweep.dir}  |  results usp report {sweep.dir}  |  "
                             f"cancel usp cancel {sweep.dir}"), highlight=False, soft_wrap=True)
    sweep.write()
    return failed
