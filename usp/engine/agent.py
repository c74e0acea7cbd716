"""The torchrun agent as usp starts it: `python -m usp.engine.agent <torchrun options>` runs
`python -m torch.distributed.run` unchanged, except that a stop signal it passes on to its ranks
ends it quietly with 128 + the signal's number instead of a traceback, and without torchrun's log
lines about it: the ranks and the launcher say what happened (usp/engine/signals.py,
usp/launch/local.py, the Slurm batch script)."""
from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main

# torchrun's log lines that usp says better: (logger, the start of the message).
_NOISE = (("torch.distributed.elastic.agent.server.api", "Received %s death signal"),
          ("torch.distributed.elastic.multiprocessing.api", "Sending process %s closing signal"))


def _not_noise(record: logging.LogRecord) -> bool:
    return not any(record.name == name and str(record.msg).startswith(start) for name, start in _NOISE)


def main(argv: list[str] | None = None) -> None:
    for name in {name for name, _ in _NOISE}:
        logging.getLogger(name).addFilter(_not_noise)
    try:
        torchrun_main(argv)
    except SignalException as exc:
        sys.exit(128 + int(exc.sigval))


if __name__ == "__main__":
    main()
