"""`usp status [RUN_DIR]`: what happened to a run, read from its run directory alone (no torch).

State: completed (summary.json, no failure after it), failed (logs/failure_rank<R>.json files
of the latest launch, not followed by a restart), else incomplete / running. For a failed run
the root cause is the earliest failure that is not a "lost peer" (a rank that lost its
connection only because another one died); ranks of the plan that left no failure file died
without a Python traceback (a signal: the OOM killer, SIGKILL, or torchrun stopping them)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from usp.errors import LaunchError
from usp.rundir import LOST_PEER, checkpoint_dir, list_checkpoints, read_jsonl, read_plan_if_any

_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


@dataclass
class FailureReport:
    root: dict | None = None  # the failure that started it (None: only silent ranks / lost peers)
    secondary: list[dict] = field(default_factory=list)  # failures caused by the root one
    silent: list[dict] = field(default_factory=list)  # plan rank entries with no failure file
    earlier: list[dict] = field(default_factory=list)  # failures before the latest launch or restart
    lost_peer_seen: bool = False

    @property
    def failed(self) -> bool:
        return self.root is not None or bool(self.secondary)


# -- reading the run directory ---------------------------------------------------------------

def resolve_run_dir(arg: str | None, runs_dir: str | Path = "runs") -> Path:
    """RUN_DIR, or the most recently modified directory under ./runs."""
    if arg:
        path = Path(arg)
        if not path.is_dir():
            raise LaunchError(f"no run directory {path}", key="RUN_DIR", fix="usp status runs/<name>")
        return path
    runs = Path(runs_dir)
    candidates = [p for p in runs.iterdir() if p.is_dir()] if runs.is_dir() else []
    if not candidates:
        raise LaunchError(f"no run directory given and {runs}/ has none", key="RUN_DIR",
                          fix="usp status <run dir> (e.g. runs/<name>)")
    return max(candidates, key=lambda p: p.stat().st_mtime)


def read_failures(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted((run_dir / "logs").glob("failure_rank*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        record["_path"] = str(path)
        record.setdefault("unix_time", path.stat().st_mtime)
        out.append(record)
    return out


def analyse_failures(run_dir: Path, plan: dict | None) -> FailureReport:
    """Sort the failure files of the latest launch (and attempt) into root cause and consequences."""
    failures = read_failures(run_dir)
    since = (run_dir / "plan.yaml").stat().st_mtime if (run_dir / "plan.yaml").is_file() else 0.0
    restarts = [e for e in read_jsonl(run_dir / "logs" / "events.jsonl") if e.get("event") == "restart"]
    if restarts:
        since = max(since, max(float(e.get("time", 0)) for e in restarts))
    report = FailureReport()
    active = []
    for f in failures:
        (active if float(f["unix_time"]) >= since - 1.0 else report.earlier).append(f)
    active.sort(key=lambda f: float(f["unix_time"]))
    report.lost_peer_seen = any(f.get("error_class") == LOST_PEER for f in active)
    primary = [f for f in active if f.get("error_class") != LOST_PEER]
    report.root = (primary or active or [None])[0]
    report.secondary = [f for f in active if f is not report.root]
    if active and plan:
        reported = {int(f.get("rank", -1)) for f in active}
        report.silent = [r for r in plan.get("ranks", []) if int(r["rank"]) not in reported]
    return report


# -- formatting ------------------------------------------------------------------------------

def _coords(coords: dict | None, degrees: dict | None) -> str:
    if not coords:
        return "-"
    shown = {d: c for d, c in coords.items() if not degrees or int(degrees.get(d, 1)) > 1}
    return " ".join(f"{d}={c}" for d, c in shown.items()) or "single process"


def _stages(record: dict, plan: dict | None) -> str:
    stages = record.get("stages")
    if stages is None and plan and (plan.get("pipeline") or {}).get("rank_stages") and record.get("coords"):
        stages = plan["pipeline"]["rank_stages"][int(record["coords"].get("pp", 0))]
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


def _last_log_line(run_dir: Path, rank: int) -> str:
    path = run_dir / "logs" / f"rank_{rank}.log"
    if not path.is_file():
        return "(no log)"
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return _first_line(lines[-1], 160) if lines else "(empty log)"


def _ranks(items: list) -> str:
    return ", ".join(str(i) for i in items)


# -- rendering -------------------------------------------------------------------------------

def render_failure(run_dir: Path, plan: dict | None, report: FailureReport, console: Console) -> None:
    """The root cause as a table, then what followed from it."""
    degrees = (plan or {}).get("degrees")
    root = report.root
    show_root = root is not None and not (root.get("error_class") == LOST_PEER and report.silent)
    if show_root:
        table = Table(title="root cause", show_header=False, title_justify="left", title_style="bold red")
        table.add_column(style="bold cyan")
        table.add_column(overflow="fold")
        step, rank_log = root.get("last_completed_step"), f"rank_{root.get('rank')}.log"
        rows = [("failing rank", str(root.get("rank"))),
                ("node", f"{root.get('node')} ({root.get('host', '?')}), local rank {root.get('local_rank')}"),
                ("mesh coordinates", _coords(root.get("coords"), degrees)),
                ("pipeline stage", _stages(root, plan)),
                ("error class", str(root.get("error_class"))),
                ("exception", str(root.get("exception_type"))),
                ("message", _first_line(root.get("message"))),
                ("last completed step", "-" if step is None else str(step)),
                ("time", _when(root.get("unix_time"))),
                ("details", escape(f"{root['_path']} (traceback), {run_dir / 'logs' / rank_log}"))]
        for k, v in rows:
            table.add_row(k, v)
        console.print(table)
    others = report.secondary if show_root else [f for f in (root, *report.secondary) if f]
    if others:
        console.print(("[dim]then:[/] " if show_root else "[dim]seen by the other ranks:[/] ") + "; ".join(
            f"rank {f.get('rank')}: {f.get('error_class')} after step {f.get('last_completed_step', '-')} "
            f"({_first_line(f.get('message'), 80)})" for f in others), highlight=False)
    if report.silent:
        ranks = [int(r["rank"]) for r in report.silent]
        primary = root is not None and root.get("error_class") != LOST_PEER
        also = f", or torchrun stopping the other ranks after rank {root.get('rank')} failed" if primary else ""
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
            table.add_row(str(r["rank"]), str(r.get("node")), str(r.get("local_rank")),
                          _coords(r.get("coords"), degrees), _stages({"coords": r.get("coords")}, plan),
                          _last_log_line(run_dir, int(r["rank"])))
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
    summary_file = run_dir / "summary.json"
    events = read_jsonl(run_dir / "logs" / "events.jsonl")
    latest_failure = max((float(f["unix_time"]) for f in [report.root, *report.secondary] if f), default=0.0)
    launched = (run_dir / "plan.yaml").stat().st_mtime if (run_dir / "plan.yaml").is_file() else 0.0
    done = summary_file.stat().st_mtime if summary_file.is_file() else None  # of this launch, not an earlier one
    if done is not None and done >= launched - 1.0 and latest_failure <= done:
        state, code = "[bold green]completed[/]", 0
    elif report.failed:
        state, code = "[bold red]failed[/]", 1
    else:
        state, code = "[yellow]incomplete / running[/]", 0
        if events and events[-1].get("event") == "preempted":
            from usp.launch.slurm import read_jobs  # a Slurm job requeues itself; a local run needs the user

            how = "its Slurm job requeues and resumes by itself" if read_jobs(run_dir) else \
                "resume by running the same command"
            state += f" (preempted at step {events[-1].get('step')}; {how})"

    table = Table(title=escape(f"run: {(plan or {}).get('name', run_dir.name)}"), show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column(overflow="fold")
    table.add_row("run dir", escape(str(run_dir)))
    if plan:
        degrees = plan.get("degrees") or {}
        layout = " x ".join(f"{d}={v}" for d, v in degrees.items() if int(v) > 1) or "single process"
        table.add_row("world", f"{plan.get('world_size')} = {plan.get('nodes')} node(s) x "
                               f"{plan.get('procs_per_node')} process(es), {plan.get('device')}/{plan.get('backend')}")
        table.add_row("layout", layout)
    else:
        table.add_row("plan", "no plan.yaml (not a run directory, or not launched yet)")
    table.add_row("state", state)
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "step" in m]
    total = ((plan or {}).get("config") or {}).get("train", {}).get("steps")
    if metrics:
        last = metrics[-1]
        loss = last.get("loss")
        val = f", val loss {last['val_loss']:.4f}" if isinstance(last.get("val_loss"), (int, float)) else ""
        table.add_row("last logged step", f"{last['step']}{f' / {total}' if total else ''}: loss "
                                          f"{loss:.4f}{val}" if isinstance(loss, (int, float)) else f"{last['step']}")
    else:
        table.add_row("last logged step", "none (no metrics.jsonl yet)")
    restarts = [e for e in events if e.get("event") == "restart"]
    table.add_row("restarts", "none" if not restarts else "; ".join(
        f"#{e.get('restart', '?')} at {_when(e.get('time'))}"
        + (f", resumed from step {e['resumed_from_step']}" if e.get("resumed_from_step") is not None else "")
        for e in restarts))
    others = [e for e in events if e.get("event") not in (None, "restart")]
    if others:
        table.add_row("events", escape("; ".join(
            f"{e['event']} at {_when(e.get('time'))}" + "".join(f", {k} {v}" for k, v in e.items()
                                                                 if k not in ("event", "time")) for e in others[-5:])))
    if report.earlier:
        table.add_row("earlier failures", f"{len(report.earlier)} failure record(s) from before the latest launch "
                                          "or restart (recovered or superseded)")
    console.print(table)
    from usp.launch.jobs import slurm_table  # (imports this module)

    job_table = slurm_table(run_dir)
    if job_table is not None:
        console.print(job_table)
    _render_checkpoints(run_dir, plan, console)
    if code == 1:
        render_failure(run_dir, plan, report, console)
    return code


def _render_checkpoints(run_dir: Path, plan: dict | None, console: Console) -> None:
    ckpt_cfg = ((plan or {}).get("config") or {}).get("checkpoint") or {}
    if plan and not ckpt_cfg.get("enabled", True):
        console.print("checkpoints: disabled (checkpoint.enabled=false)")
        return
    where = checkpoint_dir(plan) if plan else run_dir / "checkpoints"
    found = list_checkpoints(where)
    if not found:
        console.print(f"checkpoints: none in {escape(str(where))}", highlight=False)
        return
    table = Table(title="checkpoints", title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("state")
    table.add_column("directory / problem", overflow="fold")
    for c in found:
        if c.complete:
            table.add_row(str(c.step), "[green]complete[/]", c.path.name)
        else:
            table.add_row(str(c.step), "[red]incomplete[/]", escape(f"{c.path.name}: {c.problem}"))
    done = [c.step for c in found if c.complete]
    console.print(table)
    console.print(escape(f"  in {where}: " + (f"resume / export from step {done[-1]}" if done else "no complete checkpoint")),
                  highlight=False, soft_wrap=True)
