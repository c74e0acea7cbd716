"""fault_tolerance=torchft on this machine (docs/fault_tolerance.md): torchft's lighthouse, then one
torchrun per replica group, each restarted on its own when it is lost. No torch.

Every group trains its own layout (dp_shard x cp x tp x pp ranks of the plan) under a torchrun of its
own (`--standalone`: its own rendezvous and store); the groups meet through the lighthouse every step
(usp/engine/fault_tolerance.py). When a group's torchrun ends with a failure (a rank killed, a node
lost, a Python error) while the run goes on, it is started again (fault_tolerance.max_group_restarts
times at most): the new ranks load the last checkpoint, join the quorum and heal from a live group.
The other groups train on meanwhile. A stop signal (Ctrl-C, SIGTERM) goes to every group, as under
one torchrun (usp/launch/stop_signals.py); nothing is restarted after it. The lighthouse is stopped
when the last group has ended, and dies with usp (PR_SET_PDEATHSIG), so no process outlives the run."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from usp.launch.lighthouse import Lighthouse
from usp.launch.local import AGENT_MODULE, SHUTDOWN_TIMEOUT_S, WORKER_MODULE, _die_with_parent, worker_env
from usp.launch.stop_signals import FORWARDED, StopForwarder, _say, _signal, kill_tree
from usp.run.files import (
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    FT_ATTEMPT_ENV,
    FT_LAUNCH_ENV,
    FT_LIGHTHOUSE_ENV,
    FT_REPLICA_GROUP_ENV,
    GROUP_RESTART_EVENT,
    STOP_CODES,
    events_path,
    stop_again_hint,
    summary_path,
)

POLL_S = 0.2
AFTER_COMPLETION_S = 10.0  # a group still running this long after the run completed is a restart too late: killed


@dataclass
class ReplicaGroup:
    index: int
    proc: subprocess.Popen | None = None
    attempt: int = 0
    code: int | None = None  # the last attempt's exit code, once it ended for good


def group_command(plan, plan_path: Path) -> list[str]:
    ft = plan.fault_tolerance
    return [sys.executable, "-m", AGENT_MODULE, "--standalone", f"--nproc-per-node={ft.group_world_size}",
            "--max-restarts=0", f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
            "--module", WORKER_MODULE, "--plan", str(plan_path)]


class _StopAll(StopForwarder):
    """StopForwarder over every group's torchrun."""

    def __init__(self, groups: list[ReplicaGroup]):
        super().__init__(None)  # type: ignore[arg-type]
        self.groups = groups

    def _on_signal(self, signum, frame) -> None:
        import signal

        name = signal.Signals(signum).name
        live = [g.proc.pid for g in self.groups if g.proc is not None and g.proc.poll() is None]
        if self.first is None:
            self.first = name
            _say(f"usp: {name}: every replica group stops after its current step ({stop_again_hint(name)})")
            for pid in live:
                _signal(pid, signum)
        elif self.second is None and signum != signal.SIGHUP:
            self.second = name
            _say(f"usp: second {name}: stopping every rank at once")
            for pid in live:
                kill_tree(pid)


def launch_replica_groups(plan, plan_path: Path) -> int:
    """Run the plan's replica groups here; the run's exit code (0: completed)."""
    from usp.engine.observe.terminal import survive_a_lost_terminal

    survive_a_lost_terminal()
    ft, run_dir = plan.fault_tolerance, Path(plan.run_dir)
    launch = secrets.token_hex(6)
    groups = [ReplicaGroup(g) for g in range(ft.replica_groups)]
    started = time.time()
    with Lighthouse(ft, run_dir, host="localhost", bind="127.0.0.1") as lighthouse:
        print(f"usp: torchft lighthouse {lighthouse.address}; {ft.replica_groups} replica groups of "
              f"{ft.group_world_size} rank(s), each restarted on its own (at most {ft.max_group_restarts} times)",
              file=sys.stderr, flush=True)
        env = worker_env(plan)
        env.update({FT_LIGHTHOUSE_ENV: lighthouse.address, FT_LAUNCH_ENV: launch})
        env.setdefault("RUST_LOG", "warn")  # torchft's manager logs every quorum and commit at info
        with _StopAll(groups) as stops:
            try:
                for group in groups:
                    _start(group, plan, plan_path, env)
                _supervise(groups, plan, plan_path, env, stops, started)
            finally:  # an error here (or KeyboardInterrupt) leaves no group behind
                for group in groups:
                    if group.proc is not None and group.proc.poll() is None:
                        kill_tree(group.proc.pid)
                        group.proc.wait()
    return _outcome(groups, stops, run_dir, started)


def _start(group: ReplicaGroup, plan, plan_path: Path, env: dict) -> None:
    env = dict(env, **{FT_REPLICA_GROUP_ENV: str(group.index), FT_ATTEMPT_ENV: str(group.attempt)})
    group.proc = subprocess.Popen(group_command(plan, plan_path), env=env, preexec_fn=_die_with_parent,
                                  start_new_session=True)


def _supervise(groups: list[ReplicaGroup], plan, plan_path: Path, env: dict, stops: _StopAll, started: float) -> None:
    ft, run_dir = plan.fault_tolerance, Path(plan.run_dir)
    completed_at = None
    while any(g.code is None for g in groups):
        time.sleep(POLL_S)
        if completed_at is None and _completed(run_dir, started):
            completed_at = time.monotonic()
        if completed_at is not None and time.monotonic() - completed_at > AFTER_COMPLETION_S:
            for group in groups:  # the run is complete: nothing a late group could add
                if group.code is None and group.proc is not None and group.proc.poll() is None:
                    kill_tree(group.proc.pid)
                    group.proc.wait()
        for group in groups:
            if group.code is not None or group.proc is None or group.proc.poll() is None:
                continue
            code = group.proc.returncode
            finished = code == 0 or stops.first is not None or code in STOP_CODES or _completed(run_dir, started)
            if finished or group.attempt >= ft.max_group_restarts:
                group.code = code
                if code and not finished:
                    print(f"usp: replica group {group.index} failed (exit code {code}) and has no restart left "
                          f"(fault_tolerance.max_group_restarts={ft.max_group_restarts}); the others train on",
                          file=sys.stderr, flush=True)
                continue
            group.attempt += 1
            print(f"usp: replica group {group.index} lost (exit code {code}); the other groups train on. "
                  f"Restarting it ({group.attempt} of at most {ft.max_group_restarts}): it rejoins and heals "
                  "from a live group", file=sys.stderr, flush=True)
            _event(run_dir, GROUP_RESTART_EVENT, group=group.index, attempt=group.attempt, exit_code=code)
            _start(group, plan, plan_path, env)


def _completed(run_dir: Path, started: float) -> bool:
    path = summary_path(run_dir)
    return path.is_file() and path.stat().st_mtime >= started - 1.0


def _event(run_dir: Path, event: str, **fields) -> None:
    path = events_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def _outcome(groups: list[ReplicaGroup], stops: _StopAll, run_dir: Path, started: float) -> int:
    codes = [g.code for g in groups]
    if _completed(run_dir, started):
        return 0
    if stops.first is not None:
        return EXIT_INTERRUPTED if stops.first == "SIGINT" or stops.second else EXIT_PREEMPTED
    stopped = [c for c in codes if c in STOP_CODES]
    if stopped:
        return stopped[0]
    return next((c for c in codes if c), 1)


__all__ = ["FORWARDED", "launch_replica_groups", "group_command"]
