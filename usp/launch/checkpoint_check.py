"""`usp checkpoints verify [RUN_DIR | CHECKPOINT_DIR]`: read every file of a run's checkpoints and
check it against the checksums its manifest recorded (usp/run/checksums.py), with a progress bar.
Exit 0 when every complete checkpoint verifies (or predates checksums), 1 when one is damaged or
incomplete. No torch."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from usp.contract.plan_file import read_plan_if_any
from usp.errors import LaunchError
from usp.run import checksums
from usp.run.files import (
    CHECKPOINTS,
    CheckpointInfo,
    check_manifest,
    list_checkpoints,
    run_checkpoint_dir,
)
from usp.run.state import resolve_run_dir

VERIFIED, UNVERIFIED, DAMAGED, INCOMPLETE = "verified", "unverified", "damaged", "incomplete"


def checkpoints_of(target: str | None, step: int | None) -> tuple[Path, list[CheckpointInfo]]:
    """(where, checkpoints) of a run directory, a checkpoints directory or one step_<N> directory;
    `step` picks one."""
    path = resolve_run_dir(target, any_dir=True)
    if (path / "manifest.json").is_file() or path.name.startswith("step_"):
        problem = check_manifest(path)
        found = [CheckpointInfo(_step_of(path), path, problem is None, problem)]
        where = path.parent
    else:
        plan = read_plan_if_any(path)
        configured = plan.config.checkpoint.dir if plan is not None else None
        where = run_checkpoint_dir(path, configured) if plan or (path / CHECKPOINTS).is_dir() else path
        found = list_checkpoints(where)
    if step is not None:
        found = [c for c in found if c.step == step]
        if not found:
            raise LaunchError(f"no checkpoint of step {step} in {where}", key="--step", value=step,
                              fix=f"usp status {path} lists the checkpoints")
    if not found:
        raise LaunchError(f"no checkpoint in {where}", key="RUN_DIR", value=str(path),
                          fix="a run directory with checkpoints, its checkpoints/ or one step_<N> directory")
    return where, found


def _step_of(path: Path) -> int:
    digits = path.name.removeprefix("step_")
    return int(digits) if digits.isdigit() else -1


def verify(target: str | None, step: int | None = None, console: Console | None = None) -> int:
    """Check the checkpoints, print one row each; the exit code (0 all usable, 1 otherwise)."""
    console = console or Console()
    where, found = checkpoints_of(target, step)
    total = sum(_bytes(c.path) for c in found if c.complete)
    rows = []
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("verifying", total=total)
        for c in found:
            if not c.complete:
                rows.append((c, INCOMPLETE, [c.problem or "incomplete"]))
                continue
            progress.update(task, description=f"verifying {c.path.name}")
            state, problems = checksums.verify_checkpoint(c.path, lambda _name, n: progress.advance(task, n))
            rows.append((c, state, problems))
    _show(where, rows, console)
    return 1 if any(state in (DAMAGED, INCOMPLETE) for _, state, _ in rows) else 0


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


_STYLE = {VERIFIED: "green", UNVERIFIED: "yellow", DAMAGED: "red", INCOMPLETE: "red"}
_MEANS = {VERIFIED: "every file matches its checksum",
          UNVERIFIED: "saved by an earlier usp, without checksums: complete, contents not checkable",
          DAMAGED: "", INCOMPLETE: ""}


def _show(where: Path, rows: list, console: Console) -> None:
    table = Table(title=escape(f"checkpoints in {where}"), title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("state")
    table.add_column("details", overflow="fold")
    for c, state, problems in rows:
        table.add_row(str(c.step), f"[{_STYLE[state]}]{state}[/]", escape("; ".join(problems) or _MEANS[state]))
    console.print(table)
    usable = [c.step for c, state, _ in rows if state in (VERIFIED, UNVERIFIED)]
    bad = [c.step for c, state, _ in rows if state in (DAMAGED, INCOMPLETE)]
    if bad:
        console.print(escape(f"  {len(bad)} checkpoint(s) can't be used ({', '.join(map(str, bad))}); a resume skips "
                             "them for the newest usable one" + (f" (step {usable[-1]})" if usable else
                                                                 ": there is none")), highlight=False)
