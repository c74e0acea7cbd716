"""`python -m usp.launch.slurm_outcome RUN_DIR SINCE CODE [NODELIST]`: what the batch script
does after the job step ends. Prints `done`, `preempted` (the ranks stopped on SIGUSR1 after a
checkpoint: requeue), `hung` (the hang watchdog stopped the run, docs/hangs.md: requeue, the next
attempt resumes from the last checkpoint), `stopped <signal>` (they stopped on SIGINT or SIGTERM: not
requeued),
`node_failure <node>:<state> ...` (the step failed and Slurm marks a node of the job down, drained
or not responding: requeue, the next attempt avoids it) or `failed`.
torchrun reports any worker exit as 1, so a stop is read from the run's logs/events.jsonl,
written by rank 0 (usp/engine/worker.py). No torch import."""
from __future__ import annotations

import sys
from pathlib import Path

from usp.launch.slurm import unhealthy_nodes
from usp.run.state import hung_since, is_preemption, stopped_since


def outcome(run_dir: Path, since: float, code: int, nodelist: str = "") -> str:
    stop = stopped_since(run_dir, since)
    if hung_since(run_dir, since) is not None:
        return "hung"
    if stop is not None:
        return "preempted" if is_preemption(stop) else f"stopped {stop['signal']}"
    if code == 0:
        return "done"
    bad = unhealthy_nodes(nodelist) if nodelist else {}
    return "node_failure " + " ".join(f"{n}:{s}" for n, s in bad.items()) if bad else "failed"


def main(argv: list[str] | None = None) -> None:
    args = (argv or sys.argv[1:]) + [""]
    print(outcome(Path(args[0]), float(args[1]), int(args[2]), args[3]))


if __name__ == "__main__":
    main()
