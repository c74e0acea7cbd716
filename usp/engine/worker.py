"""Worker entry point: `python -m usp.engine.worker --plan runs/<name>/plan.yaml`, started by
torchrun once per rank (or called in-process for a single rank). Reads only plan.yaml."""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from usp.contract.plan_file import read_plan
from usp.contract.run_plan import RunPlan
from usp.contract.typed import PlanFileError
from usp.data.data_error import DataError
from usp.data.tokenized import plan_data_meta
from usp.engine import PROCESS_STARTED, signals
from usp.engine.accel import apply_determinism
from usp.engine.observe.failure import record_failures, recorded
from usp.engine.parallel import mesh as udist
from usp.engine.startup_gc import freeze_imports
from usp.engine.trainer import Stopped, Trainer
from usp.errors import UspError
from usp.run import lock as runlock
from usp.run.files import (
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    METRICS,
    RESTART_EVENT,
    SAMPLE,
    STOP_EVENT,
    SUMMARY_BY_LAUNCHER_ENV,
    append_event,
)


@signals.handles_stop_signals  # SIGINT/SIGTERM/SIGUSR1: stop at a step boundary with a checkpoint
@record  # on failure torchrun reports this rank's traceback in its summary
@record_failures  # ... and logs/failure_rank<R>.json says where and why (read by `usp status`)
def run_worker(plan_path: str) -> int:
    """Train one rank; returns 0, or after a stop signal EXIT_INTERRUPTED (SIGINT) or EXIT_PREEMPTED."""
    plan = read_plan(Path(plan_path))  # rebuilt and checked against its types (usp/contract/plan_file.py)
    imported = time.time()
    ft = _replica_group(plan)  # fault_tolerance=torchft: this process trains in one replica group
    if ft is not None:
        plan = ft.group_plan(plan)
    torch.manual_seed(int(plan.config.train.seed))
    apply_determinism(plan)
    ctx = udist.setup(plan)
    if ft is not None:
        ctx = ft.group_context(ctx, plan, ft.replica_group(plan))
    met = time.time()
    clean, code, lock = False, 0, None
    try:
        if ctx.is_main:  # the launcher's run lock kept alive, or taken here (a Slurm job, torchrun by hand)
            lock = runlock.acquire(plan.run_dir, token=os.environ.get(runlock.TOKEN_ENV))
            lock.start_heartbeat()
        trainer = ft.ReplicaGroupTrainer(plan, ctx) if ft is not None else Trainer(plan, ctx)
        trainer.startup.update(process_started=PROCESS_STARTED, imports_s=imported - PROCESS_STARTED,
                               rendezvous_s=met - imported)
        _log_placement(ctx, plan)
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restarts and ctx.is_main:
            append_event(trainer.run_dir, RESTART_EVENT, restart=restarts, resumed_from_step=trainer.start_step)
        try:
            summary = trainer.fit()
        except Stopped as stop:
            summary, code = None, EXIT_INTERRUPTED if stop.signal == "SIGINT" else EXIT_PREEMPTED
            if ctx.is_main:
                append_event(trainer.run_dir, STOP_EVENT, step=stop.step, signal=stop.signal, checkpoint=stop.saved)
                print(f"usp: {stop}", flush=True)
        if summary is not None and ctx.is_main:
            _final_report(trainer, summary)
        # Free DDP (its Reducer holds the process group) while the group is still alive:
        # otherwise gloo's destructor runs inside the Reducer's dealloc with the GIL held and
        # deadlocks joining its worker thread.
        del trainer
        clean = True
    finally:
        if lock is not None:
            lock.release()
        udist.teardown(clean)
    return code


def _replica_group(plan: RunPlan):
    """usp/engine/fault_tolerance.py when the plan says fault_tolerance=torchft, else None."""
    if plan.fault_tolerance is None:
        return None
    from usp.engine import fault_tolerance

    return fault_tolerance


def _log_placement(ctx, plan: RunPlan) -> None:
    """Where this rank landed (as torchrun/Slurm placed it) next to where the plan put it, and
    the cluster.env values as this process sees them: the first thing to read when a multi-node
    launch misbehaves."""
    import logging

    rank, log = ctx.rank, logging.getLogger(f"usp.rank{ctx.rank}")  # logs/rank_<R>.log (usp.engine.observe.console)
    planned = plan.ranks[rank]
    env = os.environ
    log.info("placement: rank %d local_rank %s node_rank %s host %s slurm_node %s slurm_restart %s | plan: "
             "node %s local_rank %s", rank, env.get("LOCAL_RANK", "0"), env.get("GROUP_RANK", "0"),
             os.uname().nodename, env.get("SLURMD_NODENAME", "-"), env.get("SLURM_RESTART_COUNT", "-"),
             planned.node, planned.local_rank)
    log.info("garbage collector: %s, %d objects frozen at start-up (usp/engine/startup_gc.py)",
             "on" if gc.isenabled() else "OFF", gc.get_freeze_count())
    for key in plan.config.cluster.env:
        value = env.get(key)
        if value is not None and _SECRET.search(key):  # logs get shared in bug reports: never a token
            value = f"<{len(value)} characters, hidden>"
        log.info("env: %s=%r", key, value)


_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def _final_report(trainer: Trainer, summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="summary", show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column()
    val = summary["final_val_loss"]
    rows = [("steps", f"{summary['steps']}"), ("tokens", f"{summary['tokens']:,}"),
            ("time", f"{summary['time_s']:.1f} s"), ("tokens/s", _fmt(summary["tokens_per_s"], ",.0f")),
            ("train loss", f"{_fmt(summary['first_loss'], '.4f')} -> {_fmt(summary['final_loss'], '.4f')}"
                           + (f" (resumed at step {summary['resumed_from_step']})"
                              if summary.get("resumed_from_step") else "")),
            ("val loss", f"{val:.4f}" if val is not None else "-"),
            ("metrics", str(trainer.run_dir / METRICS))]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    text = _sample_text(trainer)
    if text is not None:
        console.print(f"[bold]sample[/] (prompt {trainer.cfg.train.sample_prompt!r}):")
        console.print(text, markup=False, highlight=False)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _sample_text(trainer: Trainer) -> str | None:
    from usp.data.tokenizer import load_tokenizer
    from usp.engine.sample import generate

    train = trainer.cfg.train
    if train.sample_tokens <= 0 or trainer.meta.get("tokenizer") in (None, "none"):
        return None
    if not _whole_model_on_rank0(trainer):
        return None
    tok = load_tokenizer(Path(trainer.plan.dataset_dir))
    prompt = tok.encode(train.sample_prompt)
    out = generate(trainer.raw_model, prompt, int(train.sample_tokens), trainer.seq_len, int(train.seed))
    text = train.sample_prompt + tok.decode(out)
    (trainer.run_dir / SAMPLE).write_text(text + "\n")
    return text


def _whole_model_on_rank0(trainer: Trainer) -> bool:
    """Sampling runs on rank 0 alone: only when its model is whole (not sharded or pipelined)."""
    deg = trainer.ctx.degrees
    return (trainer.raw_model is not None and max(deg["tp"], deg["pp"], deg["cp"]) == 1
            and trainer.plan.parallel.ep == 1 and trainer.plan.decisions.dp_kind in ("none", "ddp", "zero1"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="usp.engine.worker")
    parser.add_argument("--plan", required=True, help="path to plan.yaml")
    path = parser.parse_args(argv).plan
    try:  # a plan.yaml this usp can't read, or a saved plan without its data: say so before starting
        plan_data_meta(read_plan(Path(path)))
    except (DataError, PlanFileError) as exc:
        print(f"usp: error on rank {os.environ.get('RANK', '0')}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        sys.exit(run_worker(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        record = recorded(exc)  # logs/failure_rank<R>.json and the rank's log hold the traceback
        if record is None and not isinstance(exc, UspError):
            raise
        if os.environ.get(SUMMARY_BY_LAUNCHER_ENV) != "1":  # else `usp train` shows the root cause after
            where = f" (traceback: {record})" if record and not isinstance(exc, UspError) else ""
            print(f"usp: error on rank {os.environ.get('RANK', '0')}: {exc}{where}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    freeze_imports()  # the imports above ran with the collector paused (usp/engine/__init__.py)
    main()
