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

from usp.errors import LaunchError
from usp.launch.local import plan_accelerator_env
from usp.perf.layout import layout_tag
from usp.run.files import EXIT_PREEMPTED, logs_dir

TEMPLATE = "job.sbatch.j2"
GPU_REQUESTS = ("gpus_per_node", "gres", "none")
_TIME = re.compile(r"^\d+(-\d+)?(:\d+){0,2}$")  # minutes | [D-]H[:M[:S]] | M:S (sbatch --time forms)
_PLAIN = re.compile(r"^[^\s'\"`$;\\]+$")  # one #SBATCH word: no spaces, quotes or shell characters
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def render_job(plans: list, plan_paths: list[Path], command: list[str], *, log_dir: Path | None = None,
               title: str | None = None, array_limit: int = 0) -> str:
    """The batch script for one run (one plan) or a job array (one plan per task; all plans
    must ask for the same nodes and processes). `command` is the usp command line, shown in
    a comment only."""
    first = plans[0]
    cluster = first.config["cluster"]
    slurm = cluster["slurm"]
    check_slurm_settings(slurm, first.device)
    for p in plans[1:]:
        if (p.nodes, p.procs_per_node) != (first.nodes, first.procs_per_node):
            raise LaunchError("the tasks of one job array must use the same nodes x processes",
                              key="cluster.nodes", value=p.nodes, fix="sweep over one node count per array")
    is_array = len(plans) > 1
    log_dir = Path(log_dir or default_log_dir(first))
    options = _sbatch_options(first, slurm)
    if is_array:
        options.append(f"--array=0-{len(plans) - 1}" + (f"%{array_limit}" if array_limit else ""))
    lead = int(slurm["signal_lead_s"])
    context = {
        "title": title or f"run {first.name}",
        "nodes": first.nodes, "procs_per_node": first.procs_per_node, "world_size": first.world_size,
        "layout": _layout(first),
        "command": _comment(shlex.join(command)),
        "job_name": _job_name(title or first.name),
        "sbatch_options": options,
        "sbatch_extra": list(slurm["sbatch_extra"]),
        "output": str(log_dir / ("slurm-%A_%a.out" if is_array else "slurm-%j.out")),
        "signal_lead_s": lead,
        "setup": list(slurm["setup"]),
        "threads_per_proc": first.threads_per_proc,
        "env": sorted({**plan_accelerator_env(first), **{str(k): str(v) for k, v in cluster["env"].items()}}.items()),
        "plans": [str(Path(p).resolve()) for p in plan_paths],
        "python": slurm.get("python") or sys.executable,
        "max_requeues": int(slurm["max_requeues"]),
        "rdzv_port": slurm["rdzv_port"],
        "shutdown_timeout_s": max(30, lead - 30),  # leave the ranks time to checkpoint before SIGKILL
        "srun_options": _srun_options(slurm),
        "exit_preempted": EXIT_PREEMPTED,  # "try again later": resubmitting resumes from the checkpoint
    }
    for key, _ in context["env"]:
        if not _ENV_KEY.match(key):
            raise LaunchError("not a valid environment variable name", key=f"cluster.env.{key}", value=key,
                              fix="letters, digits and _ (not starting with a digit)")
    return _environment().get_template(TEMPLATE).render(**context)


def default_log_dir(plan) -> Path:
    """cluster.slurm.log_dir (absolute: job.json is read from other directories), or <run_dir>/logs."""
    configured = plan.config["cluster"]["slurm"].get("log_dir")
    return Path(configured).expanduser().resolve() if configured else logs_dir(plan.run_dir)


def check_slurm_settings(slurm: dict, device: str) -> None:
    """Refuse, before anything is written or submitted, what sbatch would reject or misread."""
    def bad(key, value, why, fix):
        raise LaunchError(why, key=f"cluster.slurm.{key}", value=value, fix=fix)

    if not _TIME.match(str(slurm["time"])):
        bad("time", slurm["time"], "not a Slurm time limit", "cluster.slurm.time=HH:MM:SS (or D-HH:MM:SS, or minutes)")
    for key in ("partition", "account", "qos", "mem", "constraint", "container_image", "container_mounts"):
        value = slurm.get(key)
        if value is not None and not _PLAIN.match(str(value)):
            bad(key, value, "must be one word without spaces, quotes or shell characters",
                f"cluster.slurm.{key}=<value> (for anything else use cluster.slurm.sbatch_extra)")
    for i, option in enumerate(slurm["sbatch_extra"]):
        if not str(option).startswith("-") or "\n" in str(option):
            bad(f"sbatch_extra[{i}]", option, "each entry is one sbatch option on one line",
                "cluster.slurm.sbatch_extra=['--reservation=big']")
    for i, line in enumerate(slurm["setup"]):
        if "\n" in str(line):
            bad(f"setup[{i}]", line, "each entry is one shell line", "split it into several list entries")
    if slurm["gpu_request"] not in GPU_REQUESTS:
        bad("gpu_request", slurm["gpu_request"], f"must be one of {', '.join(GPU_REQUESTS)}",
            "cluster.slurm.gpu_request=gpus_per_node")
    if int(slurm["signal_lead_s"]) < 1:
        bad("signal_lead_s", slurm["signal_lead_s"], "the ranks need a warning before the time limit to checkpoint",
            "cluster.slurm.signal_lead_s=180")
    limit = _time_limit_s(str(slurm["time"]))
    if limit is not None and int(slurm["signal_lead_s"]) >= limit:
        bad("signal_lead_s", slurm["signal_lead_s"], f"is not shorter than the time limit ({slurm['time']})",
            "a lead of a few minutes, well inside cluster.slurm.time")
    if int(slurm["max_requeues"]) < 0:
        bad("max_requeues", slurm["max_requeues"], "must be 0 or more", "cluster.slurm.max_requeues=3")
    if slurm["rdzv_port"] is not None and not 1 <= int(slurm["rdzv_port"]) <= 65535:
        bad("rdzv_port", slurm["rdzv_port"], "not a TCP port", "cluster.slurm.rdzv_port=29500, or null for one per job")


def _sbatch_options(plan, slurm: dict) -> list[str]:
    out = [f"--{flag}={slurm[key]}" for key, flag in (("partition", "partition"), ("account", "account"),
                                                     ("qos", "qos")) if slurm.get(key)]
    out.append(f"--time={slurm['time']}")
    cpus = int(slurm["cpus_per_task"]) or plan.procs_per_node * plan.threads_per_proc
    out.append(f"--cpus-per-task={cpus}")
    if slurm.get("mem") is not None:
        out.append(f"--mem={slurm['mem']}")
    if plan.device != "cpu" and slurm["gpu_request"] == "gpus_per_node":
        out.append(f"--gpus-per-node={plan.procs_per_node}")
    elif plan.device != "cpu" and slurm["gpu_request"] == "gres":
        out.append(f"--gres=gpu:{plan.procs_per_node}")
    if slurm.get("constraint"):
        out.append(f"--constraint={slurm['constraint']}")
    if slurm["exclusive"]:
        out.append("--exclusive")
    return out


def _srun_options(slurm: dict) -> list[str]:
    out = []
    if slurm.get("container_image"):
        out.append(f"--container-image={slurm['container_image']}")
    if slurm.get("container_mounts"):
        out.append(f"--container-mounts={slurm['container_mounts']}")
    return out + [shlex.quote(str(o)) for o in slurm["srun_extra"]]


def _time_limit_s(text: str) -> int | None:
    """Seconds of a Slurm time limit, or None when the form is ambiguous to us."""
    days, _, rest = text.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, s = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + s
    if len(parts) == 1:
        return parts[0] * 60  # minutes
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]  # M:S
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def _layout(plan) -> str:
    b = plan.batch
    return (f"layout {layout_tag(plan.degrees)}; global batch {b.global_batch} = micro {b.micro_batch} "
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
