"""Hangs name themselves (docs/hangs.md), on real torchrun ranks over gloo: a SIGSTOPped rank is
detected within the window, every live rank's stack, the stopped rank's process state and torch's
flight recorder land in the run directory, the live rank saves the state without the stopped one
(plain DDP) and the resume from it trains exactly as an uninterrupted run, `usp train` exits 75
(restartable) and `usp status` names the rank. A stall that clears stops the run with a checkpoint; a
rank throttled by a cgroup's CPU quota is flagged as a straggler. The window, the verdict and the detector
without torch: tests/unit/test_hangs.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.test_checkpoint import worker_pids
from tests.e2e.test_fault_tolerance import _group_ranks, no_orphans  # noqa: F401 (a fixture)
from tests.e2e.test_interrupt import assert_gone
from tests.helpers import REPO, USP, run_usp, usp_env
from usp.engine.agent import FAILED_GROUP_STOP_S
from usp.engine.observe.hang_verdict import SILENT
from usp.run.checksums import verify_checkpoint
from usp.run.files import EXIT_HUNG, check_manifest, list_checkpoints, read_jsonl

WINDOW = 5.0  # train.hang_timeout_s: its poll is 0.25 s and its grace 5 s
SHAPE = ["data.tokenizer=bytes", "model.dim=32", "model.ffn_dim=64", "train.seq_len=32", "train.global_batch=4",
         "train.eval_batches=1", "train.eval_interval=0", "train.sample_tokens=0", "train.measure_memory=false",
         "logging.console=plain", "cluster.procs_per_node=2", f"train.hang_timeout_s={WINDOW:g}"]
FAST = [*SHAPE, "train.steps=100000"]
# a schedule that does not depend on train.steps: a run resumed with fewer steps trains on the same learning rates
CONSTANT = ["optimizer.schedule=constant", "optimizer.warmup_steps=0"]


def start(tmp_path: Path, name: str, *extra: str, out=subprocess.PIPE) -> subprocess.Popen:
    """`usp train` in the background; `out`: a file for a run that prints more than a pipe holds unread."""
    return subprocess.Popen([USP, "train", *FAST, f"train.name={name}", f"train.runs_dir={tmp_path}", *extra],
                            env=usp_env(), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for(what, proc: subprocess.Popen, timeout: float = 180):
    """Poll `what()` until it returns something true, while `usp train` runs."""
    deadline = time.time() + timeout
    while not (found := what()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.05)
    return found


def logged_step(run_dir: Path, step: int):
    return lambda: any(r.get("step", 0) >= step for r in read_jsonl(run_dir / "metrics.jsonl"))


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "logs" / "events.jsonl") if e.get("event") == kind]


def stop(pid: int) -> float:
    os.kill(pid, signal.SIGSTOP)
    return time.time()


def release(pids) -> None:
    """Teardown: a rank the test stopped is continued and killed, never left behind."""
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break


def assert_nothing_half_written(run_dir: Path) -> None:
    """Every JSON file in logs/ reads whole, no staged temporary is left, every published checkpoint
    is complete (a save the hang interrupted stays an unpublished .tmp-step_<N>)."""
    logs = run_dir / "logs"
    assert not [p.name for p in logs.iterdir() if ".tmp-" in p.name]
    for path in logs.glob("*.json"):
        json.loads(path.read_text())
    published = [c for c in list_checkpoints(run_dir / "checkpoints") if c.path.name.startswith("step_")]
    assert published and all(check_manifest(c.path) is None for c in published), published


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_stopped_rank_is_named_the_live_rank_saves_alone_and_the_resume_equals_an_uninterrupted_run(tmp_path):
    name, run_dir = "stopped", tmp_path / "stopped"
    # no checkpoint before the hang: the one the live rank writes alone is the only one
    proc = start(tmp_path, name, "checkpoint.interval=100000", "train.log_interval=1", *CONSTANT)
    pids: dict[int, int] = {}
    try:
        wait_for(logged_step(run_dir, 6), proc)
        pids = worker_pids(run_dir / "plan.yaml")
        stopped_at = stop(pids[1])
        wait_for(lambda: events(run_dir, "hung"), proc)
        named_at = time.time()
        hang = json.loads((run_dir / "logs" / "hang.json").read_text())
        assert_the_hang_is_named(run_dir, hang, pids, stopped_at)
        out = proc.communicate(timeout=120)[0]  # the agent SIGKILLs the stopped rank FAILED_GROUP_STOP_S after SIGTERM
        ended_at = time.time()
        print(f"stop -> hung event {named_at - stopped_at:.1f} s, -> usp train's exit {ended_at - stopped_at:.1f} s")
    finally:
        release(pids.values())
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_HUNG, out[-4000:]
    # the live rank exits once it has saved (before the event); torchrun's own 30 s wait made this 30.3 s
    assert ended_at - named_at <= FAILED_GROUP_STOP_S + 10, ended_at - named_at
    host = os.uname().nodename
    assert f"usp: hang: rank 1 (pid {pids[1]} on {host}: T (stopped)" in out, out[-4000:]
    assert "the same command resumes from" in out and "Traceback" not in out and "Unable to shutdown" not in out
    hang = json.loads((run_dir / "logs" / "hang.json").read_text())  # resolved: with the save's outcome
    saved = hang["checkpoint"]
    assert f"rank 0 saved the state after step {saved['step']} without the stuck rank" in out, out[-4000:]
    assert [(e["stuck"], e["cleared"], e["checkpoint_step"]) for e in events(run_dir, "hung")] == \
        [([1], False, saved["step"])]
    assert hang["outcome"] == "stuck" and hang["grace_s"] == WINDOW and saved["by"] == 0
    assert hang["step"] - 1 <= saved["step"] <= hang["step"], (hang["step"], saved)  # the last step applied
    assert Path(saved["path"]) == run_dir / "checkpoints" / f"step_{saved['step']:08d}"
    assert verify_checkpoint(Path(saved["path"])) == ("verified", [])  # the manifest and checksums of any save
    written = sorted(p.name for p in Path(saved["path"]).iterdir())
    assert [n for n in written if n.endswith(".distcp")] == ["__0_0.distcp"] and "rng_rank1.pt" not in written
    assert_gone(pids.values())
    assert_nothing_half_written(run_dir)
    status = run_usp("status", str(run_dir), cwd=tmp_path)
    text = " ".join(status.stdout.split())
    assert status.returncode == 0 and "state │ hung (rank 1 made no progress" in text, text
    assert f"stuck rank 1 │ node 0, local rank 1, host {host}, pid {pids[1]}" in text, text
    assert "T (stopped)" in text and "exited with code 75; rank 0 saved the state after step" in text, text
    assert_the_resume_equals_an_uninterrupted_run(tmp_path, name, saved["step"])


def assert_the_resume_equals_an_uninterrupted_run(tmp_path: Path, name: str, saved: int) -> None:
    """The run resumed from the hang's checkpoint and a run that never stopped log the same losses."""
    losses = {}
    for run in (name, "uninterrupted"):
        r = run_usp("train", *SHAPE, *CONSTANT, f"train.steps={saved + 3}", "train.log_interval=1",
                    f"train.name={run}", f"train.runs_dir={tmp_path}", cwd=tmp_path)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        losses[run] = {rec["step"]: rec["loss"] for rec in read_jsonl(tmp_path / run / "metrics.jsonl")}
    resumed, reference = losses[name], losses["uninterrupted"]
    print(f"resumed from step {saved}: {[resumed[s] for s in range(saved + 1, saved + 4)]}")
    # the stall can come after step `saved`'s update and before its metrics line (saved == the hang's step):
    # that one step is then logged only by the uninterrupted run
    assert set(range(1, saved + 4)) - set(resumed) <= {saved}, (saved, sorted(resumed))
    for step in sorted(set(range(1, saved + 4)) & set(resumed)):  # before the hang and after the resume alike
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), (step, resumed, reference)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_stopped_rank_of_a_sharded_layout_leaves_the_checkpoints_and_says_why(tmp_path):
    """FSDP: each rank holds a part of the state, so no live rank can save it alone."""
    name, run_dir = "sharded", tmp_path / "sharded"
    proc = start(tmp_path, name, "checkpoint.interval=5", "train.log_interval=1", "parallelism.dp_replicate=1",
                 "parallelism.dp_shard=2")
    pids: dict[int, int] = {}
    try:
        wait_for(logged_step(run_dir, 6), proc)
        before = [c.step for c in list_checkpoints(run_dir / "checkpoints") if c.complete]
        pids = worker_pids(run_dir / "plan.yaml")
        stop(pids[1])
        out = proc.communicate(timeout=180)[0]
    finally:
        release(pids.values())
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_HUNG, out[-4000:]
    why = "the state is sharded (fsdp: each rank holds a part of it), so a checkpoint needs every rank"
    hang = json.loads((run_dir / "logs" / "hang.json").read_text())
    assert hang["outcome"] == "stuck" and hang["checkpoint"] == {"why": why}, hang
    assert f"no new checkpoint ({why}): the last one is kept" in out, out[-4000:]
    assert [(e["stuck"], e["checkpoint_step"]) for e in events(run_dir, "hung")] == [([1], None)]
    after = [c.step for c in list_checkpoints(run_dir / "checkpoints") if c.complete]
    assert after[-1] >= before[-1] and after[-1] % 5 == 0, (before, after)  # only the interval's saves
    assert_gone(pids.values())
    text = " ".join(run_usp("status", str(run_dir), cwd=tmp_path).stdout.split())
    assert "no new checkpoint (the state is sharded" in text, text


def assert_the_hang_is_named(run_dir: Path, hang: dict, pids: dict[int, int], stopped_at: float) -> None:
    """Detected within the window; rank 1 named with its process state; rank 0's stacks and flight
    recorder written, from this checkout's code."""
    latency = hang["detected_at"] - stopped_at
    print(f"detection latency {latency:.2f} s (window {WINDOW:g} s, {hang['phase']} phase, step {hang['step']})")
    assert WINDOW - 1.0 <= latency <= WINDOW + 2.5, latency  # the live rank's stall began within a step of it
    assert hang["stuck"] == [1] and hang["reason"] == SILENT and hang["detected_by"] == 0
    ranks = {e["rank"]: e for e in hang["ranks"]}
    assert ranks[1]["process"].startswith("T (stopped), wchan ") and ranks[1]["pid"] == pids[1]
    assert ranks[0]["responded"] and ranks[0]["collective"].startswith("gloo:"), ranks[0]
    logs = run_dir / "logs"
    live = (logs / "stacks_rank0.txt").read_text()
    assert live.startswith(f"usp hang watchdog: rank 0 (pid {pids[0]} on ") and "(the training loop)" in live
    assert "Thread 0x" in live and f"{REPO}/usp/engine/trainer.py" in live  # this checkout's engine ran
    silent = (logs / "stacks_rank1.txt").read_text()
    assert "rank 1 did not respond" in silent and f"pid {pids[1]}" in silent and "T (stopped)" in silent
    trace = json.loads((logs / "fr_trace_rank0.json").read_text())
    assert any(not e["retired"] for e in trace["entries"])  # the collective rank 0 waits in


class CpuQuota:
    """A cgroup capping its threads at `share` of one CPU per 10 ms, as a job scheduler's CPU limit
    (Slurm's cgroups, Kubernetes' cpu.limits) throttles a process: cgroup v1's cpu controller or v2's
    cpu.max; the test is skipped where neither can be written."""

    def __init__(self, share: float):
        quota, name = int(share * 10000), f"usp-test-{uuid.uuid4().hex[:8]}"
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        try:
            if (v1 / "cpu.cfs_quota_us").is_file():
                self.dir, self.tasks, self.parent = v1 / name, "tasks", v1
                self.dir.mkdir()
                (self.dir / "cpu.cfs_period_us").write_text("10000")
                (self.dir / "cpu.cfs_quota_us").write_text(str(quota))
            elif "cpu" in (v2 / "cgroup.controllers").read_text().split():
                self.dir, self.tasks, self.parent = v2 / name, "cgroup.procs", v2
                self.dir.mkdir()
                (self.dir / "cpu.max").write_text(f"{quota} 10000")
            else:
                pytest.skip("no cgroup cpu controller to throttle a rank with")
        except OSError as exc:
            pytest.skip(f"can't make a cgroup to throttle a rank with: {exc}")

    def move(self, pid: int, into: bool) -> None:
        where = (self.dir if into else self.parent) / self.tasks
        for tid in os.listdir(f"/proc/{pid}/task") if self.tasks == "tasks" else [str(pid)]:
            try:
                where.write_text(tid)
            except ProcessLookupError:
                pass  # a thread that ended meanwhile

    def close(self) -> None:
        if self.dir.is_dir():
            self.dir.rmdir()


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_throttled_rank_is_flagged_and_a_stall_that_clears_stops_with_a_checkpoint(tmp_path):
    name, run_dir = "cleared", tmp_path / "cleared"
    quota = CpuQuota(0.2)
    proc = start(tmp_path, name, "train.log_interval=2")
    pids: dict[int, int] = {}
    try:
        wait_for(logged_step(run_dir, 4), proc)
        pids = worker_pids(run_dir / "plan.yaml")
        quota.move(pids[1], into=True)
        flagged = wait_for(lambda: [r for r in read_jsonl(run_dir / "metrics.jsonl") if 1 in r.get("stragglers", [])],
                           proc)[0]
        quota.move(pids[1], into=False)
        work = flagged["work_s_by_rank"]
        assert work[1] > 1.25 * work[0] and flagged["work_s_slowest_rank"] == 1, flagged
        stopped_at = stop(pids[1])
        wait_for(lambda: (run_dir / "logs" / "hang.json").is_file(), proc)
        os.kill(pids[1], signal.SIGCONT)  # the stall clears: every rank stops at the next step with a checkpoint
        out = proc.communicate(timeout=120)[0]
    finally:
        release(pids.values())
        quota.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_HUNG, out[-4000:]
    assert "usp: warning: rank 1 (node 0, local rank 1) is a straggler: its own work per step (time on or waiting " \
           "for a CPU) was" in out, out[-4000:]
    hung, stopped = events(run_dir, "hung"), events(run_dir, "stopped")
    assert [(e["stuck"], e["cleared"]) for e in hung] == [([1], True)], hung
    assert [(e["signal"], e["checkpoint"]) for e in stopped] == [("hang", True)], stopped
    step = stopped[0]["step"]
    assert check_manifest(run_dir / "checkpoints" / f"step_{step:08d}") is None
    assert f"usp: stopped by the hang watchdog (a stall that cleared, docs/hangs.md) after step {step}, kept in a " \
           "checkpoint" in out, out[-3000:]
    hang = json.loads((run_dir / "logs" / "hang.json").read_text())
    print(f"detection latency {hang['detected_at'] - stopped_at:.2f} s")
    assert hang["outcome"] == "cleared" and WINDOW - 1.0 <= hang["detected_at"] - stopped_at <= WINDOW + 2.5
    own = (run_dir / "logs" / "stacks_rank1.txt").read_text()  # the rank woke up and dumped its own stacks
    assert own.startswith(f"usp hang watchdog: rank 1 (pid {pids[1]} on ") and "(the training loop)" in own
    assert 1 in [e["rank"] for e in events(run_dir, "straggler")]
    assert_gone(pids.values())
    assert_nothing_half_written(run_dir)
    text = " ".join(run_usp("status", str(run_dir), cwd=tmp_path).stdout.split())
    assert "hung (rank 1 stalled in step" in text and "then moved again" in text and "straggler at " in text, text


# torchft: 2 replica groups of 2 FSDP ranks (the window outlasts a lost group's wait, timeout 5 + join 1 +
# heartbeat 2 s). A group with a stopped rank still heartbeats, so the other group waits for it until its live
# ranks exit: that group is "waited", not hung. No checkpoint on the way: `usp status` lists the last events.
FT_HANG = ["cluster.procs_per_node=4", "parallelism.dp_replicate=2", "parallelism.dp_shard=2",
           "fault_tolerance=torchft", "fault_tolerance.timeout_s=5", "fault_tolerance.join_timeout_s=1",
           "train.global_batch=8", "train.log_interval=1", "checkpoint.interval=100000"]
FT_WINDOW = 20


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("no_orphans")
def test_under_torchft_the_stuck_group_is_named_and_restarted_while_the_other_trains_on(tmp_path):
    name, run_dir, console = "ft_stopped", tmp_path / "ft_stopped", tmp_path / "console.txt"
    with open(console, "w") as sink:
        proc = start(tmp_path, name, *FT_HANG, f"train.hang_timeout_s={FT_WINDOW}", out=sink)
    pids: dict[tuple[int, int], int] = {}
    try:
        wait_for(logged_step(run_dir, 4), proc)
        pids = _group_ranks(run_dir / "plan.yaml")
        assert sorted(pids) == [(0, 0), (0, 1), (1, 0), (1, 1)], pids
        stopped_at, stopped_step = stop(pids[(1, 1)]), max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl"))
        restart = wait_for(lambda: events(run_dir, "replica_group_restart"), proc, timeout=300)[0]
        later = _group_ranks(run_dir / "plan.yaml")
        wait_for(lambda: [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > stopped_step
                          and r["participants"] == 2 and r["time"] > restart["time"]], proc, timeout=300)
    finally:
        release(pids.values())
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the run would train on for ever: stopped as Ctrl-C does
        proc.wait(timeout=180)
    out = console.read_text()
    hang = json.loads((run_dir / "logs" / "hang_group1.json").read_text())
    print(f"stop -> detected {hang['detected_at'] - stopped_at:.1f} s, -> group 1 restarted "
          f"{restart['time'] - stopped_at:.1f} s")
    assert hang["replica_group"] == 1 and hang["stuck"] == [1] and hang["reason"] == SILENT, hang
    assert hang["outcome"] == "stuck" and hang["checkpoint"] == {"why": "under torchft a live replica group saves "
                                                                        "the checkpoints"}
    assert FT_WINDOW - 1.0 <= hang["detected_at"] - stopped_at <= 2 * FT_WINDOW + 5, hang["detected_at"] - stopped_at
    assert [(e["stuck"], e["replica_group"]) for e in events(run_dir, "hung")] == [([1], 1)]
    assert restart["group"] == 1 and restart["time"] > hang["resolved_at"]
    logs = run_dir / "logs"
    assert not (logs / "hang.json").exists()
    waited = json.loads((logs / "hang_group0.json").read_text())  # group 0 stalled too, waiting for group 1
    assert waited["stuck"] == [] and waited["outcome"] == "waited" and waited["waited_for_group"] == 1, waited
    assert "usp: hang: replica group 0 waits for replica group 1's stuck rank; it is not hung itself" in out
    assert {p.name for p in logs.glob("heartbeat_*")} >= {f"heartbeat_group{g}_rank{r}.json" for g in (0, 1)
                                                          for r in (0, 1)}
    assert "rank 1 of replica group 1 did not respond" not in (logs / "stacks_group1_rank0.txt").read_text()
    assert "rank 1 did not respond" in (logs / "stacks_group1_rank1.txt").read_text()
    assert f"usp: hang: rank 1 of replica group 1 (pid {pids[(1, 1)]} on " in out, out[-4000:]
    # group 0 was never restarted and kept committing steps alone while group 1 was stuck
    assert later[(0, 0)] == pids[(0, 0)] and later[(0, 1)] == pids[(0, 1)], (pids, later)
    records = read_jsonl(run_dir / "metrics.jsonl")
    alone = [r for r in records if r["step"] > stopped_step and r["participants"] == 1]
    assert alone and alone[-1]["time"] > hang["detected_at"], "group 0 did not train on alone"
    gaps = [b["time"] - a["time"] for a, b in zip(records, records[1:]) if b["step"] > stopped_step]
    print(f"group 0's longest step gap after the stop: {max(gaps):.1f} s")
    assert max(gaps) <= restart["time"] - stopped_at + 5, gaps  # it trained on once group 1's torchrun ended
    text = " ".join(run_usp("status", str(run_dir), cwd=tmp_path).stdout.split())
    assert "hung at " in text and "rank(s) 1 of replica group 1 in step" in text, text
