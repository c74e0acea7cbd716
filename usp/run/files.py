"""The run directory: every path a run writes, read by the engine, the launchers and `usp report`
alike, so a file name is spelled once. No torch, no usp imports: every layer may import this.

    <run_dir>/plan.yaml              the resolved config + derived plan (the engine's only input)
    <run_dir>/job.sbatch, job.json   the Slurm script and the record of its submissions
    <run_dir>/metrics.jsonl          one JSON object per logged step
    <run_dir>/summary.json           written once a run completes
    <run_dir>/sample.txt             a text sample from the trained model
    <run_dir>/verify.json            `usp verify`'s result
    <run_dir>/logs/rank_<R>.log      per-rank logs; failure_rank<R>.json, events.jsonl beside them
    <run_dir>/logs/heartbeat_rank<R>.json  each rank's progress (step, phase) for the hang watchdog;
                                     after a hang: stacks_rank<R>.txt, fr_trace_rank<R>.json, hang.json
    <run_dir>/profile/               profiler traces (rank_<R>.json, summary_rank_<R>.txt)
    <run_dir>/checkpoints/step_<N:08d>/  checkpoints (or checkpoint.dir), complete iff manifest.json
                                         lists every file with its size; saves in progress live in
                                         .tmp-step_<N>
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

# -- file names ------------------------------------------------------------------------------
PLAN = "plan.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
SAMPLE = "sample.txt"
JOB_SCRIPT = "job.sbatch"
JOB_RECORD = "job.json"
VERIFY = "verify.json"
SWEEP = "sweep.json"
LOGS = "logs"
EVENTS = "events.jsonl"
# events.jsonl: one JSON line per run-level event. A stop signal's line: {"event": "stopped", "time",
# "step", "signal" (SIGINT, SIGTERM, SIGUSR1), "checkpoint" (the state after that step is saved)}.
# "preempted" (no signal) is the same, written by earlier versions for SIGTERM and SIGUSR1.
STOP_EVENT, OLD_STOP_EVENT = "stopped", "preempted"
# A hang (docs/hangs.md): {"event": "hung", "time", "step", "stuck": [ranks], "cleared": bool,
# "checkpoint_step" (not cleared: the step a live rank saved alone, or null), ...}, and
# when the stall cleared, the stop that follows: {"event": "stopped", "signal": "hang", ...}. A straggler:
# {"event": "straggler", "time", "step", "rank", "ratio", ...} when a rank is first flagged.
HANG_EVENT, HANG_STOP, STRAGGLER_EVENT = "hung", "hang", "straggler"
HANG = "hang.json"  # the watchdog's verdict: which rank(s) stalled, where, what each live rank was waiting in
HEARTBEAT_GLOB, STACKS_GLOB, HANG_GLOB = "heartbeat_*rank*.json", "stacks_*rank*.txt", "hang*.json"
# logs/events.jsonl's other events: "restart" (a torchrun restart: its count, the step resumed);
# "attempt" (rank 0 after each launch's first step: how long its start-up phases took, what it loaded);
# "checkpoint" (each published save: step, bytes, seconds blocked and in all). The goodput model's
# costs are fitted from them (usp/perf/calibration/restarts.py, docs/faults.md).
RESTART_EVENT, ATTEMPT_EVENT, CHECKPOINT_EVENT = "restart", "attempt", "checkpoint"
GROUP_RESTART_EVENT = "replica_group_restart"  # torchft: usp's launcher restarted one replica group
PROFILE = "profile"
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
FAILURE_GLOB = "failure_rank*.json"
RANK_LOG_GLOB = "rank_*.log"
# file names with a rank in them (group 1): logs/rank_<R>.log, profile/rank_<R>.json[.gz], profile/summary_rank_<R>.txt
RANK_LOG_RE = r"rank_(\d+)\.log"
PROFILE_TRACE_RE = r"rank_(\d+)\.json(?:\.gz)?"
PROFILE_SUMMARY_RE = r"summary_rank_(\d+)\.txt"

# -- exit codes shared by the worker, the launchers, the batch script and sweeps ---------------
EXIT_OK = 0
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGUSR1 after a checkpoint; "try again later" (requeue)
EXIT_INTERRUPTED = 130  # stopped by SIGINT (128 + SIGINT), at a step boundary or, on a second one, at once
# A hang (docs/hangs.md): the live ranks, torchrun's launcher and `usp train` exit with it too, so whatever
# restarts a preempted run (Slurm's requeue, a job controller, a sweep run again) restarts a hung one.
EXIT_HUNG = EXIT_PREEMPTED
STOP_CODES = (EXIT_PREEMPTED, EXIT_INTERRUPTED)  # a sweep stops on these; running it again resumes


def hang_saved_text(checkpoint: dict | None) -> str:
    """What the live ranks kept of a hang that did not clear, in words, from hang.json's "checkpoint":
    {"step", "path", "by"} of a save without the stuck rank, or {"why"} none was written."""
    checkpoint = checkpoint or {}
    if checkpoint.get("path"):
        return (f"rank {checkpoint.get('by')} saved the state after step {checkpoint.get('step')} without the stuck "
                f"rank, to {checkpoint['path']}")
    return f"no new checkpoint ({checkpoint.get('why', 'none was written')}): the last one is kept"


def stop_again_hint(name: str) -> str:
    """What a second signal does, as the first one's message says it: a second SIGINT or SIGTERM stops
    at once (no checkpoint); a second SIGHUP changes nothing (a closed terminal's shell may pass the
    kernel's hangup on again), so SIGHUP's message points at the other two."""
    if name == "SIGHUP":
        return "send SIGINT or SIGTERM to stop at once, without one"
    return f"send {name} again to stop at once, without one"


# -- failure classes written by the engine's failure summary, read by `usp status` -------------
OOM, TIMEOUT, LOST_PEER, PYTHON = "OOM", "collective timeout", "lost peer", "Python error"
DISK_FULL = "disk full"  # ENOSPC / EDQUOT while writing (usp.engine.diskfull)
# Set by `usp train`'s local launcher, which prints the failure summary itself: the ranks and the
# torchrun agent keep their tracebacks in the logs then, instead of printing them before it.
SUMMARY_BY_LAUNCHER_ENV = "USP_SUMMARY_BY_LAUNCHER"

# -- fault_tolerance=torchft (usp/launch/ft_local.py, the Slurm scripts, usp/engine/fault_tolerance.py) ----------
FT_REPLICA_GROUP_ENV = "USP_FT_REPLICA_GROUP"  # this process's replica group, 0 .. dp_replicate - 1
FT_LAUNCH_ENV = "USP_FT_LAUNCH"  # one id per launch of the whole run: the groups' start barrier is under it
FT_ATTEMPT_ENV = "USP_FT_ATTEMPT"  # 0 for a group's first start in a launch, then its restarts
FT_LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: the lighthouse's http://host:port
FT_DIR = "ft"  # <run_dir>/ft: the lighthouse's address (Slurm) and the start barrier
LIGHTHOUSE_FILE = "lighthouse.json"  # {"address": "http://host:port", "job": ..., "token": the run lock's}

# -- profiler span names: the trainer records them, `usp report` reads them ---------------------
SPAN_PREFIX = "usp_"  # every span the engine records starts with it
SPAN_FORWARD, SPAN_BACKWARD, SPAN_OPTIMIZER = "usp_forward", "usp_backward", "usp_optimizer"
SPAN_PIPELINE = "usp_pipeline_forward_backward"  # one span for a pipeline schedule's whole step
SPAN_STEP_PREFIX = "usp_step_"  # + the optimizer step: usp_step_<N>


def step_span(step: int) -> str:
    return f"{SPAN_STEP_PREFIX}{step}"


# Collective / point-to-point ops as the profiler names them (c10d::allreduce_, gloo:all_reduce,
# nccl:all_gather, record_param_comms, ...): the engine's profiler summary and `usp report` both ask.
_COMM = re.compile(r"c10d|gloo|nccl|xccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|send|recv|"
                   r"broadcast|record_param_comms|barrier", re.IGNORECASE)


def is_comm(name: str) -> bool:
    """aten:: ops are compute (aten::broadcast_tensors), usp_ spans are the engine's own."""
    return not name.startswith(("aten::", SPAN_PREFIX)) and _COMM.search(name) is not None


# -- paths ----------------------------------------------------------------------------------
def plan_path(run_dir) -> Path:
    return Path(run_dir) / PLAN


def metrics_path(run_dir) -> Path:
    return Path(run_dir) / METRICS


def summary_path(run_dir) -> Path:
    return Path(run_dir) / SUMMARY


def ft_start_dir(run_dir, launch: str) -> Path:
    """Where the replica groups of one launch say they are up (fault_tolerance=torchft)."""
    return Path(run_dir) / FT_DIR / f"start_{launch}"


def lighthouse_path(run_dir) -> Path:
    return Path(run_dir) / FT_DIR / LIGHTHOUSE_FILE


def logs_dir(run_dir) -> Path:
    return Path(run_dir) / LOGS


def events_path(run_dir) -> Path:
    return logs_dir(run_dir) / EVENTS


def rank_log(run_dir, rank: int) -> Path:
    return logs_dir(run_dir) / f"rank_{rank}.log"


def failure_path(run_dir, rank: int) -> Path:
    return logs_dir(run_dir) / f"failure_rank{rank}.json"


def rank_name(rank: int, group: int | None = None) -> str:
    """A rank in the hang watchdog's file names: rank<R>; under fault_tolerance=torchft, where every replica
    group numbers its ranks from 0, group<G>_rank<R> (docs/hangs.md)."""
    return f"rank{rank}" if group is None else f"group{group}_rank{rank}"


def heartbeat_path(run_dir, rank: int, group: int | None = None) -> Path:
    return logs_dir(run_dir) / f"heartbeat_{rank_name(rank, group)}.json"


def stacks_path(run_dir, rank: int, group: int | None = None) -> Path:
    return logs_dir(run_dir) / f"stacks_{rank_name(rank, group)}.txt"


def fr_trace_path(run_dir, rank: int, group: int | None = None) -> Path:
    """torch's flight recorder of a rank's collectives, dumped after a hang (docs/hangs.md)."""
    return logs_dir(run_dir) / f"fr_trace_{rank_name(rank, group)}.json"


def hang_path(run_dir, group: int | None = None) -> Path:
    """logs/hang.json; under torchft one per replica group, logs/hang_group<G>.json."""
    return logs_dir(run_dir) / (HANG if group is None else f"hang_group{group}.json")


def profile_dir(run_dir) -> Path:
    return Path(run_dir) / PROFILE


def run_checkpoint_dir(run_dir, configured: str | None) -> Path:
    """Where the run directory `run_dir` keeps its checkpoints: checkpoint.dir (`configured`), or
    <run_dir>/checkpoints (not the run_dir its plan names: a run directory copied or moved elsewhere
    keeps its own)."""
    return Path(configured) if configured else Path(run_dir) / CHECKPOINTS


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# -- writing and reading ---------------------------------------------------------------------
@contextmanager
def staged(path) -> Iterator[Path]:
    """A temporary sibling of `path` to write instead (it doesn't exist yet: make a file or a
    directory there). When the block ends, the new output replaces `path` in one step; whatever was
    at `path` (a file or a whole directory) stays intact until then. On an exception (Ctrl-C too) the
    temporary is removed and `path` is untouched; a SIGKILL leaves only the hidden temporary."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        yield tmp
        _swap_in(tmp, path)
    finally:
        _remove(tmp)  # the unfinished output, or after a swap what was at `path` before


def _swap_in(tmp: Path, path: Path) -> None:
    """rename(2) replaces a file in one step but not a directory (nor a file by a directory):
    those are exchanged with renameat2(RENAME_EXCHANGE), atomic, so `path` is never missing."""
    if not os.path.lexists(path) or not (tmp.is_dir() or path.is_dir()):
        os.replace(tmp, path)
        return
    try:
        _exchange(tmp, path)
    except OSError as exc:  # no renameat2 here (not Linux, or a filesystem without it): two renames
        if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        aside = tmp.with_name(tmp.name + "-old")
        os.replace(path, aside)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.replace(aside, path)
            raise
        os.replace(aside, tmp)


def _exchange(a: Path, b: Path) -> None:
    import ctypes  # only here: every other write needs no ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2  # <fcntl.h>, <linux/fs.h>
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and a rename, so a crash never leaves a half-written file."""
    with staged(path) as tmp:
        tmp.write_text(text)


def append_event(run_dir, event: str, **fields) -> None:
    """One line in logs/events.jsonl: {"event": ..., "time": ..., **fields}. Rank 0 writes most of them
    (stop, restart, attempt, checkpoint, straggler); the hang watchdog's "hung" comes from whichever
    live rank wrote the verdict. One O_APPEND write(2) per line, so lines appended by several
    processes never interleave."""
    path = events_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps({"event": event, "time": time.time(), **fields}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jobs(record_dir) -> list[dict]:
    """The Slurm submissions recorded in <dir>/job.json (a run dir, or a sweep dir); [] without one."""
    path = Path(record_dir) / JOB_RECORD
    return json.loads(path.read_text())["jobs"] if path.is_file() else []


def read_jsonl(path) -> list[dict]:
    """JSON lines, skipping a torn last line (a crash mid-write)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out


# -- checkpoints ------------------------------------------------------------------------------
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp-step_(\d+)")


class CheckpointInfo(NamedTuple):
    step: int
    path: Path
    complete: bool
    problem: str | None  # why it is not complete (None when it is)


def check_manifest(path: Path) -> str | None:
    """None if the checkpoint directory `path` is complete, else what is wrong with it."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST}: the save did not finish"
    try:
        data = json.loads(manifest.read_text())
        files = dict(data["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    for name, size in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"missing file {name} (listed in {MANIFEST})"
        actual = f.stat().st_size
        if actual != int(size):
            return f"{name} is {actual:,} bytes, {MANIFEST} says {int(size):,} (truncated or corrupt)"
    match = _STEP_DIR.match(path.name)
    if match and "step" in data and int(data["step"]) != int(match.group(1)):
        return f"{MANIFEST} says step {data['step']} but the directory is {path.name}"
    return None


def list_checkpoints(ckpt_dir) -> list[CheckpointInfo]:
    """Every checkpoint under `ckpt_dir`, oldest step first: (step, path, complete, problem).
    Unfinished `.tmp-step_<N>` directories are listed too, as incomplete."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        if match := _STEP_DIR.match(entry.name):
            problem = check_manifest(entry)
            out.append(CheckpointInfo(int(match.group(1)), entry, problem is None, problem))
        elif match := _TMP_DIR.match(entry.name):
            out.append(CheckpointInfo(int(match.group(1)), entry, False, "unfinished save (temporary directory)"))
    return sorted(out, key=lambda c: (c.step, c.complete))


def latest_complete(ckpt_dir) -> CheckpointInfo | None:
    done = [c for c in list_checkpoints(ckpt_dir) if c.complete]
    return done[-1] if done else None
