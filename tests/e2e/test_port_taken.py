"""Several local multi-rank launches at once all start: rank 0's port can't be taken from under it.

torchrun's agent serves the ranks' store on a port it holds from before it announces it (usp shares
the agent's store, also with train.max_restarts > 0: half the launches here restart on a failure,
usp/engine/parallel/mesh.py). Before, rank 0 bound a port torchrun had picked by binding port 0 and
closing it, seconds earlier: another launch could take it in between (seen in CI as EADDRINUSE when
two test workers launched at once). The check here is real: each run's announced port is tried while
the runs start, and must already be in use."""
from __future__ import annotations

import errno
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import USP, usp_env

LAUNCHES = 4
QUIET = ["cluster=local_cpu2", "train.steps=2", "logging.console=plain", "train.sample_tokens=0",
         "train.eval_interval=0", "train.measure_memory=false", "checkpoint.enabled=false"]


def _held_by_someone(port: int) -> bool:
    try:
        socket.create_server(("", port)).close()
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    return False


@pytest.mark.distributed
def test_concurrent_local_launches_all_start_on_ports_held_from_the_start(tmp_path, shakespeare):
    env = usp_env(LOGLEVEL="INFO")  # torchrun logs the port it gives the ranks (master_port=...)
    logs = [tmp_path / f"launch{i}.log" for i in range(LAUNCHES)]
    procs = [subprocess.Popen([USP, "train", f"train.runs_dir={tmp_path}", f"train.name=run{i}", *QUIET,
                               f"train.max_restarts={i % 2}"], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
             for i, log in enumerate(logs)]
    ports: dict[int, bool] = {}  # announced port -> held by someone when tried
    try:
        deadline = time.time() + 300
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            for log in logs:
                for port in map(int, re.findall(r"master_port=(\d+)", log.read_text())):
                    if port not in ports:
                        ports[port] = _held_by_someone(port)
            time.sleep(0.05)
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outputs = [log.read_text() for log in logs]
    assert codes == [0] * LAUNCHES, "\n\n".join(out[-3000:] for out in outputs)
    assert len(ports) == LAUNCHES and all(ports.values()), ports  # no port left free for another to take
    for i in range(LAUNCHES):
        run_dir = Path(tmp_path / f"run{i}")
        assert (run_dir / "summary.json").is_file() and not list((run_dir / "logs").glob("failure_rank*.json"))
