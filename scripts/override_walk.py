#!/usr/bin/env python
"""How far one override travels back: the rooms (usp packages) a config value passes through from the
command line to the engine's build, and how often the walk returns to a room upstream of where it
already is (docs/architecture.md, "The walk of one override").

One process, the path `usp train` takes for one rank, with `parallelism.tp=2` on two processes:
compose the config, plan it, write and read plan.yaml, then the engine side as every rank runs it
(the plan's checks, the mesh and the parallel model built on the meta device under a fake process
group: usp.engine.meta_build). sys.setprofile records every call into a usp function; each call's
room is its package (usp.config, usp.plan, ...; usp.run and usp.errors, the floor every layer
stands on, are not rooms). Rooms in the order the walk should take them: config -> plan (plan, perf,
data) -> launch -> engine (engine, models). A return is a call into a room whose place in that
order is before the furthest room the walk has reached.

    python scripts/override_walk.py            # the counts
    python scripts/override_walk.py --list     # and every return, caller -> callee
"""
from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ORDER = {"config": 0, "plan": 1, "perf": 1, "data": 1, "engine": 2, "models": 2}
OVERRIDES = ["conf=tiny_ddp", "parallelism.tp=2", "parallelism.dp_replicate=1", "train.name=walk",
             "checkpoint.enabled=false"]


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "usp" and parts[1] in ORDER else None


def walk(runs_dir: str) -> list[tuple[str, str, str]]:
    """Every call into a room as (room, function, caller's room + function), in order."""
    calls: list[tuple[str, str, str]] = []

    def profile(frame, event, _arg):
        if event != "call":
            return
        here = room(frame.f_globals.get("__name__", ""))
        if here is None or frame.f_code.co_name == "<module>":
            return
        back = frame.f_back
        caller = f"{back.f_globals.get('__name__', '?')}.{back.f_code.co_name}" if back else "?"
        calls.append((here, f"{frame.f_globals['__name__']}.{frame.f_code.co_name}", caller))

    from usp.engine.meta_build import check_rank

    _import_everything()  # torch, the engine, every usp module: imports are not the walk
    sys.setprofile(profile)
    try:
        run_flow(runs_dir, check_rank)
    finally:
        sys.setprofile(None)
    return calls


def _import_everything() -> None:
    import importlib
    import pkgutil

    import usp

    for module in pkgutil.walk_packages(usp.__path__, "usp."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)


def run_flow(runs_dir: str, check_rank) -> None:
    import io

    from rich.console import Console

    from usp.config.compose import compose_config
    from usp.launch.pre_launch import prepare_run
    from usp.run.lock import release

    conf, overrides = OVERRIDES[0].split("=", 1)[1], [*OVERRIDES[1:], f"train.runs_dir={runs_dir}"]
    cfg, choices = compose_config(conf, overrides)
    plan, plan_file = prepare_run(cfg, choices, console=Console(file=io.StringIO()))
    release(plan.run_dir)
    engine_side(str(plan_file), check_rank)


def engine_side(plan_file: str, check_rank) -> None:
    """What a rank does with plan.yaml before its first step: read (and check) it, then build."""
    import usp.engine.worker as worker

    plan = worker.read_plan(plan_file)
    if hasattr(worker, "check_values"):
        worker.check_values(plan)
    result = check_rank(plan, 0)
    assert "error" not in result, result


def returns(calls: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The calls into a room before the furthest one reached (in ORDER), each distinct caller -> callee
    once per transition into the room."""
    out, furthest, previous = [], -1, None
    for here, function, caller in calls:
        if here != previous and ORDER[here] < furthest:
            out.append((here, function, caller))
        furthest, previous = max(furthest, ORDER[here]), here
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        calls = walk(tmp)
    back = returns(calls)
    transitions = sum(1 for a, b in zip(calls, calls[1:]) if a[0] != b[0])
    print(f"calls into usp rooms: {len(calls)}; room changes: {transitions}; returns upstream: {len(back)}")
    print("returns by room: " + ", ".join(f"{r} {n}" for r, n in Counter(r for r, _, _ in back).most_common()))
    if "--list" in sys.argv:
        for _room, function, caller in back:
            print(f"  {caller} -> {function}")


if __name__ == "__main__":
    main()
