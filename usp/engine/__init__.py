"""The engine: what runs on every rank, reading only plan.yaml as a RunPlan (usp/contract/).

Top level: the entry points (worker.py, verify_worker.py, and agent.py: torchrun's own entry,
without its tracebacks on a stop signal or a failed rank), the training loop (trainer.py with
optim.py, grad_norm.py, signals.py, sample.py and accel.py's device/dtype choices) and
checkpointing (checkpoint.py, export.py; diskfull.py says when the disk filled up). parallel/ turns
a model into a parallel one; observe/ is what a run shows and records (console, metrics, trackers,
profiler, memory probe, failures).
The engine imports usp.run, usp.contract (the plan's types), usp.data, usp.models and usp.errors;
never the planner (usp.plan, usp.perf), usp.launch or usp.report.

A rank that torchrun starts (`python -m usp.engine.worker`) catches the stop signals from here on,
before torch loads: usp/engine/signals.py. Every entry (`python -m usp.engine.<entry>`) imports torch
with Python's garbage collector paused (usp/engine/startup_gc.py), and its console writes outlive a
terminal that goes away (usp/engine/observe/terminal.py)."""
import sys
import time

PROCESS_STARTED = time.time()  # about when this rank's Python started: its start-up phases count from here


def _started_as() -> str | None:
    """The module Python was started with (`python -m usp.engine.worker`: "usp.engine.worker")."""
    argv = sys.orig_argv
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None


_ENTRY = _started_as() or ""
if _ENTRY.startswith("usp.engine."):  # an entry process (a rank, torchrun's agent, ...)
    from usp.engine.observe.terminal import survive_a_lost_terminal
    from usp.engine.startup_gc import pause

    pause()  # its `__main__` calls freeze_imports() after the imports
    survive_a_lost_terminal()  # an ssh session that drops must not fail its console writes
if _ENTRY == "usp.engine.worker":
    from usp.engine.signals import catch_from_start

    catch_from_start()
