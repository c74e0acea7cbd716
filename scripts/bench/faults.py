#!/usr/bin/env python
"""Goodput under injected failures: a real `usp train` of 4 ranks with restarts on, a random rank
killed (SIGKILL) at Poisson-distributed times, the measured goodput against the goodput model's
prediction from the costs measured in the same run (usp/perf/goodput.py, docs/faults.md).

    python scripts/bench/faults.py                      # 10 minutes, 4 ranks, a failure every 60 s on average
    python scripts/bench/faults.py --minutes 3 --mtbf-s 30 --seed 1
    python scripts/bench/faults.py --smoke              # 2 ranks, two kills at fixed times (the test suite's)

1. A probe run without failures measures the step time, a save's cost and the start-up phases; the
   checkpoint interval is the Young–Daly interval √(2 · save · MTBF) from them, and the step count
   fills about --minutes of wall time at the goodput the probe's costs predict.
2. The run: `usp train ... train.max_restarts=1000` as a subprocess, as a user starts it. From its
   first step on, an injector thread draws exponential gaps (mean --mtbf-s) and kills a random rank
   process at each; torchrun restarts the ranks, which resume from the last checkpoint. A kill that
   finds no rank alive (the restart between two processes) kills nothing and is counted apart.
3. Measured: goodput = committed steps x failure-free step time / wall time, the wall time from the
   first step's start to the final checkpoint, the step time the mean gap between consecutive steps'
   records without a save (metrics.jsonl, train.log_interval=1). Costs, from logs/events.jsonl: a save's blocking
   time (median), a restart's (mean over the kills that stopped a training attempt: the kill to the
   new attempt's first step, less one step).
4. Predicted: Daly's goodput at the interval's seconds, the save and restart costs, and the injected
   MTBF; also at the MTBF the run realised (wall time / kills), which takes the injector's luck out."""
from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import REPO, emit, machine, parser

from usp.perf.goodput import goodput, young_daly
from usp.run.files import ATTEMPT_EVENT, CHECKPOINT_EVENT, events_path, metrics_path, read_jsonl

WORKER = "usp.engine.worker"


def usp_train(runs_dir: Path, name: str, ranks: int, overrides: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "usp.cli", "train", "model=tiny", f"cluster.procs_per_node={ranks}",
           f"train.runs_dir={runs_dir}", f"train.name={name}", "train.log_interval=1", "train.eval_interval=0",
           "train.eval_batches=1", "train.sample_tokens=0", "logging.console=plain", *overrides]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO)


def worker_pids(plan: Path) -> list[int]:
    """The rank processes of this run (python -m usp.engine.worker --plan <plan>)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        module = argv[argv.index(b"-m") + 1] if b"-m" in argv[:-1] else b""
        if module == WORKER.encode() and str(plan).encode() in argv:  # not torchrun's agent (-m usp.engine.agent)
            pids.append(int(entry.name))
    return pids


class Injector(threading.Thread):
    """Kills a random rank at each time of a schedule (seconds from start()), or at exponential gaps."""

    def __init__(self, plan: Path, mtbf_s: float | None, seed: int, schedule: list[float] | None = None):
        super().__init__(daemon=True)
        self.plan, self.mtbf_s, self.rng, self.schedule = plan, mtbf_s, random.Random(seed), schedule
        self.kills: list[float] = []  # times of the kills that hit a rank
        self.missed: list[float] = []  # times that found no rank alive
        self.done = threading.Event()

    def gaps(self):
        if self.schedule is not None:
            last = 0.0
            for at in self.schedule:
                yield at - last
                last = at
            return
        while True:
            yield self.rng.expovariate(1.0 / float(self.mtbf_s or 1.0))

    def run(self) -> None:
        for gap in self.gaps():
            if self.done.wait(gap):
                return
            pids = worker_pids(self.plan)
            if not pids:
                self.missed.append(time.time())
                continue
            try:
                os.kill(self.rng.choice(pids), signal.SIGKILL)
                self.kills.append(time.time())
            except ProcessLookupError:
                self.missed.append(time.time())


def wait_for_first_step(run_dir: Path, proc: subprocess.Popen) -> None:
    while proc.poll() is None:
        if any(e.get("event") == ATTEMPT_EVENT for e in read_jsonl(events_path(run_dir))):
            return
        time.sleep(0.05)


def step_time(run_dir: Path, interval: int) -> float:
    """Mean gap between consecutive steps' records (the loop's whole step, logging included), leaving
    out the gaps that hold a save or a restart: the mean, not the median, because the machine's load
    drifts over a run and the wall time sums every step."""
    records = read_jsonl(metrics_path(run_dir))
    at = {r["step"]: r["time"] for r in records if isinstance(r.get("time"), float)}
    gaps = [at[s + 1] - at[s] for s in at if s + 1 in at and s % interval]
    typical = statistics.median(gaps)
    return statistics.fmean(g for g in gaps if g < 5 * typical)


def measure(run_dir: Path, kills: list[float], interval: int) -> dict:
    events = read_jsonl(events_path(run_dir))
    attempts = [e for e in events if e.get("event") == ATTEMPT_EVENT]
    saves = [e for e in events if e.get("event") == CHECKPOINT_EVENT]
    step = step_time(run_dir, interval)
    first = attempts[0]
    start = first["time"] - first["first_step_s"]
    end = saves[-1]["time"]
    steps = saves[-1]["step"]
    restarts = []
    for kill in kills:  # the kill to the next attempt's first step less one step; another kill before: skipped
        later = [a for a in attempts if a["time"] > kill]
        if later and not any(kill < k < later[0]["time"] for k in kills):
            restarts.append(later[0]["time"] - step - kill)
    return {"steps": steps, "wall_s": end - start, "step_s": step, "goodput": steps * step / (end - start),
            "save_s": statistics.median(e["blocking_s"] for e in saves), "saves": len(saves),
            "restart_s": statistics.fmean(restarts) if restarts else float("nan"), "restarts_timed": len(restarts),
            "attempts": len(attempts), "interrupted_restarts": len(kills) - len(restarts)}


def probe(runs_dir: Path, ranks: int, steps: int, interval: int) -> dict:
    """A failure-free run: step time, save cost, start-up phases."""
    log = runs_dir / "probe.log"
    proc = usp_train(runs_dir, "probe", ranks, [f"train.steps={steps}", f"checkpoint.interval={interval}"], log)
    if proc.wait() != 0:
        sys.exit(f"the probe run failed: {log}\n{log.read_text()[-3000:]}")
    run_dir = runs_dir / "probe"
    events = read_jsonl(events_path(run_dir))
    attempt = next(e for e in events if e.get("event") == ATTEMPT_EVENT)
    saves = [e["blocking_s"] for e in events if e.get("event") == CHECKPOINT_EVENT]
    step = step_time(run_dir, interval)
    start = attempt["imports_s"] + attempt["rendezvous_s"] + attempt["build_s"] + attempt["first_step_s"] - step
    return {"step_s": step, "save_s": statistics.median(saves), "startup_s": start}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=10.0, help="wall time of the run with failures (about)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mtbf-s", type=float, default=60.0, help="mean seconds between injected failures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    p.add_argument("--smoke", action="store_true", help="2 ranks, 60 steps, kills at 4 s and 14 s after the "
                                                         "first step (the test suite's check of the flow)")
    args = p.parse_args()
    runs_dir = Path(args.out or tempfile.mkdtemp(prefix="usp-faults-"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    ranks = 2 if args.smoke else args.ranks
    costs = probe(runs_dir, ranks, 20 if args.smoke else 60, 10)
    if args.smoke:
        interval, steps, schedule, mtbf = 5, 60, [4.0, 14.0], 10.0
    else:
        mtbf, schedule = args.mtbf_s, None
        interval = max(1, round(young_daly(costs["save_s"], mtbf) / costs["step_s"]))
        restart_guess = costs["startup_s"] + 2.0  # + torchrun noticing the failure and starting the ranks
        expected = goodput(interval * costs["step_s"], costs["save_s"], restart_guess, mtbf)
        steps = int(args.minutes * 60 * expected / costs["step_s"])
    name = "faults"
    log = runs_dir / f"{name}.log"
    started = time.time()
    proc = usp_train(runs_dir, name, ranks, [f"train.steps={steps}", f"checkpoint.interval={interval}",
                                             "train.max_restarts=1000"], log)
    run_dir = runs_dir / name
    wait_for_first_step(run_dir, proc)
    injector = Injector(run_dir / "plan.yaml", mtbf, args.seed, schedule)
    injector.start()
    code = proc.wait()
    injector.done.set()
    injector.join()
    if code != 0:
        sys.exit(f"the run failed ({code}): {log}\n{log.read_text()[-3000:]}")
    measured = measure(run_dir, injector.kills, interval)
    failures = len(injector.kills)
    tau = interval * measured["step_s"]
    predicted = goodput(tau, measured["save_s"], measured["restart_s"], mtbf)
    realised_mtbf = measured["wall_s"] / max(failures, 1)
    predicted_realised = goodput(tau, measured["save_s"], measured["restart_s"], realised_mtbf)
    result = {**machine(), "ranks": ranks, "mtbf_s": mtbf, "seed": args.seed, "interval_steps": interval,
              "interval_s": tau, "probe": costs, "kills": failures, "missed_kills": len(injector.missed),
              "measured": measured, "predicted": predicted, "predicted_at_realised_mtbf": predicted_realised,
              "realised_mtbf_s": realised_mtbf, "kill_times": injector.kills,
              "error": measured["goodput"] / predicted - 1,
              "error_at_realised_mtbf": measured["goodput"] / predicted_realised - 1,
              "total_s": time.time() - started, "runs_dir": str(runs_dir)}
    m = measured
    emit(result, args, [
        f"{ranks} ranks, {m['steps']} steps, checkpoint every {interval} steps ({tau:.2f} s), "
        f"{failures} ranks killed (+{len(injector.missed)} kills that found none) over {m['wall_s']:.0f} s",
        f"measured: step {m['step_s']:.4f} s, save {m['save_s']:.3f} s, restart {m['restart_s']:.2f} s "
        f"(mean of {m['restarts_timed']}), {m['attempts']} launches",
        f"goodput measured {m['goodput']:.3f}; predicted {predicted:.3f} at the injected MTBF {mtbf:g} s "
        f"({result['error']:+.1%}), {predicted_realised:.3f} at the realised {realised_mtbf:.1f} s "
        f"({result['error_at_realised_mtbf']:+.1%})",
    ])
    (runs_dir / "faults.json").write_text(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
    main()
