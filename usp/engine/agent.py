"""The torchrun agent as usp starts it: `python -m usp.engine.agent <torchrun options>` runs
`python -m torch.distributed.run` unchanged, except for what it prints:

- a stop signal it passes on to its ranks ends it quietly with 128 + the signal's number instead
  of a traceback, and without torchrun's log lines about it: the ranks and the launcher say what
  happened (usp/engine/signals.py, usp/launch/local.py, the Slurm batch script);
- failed ranks end it with exit code 1 and one line (none under `usp train`, which prints the
  root cause itself) instead of torchrun's report of every rank's traceback: the tracebacks are
  in the run's logs (usp/engine/observe/failure.py), and `usp status` names the root cause;
- once a rank has failed, the ranks still running get FAILED_GROUP_STOP_S after SIGTERM before
  SIGKILL, not torchrun's fixed 30 s (below)."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException, SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from usp.engine.signals import RENDEZVOUS_STOP_S
from usp.engine.startup_gc import freeze_imports
from usp.run.files import SUMMARY_BY_LAUNCHER_ENV, logs_dir

# torchrun's log lines that usp says better: (logger, the start of the message).
_NOISE = (("torch.distributed.elastic.agent.server.api", "Received %s death signal"),
          ("torch.distributed.elastic.multiprocessing.api", "Sending process %s closing signal"),
          ("torch.distributed.elastic.multiprocessing.api", "failed (exitcode: %s)"),
          # a rank that didn't end on SIGTERM (a hung one, SIGSTOPped or frozen: docs/hangs.md) gets SIGKILL
          ("torch.distributed.elastic.multiprocessing.api", "Unable to shutdown process %s via %s"),
          ("torch.distributed.elastic.multiprocessing.errors.error_handler", "no error file defined for parent"))


# When a rank fails (or exits 75 after a hang verdict), torchrun's poll stops the others with SIGTERM and
# SIGKILL after a fixed 30 s (SubprocessContext._poll calls close() without a timeout; --shutdown-timeout
# reaches only a stop signal's and the final shutdown's close). The ranks left can't use that time: a
# live rank whose peer died fails its next collective on its own (gloo: the connection resets), one
# waiting in the rendezvous ends RENDEZVOUS_STOP_S after the signal (usp/engine/signals.py), and a stuck
# rank (SIGSTOPped, frozen: docs/hangs.md) never reacts to SIGTERM. 5 s past the rendezvous limit, so that
# such a rank still ends on its own, saying why. A stop signal's close keeps --shutdown-timeout: there the
# ranks stop at a step boundary with a checkpoint.
FAILED_GROUP_STOP_S = int(RENDEZVOUS_STOP_S) + 5
_torchrun_close = SubprocessContext.close


def _close(self: SubprocessContext, death_sig=None, timeout: int = FAILED_GROUP_STOP_S) -> None:
    _torchrun_close(self, death_sig, timeout)


def _not_noise(record: logging.LogRecord) -> bool:
    return not any(record.name == name and str(record.msg).startswith(start) for name, start in _NOISE)


def main(argv: list[str] | None = None) -> None:
    SubprocessContext.close = _close  # type: ignore[method-assign]
    for name in {name for name, _ in _NOISE}:
        logging.getLogger(name).addFilter(_not_noise)
    try:
        torchrun_main(argv)
    except SignalException as exc:
        sys.exit(128 + int(exc.sigval))
    except ChildFailedError as exc:
        if os.environ.get(SUMMARY_BY_LAUNCHER_ENV) != "1":
            print(_failed_line(exc, argv if argv is not None else sys.argv[1:]), file=sys.stderr, flush=True)
        sys.exit(1)


def _failed_line(exc: ChildFailedError, argv: list[str]) -> str:
    rank, first = exc.get_first_failure()
    others = sorted(r for r in exc.failures if r != rank)
    also = f" (then rank(s) {', '.join(map(str, others))})" if others else ""
    run_dir = Path(argv[argv.index("--plan") + 1]).parent if "--plan" in argv[:-1] else None
    where = f"; tracebacks in {logs_dir(run_dir)}, root cause: usp status {run_dir}" if run_dir else ""
    return f"usp: rank {rank} failed first, exit code {first.exitcode}{also}{where}"


if __name__ == "__main__":
    freeze_imports()  # the imports above ran with the collector paused (usp/engine/__init__.py)
    main()
