"""`usp sweep`: expand comma-list overrides into a grid, plan every point, run the ones the
planner accepts. No torch here (the local runner imports the engine only to train).

Three independent steps, so that another launcher (a Slurm job array, `submit_sweep_slurm`)
can reuse the first two and replace the third:

    grid  = expand_grid(overrides)                    # list of override lists, one per point
    sweep = plan_grid(conf, grid, name, runs_dir)     # compose + plan each; writes sweep.json
    run_sweep_local(sweep)                            # or: submit_sweep_slurm(sweep)

A runner is registered in SWEEP_LAUNCHERS under the `cluster.launcher` it serves. The record,
runs/<sweep_name>/sweep.json, and its format: usp/run/sweep_record.py.
"""
from __future__ import annotations

import io
import itertools
import re
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from usp.contract.plan_file import read_plan_if_any
from usp.data.data_error import DataError
from usp.errors import LaunchError, UspError, one_line
from usp.launch.checkpoints import RunAlreadyDone
from usp.run import lock as runlock
from usp.run.files import EXIT_INTERRUPTED, STOP_CODES, logs_dir
from usp.run.names import check_dir_name
from usp.run.state import analyse_failures
from usp.run.sweep_record import Sweep, SweepPoint, layout_text, read_sweep, refresh_statuses

# Short names for the run ids (p03_n2_mb8); other keys use their last component.
_ABBREV = {"micro_batch": "mb", "grad_accum": "ga", "global_batch": "gb", "global_batch_tokens": "gbt",
           "procs_per_node": "n", "dp_replicate": "dpr", "dp_shard": "dps", "seq_len": "seq",
           "recompute": "rc", "pp_schedule": "sched"}


# -- 1. the grid -----------------------------------------------------------------------------

def split_sweep(overrides: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(overrides every point shares, {swept key: its values}) using Hydra's own override
    grammar: `a=1,2`, `a=range(1,4)` and `a=choice(x,y)` sweep; `a='1,2'` is one quoted value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:  # OverrideParseException and friends: one clear line
        raise UspError(str(exc).strip().splitlines()[0], key="overrides", fix="overrides are key=value, "
                       "key=a,b,c (a sweep), or key='a,b' (one value with a comma)") from None
    base, swept = [], {}
    for item in parsed:
        if not item.is_sweep_override():
            base.append(str(item.input_line))
            continue
        key = item.get_key_element()
        if key in swept:
            raise UspError("the same key is swept twice", key=key, fix="give all its values in one comma list")
        swept[key] = [str(v) for v in item.sweep_string_iterator()]
    return base, swept


def expand_grid(overrides: list[str]) -> list[list[str]]:
    """The cartesian product of the comma-list overrides: one override list per point, the
    shared overrides first. `conf=...` is not an override: pass it to plan_grid instead."""
    if any(o.startswith("conf=") for o in overrides):
        raise UspError("conf= names the primary config, it is not swept", key="conf",
                       fix="pass conf separately (the CLI does: `usp sweep conf=x a=1,2`)")
    base, swept = split_sweep(overrides)
    keys = list(swept)
    return [base + [f"{k}={v}" for k, v in zip(keys, values)]
            for values in itertools.product(*(swept[k] for k in keys))]


def point_id(index: int, swept: dict[str, str]) -> str:
    """p03_n2_mb8: readable, unique (the index), and safe as a directory name."""
    parts = [f"p{index:02d}"]
    for key, value in swept.items():
        short = _ABBREV.get(key.lstrip("+").split(".")[-1], key.lstrip("+").split(".")[-1])
        parts.append(short + re.sub(r"[^A-Za-z0-9.]+", "-", value.strip("'\""))[:24])
    return "_".join(parts)


# -- 2. planning -----------------------------------------------------------------------------

def plan_grid(conf: str | None, grid: list[list[str]], sweep_name: str, runs_dir: str | None = None) -> Sweep:
    """Compose and plan every point as `usp train` would (checked_plan);
    a point that can't run is kept as `rejected` with the reason. Writes sweep.json."""
    from omegaconf import OmegaConf

    from usp.config.compose import compose_config
    from usp.plan.plan import checked_plan

    if not grid:
        raise UspError("the sweep has no points", key="overrides", fix="sweep a key: e.g. train.micro_batch=4,8")
    check_dir_name(sweep_name, key="--name", fix="--name my_sweep")
    swept_keys = _swept_keys(grid)
    extra = [f"train.runs_dir={runs_dir}"] if runs_dir else []
    points, sweep_dir, launchers = [], None, set()
    for index, overrides in enumerate(grid):
        swept = {k: v for k, _, v in (o.partition("=") for o in overrides) if k in swept_keys}  # ~key has no "="
        pid = point_id(index, swept)
        point = SweepPoint(index, pid, list(overrides), swept, f"{sweep_name}/{pid}", "")
        try:
            point.cfg, point.choices = compose_config(conf, [*overrides, *extra, f"train.name={pid}"])
            runs = Path(point.cfg.train.runs_dir).expanduser().resolve()
            point.run_dir = str(runs / point.run_name)
            # A run name is one directory name (usp.run.names): the point's run lives in the sweep's directory.
            OmegaConf.update(point.cfg, "train.runs_dir", str(runs / sweep_name))
            sweep_dir = sweep_dir or runs / sweep_name
            launchers.add(str(point.cfg.cluster.launcher))
            point.plan = checked_plan(point.cfg, point.choices)  # what prepare_run refuses, refused here
            point.info = _plan_info(point.plan)
        except DataError:  # e.g. a missing tokenizer: one error before anything is written, as `usp plan` says it
            raise
        except UspError as exc:
            point.status, point.reason = "rejected", one_line(exc)
        points.append(point)
    if sweep_dir is None:  # not even one point composed: no runs_dir to put sweep.json in
        raise UspError(f"no point of the sweep composes; the first: {points[0].reason}", key="overrides",
                       fix="check the overrides with `usp plan` (one value per key)")
    if len({str(Path(p.run_dir).parent) for p in points if p.run_dir}) > 1:
        raise UspError("the points would be written to different run directories", key="train.runs_dir",
                       fix="don't sweep train.runs_dir; use --name for the sweep's directory")
    if len(launchers) > 1:
        raise UspError(f"the points use different launchers: {sorted(launchers)}", key="cluster.launcher",
                       fix="sweep clusters of one launcher (local or slurm) at a time")
    base = [o for o in grid[0] if o.partition("=")[0] not in swept_keys]
    sweep = Sweep(sweep_name, sweep_dir, conf, swept_keys, base, points, launchers.pop() if launchers else "local")
    _resume(sweep)
    sweep.write()
    return sweep


def _plan_info(plan) -> dict:
    tensor = max((s.total - s.overhead for s in plan.memory.stages), default=None)
    degrees = {**plan.degrees, "ep": int(plan.config.parallelism.ep)}  # ep is carved out of dp, not a mesh dim
    return {"world_size": plan.world_size, "nodes": plan.nodes, "params": plan.model.params,
            "degrees": degrees, "micro_batch": plan.batch.micro_batch,
            "grad_accum": plan.batch.grad_accum, "global_batch": plan.batch.global_batch,
            "predicted": {"tokens_per_s": plan.timing.tokens_per_s, "mfu": plan.timing.mfu,
                          "memory_gib": plan.memory.peak_gib,
                          "memory_tensor_gib": None if tensor is None else tensor / 1024 ** 3}}


def _swept_keys(grid: list[list[str]]) -> dict[str, list[str]]:
    """Keys whose value differs between points, with their values in grid order."""
    values: dict[str, list[str]] = {}
    for overrides in grid:
        for o in overrides:
            k, _, v = o.partition("=")
            if v not in values.setdefault(k, []):
                values[k].append(v)
    return {k: v for k, v in values.items() if len(v) > 1}


def _resume(sweep: Sweep) -> None:
    """Same name and same grid as an existing sweep.json: keep the points already done (running
    the command again finishes an interrupted sweep). A different grid under that name: refuse."""
    if not sweep.path.is_file():
        return
    from usp.launch.slurm import refuse_if_active

    refuse_if_active(sweep.dir)  # its array tasks read the plans this would rewrite
    old = refresh_statuses(read_sweep(sweep.dir))  # array tasks that finished count as done
    if [p["overrides"] for p in old["points"]] != [p.overrides for p in sweep.points]:
        raise LaunchError(f"{sweep.path} holds a different sweep", key="--name", value=sweep.name,
                          fix="another --name, or delete that directory")
    sweep.created = old.get("created", sweep.created)
    for point, before in zip(sweep.points, old["points"]):
        if point.status != "rejected" and before["status"] == "done":
            point.status, point.exit_code = "done", before.get("exit_code")
            point.started, point.finished = before.get("started"), before.get("finished")


# -- 3. running ------------------------------------------------------------------------------

def run_sweep_local(sweep: Sweep, console: Console | None = None, launch: Callable | None = None, *,
                    max_parallel: int = 0, dry_run: bool = False) -> int:
    """Run the accepted points one after another, as `usp train` would (prepare_run +
    launch_local). A failed point doesn't stop the sweep; Ctrl-C or preemption does (run the
    same command again to resume). Returns the number of failed points. (max_parallel: a Slurm
    option, one point at a time here; dry_run: the plans in sweep.json are all there is.)"""
    if dry_run:
        return 0
    from usp.launch.local import launch_local
    from usp.launch.pre_launch import prepare_run

    console = console or Console()
    launch = launch or launch_local
    todo = [p for p in sweep.accepted if p.status != "done"]
    done_before = len(sweep.accepted) - len(todo)
    if done_before:
        console.print(f"{done_before} point(s) already done in {sweep.path}: skipped", highlight=False)
    failed = 0
    for n, point in enumerate(todo, 1):
        console.rule(f"point {n}/{len(todo)}: {point.id}  {' '.join(f'{k}={v}' for k, v in point.swept.items())}")
        point.status, point.started, point.reason, point.exit_code = "running", time.time(), None, None
        sweep.write()
        code, reason = _run_point(point, prepare_run, launch)
        point.exit_code, point.finished = code, time.time()
        point.status = "done" if code == 0 else "failed"
        point.reason = None if code == 0 else reason or _failure_reason(point, code)
        sweep.write()
        console.print(f"point {n}/{len(todo)}: {point.id} {point.status}"
                      + (f" ({point.reason})" if point.reason else ""), highlight=False)
        failed += code != 0
        if code in STOP_CODES:  # preempted / Ctrl-C: stop; running the sweep again resumes it
            console.print(f"sweep stopped (exit {code}); run the same command again to resume it", highlight=False)
            break
    return failed


def _run_point(point: SweepPoint, prepare_run, launch) -> tuple[int, str | None]:
    try:
        plan, plan_path = prepare_run(point.cfg, point.choices, console=Console(file=io.StringIO()), plan=point.plan)
    except UspError as exc:  # e.g. the run directory or the data: this point only
        return 2, one_line(exc)
    except RunAlreadyDone:  # its checkpoint is at train.steps already
        return 0, None
    try:
        return int(launch(plan, plan_path)), None
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED, "interrupted"
    except Exception as exc:  # one rank runs in-process: its exception is this point's failure
        return 1, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    finally:
        runlock.release(plan.run_dir)


def _failure_reason(point: SweepPoint, code: int) -> str:
    run_dir = Path(point.run_dir)
    root = analyse_failures(run_dir, read_plan_if_any(run_dir)).root
    if root:
        message = (root.get("message") or "").strip().splitlines()
        return f"exit {code}: {root.get('error_class')}: {message[0][:200] if message else ''}"
    return f"exit {code} (logs in {logs_dir(run_dir)})"


def _submit_slurm(sweep: Sweep, console: Console | None = None, *, max_parallel: int = 0,
                  dry_run: bool = False) -> int:
    from usp.launch.slurm_sweep import submit_sweep_slurm

    return submit_sweep_slurm(sweep, console, max_parallel=max_parallel, dry_run=dry_run)


SWEEP_LAUNCHERS: dict[str, Callable[..., int]] = {"local": run_sweep_local, "slurm": _submit_slurm}
"""cluster.launcher -> runner(sweep, console, *, max_parallel, dry_run) returning the number of
failed points (a Slurm job array: the points that could not be submitted)."""


def launch_sweep(sweep: Sweep, console: Console | None = None, **options) -> int:
    runner = SWEEP_LAUNCHERS.get(sweep.launcher)
    if runner is None:
        raise LaunchError("no sweep runner for this launcher", key="cluster.launcher", value=sweep.launcher,
                          fix=f"one of: {', '.join(SWEEP_LAUNCHERS)} (or `usp sweep --dry-run` to plan only)")
    return runner(sweep, console, **options)


# -- the grid table --------------------------------------------------------------------------

def render_sweep(sweep: Sweep, console: Console | None = None) -> None:
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    table = Table(title=escape(f"sweep {sweep.name}: {len(sweep.points)} points, {len(sweep.rejected)} rejected"),
                  title_justify="left")
    for col in ("point", "overrides", "world", "layout", "predicted tok/s", "status / reason"):
        table.add_column(col, overflow="fold", justify="right" if col in ("world", "predicted tok/s") else "left")
    style = {"done": "green", "failed": "red", "rejected": "yellow", "running": "cyan", "submitted": "cyan",
             "planned": ""}
    for p in sweep.points:
        tps = (p.info.get("predicted") or {}).get("tokens_per_s")
        status = p.status + (f": {p.reason}" if p.reason else "")
        swept = " ".join(f"{k.split('.')[-1]}={v}" for k, v in p.swept.items())
        table.add_row(p.id, escape(swept), str(p.info.get("world_size", "-")), layout_text(p.info, full=False),
                      "-" if tps is None else f"{tps:,.0f}",
                      f"[{style[p.status]}]{escape(status)}[/]" if style[p.status] else escape(status))
    console.print(table)
    console.print(f"sweep file: {escape(str(sweep.path))}", highlight=False, soft_wrap=True)
