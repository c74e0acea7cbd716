#!/usr/bin/env python
"""`usp plan --build-check` on every recipe of the catalogue: wall and CPU time of the whole command
(planning, torch's import in the engine's subprocess, the ranks' meta builds) and each rank's largest
difference from the planner's figures (target: under 60 s for the 70B and 405B recipes, 1 %).

    python scripts/bench/build_check.py                 # every recipe, its default ranks
    python scripts/bench/build_check.py --recipes llama3_1_70b llama3_1_405b --ranks first-last --json

Ranks: `default` (the first rank of each pipeline stage and the last rank: what the command picks
by itself) or `first-last` (rank 0 and the last rank: the 405B recipe's first and last pipeline ranks).
The data cache is empty (no corpus prepared); no GPU is used."""
from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

USP = str(Path(sys.executable).parent / "usp")
TARGET_S = 60.0
SUMMARY = re.compile(r"build check: (\d+) of (\d+) rank\(s\) built(?:; local bytes within ([\d.]+)%)?")


def recipes() -> list[str]:
    from usp.config.paths import recipe_names

    return recipe_names()


def world_size(recipe: str) -> int:
    from usp.config.compose import compose_config

    cfg, _ = compose_config(recipe, [])
    return int(cfg.cluster.nodes) * int(cfg.cluster.procs_per_node)


def check(recipe: str, ranks: str) -> dict:
    args = ["0", str(world_size(recipe) - 1)] if ranks == "first-last" else []
    with tempfile.TemporaryDirectory(prefix="usp-bench-build-check-") as cache:
        env = dict(os.environ, USP_CACHE_DIR=cache, COLUMNS="250")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run([USP, "plan", "--build-check", f"conf={recipe}", *args], env=env, capture_output=True,
                              text=True, timeout=900)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    m = SUMMARY.search(proc.stdout)
    return {"recipe": recipe, "ranks": args or "default", "exit": proc.returncode, "wall_s": round(wall, 1),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "built": f"{m.group(1)}/{m.group(2)}" if m else "-",
            "within_pct": float(m.group(3)) if m and m.group(3) else None,
            "error": proc.stderr.strip().splitlines()[0] if proc.returncode else None}


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--recipes", nargs="+", default=None, help="default: every recipe")
    p.add_argument("--ranks", choices=("default", "first-last"), default="default")
    opts = p.parse_args()
    results = [check(r, opts.ranks) for r in opts.recipes or recipes()]
    lines = ["| recipe | ranks | built | within | wall s | CPU s |", "|---|---|---:|---:|---:|---:|"]
    for r in results:
        within = f"{r['within_pct']:.2f} %" if r["within_pct"] is not None else "-"
        lines.append(f"| {r['recipe']} | {r['ranks']} | {r['built']} | {within} | {r['wall_s']} | {r['cpu_s']} |")
        if r["error"]:
            lines.append(f"|   error: {r['error']} | | | | | |")
    lines.append(f"target: the 70B and 405B recipes under {TARGET_S:g} s each, every rank within 1 %")
    _common.emit({"machine": _common.machine(), "results": results}, opts, lines)


if __name__ == "__main__":
    main()
