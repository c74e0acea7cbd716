"""The stop signals a rank acts on: SIGINT (Ctrl-C), SIGTERM (kill, a job controller, scancel),
SIGUSR1 (Slurm before a time limit or a preemption, passed on by the batch script) and SIGHUP (the
terminal went away: an ssh session dropped; its console output then goes nowhere instead of failing
the run, usp/engine/observe/terminal.py).

The first one asks for a stop. Every rank finishes its current step, the ranks agree on the step
(the trainer max-reduces the signal over all ranks at each step boundary, so a signal that reached
one rank stops them all), they write a checkpoint, rank 0 records the stop in logs/events.jsonl,
and each rank exits with EXIT_INTERRUPTED (SIGINT) or EXIT_PREEMPTED (the others).

A rank may hear one signal twice: Slurm signals every process of a job step, and torchrun passes
the signal on again. Under torchrun a repeat changes nothing (a stop that hangs ends with
torchrun's --shutdown-timeout, or with the launcher's second signal: usp/launch/local.py). In one
process without torchrun (`usp train` of one rank) the rank is the process the user signals: a
second SIGINT or SIGTERM stops it at once, without a checkpoint, with one line and EXIT_INTERRUPTED
instead of a traceback. A rank blocked in a collective may then see its peer leave (a gloo
"connection closed") before it sees the signal: that error, too, is the interruption, not a failure."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
import time

from usp.run.files import EXIT_INTERRUPTED, EXIT_PREEMPTED, HANG_STOP, stop_again_hint

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
# Not a signal: the hang watchdog's stop after a stall that cleared (usp/engine/observe/hang.py). Above
# every signal number, so that the ranks' max-reduce names the hang when a signal came as well.
HANG = 1000
_requested = {"signal": 0}  # the first stop signal this process got (0: none)
_interrupted = threading.Event()  # stopped at once (a second signal), not at a step boundary
_at_a_boundary = threading.Event()  # the training loop reached a step boundary: a stop has its place to happen
_rendezvous = {"since": 0.0}  # monotonic time this rank entered the process group's rendezvous (0: not in it)
# torchrun stops the ranks with SIGTERM when one of them dies; a rank still in the rendezvous waits there for
# the dead one (the agent's store: no connection of the dead rank to break) until the SIGKILL that follows
# (torchrun's fixed 30 s, usp's agent's FAILED_GROUP_STOP_S; measured: a rank killed 1 s after the ranks
# started delayed the restart by 30.1 s under torchrun's). A rank stopped while
# it starts ends at once once it has waited in the rendezvous this long after the signal: live peers meet
# in far less, and before the first step there is nothing to save.
RENDEZVOUS_STOP_S = 10.0


def requested() -> int:
    """The number of the first stop signal this process got, 0 if none."""
    return _requested["signal"]


def interrupted() -> bool:
    """Whether a second signal stopped this process at once (usp.engine.observe.failure records no
    failure then)."""
    return _interrupted.is_set()


def signal_name(signum: int) -> str:
    return HANG_STOP if signum == HANG else signal.Signals(signum).name


def request_stop(code: int) -> None:
    """Ask for a stop at the next step boundary with a checkpoint, as a stop signal does (`code`: HANG)."""
    if not _requested["signal"]:
        _requested["signal"] = code


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def reached_a_boundary() -> None:
    """The training loop's stop check ran on every rank (Trainer._stop_if_signalled): from here on a stop
    signal is acted on at the step boundary only (start-up's RENDEZVOUS_STOP_S is off)."""
    _at_a_boundary.set()


@contextlib.contextmanager
def rendezvous():
    """Around the process group's and the mesh's set-up (usp/engine/parallel/mesh.py: setup), where the
    ranks wait for each other through the agent's store."""
    _rendezvous["since"] = time.monotonic()
    try:
        yield
    finally:
        _rendezvous["since"] = 0.0


def _end_start_up_after(name: str, code: int) -> None:
    """A stop signal during start-up under torchrun: the rank goes on to the first step boundary and
    stops there (nothing to save), unless it waits in the rendezvous RENDEZVOUS_STOP_S after the signal:
    then a peer is gone, and it ends here instead of at torchrun's SIGKILL."""
    signalled = time.monotonic()

    def expire() -> None:
        while not _at_a_boundary.wait(0.2):
            since = _rendezvous["since"]
            if since and time.monotonic() - max(since, signalled) > RENDEZVOUS_STOP_S:
                _say(f"usp: rank {os.environ.get('RANK', '?')}: {name} while waiting for the other ranks to start "
                     f"(still waiting {RENDEZVOUS_STOP_S:g} s later: one is gone): stopped at once, nothing to save")
                os._exit(code)
    threading.Thread(target=expire, name="usp-start-up-stop", daemon=True).start()


def _say(text: str) -> None:
    """Write to stderr from a signal handler: os.write, as print could re-enter a write in progress."""
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


def _on_stop_signal(signum, frame) -> None:
    name = signal_name(signum)
    if not _requested["signal"]:
        _requested["signal"] = signum
        logging.getLogger(f"usp.rank{os.environ.get('RANK', '0')}").info(
            "received %s: stopping after this step with a checkpoint", name)
        if not under_torchrun():  # the launcher says it for several ranks
            _say(f"usp: {name}: stopping after the current step with a checkpoint "
                 f"({stop_again_hint(name)})")
        elif not _at_a_boundary.is_set():
            _end_start_up_after(name, EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED)
        return
    if not under_torchrun() and signum in (signal.SIGINT, signal.SIGTERM) and not _interrupted.is_set():
        _interrupted.set()
        raise KeyboardInterrupt(name)


def catch_from_start() -> None:
    """A rank that torchrun started (`python -m usp.engine.worker`, usp/engine/__init__.py calls
    this before anything else is imported): a stop signal that comes while torch loads (seconds)
    asks for a stop too, instead of ending the rank with a KeyboardInterrupt traceback or silently."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)


def handles_stop_signals(worker):
    """Decorator for the worker entry `worker(plan_path)`: the stop signals ask for a stop at the
    next step boundary while it runs (the previous handlers come back after it); a second signal
    in one process ends it with one line ("usp: stopped at once by a second SIGINT after step N; ...")
    and EXIT_INTERRUPTED instead of a traceback."""
    @functools.wraps(worker)
    def wrapper(plan_path, *args, **kwargs):
        if not under_torchrun():  # a process may run several (a sweep's points); a rank runs one
            _requested["signal"] = 0
            _interrupted.clear()
        in_main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS} if in_main else {}
        try:
            return worker(plan_path, *args, **kwargs)
        except BaseException as exc:
            if not (isinstance(exc, KeyboardInterrupt) or _interrupted.is_set()):
                raise
            _say_interrupted(exc)
            return EXIT_INTERRUPTED
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return wrapper


def _say_interrupted(exc: BaseException) -> None:
    step = None
    tb = exc.__traceback__
    while tb is not None:  # the worker entry's `trainer` local, when it got that far
        step = getattr(tb.tb_frame.f_locals.get("trainer"), "last_completed_step", step)
        tb = tb.tb_next
    second = exc.args[0] if isinstance(exc, KeyboardInterrupt) and exc.args else None
    how = f"by a second stop signal ({second})" if second else "(Ctrl-C)"
    who = f"rank {os.environ.get('RANK', '0')} " if under_torchrun() else ""
    _say(f"usp: {who}stopped at once {how} after step {'-' if step is None else step}, without a checkpoint "
         "of the steps since the last one; the same command resumes from the last checkpoint, if any")
