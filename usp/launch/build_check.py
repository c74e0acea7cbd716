"""`usp plan --build-check`: the engine builds the named ranks' parallel model on the meta device
(usp/engine/meta_build.py) in a subprocess, so that this process, like every torch-free command,
never imports torch. No GPU, no corpus, no checkpoint needed; nothing is allocated."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from usp.contract.plan_file import write_plan
from usp.errors import LaunchError, PlanError
from usp.launch.local import require_torch

ENGINE_MODULE = "usp.engine.meta_build"


def default_ranks(plan) -> list[int]:
    """The first rank of every pipeline stage (each holds the most of its stage: FSDP2's uneven last
    shards are the smaller ones) and the last rank of the world."""
    firsts: dict[int, int] = {}
    for r in plan.ranks:
        firsts.setdefault(r.coords["pp"], r.rank)
    return sorted({*firsts.values(), plan.world_size - 1})


def check_ranks(plan, ranks: list[int]) -> list[int]:
    """The ranks asked for, each in the plan's world, in order, once."""
    for r in ranks:
        if not 0 <= r < plan.world_size:
            raise PlanError(f"not a rank of this plan's {plan.world_size} (0..{plan.world_size - 1})",
                            key="--build-check", value=r, fix=f"ranks in 0..{plan.world_size - 1}, or none: the "
                                                              "first rank of each pipeline stage and the last")
    return sorted(set(ranks)) or default_ranks(plan)


def run_build_check(plan, ranks: list[int], on_result: Callable[[dict], None] = lambda r: None) -> list[dict]:
    """Each rank's result from usp/engine/meta_build.py (one JSON line each, passed to on_result as it
    arrives): local parameter / gradient / optimizer-state bytes, or the error its build raised."""
    require_torch("plan --build-check")
    with tempfile.TemporaryDirectory(prefix="usp-build-check-") as tmp:
        path = write_plan(plan, Path(tmp) / "plan.yaml")
        cmd = [sys.executable, "-m", ENGINE_MODULE, "--plan", str(path), "--ranks", *map(str, ranks)]
        results = []
        with open(Path(tmp) / "stderr", "w+") as err, \
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
            for line in proc.stdout or []:
                if line.startswith("{"):
                    results.append(json.loads(line))
                    on_result(results[-1])
            proc.wait()
            err.seek(0)
            stderr = err.read()[-3000:]
    if len(results) != len(ranks):
        raise LaunchError(f"the build check stopped after {len(results)} of {len(ranks)} rank(s) (exit code "
                          f"{proc.returncode}): {stderr.strip() or 'no output'}")
    return results
