"""Render <run_dir>/job.sbatch from usp/launch/templates/job.sbatch.j2 (no torch).

Nodes, processes per node and GPUs come from the plan; the rest from cluster.slurm. Values
that land in the script are checked first (a bad one is a LaunchError naming the key), and
every value used as a shell word is quoted. Overrides never appear as shell words at all:
the ranks read them from plan.yaml."""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from usp.contract.config_schema import SlurmConfig
from usp.contract.typed import plain
from usp.errors import LaunchError
from usp.launch.local import plan_accelerator_env
from usp.plan.rules import field_failures
from usp.run.files import EXIT_PREEMPTED, logs_dir

TEMPLATE = "job.sbatch.j2"
LIGHTHOUSE_TEMPLATE = "lighthouse.sbatch.j2"
LIGHTHOUSE_WAIT_S = 600  # a replica group's task waits this long for the lighthouse job's address


def render_job(plans: list, plan_paths: list[Path], command: list[str], *, log_dir: Path | None = None,
               title: str | None = None, array_limit: int = 0, lighthouse_file: Path | None = None) -> str:
    """The batch script for one run (one plan) or a job array (one plan per task; all plans
    must ask for the same nodes and processes). `command` is the usp command line, shown in
    a comment only."""
    first = plans[0]
    cluster = first.config.cluster
    slurm = cluster.slurm
    check_slurm_settings(cluster)
    for p in plans[1:]:
        if (p.nodes, p.procs_per_node) != (first.nodes, first.procs_per_node):
            raise LaunchError("the tasks of one job array must use the same nodes x processes",
                              key="cluster.nodes", value=p.nodes, fix="sweep over one node count per array")
    is_array = len(plans) > 1
    log_dir = Path(log_dir or default_log_dir(first))
    options = _sbatch_options(first, slurm)
    if is_array:
        options.append(f"--array=0-{len(plans) - 1}" + (f"%{array_limit}" if array_limit else ""))
    lead = int(slurm.signal_lead_s)
    own_env = {str(k): str(v) for k, v in cluster.env.items()}  # cluster.env: the ranks' own settings win
    context = {
        "title": title or f"run {first.name}",
        "nodes": first.nodes, "procs_per_node": first.procs_per_node, "world_size": first.world_size,
        "layout": _layout(first),
        "command": _comment(shlex.join(command)),
        "job_name": _job_name(title or first.name),
        "sbatch_options": options,
        "sbatch_extra": list(slurm.sbatch_extra),
        "output": str(log_dir / ("slurm-%A_%a.out" if is_array else "slurm-%j.out")),
        "signal_lead_s": lead,
        "setup": list(slurm.setup),
        "threads_per_proc": first.threads_per_proc,
        "env": sorted({**plan_accelerator_env(first, own_env), **own_env}.items()),
        "plans": [str(Path(p).resolve()) for p in plan_paths],
        "python": slurm.python or sys.executable,
        "max_requeues": int(slurm.max_requeues),
        "rdzv_port": slurm.rdzv_port,
        "shutdown_timeout_s": max(30, lead - 30),  # leave the ranks time to checkpoint before SIGKILL
        "srun_options": _srun_options(slurm),
        "exit_preempted": EXIT_PREEMPTED,  # "try again later": resubmitting resumes from the checkpoint
        "ft": lighthouse_file is not None,  # fault_tolerance=torchft: one array task per replica group
        "lighthouse_file": str(lighthouse_file or ""),
        "lighthouse_wait_s": LIGHTHOUSE_WAIT_S,
    }
    return _environment().get_template(TEMPLATE).render(**context)


def default_log_dir(plan) -> Path:
    """cluster.slurm.log_dir (absolute: job.json is read from other directories), or <run_dir>/logs."""
    configured = plan.config.cluster.slurm.log_dir
    return Path(configured).expanduser().resolve() if configured else logs_dir(plan.run_dir)


def check_slurm_settings(cluster) -> None:
    """Refuse, before anything is written or submitted, what sbatch would reject or misread: the
    cluster.slurm and cluster.env rules of usp.plan.rules (the plan checked them too; a saved plan
    is checked again)."""
    found = field_failures({"cluster": {"launcher": "slurm", "slurm": plain(cluster.slurm), "env": dict(cluster.env)}})
    if found:
        raise LaunchError(found[0].why, key=found[0].key, value=found[0].value, fix=found[0].fix)


def _sbatch_options(plan, slurm: SlurmConfig) -> list[str]:
    out = [f"--{key}={getattr(slurm, key)}" for key in ("partition", "account", "qos") if getattr(slurm, key)]
    out.append(f"--time={slurm.time}")
    cpus = int(slurm.cpus_per_task) or plan.procs_per_node * plan.threads_per_proc
    out.append(f"--cpus-per-task={cpus}")
    if slurm.mem is not None:
        out.append(f"--mem={slurm.mem}")
    if plan.device != "cpu" and slurm.gpu_request == "gpus_per_node":
        out.append(f"--gpus-per-node={plan.procs_per_node}")
    elif plan.device != "cpu" and slurm.gpu_request == "gres":
        out.append(f"--gres=gpu:{plan.procs_per_node}")
    if slurm.constraint:
        out.append(f"--constraint={slurm.constraint}")
    if slurm.exclusive:
        out.append("--exclusive")
    return out


def _srun_options(slurm: SlurmConfig) -> list[str]:
    out = []
    if slurm.container_image:
        out.append(f"--container-image={slurm.container_image}")
    if slurm.container_mounts:
        out.append(f"--container-mounts={slurm.container_mounts}")
    return out + [shlex.quote(str(o)) for o in slurm.srun_extra]


def _layout(plan) -> str:
    b = plan.batch
    return (f"layout {plan.parallel.label(with_ep=False)}; global batch {b.global_batch} = micro {b.micro_batch} "
            f"x grad-accum {b.grad_accum} x dp {b.dp}; {plan.device}/{plan.backend}")


def _job_name(name: str) -> str:
    return ("usp-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", name))[:64]


def _comment(text: str) -> str:
    """Keep the text on the one comment line: a newline would end the comment."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def render_lighthouse(plan, array_job: str, *, log_dir: Path) -> str:
    """The lighthouse's batch script (fault_tolerance=torchft): one CPU on one node, the lighthouse and the
    watch over the replica groups' array job `array_job` (usp/launch/lighthouse.py)."""
    slurm = plan.config.cluster.slurm
    options = [f"--{key}={getattr(slurm, key)}" for key in ("partition", "account", "qos") if getattr(slurm, key)]
    context = {"job_name": _job_name(f"{plan.name}-lighthouse"), "options": options, "time": slurm.time,
               "output": str(log_dir / "slurm-%j.out"), "setup": list(slurm.setup),
               "python": slurm.python or sys.executable, "run_dir": str(Path(plan.run_dir).resolve()),
               "array_job": array_job, "title": f"torchft lighthouse of run {plan.name}"}
    return _environment().get_template(LIGHTHOUSE_TEMPLATE).render(**context)
