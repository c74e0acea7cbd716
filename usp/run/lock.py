"""One live run per run directory: <run_dir>/run.lock. No torch: the launchers, the engine and
`usp status` all use it.

The lock is a small JSON file created with O_EXCL (two launches can't both create it):

    {"pid": 4242, "host": "node1", "started": 1700000000.0, "slurm_job": "123" | null,
     "token": "9f1c...", "pid_start": "123456"}

`usp train` takes it before it writes anything in the run directory and gives it back when the run
ends; the engine's rank 0 keeps its mtime fresh (the heartbeat, every HEARTBEAT_S seconds) and takes
the lock itself when nothing did (a Slurm job, torchrun started by hand). The launcher hands its
token to the ranks in USP_RUN_LOCK_TOKEN, so rank 0 knows the lock is its launcher's.

A lock is live when its process is alive (same host: the pid exists and started when the lock
says), or, for a lock of another host, when its heartbeat is younger than STALE_AFTER_S. A stale
lock is taken over with a message."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from usp.errors import LaunchError

LOCK = "run.lock"
TOKEN_ENV = "USP_RUN_LOCK_TOKEN"
HEARTBEAT_S = 5.0  # rank 0 touches the lock this often
STALE_AFTER_S = 120.0  # another host's lock without a heartbeat for this long is stale
_FRESH_EMPTY_S = 10.0  # a lock just created (O_EXCL) may not have its JSON yet: live while this young


def lock_path(run_dir) -> Path:
    return Path(run_dir) / LOCK


@dataclass
class LockInfo:
    """What a run.lock says, and whether its run is alive (see the module docstring)."""

    path: Path
    record: dict
    heartbeat: float  # the lock file's mtime
    live: bool
    reason: str  # why it is live or stale, for messages

    def owner(self) -> str:
        r = self.record
        job = f"Slurm job {r['slurm_job']}, " if r.get("slurm_job") else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(r.get("started") or self.heartbeat)))
        return f"{job}pid {r.get('pid', '?')} on {r.get('host', '?')}, started {started}"


def pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): tells a
    reused pid from the process that took the lock. None where /proc has no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def read_lock(run_dir, now: float | None = None) -> LockInfo | None:
    """The run directory's lock and whether it is live; None without one."""
    path = lock_path(run_dir)
    try:
        heartbeat = path.stat().st_mtime
        text = path.read_text()
    except OSError:
        return None
    now = time.time() if now is None else now
    age = now - heartbeat
    try:
        record = json.loads(text)
        assert isinstance(record, dict)
    except (ValueError, AssertionError):
        live = age < _FRESH_EMPTY_S
        return LockInfo(path, {}, heartbeat, live, "being written" if live else "unreadable and old")
    host, pid = record.get("host"), record.get("pid")
    pid = pid if isinstance(pid, int) else 0
    if host == socket.gethostname() and pid:
        start = pid_start(pid)
        if not _pid_alive(pid) or (start is not None and record.get("pid_start") not in (None, start)):
            return LockInfo(path, record, heartbeat, False, f"process {pid} is not running")
        return LockInfo(path, record, heartbeat, True, f"process {pid} is running")
    if age > STALE_AFTER_S:
        return LockInfo(path, record, heartbeat, False, f"no heartbeat for {age:.0f} s")
    return LockInfo(path, record, heartbeat, True, f"heartbeat {age:.0f} s ago")


class RunLock:
    """A lock this process holds (or, in the engine, its launcher's lock it keeps alive)."""

    def __init__(self, run_dir, token: str, owned: bool):
        self.path, self.token, self.owned = lock_path(run_dir), token, owned
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.path)

    def start_heartbeat(self, every: float = HEARTBEAT_S) -> None:
        """Touch the lock every `every` seconds from a daemon thread, whatever a step costs."""
        def loop():
            while not self._stop.wait(every):
                self.beat()

        self.beat()
        self._thread = threading.Thread(target=loop, name="usp-run-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat; remove the lock if it is still ours (never another run's)."""
        self._stop.set()
        if not self.owned:
            return
        _HELD.pop(str(self.path), None)
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()


_HELD: dict[str, RunLock] = {}  # locks this process holds, released at exit if nobody did


@atexit.register
def _release_all() -> None:
    for lock in list(_HELD.values()):
        lock.release()


def _create(path: Path, token: str) -> bool:
    """Create the lock with O_EXCL; False when one exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    pid = os.getpid()
    record = {"pid": pid, "host": socket.gethostname(), "started": time.time(),
              "slurm_job": os.environ.get("SLURM_JOB_ID"), "token": token, "pid_start": pid_start(pid)}
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
    return True


def held_token(run_dir) -> str | None:
    """The token of the lock this process holds on `run_dir` (None: it holds none)."""
    lock = _HELD.get(str(lock_path(run_dir)))
    return lock.token if lock is not None else None


def release(run_dir) -> None:
    """Give back the lock this process holds on `run_dir`, if any."""
    lock = _HELD.get(str(lock_path(run_dir)))
    if lock is not None:
        lock.release()


def _same_slurm_job(info: LockInfo) -> bool:
    """A lock of this very Slurm job: an earlier attempt of it (requeued, maybe on another node)."""
    job = os.environ.get("SLURM_JOB_ID")
    return bool(job) and info.record.get("slurm_job") == job


def refuse_if_locked(run_dir, verb: str = "train") -> LockInfo | None:
    """LaunchError when a live run holds the run directory; the stale lock (or None) otherwise."""
    info = read_lock(run_dir)
    if info is not None and info.live and not _same_slurm_job(info):
        raise LaunchError(f"the run directory {Path(run_dir)} is in use by a live run ({info.owner()}; "
                          f"{info.reason})", key="train.name", value=Path(run_dir).name,
                          fix=f"wait for it to finish (`usp status {run_dir}`), stop it (Ctrl-C, kill "
                              f"{info.record.get('pid', '<pid>')} or `usp cancel`), or {verb} under another "
                              "train.name")
    return info


def acquire(run_dir, say=print, token: str | None = None) -> RunLock:
    """Take the run directory's lock: refused (LaunchError) while a live run holds it; a stale lock
    is taken over with a message. A lock with `token`, or one this process holds already, is
    adopted: kept alive, not removed by the adopter's release (the engine's rank 0 under its
    launcher; a process that runs several runs one after another, like a sweep or the tests)."""
    path = lock_path(run_dir)
    for _ in range(3):
        current = read_lock(run_dir)
        ours = _HELD.get(str(path))  # one process may run its runs one after another
        adoptable = {t for t in (token, ours.token if ours is not None else None) if t}
        if current is not None and current.record.get("token") in adoptable:
            # the launcher's (or ours): keep it alive, don't remove it
            return RunLock(run_dir, current.record["token"], owned=False)
        mine = secrets.token_hex(8)
        if _create(path, mine):
            lock = _HELD[str(path)] = RunLock(run_dir, mine, owned=True)
            return lock
        stale = refuse_if_locked(run_dir)
        if stale is not None and _remove_if_unchanged(stale):
            say(f"usp: taking over the stale run lock {path} ({stale.owner()}: {stale.reason})")
    raise LaunchError(f"could not take the run lock {path}: other launches keep taking it", key="train.name",
                      value=Path(run_dir).name, fix="run one `usp train` per run directory at a time")


def _remove_if_unchanged(stale: LockInfo) -> bool:
    """Remove a stale lock unless another launch replaced it meanwhile (they serialize on an flock)."""
    import fcntl

    guard = stale.path.with_name(LOCK + ".takeover")
    with open(guard, "a") as g:
        fcntl.flock(g, fcntl.LOCK_EX)
        again = read_lock(stale.path.parent)
        if again is None:
            return True  # gone already: the next O_EXCL create decides
        if (again.live and not _same_slurm_job(again)) or again.record.get("token") != stale.record.get("token"):
            return False
        stale.path.unlink(missing_ok=True)
        return True
