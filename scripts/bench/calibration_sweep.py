#!/usr/bin/env python
"""The planner's memory model on real runs: each row of a measured sweep (the Ultra-Scale
Playbook's nanotron runs on 8xH100 nodes) becomes a usp layout (usp.perf.calibration.measured_runs: the
mapping, once, shared with `usp calibrate`) and the memory model (usp.perf.calibration.memory_check), as a
profile's recipe (`--profile`, default nanotron), predicts the peak memory of pp rank 0 (what the
sweep measured) and whether the run fits. Prints, on the runs measured ok: the median |error|, the
share within 10 %, the runs predicted out of memory, per (model, zero, tp/pp) group; on the failed
runs: how many are predicted to fit. Pure Python.

    python scripts/bench/calibration_sweep.py [SWEEP.csv] [--archs ARCHS.csv] [--profile usp|nanotron]
        [--json] [--list]

SWEEP.csv defaults to calibration/playbook_h100/playbook_sweep_calibration.csv, --archs to
playbook_model_archs.csv beside it; --list prints every ok run predicted out of memory.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from usp.perf.calibration.measured_runs import SWEEP_CSV, MeasuredRun, read_sweep_csv  # noqa: E402
from usp.perf.calibration.memory_check import accuracy, check_memory  # noqa: E402
from usp.perf.stack_profile import get_profile  # noqa: E402


def group(run: MeasuredRun) -> str:
    par = "+".join(d for d in ("tp", "pp") if getattr(run.layout, d) > 1) or "dp only"
    return f"{run.model} zero={int(run.layout.zero1)}, {par}"


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("sweep", type=Path, nargs="?", default=SWEEP_CSV)
    p.add_argument("--archs", type=Path, default=None)
    p.add_argument("--profile", default="nanotron")
    p.add_argument("--list", action="store_true", help="print every run measured ok but predicted OOM")
    args = p.parse_args()
    checks = check_memory(read_sweep_csv(args.sweep, args.archs), get_profile(args.profile))
    groups = defaultdict(list)
    for c in checks:
        groups[group(c.run)].append(c)
    result = {"profile": args.profile, **accuracy(checks),
              "by_group": {g: accuracy(v) for g, v in sorted(groups.items())}}
    listed = [f"{c.run.model} nodes={c.run.nodes} {c.run.layout.label()} mbs={c.run.layout.micro_batch} "
              f"gas={c.run.layout.grad_accum} zero={int(c.run.layout.zero1)}: measured {c.run.mem_gib} GiB, predicted "
              f"{c.predicted_gib:.1f} GiB on pp rank 0" for c in checks if c.run.ok and not c.fits and c.predicted_gib]
    lines = [f"profile {args.profile}: {result['ok_runs']} runs measured ok: median |error| "
             f"{result['median_abs_error']:.1%}, {result['within_10pct']:.1%} within 10 %, "
             f"{result['ok_predicted_oom']} predicted out of memory ({result['ok_zero1_tp_pp_predicted_oom']} of them "
             f"ZeRO-1 with TP/PP); {result['failed_predicted_fit']} of "
             f"{result['failed_runs']} failed runs predicted to fit",
             "| runs | ok | median abs error | within 10 % | ok predicted OOM | failed | failed predicted fit |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {g} | {v['ok_runs']} | {v['median_abs_error']:.1%} | {v['within_10pct']:.0%} | "
              f"{v['ok_predicted_oom']} | {v['failed_runs']} | {v['failed_predicted_fit']} |"
              for g, v in result["by_group"].items()]
    _common.emit(result, args, (listed if args.list else []) + lines)


if __name__ == "__main__":
    main()
