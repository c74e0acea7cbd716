"""`usp train`'s handling of stop signals while torchrun runs (usp/launch/stop_signals.py), on a real
child process: the first signal is passed on, a second SIGHUP changes nothing (and the first one's
message says so by naming the signals that do stop at once), a second SIGTERM kills the tree."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from usp.launch.stop_signals import StopForwarder

CHILD = "import signal, time; signal.signal(signal.SIGHUP, signal.SIG_IGN); signal.signal(signal.SIGTERM, " \
        "signal.SIG_IGN); time.sleep(60)"  # a torchrun stand-in that outlives the first signal


def test_a_second_sighup_changes_nothing_and_the_message_says_what_does(capfd):
    proc = subprocess.Popen([sys.executable, "-c", CHILD], start_new_session=True)
    try:
        time.sleep(0.5)  # the child's handlers installed
        with StopForwarder(proc) as stops:
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)
            assert (stops.first, stops.second) == ("SIGHUP", None) and proc.poll() is None
            os.kill(os.getpid(), signal.SIGTERM)
            assert proc.wait(timeout=10) == -signal.SIGKILL and stops.second == "SIGTERM"
        err = capfd.readouterr().err
        assert "send SIGINT or SIGTERM to stop at once" in err and "send SIGHUP again" not in err, err
    finally:
        proc.kill()
        proc.wait()
