"""What `usp train` does with SIGINT, SIGTERM and SIGHUP (its terminal went away) while torchrun runs
its ranks (no torch here).

torchrun runs in a session of its own (usp/launch/local.py), so a signal reaches usp alone, whether
it was sent to usp's pid (a job controller, an IDE's stop button, `kill`) or to its process group
(Ctrl-C in a terminal, `kill -INT -<pgid>`). The first one is passed on to torchrun, which passes
it to every rank: the ranks stop at the next step boundary with a checkpoint (usp/engine/signals.py).
A second SIGINT or SIGTERM kills torchrun and every process under it at once (ranks, their own
children): a stop that waits for a long step or checkpoint can always be cut short. A second SIGHUP
changes nothing: a closed terminal's shell may pass on the kernel's hangup again."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Self

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # torchrun passes each on to its ranks


class StopForwarder:
    """Context manager around the wait for torchrun: `first` and `second` are the names of the
    signals it acted on (None: none came)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.first: str | None = None
        self.second: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.first is None:
            self.first = name
            _say(f"usp: {name}: every rank stops after its current step and writes a checkpoint "
                 f"(send {name} again to stop at once, without one)")
            _signal(self.proc.pid, signum)
        elif self.second is None and signum != signal.SIGHUP:  # a hangup may come twice (the kernel, the shell)
            self.second = name
            _say(f"usp: second {name}: stopping every rank at once")
            kill_tree(self.proc.pid)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process under it (torchrun starts each rank in a session of its own:
    a process group signal would not reach them). The tree is read first, and `pid` killed first,
    so that torchrun can't start a rank again."""
    tree = descendants(pid)
    for each in (pid, *tree):
        _signal(each, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, parents before their children (Linux /proc; [] elsewhere)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:  # the field after the command name, which may hold spaces and parentheses
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    out, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(0), [])
        out.extend(children)
        frontier.extend(children)
    return out


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # already gone
        pass


def _say(text: str) -> None:
    """Write to stderr from a signal handler: os.write, as print could re-enter a write in progress."""
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass
