"""A hang and the stragglers as `usp status` and `usp train` say them (docs/hangs.md), read from the run
directory: the hang watchdog's logs/hang.json and "hung" event, the stragglers' fields of
metrics.jsonl. No torch."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from usp.contract.run_plan import RunPlan
from usp.run.files import (
    EXIT_HUNG,
    HANG_GLOB,
    STACKS_GLOB,
    hang_path,
    hang_saved_text,
    logs_dir,
    metrics_path,
    read_jsonl,
)


def read_hang(run_dir: Path, group: int | None = None) -> dict | None:
    """The verdict of a hang: logs/hang.json, or under torchft logs/hang_group<G>.json of `group`, else the
    newest one of a group that was hung (not one that only waited for another group); None (none, or
    unreadable)."""
    paths = [hang_path(run_dir, group)] if group is not None else \
        sorted(logs_dir(run_dir).glob(HANG_GLOB), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in paths:
        try:
            hang = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(hang, dict) and hang.get("outcome") != "waited":
            return hang
    return None


def _stuck(hang: dict | None, event: dict) -> list[dict]:
    """The stuck ranks' entries of hang.json (or, without it, what the event says)."""
    if hang is not None:
        return [e for e in hang.get("ranks", []) if e.get("rank") in hang.get("stuck", [])]
    return [{"rank": r} for r in event.get("stuck", [])]


def _who(stuck: list[dict], hang: dict | None = None) -> str:
    """"rank 1", "ranks 1, 3", under torchft "rank 1 of replica group 2" (ranks are numbered per group)."""
    group = (hang or {}).get("replica_group")
    of = f" of replica group {group}" if group is not None else ""
    if not stuck:
        return f"no single rank{of} (every rank responded: compare their stacks)"
    names = ", ".join(str(e["rank"]) for e in stuck[:8]) + (f" and {len(stuck) - 8} more" if len(stuck) > 8 else "")
    return f"rank{'s' if len(stuck) > 1 else ''} {names}{of}"


def hang_text(run_dir: Path, event: dict, slurm: bool) -> str:
    """The state line of a hung run: who, where, what became of it, how it resumes."""
    hang = read_hang(run_dir, event.get("replica_group"))
    stuck = _stuck(hang, event)
    where = f" {stuck[0]['where']}" if stuck and stuck[0].get("where") else f" in step {event.get('step')}"
    state = f" ({stuck[0]['process']})" if stuck and stuck[0].get("process") else ""
    if event.get("cleared"):
        what = (f"{_who(stuck, hang)} stalled{where}{state} for {event.get('stalled_s')} s, then moved again: every "
                "rank stopped at the next step boundary with a checkpoint")
    else:
        what = (f"{_who(stuck, hang)} made no progress{where}{state}; after {event.get('stalled_s')} s the live ranks "
                f"exited with code {EXIT_HUNG}; {hang_saved_text((hang or {}).get('checkpoint'))}")
    how = "its Slurm job requeues and resumes by itself" if slurm else "resume by running the same command"
    return f"{what}; {how}"


def render_hang(run_dir: Path, plan: RunPlan | None, console: Console) -> None:
    """The hang as a table: the stuck rank, where it was, what the live ranks waited in, the files."""
    hang = read_hang(run_dir)
    if hang is None:
        return
    table = Table(title="hang", show_header=False, title_justify="left", title_style="bold red")
    table.add_column(style="bold cyan")
    table.add_column(overflow="fold")
    group = hang.get("replica_group")
    for e in _stuck(hang, {})[:4]:
        info = plan.ranks[e["rank"]] if plan is not None and e["rank"] < len(plan.ranks) and group is None else None
        node = f"node {info.node}, local rank {info.local_rank}, " if info is not None else ""
        name = f"stuck rank {e['rank']}" + ("" if group is None else f" of replica group {group}")
        table.add_row(name, escape(f"{node}host {e.get('host', '?')}, pid {e.get('pid', '?')}"))
        table.add_row("  where", escape(f"{e.get('where', 'no heartbeat in this launch')} (its last heartbeat, "
                                        f"{_when(e.get('since'))})"))
        if e.get("process"):
            table.add_row("  process", escape(str(e["process"])))
    table.add_row("why this rank", escape(hang.get("reason", "?")))
    waits = "; ".join(f"{w} ({n} rank{'s' if n > 1 else ''})" for w, n in hang.get("live_waiting_in", []))
    table.add_row("live ranks", escape(f"{hang.get('responded')} of {hang.get('world_size')} responded, waiting in "
                                       f"{waits or '?'}"))
    table.add_row("detected", escape(f"{_when(hang.get('detected_at'))} by rank {hang.get('detected_by')}, "
                                     f"{hang.get('stalled_s', 0):.1f} s without progress (allowance "
                                     f"{hang.get('window_s', 0):.3g} s)"))
    outcome = {"stuck": f"still stuck after {hang.get('grace_s', 0):.3g} s of grace: the live ranks exited with code "
                        f"{EXIT_HUNG}; {hang_saved_text(hang.get('checkpoint'))}",
               "cleared": "it moved again: every rank stopped at the next step boundary with a checkpoint"}
    table.add_row("outcome", escape(outcome.get(hang.get("outcome", ""), str(hang.get("outcome")))))
    logs = logs_dir(run_dir)
    table.add_row("stacks", escape(f"{logs}/stacks_*rank*.txt (every live rank's threads; a rank that did not respond: "
                                   f"its process state), {logs}/fr_trace_*rank*.json (torch's flight recorder), "
                                   f"{hang_path(run_dir, group)}"))
    console.print(table)


def hang_line(run_dir: Path, event: dict) -> str:
    """`usp train`'s line after the ranks ended on a hang that did not clear."""
    hang = read_hang(run_dir, event.get("replica_group"))
    stuck = _stuck(hang, event)
    detail = (f" (pid {stuck[0].get('pid')} on {stuck[0].get('host')}: {stuck[0].get('process')})"
              if stuck and stuck[0].get("process") else "")
    where = f" {stuck[0]['where']}" if stuck and stuck[0].get("where") else ""
    return (f"usp: hang: {_who(stuck, hang)}{detail} made no progress{where}; after {event.get('stalled_s')} s the "
            f"live ranks exited (code {EXIT_HUNG}) and torchrun stopped the rest; "
            f"{hang_saved_text((hang or {}).get('checkpoint'))}; "
            f"every rank's stack: {logs_dir(run_dir)}/{STACKS_GLOB}; `usp status {run_dir}`")


def straggler_text(run_dir: Path) -> str | None:
    """The stragglers row: the ranks flagged in the last logged step, else the slowest rank's ratio."""
    last = next((r for r in reversed(read_jsonl(metrics_path(run_dir))) if "work_s_median" in r), None)
    if last is None:
        return None
    flagged = last.get("stragglers") or []
    ratio, slowest = last.get("work_s_slowest_ratio"), last.get("work_s_slowest_rank")
    by_rank = last.get("work_s_by_rank") or []
    if flagged:
        ratios = [f"rank {r}" + (f" ({by_rank[r] / last['work_s_median']:.2f}x the median)"
                                 if r < len(by_rank) and by_rank[r] and last.get("work_s_median") else "")
                  for r in flagged]
        return f"{', '.join(ratios)}, at step {last.get('step')} (their own work per step vs their peers')"
    shown = f"; slowest rank {slowest}: {ratio:.2f}x its peers' median" if isinstance(ratio, float) else ""
    return f"none at step {last.get('step')}{shown}"


def _when(t) -> str:
    try:
        return datetime.fromtimestamp(float(t)).strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError, OSError):
        return "?"
