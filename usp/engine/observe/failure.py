"""Why and where a rank failed, written down before the process dies.

`record_failures` wraps the worker entry: any exception writes logs/failure_rank<R>.json
(rank, node, mesh coordinates, pipeline stages, error class, message, traceback tail, last
completed step) and a one-line note at the end of logs/rank_<R>.log, then propagates.
`usp status` reads these files to name the root cause. No torch import: exceptions are
recognised by class name and message, so this also works before torch is set up."""
from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

from usp.contract.plan_file import read_plan
from usp.contract.run_plan import RunPlan
from usp.contract.typed import PlanFileError
from usp.run.files import DISK_FULL, LOST_PEER, OOM, PYTHON, TIMEOUT, failure_path, rank_log

# Lower-case message fragments, checked in this order (a lost connection often mentions a timeout).
_OOM_TEXT = ("out of memory",)
_LOST_PEER_TEXT = ("connection closed", "connection reset", "closed by peer", "reset by peer", "pair closure",
                   "broken pipe", "connection refused", "remote process exited", "socket closed",
                   "nccl communicator was aborted", "peer closed")
_TIMEOUT_TEXT = ("timed out", "timeout")
_DIST_TYPES = {"RuntimeError", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError",
               "TimeoutError"}


def classify(exc: BaseException) -> str:
    """"OOM", "disk full", "collective timeout", "lost peer" or "Python error" (the exception and its causes)."""
    from usp.engine.diskfull import is_disk_full

    if is_disk_full(exc):
        return DISK_FULL
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for e in chain:
        names = {c.__name__ for c in type(e).__mro__}
        text = str(e).lower()
        if names & {"OutOfMemoryError", "MemoryError"} or any(t in text for t in _OOM_TEXT):
            return OOM
        if names & _DIST_TYPES or "ConnectionError" in names:
            if "DistNetworkError" in names or "ConnectionError" in names or any(t in text for t in _LOST_PEER_TEXT):
                return LOST_PEER
            if any(t in text for t in _TIMEOUT_TEXT):
                return TIMEOUT
    return PYTHON


def record_failure(run_dir, plan: RunPlan, rank: int, exc: BaseException, last_step: int | None) -> Path:
    """Write logs/failure_rank<rank>.json atomically and append the whole traceback and a one-liner
    to logs/rank_<rank>.log."""
    from usp.run.files import write_text_atomic

    info = plan.ranks[rank] if 0 <= rank < len(plan.ranks) else None
    coords = dict(info.coords) if info is not None else {}
    stages = None
    if plan.pipeline is not None and "pp" in coords:
        stages = list(plan.pipeline.rank_stages[coords["pp"]])
    now = time.time()
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    record = {
        "rank": rank, "node": info.node if info else None, "local_rank": info.local_rank if info else None,
        "host": socket.gethostname(), "pid": os.getpid(), "coords": coords, "stages": stages,
        "error_class": classify(exc), "exception_type": _qualname(exc), "message": str(exc)[:2000],
        "traceback": tb[-4000:], "last_completed_step": last_step,
        "time": datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds"), "unix_time": now,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
    }
    path = failure_path(run_dir, rank)
    write_text_atomic(path, json.dumps(record, indent=2) + "\n")
    with open(rank_log(run_dir, rank), "a") as log:  # the one-line summary last: `tail -1` reads it
        log.write(tb + failure_line(record) + "\n")
    return path


def failure_line(record: dict) -> str:
    """One line for logs and terminals: what failed, where, after which step."""
    first = (record.get("message") or "").strip().splitlines()
    step = record.get("last_completed_step")
    return (f"{record.get('time', '')} rank{record.get('rank')} FAILED ({record.get('error_class')}): "
            f"{record.get('exception_type')}: {first[0] if first else ''} "
            f"[last completed step: {'-' if step is None else step}; {failure_path('.', record.get('rank'))}]")


def record_failures(worker):
    """Decorator for the worker entry `worker(plan_path)`: an exception is recorded, then re-raised
    (`recorded(exc)` says whether the record was written). The rank is torchrun's RANK; the last
    completed step comes from the `trainer` local of the failing call (its `last_completed_step`),
    when it got that far."""
    @functools.wraps(worker)
    def wrapper(plan_path, *args, **kwargs):
        try:
            return worker(plan_path, *args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            from usp.engine.signals import interrupted

            if interrupted() or isinstance(exc, PlanFileError):  # a peer's Ctrl-C; a plan.yaml it can't read
                raise
            try:
                plan = read_plan(Path(plan_path))
                trainer = _local_of(exc, worker.__code__, "trainer")
                path = record_failure(plan.run_dir, plan, int(os.environ.get("RANK", "0")), exc,
                                      getattr(trainer, "last_completed_step", None))
                _recorded[id(exc)] = path
            except Exception as err:  # never hide the real error behind a reporting problem
                print(f"usp: could not record the failure: {err!r}", file=sys.stderr)
            raise
    return wrapper


_recorded: dict[int, Path] = {}  # id(exception) -> its failure record, for the exception being raised


def recorded(exc: BaseException) -> Path | None:
    """The failure record written for `exc` by record_failures (None: none was written)."""
    return _recorded.get(id(exc))


def _local_of(exc: BaseException, code, name: str):
    """Value of local `name` in the frame of `code` on the exception's traceback (or None)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return tb.tb_frame.f_locals.get(name)
        tb = tb.tb_next
    return None


def _qualname(exc: BaseException) -> str:
    cls = type(exc)
    module = cls.__module__
    return cls.__qualname__ if module in ("builtins", "__main__") else f"{module}.{cls.__qualname__}"
