"""Everything `usp train` does before processes start: plan, refuse what can't run, check
the run directory and take its lock, make sure the tokenized data exists, write plan.yaml."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from usp.contract.plan_file import write_plan
from usp.errors import LaunchError
from usp.launch.checkpoints import check_checkpoint_dir, check_resume
from usp.launch.rendezvous import node_plan_path, node_rank
from usp.plan.plan import checked_plan
from usp.plan.render import render_plan
from usp.run import lock as runlock
from usp.run.lock import refuse_if_locked


def prepare_run(cfg, choices: dict, console: Console | None = None, prepare_data: bool = True,
                check: Callable | None = None, plan=None, hold_lock: bool = True):
    """prepare_data=False (a Slurm --dry-run): plan and write plan.yaml, tokenize nothing.
    check(plan): the launcher's own refusals, run before anything is written.
    plan: already built by checked_plan (a sweep point): not built or printed again.
    hold_lock: take the run lock (usp.run.lock) before writing anything, and keep it (the caller
    gives it back with runlock.release once the run ends); False (Slurm): only refuse a live run."""
    console = console or Console()
    if plan is None:
        plan = checked_plan(cfg, choices)
        render_plan(plan, console)
    if check is not None:
        check(plan)
    gpus = visible_nvidia_gpus() if plan.device == "cpu" and plan.config.cluster.launcher == "local" else 0
    if gpus:
        console.print(f"[yellow]note:[/] {gpus} NVIDIA GPU(s) visible here, but cluster.device=cpu: "
                      f"cluster=local_gpu cluster.procs_per_node={gpus} trains on them (bf16, NCCL)", highlight=False)
    if prepare_data and not plan.dataset_dir:  # a missing corpus is refused before the run directory is made
        from usp.data.tokenized import dataset_dir  # (the plan found its directory unless the data was missing)

        dataset_dir(cfg.data)
    made_run_dir = not Path(plan.run_dir).exists()
    run_dir = check_run_dir(Path(plan.run_dir))
    if not hold_lock:  # a Slurm job takes the lock when it starts; a live run here is refused now
        refuse_if_locked(run_dir, "submit")
        return _prepare(plan, cfg, run_dir, console, prepare_data)
    if node_rank(plan) > 0:  # several machines sharing the run directory: node 0 holds the run's lock
        return _prepare(plan, cfg, run_dir, console, prepare_data)
    runlock.acquire(run_dir, say=lambda msg: console.print(msg, markup=False, highlight=False))
    try:  # from here on the run directory is ours: give it back if preparing fails
        return _prepare(plan, cfg, run_dir, console, prepare_data)
    except BaseException:
        runlock.release(run_dir)
        if made_run_dir:  # e.g. the data failed: no empty run directory that `usp status` would list
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise


def _prepare(plan, cfg, run_dir: Path, console: Console, prepare_data: bool):
    check_resume(plan)  # an incompatible checkpoint, or nothing left to train: before plan.yaml is rewritten
    try:
        check_checkpoint_dir(plan)  # writable, with room for keep_last + 1 checkpoints
    except LaunchError as exc:
        if prepare_data:
            raise
        # A dry run may be written far from the cluster's file system: say it, don't stop.
        console.print(f"[yellow]warning (checked again on submit):[/] {exc}", highlight=False)

    if not prepare_data:
        return plan, write_plan(plan, node_plan_path(run_dir, plan))
    from usp.data.tokenized import ensure_dataset

    def warn(message: str) -> None:  # stays on the console: the status line is replaced
        console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False)

    with console.status("preparing data") as status:
        path, meta = ensure_dataset(cfg.data, progress=lambda msg: status.update(f"data: {msg}"), warn=warn)
    if meta.get("vocab_size", 0) > plan.model.vocab_size:
        raise LaunchError(f"the tokenizer has {meta['vocab_size']} tokens but the model only "
                          f"{plan.model.vocab_size}", key="model.vocab_size", value=plan.model.vocab_size,
                          fix="model.vocab_size=-1 (take it from the data)")
    console.print(f"data: {meta.get('n_train_tokens', 0):,} train tokens in {path}")
    plan.dataset_dir, plan.data_meta = str(path), dict(meta)
    return plan, write_plan(plan, node_plan_path(run_dir, plan))


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver sees (no torch, no nvidia-smi)


def visible_nvidia_gpus() -> int:
    try:
        return sum(1 for _ in NVIDIA_GPUS.iterdir())
    except OSError:
        return 0


def check_run_dir(run_dir: Path) -> Path:
    """Create the run directory, or say clearly why it can't be used."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"can't create the run directory {run_dir}: {exc.strerror}", key="train.runs_dir",
                          value=str(run_dir.parent), fix="train.runs_dir=<a writable directory>") from None
    if not os.access(run_dir, os.W_OK):
        raise LaunchError(f"the run directory {run_dir} is not writable", key="train.runs_dir",
                          value=str(run_dir.parent), fix="train.runs_dir=<a writable directory>")
    return run_dir
