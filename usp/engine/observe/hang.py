"""The hang watchdog (docs/hangs.md): a thread in every rank that notices when the rank makes no
progress, names the rank the others wait for, and ends the run so that it can be restarted.

The trainer says when a phase of its loop begins (a step, an evaluation, a checkpoint: `beat`); each
phase has its own allowance, recorded in the plan (RunPlan.decisions.hang). The beat is also written
to logs/heartbeat_rank<R>.json, in place, so that the other ranks can see where this one was. When a
phase outlasts its allowance, the watchdog thread:

 1. dumps the rank's Python stacks (every thread, faulthandler) to logs/stacks_rank<R>.txt and torch's
    flight recorder of its collectives to logs/fr_trace_rank<R>.json (where torch records one: gloo
    and NCCL with TORCH_FR_BUFFER_SIZE, which usp's launchers set);
 2. adds "detected" to its heartbeat: where its main thread is, the collective it waits in, and what
    /proc says about the other ranks of its host (a stopped rank can't speak for itself);
 3. after a settle time, the first live rank to claim this hang writes logs/hang.json (who is stuck,
    usp/engine/observe/hang_verdict.py) and a stack file for each rank that did not respond;
 4. waits grace_s for the stall to clear. If its rank moves again, the run stops at the next step
    boundary with a checkpoint (signals.HANG); else every live rank exits with EXIT_HUNG. Before that,
    where every rank holds the whole state (plain DDP), the verdict's writer saves the last step it
    applied alone, with no collective (Checkpointer.save_alone), and the other live ranks wait for it;
    a sharded layout needs every rank for a checkpoint, so the verdict says why none was written.

A rank blocked in a collective holds no Python lock, so the thread runs while the main thread waits."""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from usp.contract.run_plan import RunPlan
from usp.engine import signals
from usp.engine.observe.hang_verdict import process_state, read_heartbeat, silent_stacks_text, verdict, where_text
from usp.run import lock as runlock
from usp.run.files import (
    EXIT_HUNG,
    HANG_EVENT,
    HANG_GLOB,
    SUMMARY_BY_LAUNCHER_ENV,
    append_event,
    fr_trace_path,
    hang_path,
    hang_saved_text,
    heartbeat_path,
    logs_dir,
    stacks_path,
    staged,
    write_text_atomic,
)


def launch_id() -> str:
    """This launch and attempt: torchrun's run id and restart count, Slurm's requeue count."""
    env = os.environ
    return (f"{env.get('TORCHELASTIC_RUN_ID', 'local')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            f"/{env.get('SLURM_RESTART_COUNT', '0')}")


@dataclass(frozen=True)
class Beat:
    """Where the rank's main thread is: the phase, its step, since when (wall and monotonic clock)."""

    seq: int
    phase: str
    step: int
    since: float
    since_mono: float
    allowance: float | None  # None: not armed (before the first step, after the loop)


class Heartbeat:
    """logs/heartbeat_rank<R>.json, rewritten in place through one descriptor: no new file per beat,
    and a reader sees the whole record or retries (hang_verdict.read_heartbeat). Padded with spaces to
    the longest record so far, so a shorter record never leaves a longer one's tail behind."""

    def __init__(self, path: Path, fixed: dict):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fixed, self._size, self._lock = fixed, 0, threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, record: dict) -> None:
        data = json.dumps({**self.fixed, **record}).encode()
        with self._lock:
            self._size = max(self._size, len(data) + 1)
            with contextlib.suppress(OSError):  # a full disk must not stop training; the beat is advice
                os.pwrite(self._fd, data.ljust(self._size - 1) + b"\n", 0)

    def close(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            os.close(self._fd)


class HangWatch:
    def __init__(self, plan: RunPlan, rank: int, log, checkpointer=None, start_step: int = 0,
                 group: int | None = None):
        assert plan.decisions.hang is not None
        self.group = group  # torchft: this rank's replica group (`plan` is the group's, its ranks numbered in it)
        self.checkpointer = checkpointer  # saves alone when the stall does not clear (None: nothing to save)
        self._start, self._applied = start_step, start_step  # _applied: the last step in the weights (step_applied)
        self.window, self.plan, self.rank, self.log = plan.decisions.hang, plan, rank, log
        self.run_dir, self.launch = Path(plan.run_dir), launch_id()
        self.host = socket.gethostname()
        node = plan.ranks[rank].node
        self.neighbours = [r.rank for r in plan.ranks if r.node == node and r.rank != rank]
        self._main = threading.get_ident()  # the training loop's thread
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._beat = Beat(0, "start", 0, time.time(), time.monotonic(), None)
        self._first = True
        self._deferred = -1  # torchft: the beat this group waits in for another group's stuck rank (not re-reported)
        self.heartbeat = Heartbeat(heartbeat_path(self.run_dir, rank, group), {
            "rank": rank, "pid": os.getpid(), "pid_start": runlock.pid_start(os.getpid()), "host": self.host,
            "launch": self.launch, **({} if group is None else {"replica_group": group})})
        self._write_beat(self._beat)
        self._thread = threading.Thread(target=self._watch, name="usp-hang-watchdog", daemon=True)
        self._thread.start()

    # -- the training loop's side ------------------------------------------------------------
    def beat(self, phase: str, step: int) -> None:
        """The main thread begins `phase` ("step", "eval", "checkpoint") of step `step` (1-based)."""
        w = self.window
        allowance = {"step": w.first_step_s if self._first else w.step_s, "eval": w.eval_s,
                     "checkpoint": w.checkpoint_s}[phase]
        self._first = self._first and phase != "step"
        with self._lock:
            beat = self._beat = Beat(self._beat.seq + 1, phase, step, time.time(), time.monotonic(), allowance)
        self._write_beat(beat)

    def step_applied(self, step: int) -> None:
        """Step `step`'s optimizer update (and schedule) is in the state: a save from here on is of `step`.
        A stall in the step's own collectives (gradients, loss) comes before it, one in the logging,
        evaluation or checkpoint that follow comes after."""
        self._applied = step

    def stop(self) -> None:
        """The loop ended: disarmed, the thread stopped."""
        with self._lock:
            self._beat = Beat(self._beat.seq + 1, "done", self._beat.step, time.time(), time.monotonic(), None)
        self._stop.set()
        self._write_beat(self._beat)
        self.heartbeat.close()

    def _write_beat(self, beat: Beat) -> None:
        self.heartbeat.write({"step": beat.step, "phase": beat.phase, "since": beat.since,
                              "allowance_s": beat.allowance})

    # -- the watchdog thread -------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.window.poll_s):
            with self._lock:
                beat = self._beat
            stalled = time.monotonic() - beat.since_mono
            if beat.allowance is not None and stalled > beat.allowance and beat.seq != self._deferred:
                try:
                    self._on_hang(beat, stalled)
                except Exception as exc:  # never let reporting kill the thread silently: say why, go on
                    self.log.error("hang watchdog: %s", "".join(traceback.format_exception(exc)))
                    self._stop.wait(self.window.grace_s)

    def _on_hang(self, beat: Beat, stalled: float) -> None:
        detected_at = time.time()
        self.log.warning("hang: no progress for %.1f s %s (allowance %.3g s); dumping stacks", stalled,
                         where_text({"phase": beat.phase, "step": beat.step}), beat.allowance)
        frames = self._dump_stacks(beat, stalled)
        collective = self._dump_flight_recorder()
        peers = self._neighbour_states()
        self.heartbeat.write({"step": beat.step, "phase": beat.phase, "since": beat.since,
                              "allowance_s": beat.allowance, "detected": {
                                  "time": detected_at, "stalled_s": stalled, "frames": frames,
                                  "collective": collective, "peers": peers}})
        self._stop.wait(min(self.window.grace_s, 2 * self.window.poll_s + 1.0))  # the other live ranks detect too
        hang = self._write_verdict(beat, stalled, detected_at) if self._claim(beat) else None
        cleared = self._wait_for_progress(beat.seq, detected_at + self.window.grace_s)
        other = self._stuck_elsewhere(beat)
        if other is not None:  # torchft: this group waits for another group's stuck rank, and is not hung
            self._waits_for(other, hang, beat, cleared)
            return
        if hang is not None:
            if not cleared:
                hang["checkpoint"] = self._save_alone(hang)
            self._resolve(hang, cleared)
        if cleared:
            signals.request_stop(signals.HANG)  # every rank stops at the next step boundary, with a checkpoint
            return
        if hang is None:
            self._wait_for_resolution()
        self._exit()

    def _stuck_elsewhere(self, beat: Beat) -> int | None:
        """torchft: the replica group this one waits for, when no rank of this group stood out (its verdict
        names none) and another group's verdict of this stall names a stuck rank: every rank of this group
        waits in torchft's collectives or quorum for that group, which torchft leaves out once it is gone."""
        if self.group is None:
            return None
        own = read_heartbeat(hang_path(self.run_dir, self.group)) or {}
        if own.get("launch") != self.launch or own.get("stuck") or float(own.get("detected_at", 0)) < beat.since:
            return None
        for path in sorted(logs_dir(self.run_dir).glob(HANG_GLOB)):
            other = read_heartbeat(path) or {}
            if other.get("replica_group") not in (None, self.group) and other.get("stuck") \
                    and float(other.get("detected_at", 0)) >= beat.since:
                return int(other["replica_group"])
        return None

    def _waits_for(self, other: int, hang: dict | None, beat: Beat, cleared: bool) -> None:
        """This group is not hung: its verdict says so (outcome "waited", no "hung" event), and its ranks
        train on once torchft leaves the stuck group out; this beat is not reported again."""
        if hang is not None:
            hang.update(outcome="waited", waited_for_group=other, resolved_at=time.time())
            write_text_atomic(hang_path(self.run_dir, self.group), json.dumps(hang, indent=2) + "\n")
            self._say(f"usp: hang: replica group {self.group} waits for replica group {other}'s stuck rank; it is not "
                      "hung itself and trains on once torchft leaves that group out")
        if not cleared:
            self._deferred = beat.seq

    def _save_alone(self, hang: dict) -> dict:
        """hang.json's "checkpoint": {"step", "path", "saved_s", "by"} of the state this rank saved
        without its peers, or {"why"} no new checkpoint was written."""
        ckpt, step = self.checkpointer, self._applied
        why = "no checkpoint to write" if ckpt is None else ckpt.alone_why_not()
        if why is None and step <= self._start:  # a save of a later step still in flight can't finish: not this
            why = f"no step was trained in this launch: the state is that of step {step}, where it started"
        if why is not None:
            return {"why": why}
        started = time.perf_counter()
        self._say(f"usp: hang: rank {self.rank} saves the state after step {step} alone (every rank holds all of it: "
                  "plain DDP)")
        try:
            path = ckpt.save_alone(step)
        except BaseException as exc:  # DCP's CheckpointException too; the run restarts from the last checkpoint
            self.log.error("hang: the save without the stuck rank failed: %s", "".join(traceback.format_exception(exc)))
            return {"why": f"the save without the stuck rank failed: {type(exc).__name__}: {exc}"}
        return {"step": step, "path": str(path), "saved_s": round(time.perf_counter() - started, 2), "by": self.rank}

    def _wait_for_resolution(self) -> None:
        """A live rank that did not write the verdict exits only once its writer has resolved it (saved
        alone, or said why not): an exit now would have torchrun stop the writer in mid-save."""
        deadline = time.monotonic() + self.window.checkpoint_s + self.window.grace_s
        while time.monotonic() < deadline:
            hang = read_heartbeat(hang_path(self.run_dir, self.group)) or {}  # a JSON record read whole, or retried
            if hang.get("launch") == self.launch and hang.get("outcome") not in (None, "pending"):
                return
            time.sleep(self.window.poll_s)

    def _dump_stacks(self, beat: Beat, stalled: float) -> list[str]:
        """Every thread's Python stack into logs/stacks_rank<R>.txt (atomic); the main thread's
        innermost frames, as "file:line function"."""
        names = {t.ident: t.name for t in threading.enumerate()}
        of = "" if self.group is None else f" of replica group {self.group}"
        header = [f"usp hang watchdog: rank {self.rank}{of} (pid {os.getpid()} on {self.host}) made no progress for "
                  f"{stalled:.1f} s {where_text({'phase': beat.phase, 'step': beat.step})} (allowance "
                  f"{beat.allowance:.3g} s: {self.window.source})",
                  "threads: " + ", ".join(f"{ident:#x} {name}" + (" (the training loop)" if ident == self._main else "")
                                          for ident, name in names.items() if ident is not None), ""]
        with staged(stacks_path(self.run_dir, self.rank, self.group)) as tmp, open(tmp, "w") as f:
            f.write("\n".join(header) + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        frame = sys._current_frames().get(self._main)
        stack = traceback.extract_stack(frame) if frame is not None else []
        return [f"{_short(fs.filename)}:{fs.lineno} {fs.name}" for fs in stack[-4:]]

    def _dump_flight_recorder(self) -> str | None:
        """torch's flight recorder into logs/fr_trace_rank<R>.json; the collective this rank waits in, in words."""
        from usp.engine.observe.flight_recorder import dump_flight_recorder

        return dump_flight_recorder(fr_trace_path(self.run_dir, self.rank, self.group), self.plan.backend)

    def _neighbour_states(self) -> dict[str, str]:
        """What /proc says about the other ranks of this node (their pids from their heartbeats)."""
        out = {}
        for rank in self.neighbours:
            beat = read_heartbeat(heartbeat_path(self.run_dir, rank, self.group))
            if beat and beat.get("host") == self.host and beat.get("launch") == self.launch and beat.get("pid"):
                state = process_state(int(beat["pid"]), beat.get("pid_start"))
                if state is not None:
                    out[str(rank)] = state
        return out

    def _claim(self, beat: Beat) -> bool:
        """One verdict per stall, by the first live rank to claim it. Each rank that detects claims
        with an O_EXCL file per launch and beat; a claim made after this rank's beat began (its mtime
        >= beat.since) is the same stall, since this rank made no progress since: the earliest such
        claim wins, on every rank alike. A rank that was itself stopped (SIGSTOP) detects when it
        resumes, on an older beat than the rank that reported it, and stays quiet."""
        stem = f".hang_claim_{self.launch.replace('/', '_')}_"
        mine = f"{stem}{beat.phase}_{beat.step}"
        try:
            os.close(os.open(logs_dir(self.run_dir) / mine, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False  # another rank stalled at the same beat claimed it
        since_ns = int(beat.since * 1e9)
        claims = []
        for path in logs_dir(self.run_dir).glob(f"{stem}*"):
            with contextlib.suppress(OSError):
                mtime = path.stat().st_mtime_ns
                if mtime >= since_ns or path.name == mine:  # its own claim is of this stall, however coarse the clock
                    claims.append((mtime, path.name))
        return min(claims, default=(0, mine))[1] == mine

    def _write_verdict(self, beat: Beat, stalled: float, detected_at: float) -> dict:
        beats = {r: read_heartbeat(heartbeat_path(self.run_dir, r, self.group)) for r in range(self.plan.world_size)}
        hang = verdict(beats, self.launch, beat.since, {
            "rank": self.rank, "time": detected_at, "step": beat.step, "phase": beat.phase, "stalled_s": stalled,
            "window_s": beat.allowance, "source": self.window.source})
        hang["grace_s"] = self.window.grace_s
        if self.group is not None:
            hang["replica_group"] = self.group
        write_text_atomic(hang_path(self.run_dir, self.group), json.dumps(hang, indent=2) + "\n")
        for entry in hang["ranks"]:
            path = stacks_path(self.run_dir, entry["rank"], self.group)
            fresh = path.is_file() and path.stat().st_mtime >= beat.since  # its own dump (it woke up): keep it
            if not entry["responded"] and not fresh:
                write_text_atomic(path, silent_stacks_text(entry, hang))
        self._say(f"usp: hang: {_who(hang)} made no progress for {stalled:.1f} s "
                  f"{where_text({'phase': beat.phase, 'step': beat.step})} (allowance {beat.allowance:.3g} s); every "
                  f"live rank's stack is in {logs_dir(self.run_dir)}/stacks_*rank*.txt; the run stops in "
                  f"{self.window.grace_s:.3g} s unless it moves")
        return hang

    def _wait_for_progress(self, seq: int, deadline: float) -> bool:
        while time.time() < deadline:
            with self._lock:
                if self._beat.seq != seq:
                    return True
            time.sleep(min(self.window.poll_s, max(0.0, deadline - time.time())))
        with self._lock:
            return self._beat.seq != seq

    def _resolve(self, hang: dict, cleared: bool) -> None:
        """The verdict's outcome: hang.json updated, one "hung" event in logs/events.jsonl."""
        now = time.time()
        hang.update(outcome="cleared" if cleared else "stuck", resolved_at=now)
        write_text_atomic(hang_path(self.run_dir, self.group), json.dumps(hang, indent=2) + "\n")
        stuck = [e for e in hang["ranks"] if e["rank"] in hang["stuck"]]
        where = stuck[0].get("where") if stuck else where_text(hang)
        append_event(self.run_dir, HANG_EVENT, step=hang["step"], phase=hang["phase"], where=where, stuck=hang["stuck"],
                     hosts=sorted({str(e.get("host")) for e in stuck}), stalled_s=round(now - hang["detected_at"]
                                                                                     + hang["stalled_s"], 1),
                     window_s=round(hang["window_s"], 3), cleared=cleared, detected_by=hang["detected_by"],
                     **({} if cleared else {"checkpoint_step": hang.get("checkpoint", {}).get("step")}),
                     **({} if self.group is None else {"replica_group": self.group}))
        if cleared:
            self._say(f"usp: hang: {_who(hang)} moved again: every rank stops after this step with a checkpoint")
        elif os.environ.get(SUMMARY_BY_LAUNCHER_ENV) != "1":  # else `usp train` says it after the ranks end
            self._say(f"usp: hang: {_who(hang)} still stuck after {self.window.grace_s:.3g} s more: the live ranks "
                      f"exit with code {EXIT_HUNG} to be restarted; {hang_saved_text(hang.get('checkpoint'))}; "
                      f"usp status {self.run_dir}")

    def _say(self, text: str) -> None:
        self.log.warning("%s", text)
        print(text, file=sys.stderr, flush=True)

    def _exit(self) -> None:
        """Every live rank ends here when the stall did not clear: the main thread is blocked in a
        collective that can't complete, so only os._exit ends the process. Rank 0's own run lock (a
        Slurm job, torchrun started by hand) is given back first."""
        self.log.error("hang: still no progress after the grace of %.3g s: exiting with code %d", self.window.grace_s,
                       EXIT_HUNG)
        for handler in self.log.handlers:
            handler.flush()
        runlock.release(self.run_dir)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_HUNG)


def _who(hang: dict) -> str:
    """The stuck rank(s) in words: "rank 1 (pid 4242 on node7: T (stopped), ...)"."""
    stuck = [e for e in hang["ranks"] if e["rank"] in hang["stuck"]]
    of = f" of replica group {hang['replica_group']}" if hang.get("replica_group") is not None else ""
    if not stuck:
        return f"a rank{of} ({hang['reason']})"
    shown = "; ".join(f"rank {e['rank']}{of} (pid {e.get('pid', '?')} on {e.get('host', '?')}"
                      + (f": {e['process']}" if e.get("process") else "") + ")" for e in stuck[:4])
    return shown + (f" and {len(stuck) - 4} more" if len(stuck) > 4 else "")


def _short(filename: str) -> str:
    """A source path from its package on: .../site-packages/torch/distributed/x.py -> torch/distributed/x.py."""
    for root in ("/torch/", "/usp/"):
        if root in filename:
            return filename[filename.rindex(root) + 1:]
    return filename
