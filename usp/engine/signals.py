"""Preemption: Slurm sends SIGUSR1 (through the batch script's trap) or SIGTERM before it stops
a job. The trainer finishes the current step, writes a checkpoint and the worker exits with
EXIT_PREEMPTED, which launchers turn into a requeue. SIGINT (Ctrl-C) keeps Python's default:
stop now."""
from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def install(trainer) -> None:
    def request_stop(signum, frame):
        trainer.stop_requested = True
        trainer.log.info("received %s: stopping after this step with a checkpoint", signal.Signals(signum).name)

    for sig in STOP_SIGNALS:
        signal.signal(sig, request_stop)
