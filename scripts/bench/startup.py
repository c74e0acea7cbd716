#!/usr/bin/env python
"""CLI start-up: wall time of `usp --help`, `usp plan`, `usp estimate` (median of several runs,
targets 0.3 s / 0.8 s / 0.8 s), whether any of them imports torch (Python's -X importtime
profile), and the time from `usp train` to the end of its first optimizer step (from the
run's logs/rank_0.log timestamps).

    python scripts/bench/startup.py [--repeat 7] [--no-train] [--json]
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

USP = str(Path(sys.executable).parent / "usp")
COMMANDS = {  # name -> (argv, target seconds)
    "usp --help": (["--help"], 0.3),
    "usp plan": (["plan"], 0.8),
    # the configured layout only: --gpus / --hours add a layout search per node count (docs/planner.md)
    "usp estimate": (["estimate", "model=llama3_1_8b", "train.tokens=1e12", "cluster=slurm_h100"], 0.8),
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(argv: list[str], cwd: str, profile: bool = False) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall time, CPU time (user + system: moves less than wall time on a busy machine) and the process."""
    env = dict(os.environ, COLUMNS="200", **({"PYTHONPROFILEIMPORTTIME": "1"} if profile else {}))
    start, cpu = time.perf_counter(), _children_cpu()
    proc = subprocess.run([USP, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"usp {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, cpu, proc


def imported_modules(importtime_stderr: str) -> set[str]:
    """Top-level packages named in a -X importtime profile."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def cli_times(repeat: int, cwd: str) -> dict:
    out = {}
    for name, (argv, target) in COMMANDS.items():
        _run(argv, cwd)  # warm the page cache and .pyc files
        walls, cpus = zip(*(_run(argv, cwd)[:2] for _ in range(repeat)))
        torch_imported = "torch" in imported_modules(_run(argv, cwd, profile=True)[2].stderr)
        out[name] = {"median_s": _common.median(list(walls)), "min_s": min(walls), "runs_s": list(walls),
                     "cpu_median_s": _common.median(list(cpus)), "target_s": target, "imports_torch": torch_imported}
    return out


def _log_time(line: str) -> float:
    """Epoch seconds of a rank-log line ('2026-11-23 10:00:00,123 rank0 ...', local time)."""
    stamp = " ".join(line.split(" ", 2)[:2])
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def train_to_first_step(cwd: str) -> dict:
    """`usp train` of the tiny model (data already prepared): launch -> engine start -> step 1."""
    runs = Path(cwd) / "runs"
    argv = ["train", f"train.runs_dir={runs}", "train.steps=2", "train.sample_tokens=0", "train.eval_interval=0",
            "train.eval_batches=1", "logging.console=plain", "checkpoint.enabled=false", "train.name=startup"]
    launched = time.time()
    wall, _, _ = _run(argv, cwd)
    lines = (runs / "startup" / "logs" / "rank_0.log").read_text().splitlines()
    start = next(_log_time(x) for x in lines if " start: " in x)
    step1 = next(_log_time(x) for x in lines if " step 1 " in x)
    return {"to_engine_start_s": start - launched, "to_first_step_done_s": step1 - launched,
            "first_step_s": step1 - start, "total_wall_s": wall}


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--no-train", action="store_true", help="skip the `usp train` measurement")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as cwd:
        result = {"cli": cli_times(args.repeat, cwd), **_common.machine()}
        if not args.no_train:
            result["train"] = train_to_first_step(cwd)
    lines = [f"CLI start-up (median of {args.repeat} runs):"]
    for name, r in result["cli"].items():
        ok = "ok" if r["median_s"] < r["target_s"] else "OVER TARGET"
        lines.append(f"  {name:<14} {r['median_s']:.3f} s (min {r['min_s']:.3f}, CPU {r['cpu_median_s']:.3f}, "
                     f"target < {r['target_s']} s, {ok}); imports torch: {'YES' if r['imports_torch'] else 'no'}")
    if "train" in result:
        t = result["train"]
        lines.append(f"  usp train -> engine start {t['to_engine_start_s']:.2f} s -> first step done "
                     f"{t['to_first_step_done_s']:.2f} s (first step itself {t['first_step_s']:.2f} s)")
    _common.emit(result, args, lines)


if __name__ == "__main__":
    main()
