"""The torchrun agent as `usp train` starts it: `python -m usp.engine.agent <torchrun options>`
runs `python -m torch.distributed.run` unchanged, except that a stop signal (Ctrl-C, or the
launcher's SIGTERM) ends it with one line and 128 + the signal's number instead of a traceback.
torchrun has already stopped the ranks by then (it passes the signal on, then waits)."""
from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main


def main(argv: list[str] | None = None) -> None:
    try:
        torchrun_main(argv)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        what = "interrupted (Ctrl-C)" if exc.sigval == signal.SIGINT else f"stopped by {name}"
        print(f"usp: torchrun agent (node {os.environ.get('USP_NODE_RANK', '0')}) {what}; its ranks are stopped",
              file=sys.stderr, flush=True)
        sys.exit(128 + int(exc.sigval))


if __name__ == "__main__":
    main()
