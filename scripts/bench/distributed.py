#!/usr/bin/env python
"""Distributed layouts on CPU: step time of DDP, FSDP2 (ZeRO-3) and TP+SP on 2 ranks (gloo, one
thread each, one torchrun launch, layouts interleaved round by round) against one process with
both cores, at the same global batch (tiny model, 16 x 128 tokens). Ratios, no targets: on 2
cores the collectives and the halved per-rank work decide, not the layout's scaling.

    python scripts/bench/distributed.py [--rounds 3] [--json]
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

LAYOUTS = {
    "ddp": ["parallelism.dp_replicate=2"],
    "fsdp_zero3": ["parallelism.dp_replicate=1", "parallelism.dp_shard=2"],
    "tp_sp": ["parallelism.dp_replicate=1", "parallelism.tp=2"],
}
WARMUP, STEPS = 4, 12


def step_time(plan: dict) -> float:
    """Median whole-iteration time after the warm-up (records of every step)."""
    import torch

    from usp.engine.parallel.mesh import make_context
    from usp.engine.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(plan, make_context(plan))
    trainer.fit()
    history = trainer.history
    del trainer  # free DDP while the process group is alive
    return _common.median(_common.step_times(history, WARMUP, STEPS))


def run(layouts: dict, world: int, rounds: int) -> dict:
    from usp.engine.parallel import mesh as udist

    base = [f"train.steps={WARMUP + STEPS + 1}", "train.log_interval=1", "train.eval_batches=1",
            "train.measure_memory=false"]
    with tempfile.TemporaryDirectory() as runs:
        plans = {name: _common.plan_for(base + ov, world, runs) for name, ov in layouts.items()}
        udist.init_process_group(next(iter(plans.values())))
        times = {name: [] for name in plans}
        for _ in range(rounds):
            for name, plan in plans.items():
                times[name].append(step_time(plan))
    return times


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=__import__("argparse").SUPPRESS)
    args = p.parse_args()
    if args.worker:
        from dist.harness import run_cases

        run_cases({"layouts": lambda: {"times": run(LAYOUTS, int(os.environ["WORLD_SIZE"]), args.rounds)}})
        return
    from dist.harness import launch

    single = run({"single": []}, 1, args.rounds)["single"]
    res = launch(Path(__file__), 2, "--worker", "--rounds", str(args.rounds), timeout=1200)["layouts"]
    if not res.get("ok"):
        raise SystemExit(f"distributed measurement failed: {res.get('error')}\n{res.get('trace', '')}")
    base = _common.median(single)
    out = {"single_step_s": single, "single_median_s": base, "layouts": {}, **_common.machine()}
    lines = [f"step time at global batch 16 x 128 (tiny model), median of {args.rounds} rounds x {STEPS} steps:",
             f"  single process (2 threads)  {base * 1000:7.1f} ms  1.00x"]
    for name, times in res["times"].items():
        med = _common.median(times)
        out["layouts"][name] = {"step_s": times, "median_s": med, "ratio_vs_single": med / base}
        lines.append(f"  {name + ' (2 ranks, gloo)':<27} {med * 1000:7.1f} ms  {med / base:.2f}x")
    _common.emit(out, args, lines)


if __name__ == "__main__":
    main()
