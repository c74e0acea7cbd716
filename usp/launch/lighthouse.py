"""torchft's lighthouse for a fault_tolerance=torchft run (docs/fault_tolerance.md): the process every
replica group asks for the step's quorum. No torch.

Locally usp/launch/ft_local.py starts it beside the groups and stops it at the end. On Slurm it is a
job of its own (usp/launch/templates/lighthouse.sbatch.j2) running `python -m usp.launch.lighthouse
RUN_DIR`: it holds the run's lock, starts the lighthouse on a free port of its node, writes the address
to <run_dir>/ft/lighthouse.json for the replica groups' array tasks (which wait for it), requeues a
replica group's task that ended before the run did (scancel, a failed step), and stops once every task
has ended."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from usp.errors import LaunchError
from usp.run.files import lighthouse_path, logs_dir, summary_path, write_text_atomic

BINARY = "torchft_lighthouse"  # the console script torchft's wheel installs (torchft._torchft:lighthouse_main)
INSTALL_FIX = "pip install 'usp[ft]' (torchft==0.2.0), or fault_tolerance=none"
READY_TIMEOUT_S = 30.0


def require_torchft() -> str:
    """The lighthouse's executable; a LaunchError naming the fix when torchft is not installed here
    (checked before anything starts, without importing torch)."""
    from importlib.util import find_spec

    beside = Path(sys.executable).parent / BINARY
    binary = str(beside) if beside.is_file() else shutil.which(BINARY)
    if find_spec("torchft") is None or binary is None:
        raise LaunchError(f"fault_tolerance=torchft needs torchft, and it is not installed in {sys.prefix}",
                          key="fault_tolerance.kind", value="torchft", fix=INSTALL_FIX)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class Lighthouse:
    """One torchft_lighthouse process, its log in <run_dir>/logs/lighthouse.log."""

    def __init__(self, ft, run_dir: Path, host: str = "localhost", bind: str = "0.0.0.0"):
        self.ft, self.run_dir, self.host, self.bind = ft, Path(run_dir), host, bind
        self.port = int(ft.lighthouse_port) or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = logs_dir(self.run_dir) / "lighthouse.log"

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, binary: str) -> list[str]:
        ft = self.ft
        return [binary, "--min_replicas", str(ft.min_replicas), "--bind", f"{self.bind}:{self.port}",
                "--join_timeout_ms", str(int(float(ft.join_timeout_s) * 1000)), "--quorum_tick_ms", "100",
                "--heartbeat_timeout_ms", str(int(float(ft.heartbeat_timeout_s) * 1000))]

    def start(self) -> Lighthouse:
        binary = require_torchft()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(self.command(binary), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env=dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info")),
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(f"torchft's lighthouse exited with code {self.proc.returncode} at start-up: "
                                  f"{_tail(self.log)}", key="fault_tolerance.lighthouse_port", value=self.port,
                                  fix="fault_tolerance.lighthouse_port=0 (a free port)")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return self
            time.sleep(0.1)
        self.stop()
        raise LaunchError(f"torchft's lighthouse did not listen on port {self.port} within {READY_TIMEOUT_S:.0f} s: "
                          f"{_tail(self.log)}", key="fault_tolerance.lighthouse_port", value=self.port,
                          fix="fault_tolerance.lighthouse_port=0 (a free port)")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Lighthouse:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:]) or "(no output)"
    except OSError:
        return "(no output)"


def _die_with_parent() -> None:
    """Linux: the lighthouse gets SIGTERM when its launcher dies, even by SIGKILL: never an orphan."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


# -- the Slurm job -----------------------------------------------------------------------------------

def serve(run_dir: Path, array_job: str | None = None, poll_s: float = 2.0) -> int:
    """The lighthouse job's body (Slurm): hold the run lock, start the lighthouse, publish its address,
    watch the replica groups' array job (requeue a task that ended before the run completed, at most
    cluster.slurm.max_requeues times each) and stop when every task has ended."""
    from usp.contract.plan_file import read_plan
    from usp.run import lock as runlock
    from usp.run.files import plan_path

    plan = read_plan(plan_path(run_dir))
    ft = plan.fault_tolerance
    if ft is None:
        raise SystemExit(f"usp: {run_dir}'s plan has no fault_tolerance section; the lighthouse serves "
                         "fault_tolerance=torchft runs only")
    lock = runlock.acquire(run_dir)
    lock.start_heartbeat()
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    started = time.time()
    try:
        with Lighthouse(ft, run_dir, host=host) as lighthouse:
            write_text_atomic(lighthouse_path(run_dir), json.dumps(
                {"address": lighthouse.address, "job": os.environ.get("SLURM_JOB_ID"), "token": lock.token,
                 "started": started}) + "\n")
            print(f"usp: lighthouse {lighthouse.address} for {ft.replica_groups} replica groups",
                  flush=True)
            return _watch(run_dir, array_job, int(plan.config.cluster.slurm.max_requeues), started, lighthouse,
                          poll_s)
    finally:
        lighthouse_path(run_dir).unlink(missing_ok=True)
        lock.release()


def _watch(run_dir: Path, array_job: str | None, max_requeues: int, started: float, lighthouse: Lighthouse,
           poll_s: float) -> int:
    from usp.launch.slurm import FINISHED_STATES, job_states, requeue

    requeued: dict[str, int] = {}
    while True:
        time.sleep(poll_s)
        if lighthouse.proc is not None and lighthouse.proc.poll() is not None:
            print(f"usp: the lighthouse exited with code {lighthouse.proc.returncode}", file=sys.stderr, flush=True)
            return 1
        if array_job is None:
            continue
        try:
            tasks = job_states(array_job)
        except LaunchError as exc:  # slurmctld busy: ask again at the next poll
            print(f"usp: {exc}", file=sys.stderr, flush=True)
            continue
        if not tasks:
            return 0
        done = _completed(run_dir, started)
        live = [t for t in tasks if t.get("JobState") not in FINISHED_STATES]
        if not live:
            return 0
        for task in tasks:
            state, index = task.get("JobState"), task.get("ArrayTaskId", "")
            if done or state not in FINISHED_STATES or state == "COMPLETED" or not index.isdigit():
                continue
            name = f"{array_job}_{index}"  # the task: a bare job id of the array's first task names every task
            if requeued.get(name, 0) >= max_requeues:
                continue
            requeued[name] = requeued.get(name, 0) + 1
            print(f"usp: replica group {index} (job {name}) ended {state} before the run completed: requeueing it "
                  f"({requeued[name]} of at most {max_requeues})", flush=True)
            try:
                requeue(name)
            except LaunchError as exc:  # the lighthouse must outlive a failed requeue: the others train on
                print(f"usp: {exc}", file=sys.stderr, flush=True)


def _completed(run_dir: Path, started: float) -> bool:
    path = summary_path(run_dir)
    return path.is_file() and path.stat().st_mtime >= started


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    if not args:
        print("usage: python -m usp.launch.lighthouse RUN_DIR [ARRAY_JOB_ID]", file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(serve(Path(args[0]), args[1] if len(args) > 1 and args[1] else None))
    except LaunchError as exc:
        print(f"usp: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
