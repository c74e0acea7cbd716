#!/usr/bin/env python
"""Time the planner: `usp plan --search` (the whole command, median of several runs) for
Llama-3.1 70B on 64 nodes x 8 H100 (512 GPUs); next to it, the search alone in-process and one
`build_plan` of the best layout with its memory / time prediction. Pure Python, no torch.

    python scripts/bench/planner_search.py [--repeat 3] [--json] [extra overrides...]
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from usp.config.compose import compose_config  # noqa: E402
from usp.plan.plan import build_plan  # noqa: E402
from usp.plan.search import explain, search_config  # noqa: E402

OVERRIDES = ["model=llama3_1_70b", "cluster=slurm_h100", "cluster.nodes=64", "train.seq_len=4096",
             "train.global_batch=1024"]
USP = str(Path(sys.executable).parent / "usp")


def cli_search_s(overrides: list[str], repeat: int) -> list[float]:
    walls = []
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(repeat):
            start = time.perf_counter()
            proc = subprocess.run([USP, "plan", *overrides, "--search", "--top", "5"], cwd=cwd, capture_output=True,
                                  text=True, timeout=600, env=dict(os.environ, COLUMNS="200"))
            walls.append(time.perf_counter() - start)
            if proc.returncode != 0:
                raise SystemExit(f"usp plan --search failed:\n{proc.stderr[-3000:]}")
    return walls


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--repeat", type=int, default=3)
    args, extra = p.parse_known_args()
    overrides = OVERRIDES + extra
    walls = cli_search_s(overrides, args.repeat)
    cfg, choices = compose_config(None, overrides)
    start = time.perf_counter()
    result = search_config(cfg, top_k=5)
    search_s = time.perf_counter() - start
    best = result.best
    out = {"overrides": overrides, "cli_median_s": _common.median(walls), "cli_runs_s": walls,
           "search_inprocess_s": search_s, "evaluated": result.evaluated, "fitting": result.fitting,
           **_common.machine()}
    lines = [f"usp plan --search {' '.join(overrides)}",
             f"  command: {out['cli_median_s']:.2f} s (median of {args.repeat}); search alone {search_s:.2f} s: "
             f"{result.evaluated} memory predictions, {result.fitting} fitting layouts"]
    if best is not None:
        out["best"] = {"layout": best.describe(), "peak_gib": best.peak_gib, "mfu": best.timing.mfu,
                       "tokens_per_s_per_device": best.tokens_per_s_per_device}
        lines.append(f"  best: {best.describe()}, {best.peak_gib:.1f} GiB, "
                     f"{best.tokens_per_s_per_device:,.0f} tokens/s/device, MFU {best.timing.mfu:.1%}")
        lines += [f"  {line}" for line in explain(result)[1:]]
        cfg, choices = compose_config(None, overrides + best.layout.overrides())
        start = time.perf_counter()
        build_plan(cfg, choices, training=False)
        out["build_plan_best_s"] = time.perf_counter() - start
        lines.append(f"build_plan of the best layout (512 ranks): {out['build_plan_best_s']:.3f} s")
    assert "torch" not in sys.modules, "the planner imported torch"
    _common.emit(out, args, lines)


if __name__ == "__main__":
    main()
