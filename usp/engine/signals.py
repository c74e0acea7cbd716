"""Signals a rank acts on.

Preemption: Slurm sends SIGUSR1 (through the batch script's trap) or SIGTERM before it stops
a job. The trainer finishes the current step, writes a checkpoint and the worker exits with
EXIT_PREEMPTED, which launchers turn into a requeue.

Ctrl-C (SIGINT): stop now. The terminal sends it to every process of the group (usp, the
torchrun agent, the ranks) and the agent sends it again to its ranks, so only the first one
interrupts; each rank then prints one line and exits EXIT_INTERRUPTED (130), no traceback. A
rank blocked in a collective may see its peer leave (a gloo "connection closed") before it sees
the signal: after Ctrl-C that error, too, is the interruption, not a failure."""
from __future__ import annotations

import functools
import os
import signal
import sys
import threading

from usp.run.files import EXIT_INTERRUPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_interrupted = threading.Event()


def install(trainer) -> None:
    def request_stop(signum, frame):
        trainer.stop_requested = True
        trainer.log.info("received %s: stopping after this step with a checkpoint", signal.Signals(signum).name)

    for sig in STOP_SIGNALS:
        signal.signal(sig, request_stop)


def interrupted() -> bool:
    """Whether Ctrl-C reached this process (usp.engine.observe.failure records no failure then)."""
    return _interrupted.is_set()


def _first_interrupt(signum, frame) -> None:
    if not _interrupted.is_set():
        _interrupted.set()
        raise KeyboardInterrupt


def exits_on_interrupt(worker):
    """Decorator for the worker entry `worker(plan_path)`: Ctrl-C ends it with one line
    ("usp: rank R interrupted (Ctrl-C) after step N") and EXIT_INTERRUPTED instead of a traceback."""
    @functools.wraps(worker)
    def wrapper(plan_path, *args, **kwargs):
        _interrupted.clear()
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, _first_interrupt) if in_main else None
        try:
            return worker(plan_path, *args, **kwargs)
        except BaseException as exc:
            if not (isinstance(exc, KeyboardInterrupt) or _interrupted.is_set()):
                raise
            _say_interrupted(exc)
            return EXIT_INTERRUPTED
        finally:
            if in_main:
                signal.signal(signal.SIGINT, previous)
    return wrapper


def _say_interrupted(exc: BaseException) -> None:
    step = None
    tb = exc.__traceback__
    while tb is not None:  # the worker entry's `trainer` local, when it got that far
        step = getattr(tb.tb_frame.f_locals.get("trainer"), "last_completed_step", step)
        tb = tb.tb_next
    print(f"usp: rank {os.environ.get('RANK', '0')} interrupted (Ctrl-C) after step "
          f"{'-' if step is None else step}; the same command resumes from the last checkpoint, if any",
          file=sys.stderr, flush=True)
