"""`usp status [RUN_DIR]`: what happened to a run, read from its run directory alone (no torch).
Which state the run is in and which failure is the root cause: usp/run/state.py; here, how it is
shown (and `usp train`'s summary after a failed run)."""
from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from usp.contract.plan_file import read_plan_if_any
from usp.contract.run_plan import RunPlan
from usp.launch.hang_status import hang_text, render_hang, straggler_text
from usp.launch.jobs import slurm_table
from usp.run import checksums
from usp.run.files import (
    HANG_EVENT,
    LOST_PEER,
    METRICS,
    STRAGGLER_EVENT,
    events_path,
    list_checkpoints,
    metrics_path,
    rank_log,
    read_jobs,
    read_jsonl,
    run_checkpoint_dir,
)
from usp.run.lock import LockInfo, read_lock
from usp.run.state import (
    COMPLETED,
    FAILED,
    HUNG,
    RUNNING,
    FailureReport,
    analyse_failures,
    hang_event,
    is_preemption,
    resolve_run_dir,
    run_state,
    stop_event,
)

_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


# -- formatting ------------------------------------------------------------------------------

def _coords(coords: dict | None, degrees: dict | None) -> str:
    if not coords:
        return "-"
    shown = {d: c for d, c in coords.items() if not degrees or int(degrees.get(d, 1)) > 1}
    return " ".join(f"{d}={c}" for d, c in shown.items()) or "single process"


def _stages(record: dict, plan: RunPlan | None) -> str:
    stages = record.get("stages")
    if stages is None and plan is not None and plan.pipeline is not None and record.get("coords"):
        stages = plan.pipeline.rank_stages[int(record["coords"].get("pp", 0))]
    return ", ".join(str(s) for s in stages) if stages else "-"


def _when(t) -> str:
    try:
        return datetime.fromtimestamp(float(t)).strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError, OSError):
        return "?"


def _first_line(text: str | None, limit: int = 300) -> str:
    """First line of a message, shortened, with rich markup escaped ("[pair.cc:553] ..." is text)."""
    lines = (text or "").strip().splitlines()
    line = _SOURCE_PREFIX.sub("", lines[0]) if lines else ""  # "[/…/gloo/…/pair.cc:553] Connection closed…"
    return escape(line if len(line) <= limit else line[:limit] + "…")


def _fix(text: str | None) -> str | None:
    """The fix of a UspError's message ("<message>\n  fix: <fix>"), if it has one."""
    _, found, fix = (text or "").partition("\n  fix: ")
    return escape(" ".join(fix.split())) if found else None


def _last_log_line(run_dir: Path, rank: int) -> str:
    path = rank_log(run_dir, rank)
    if not path.is_file():
        return "(no log)"
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return _first_line(lines[-1], 160) if lines else "(empty log)"


def _ranks(items: list) -> str:
    return ", ".join(str(i) for i in items)


# -- rendering -------------------------------------------------------------------------------

def render_failure(run_dir: Path, plan: RunPlan | None, report: FailureReport, console: Console) -> None:
    """The root cause as a table, then what followed from it."""
    degrees = plan.degrees if plan is not None else None
    root = report.root
    show_root = root is not None and not (root.get("error_class") == LOST_PEER and report.silent)
    if show_root and root is not None:
        table = Table(title="root cause", show_header=False, title_justify="left", title_style="bold red")
        table.add_column(style="bold cyan")
        table.add_column(overflow="fold")
        step = root.get("last_completed_step")
        rows = [("failing rank", str(root.get("rank"))),
                ("node", f"{root.get('node')} ({root.get('host', '?')}), local rank {root.get('local_rank')}"),
                ("mesh coordinates", _coords(root.get("coords"), degrees)),
                ("pipeline stage", _stages(root, plan)),
                ("error class", str(root.get("error_class"))),
                ("exception", str(root.get("exception_type"))),
                ("message", _first_line(root.get("message"))),
                *([("fix", _fix(root.get("message")))] if _fix(root.get("message")) else []),
                ("last completed step", "-" if step is None else str(step)),
                ("time", _when(root.get("unix_time"))),
                ("details", escape(f"{root['_path']} (traceback), {rank_log(run_dir, int(root.get('rank', 0)))}"))]
        for k, v in rows:
            table.add_row(k, v)
        console.print(table)
    others = report.secondary if show_root else [f for f in (root, *report.secondary) if f]
    if others:
        console.print(("[dim]then:[/] " if show_root else "[dim]seen by the other ranks:[/] ") + "; ".join(
            f"rank {f.get('rank')}: {f.get('error_class')} after step {f.get('last_completed_step', '-')} "
            f"({_first_line(f.get('message'), 80)})" for f in others), highlight=False)
    if report.silent:
        ranks = [r.rank for r in report.silent]
        primary = root is not None and root.get("error_class") != LOST_PEER
        also = f", or torchrun stopping the other ranks after rank {(root or {}).get('rank')} failed" if primary else ""
        style = "bold red" if report.lost_peer_seen and not primary else "yellow"
        console.print(f"[{style}]rank(s) {_ranks(ranks)} died without a Python traceback[/] (killed by a signal, "
                      f"e.g. the OOM killer or SIGKILL{also})", highlight=False)
        if not primary:
            console.print("[bold]likely root cause:[/] the rank(s) that died without a traceback"
                          + (" (the others lost them as peers)" if report.lost_peer_seen else "")
                          + "; look for OOM kills (`dmesg`, the scheduler's log) on their node(s)", highlight=False)
        table = Table(title="ranks without a failure record", title_justify="left")
        for col in ("rank", "node", "local rank", "mesh coordinates", "pipeline stage", "last log line"):
            table.add_column(col, overflow="fold")
        for r in report.silent[:16]:
            table.add_row(str(r.rank), str(r.node), str(r.local_rank),
                          _coords(r.coords, degrees), _stages({"coords": r.coords}, plan),
                          _last_log_line(run_dir, r.rank))
        if len(report.silent) > 16:
            table.caption = f"{len(report.silent)} ranks; first 16 shown"
        console.print(table)


def print_failure_summary(run_dir, console: Console | None = None) -> bool:
    """What `usp train` prints after a failed run. False when there is no failure record."""
    console = console or Console(stderr=True)
    run_dir = Path(run_dir)
    plan = read_plan_if_any(run_dir)
    report = analyse_failures(run_dir, plan)
    if not report.failed:
        return False
    render_failure(run_dir, plan, report, console)
    console.print(f"[dim]more: usp status {escape(str(run_dir))}[/]", highlight=False)
    return True


def show_status(run_dir_arg: str | None = None, console: Console | None = None) -> int:
    """Print the status of a run; 1 when it failed, else 0."""
    console = console or Console()
    run_dir = resolve_run_dir(run_dir_arg)
    plan = read_plan_if_any(run_dir)
    report = analyse_failures(run_dir, plan)
    events = read_jsonl(events_path(run_dir))
    lock = read_lock(run_dir)  # read once: a lock released between two reads would read "stopped"
    state = run_state(run_dir, report, lock, events)
    console.print(_run_table(run_dir, plan, _state_text(run_dir, state, events, lock), report, events))
    job_table = slurm_table(run_dir)
    if job_table is not None:
        console.print(job_table)
    _render_checkpoints(run_dir, plan, console)
    if state == FAILED:
        render_failure(run_dir, plan, report, console)
    if state == HUNG:  # restartable, like a stop: exit code 0
        render_hang(run_dir, plan, console)
    return 1 if state == FAILED else 0


def _state_text(run_dir: Path, state: str, events: list[dict], lock: LockInfo | None) -> str:
    if state == COMPLETED:
        return "[bold green]completed[/]"
    if state == FAILED:
        return "[bold red]failed[/]"
    hang = hang_event(events)
    if state == HUNG and hang is not None:
        return "[bold red]hung[/] " + escape(f"({hang_text(run_dir, hang, bool(read_jobs(run_dir)))})")
    if state == RUNNING and lock is not None:
        return escape(f"running ({lock.owner()}; {lock.reason})")
    text = "[yellow]stopped[/] (not finished, and no live process holds the run lock"
    text += escape(f": {lock.owner()}, {lock.reason})" if lock is not None else ")")
    stop = stop_event(events)
    if read_jobs(run_dir) and stop is None:
        text += "; its Slurm job may still be queued (below)"
    if stop is not None:
        text += escape(f" ({_stop_text(stop, bool(read_jobs(run_dir)))})")
    return text


def _stop_text(stop: dict, slurm: bool) -> str:
    """The ranks' stop on a signal, as `usp status` words it."""
    what = "preempted" if "signal" not in stop else f"stopped by {stop['signal']}"
    kept = "" if stop.get("checkpoint", True) else " without a checkpoint"
    if slurm and is_preemption(stop):  # a Slurm job requeues itself; a local run needs the user
        how = "its Slurm job requeues and resumes by itself"
    else:
        how = "resume by running the same command"
    when = "before the first step" if stop.get("step") == 0 else f"after step {stop.get('step')}{kept}"
    return f"{what} {when}; {how}"


def _run_table(run_dir: Path, plan: RunPlan | None, state: str, report: FailureReport, events: list[dict]) -> Table:
    table = Table(title=escape(f"run: {plan.name if plan is not None else run_dir.name}"), show_header=False,
                  title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column(overflow="fold")
    table.add_row("run dir", escape(str(run_dir)))
    if plan is not None:
        table.add_row("world", f"{plan.world_size} = {plan.nodes} node(s) x {plan.procs_per_node} process(es), "
                               f"{plan.device}/{plan.backend}")
        table.add_row("layout", plan.parallel.describe())
    else:
        table.add_row("plan", "no plan.yaml (not a run directory, or not launched yet)")
    table.add_row("state", state)
    table.add_row("last logged step", _last_step(run_dir, plan))
    stragglers = straggler_text(run_dir)
    if stragglers is not None:
        table.add_row("stragglers", escape(stragglers))
    _event_rows(table, events)
    if report.earlier:
        table.add_row("earlier failures", f"{len(report.earlier)} failure record(s) from before the latest launch "
                                          "or restart (recovered or superseded)")
    return table


def _last_step(run_dir: Path, plan: RunPlan | None) -> str:
    metrics = [m for m in read_jsonl(metrics_path(run_dir)) if "step" in m]
    if not metrics:
        return f"none (no {METRICS} yet)"
    total = plan.config.train.steps if plan is not None else None
    last = metrics[-1]
    loss = last.get("loss")
    if not isinstance(loss, (int, float)):
        return f"{last['step']}"
    val = f", val loss {last['val_loss']:.4f}" if isinstance(last.get("val_loss"), (int, float)) else ""
    return f"{last['step']}{f' / {total}' if total else ''}: loss {loss:.4f}{val}"


def _event_rows(table: Table, events: list[dict]) -> None:
    restarts = [e for e in events if e.get("event") == "restart"]
    table.add_row("restarts", "none" if not restarts else "; ".join(
        f"#{e.get('restart', '?')} at {_when(e.get('time'))}"
        + (f", resumed from step {e['resumed_from_step']}" if e.get("resumed_from_step") is not None else "")
        for e in restarts))
    others = [e for e in events if e.get("event") not in (None, "restart")]
    if others:
        table.add_row("events", escape("; ".join(_event_text(e) for e in others[-5:])))


def _event_text(e: dict) -> str:
    when = _when(e.get("time"))
    if e["event"] == HANG_EVENT:
        ranks = ", ".join(str(r) for r in e.get("stuck") or []) or "none named"
        where = e.get("where") or f"in step {e.get('step')}"
        group = f" of replica group {e['replica_group']}" if e.get("replica_group") is not None else ""
        return (f"hung at {when}: rank(s) {ranks}{group} {where}, "
                f"{'cleared' if e.get('cleared') else 'stuck'} after {e.get('stalled_s')} s")
    if e["event"] == STRAGGLER_EVENT:
        return f"straggler at {when}: rank {e.get('rank')}, {e.get('ratio')}x its peers at step {e.get('step')}"
    return f"{e['event']} at {when}" + "".join(f", {k} {v}" for k, v in e.items() if k not in ("event", "time"))


def _render_checkpoints(run_dir: Path, plan: RunPlan | None, console: Console) -> None:
    if plan is not None and not plan.config.checkpoint.enabled:
        console.print("checkpoints: disabled (checkpoint.enabled=false)")
        return
    where = run_checkpoint_dir(run_dir, plan.config.checkpoint.dir if plan is not None else None)
    found = list_checkpoints(where)
    if not found:
        console.print(f"checkpoints: none in {escape(str(where))}", highlight=False)
        return
    table = Table(title="checkpoints", title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("state")
    table.add_column("directory / problem", overflow="fold")
    for c in found:
        if c.complete and checksums.recorded(c.path) is None:
            note = f"{c.path.name}: saved by an earlier usp, loads unverified"
            table.add_row(str(c.step), "[yellow]complete, no checksums[/]", escape(note))
        elif c.complete:
            table.add_row(str(c.step), "[green]complete[/]", c.path.name)
        else:
            table.add_row(str(c.step), "[red]incomplete[/]", escape(f"{c.path.name}: {c.problem}"))
    done = [c.step for c in found if c.complete]
    console.print(table)
    console.print(escape(f"  in {where}: " + (f"resume / export from step {done[-1]}" if done
                                              else "no complete checkpoint")), highlight=False, soft_wrap=True)
    if done:
        console.print(escape(f"  their contents are checked against their checksums when a run resumes; now: "
                             f"usp checkpoints verify {run_dir}"), highlight=False, soft_wrap=True)
