"""fault_tolerance=torchft for real (docs/fault_tolerance.md): `usp train` starts torchft's lighthouse and
three replica groups of two FSDP ranks each (torchrun per group, gloo). With no failure the run equals the
same HSDP run without torchft (dp_replicate=3 x dp_shard=2, one torchrun); with rank 1 of one group
killed by SIGKILL the other groups keep stepping (no restart, each step at most a few seconds late), the
lost group is restarted by usp's launcher, rejoins, heals from a live group, and from then on every
group holds the same parameters (metrics.jsonl's replica_spread); a stop signal then ends every group at a
step boundary (exit 130). Nothing outlives a run: the
lighthouse and every rank are gone once `usp train` returns, also when a test fails."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import USP, losses, run_usp, usp_env
from usp.run.files import EXIT_INTERRUPTED, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

QUIET = ["logging.console=plain", "train.sample_tokens=0", "train.log_interval=1", "train.eval_interval=0",
         "train.eval_batches=1", "train.measure_memory=false", "train.global_batch=12"]
HSDP = ["cluster.procs_per_node=6", "parallelism.dp_replicate=3", "parallelism.dp_shard=2"]
FT = [*HSDP, "fault_tolerance=torchft"]
PARITY_STEPS = 8


def _processes_of(run_dir: Path) -> list[int]:
    """Every process of the run still alive: ranks, torchrun agents (their command line names the plan)
    and the lighthouse (its log is the run's)."""
    out = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if int(p) != os.getpid()]


@pytest.fixture
def no_orphans(tmp_path):
    """After the test, pass or fail: no process of a run under tmp_path is left (killed if one is, and
    the test fails)."""
    yield
    left = _processes_of(tmp_path)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}"


def _train(tmp_path: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    proc = run_usp("train", f"train.runs_dir={tmp_path}", f"train.name={name}", *QUIET, *overrides, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _final_parameters(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process without a process group: intended
        state = _load_state_dict_from_keys(keys={"model"}, checkpoint_id=str(run_dir / "checkpoints" /
                                                                             f"step_{step:08d}"))
    return state["model"]


@pytest.mark.timeout(900)
def test_without_a_failure_torchft_equals_the_same_hsdp_run(tmp_path, shakespeare, no_orphans):
    """3 replica groups x FSDP over 2 ranks under torchft vs HSDP 3 x 2 without it: the same loss at every
    step (1e-5 relative), the same final parameters (1e-4), every step with all 3 groups."""
    steps = f"train.steps={PARITY_STEPS}"
    _train(tmp_path, "hsdp", *HSDP, steps)
    _train(tmp_path, "ft", *FT, steps)
    ref, ft = losses(tmp_path / "hsdp"), losses(tmp_path / "ft")
    assert sorted(ft) == sorted(ref) == list(range(1, PARITY_STEPS + 1))
    worst = max(abs(ft[s] - ref[s]) / abs(ref[s]) for s in ref)
    assert worst <= 1e-5, worst
    records = read_jsonl(tmp_path / "ft" / "metrics.jsonl")
    assert {r["participants"] for r in records} == {3} and {r["step_sequences"] for r in records} == {12}
    assert max(r["replica_spread"] for r in records) <= 1e-12
    a, b = _final_parameters(tmp_path / "hsdp", PARITY_STEPS), _final_parameters(tmp_path / "ft", PARITY_STEPS)
    assert sorted(a) == sorted(b)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-4, diff
    print(f"parity: loss rel diff {worst:.2e}, parameters max |diff| {diff:.2e}")


# The run is stopped (SIGINT, as Ctrl-C) a few steps after the lost group is back, not at a step count: a fixed
# 120 steps let the survivors finish before the restarted group was back under CI's load (40 once did on a quiet
# VM). KILL_STEPS is never reached; the stop also checks that a stop signal under torchft ends every group.
KILL_STEPS, KILL_AT, STEPS_AFTER_HEAL = 5000, 8, 3


def _group_ranks(plan_path: Path) -> dict[tuple[int, int], int]:
    """{(replica group, rank): pid} of the training processes of a run."""
    out = {}
    for pid in subprocess.run(["pgrep", "-f", f"usp.engine.worker --plan {plan_path}"], capture_output=True,
                              text=True).stdout.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if b"usp.engine.agent" in cmdline or b"RANK" not in env:
            continue
        out[(int(env[b"USP_FT_REPLICA_GROUP"]), int(env[b"RANK"]))] = int(pid)
    return out


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    path = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        if path.exists() and any(r["step"] >= step for r in read_jsonl(path)):
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached")


@pytest.mark.timeout(900)
def test_kill9_of_one_rank_the_others_train_on_and_the_group_heals(tmp_path, shakespeare, no_orphans):
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([USP, "train", f"train.runs_dir={tmp_path}", "train.name=killed", *QUIET, *FT,
                             f"train.steps={KILL_STEPS}", "checkpoint.interval=10"], env=usp_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for_step(run_dir, KILL_AT, proc)
        pids = _group_ranks(run_dir / "plan.yaml")
        assert sorted(pids) == [(g, r) for g in range(3) for r in range(2)], pids
        survivors = {k: v for k, v in pids.items() if k[0] != 2}
        killed_at = time.time()
        os.kill(pids[(2, 1)], signal.SIGKILL)
        healed_at = _wait_for_rejoin(run_dir, proc)
        later = _group_ranks(run_dir / "plan.yaml")
        _wait_for_step(run_dir, healed_at + STEPS_AFTER_HEAL, proc)
        os.kill(proc.pid, signal.SIGINT)  # usp passes it on to every group's torchrun
        out = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == EXIT_INTERRUPTED, out[-5000:]
    # the survivors were never restarted: the same processes trained on; group 2's ranks are new ones
    assert {k: later.get(k) for k in survivors} == survivors, (survivors, later)
    assert later.get((2, 1)) not in (None, pids[(2, 1)]), later
    records = read_jsonl(run_dir / "metrics.jsonl")
    last = records[-1]["step"]
    assert healed_at + STEPS_AFTER_HEAL <= last < KILL_STEPS
    log = (run_dir / "logs" / "rank_0.log").read_text()
    # every step once, in order, but one the writing group (0) dropped when the kill broke its collective and
    # then took from a live group (healed at that step): the restarted group can be back in that step's quorum
    # (CI's load). A heal at a step the writer had already written drops nothing (seen once under CI's load).
    healed = r"replica0 rank0 replica group 0 healed from a live group at step (\d+)"
    writer_healed = {int(m) for m in re.findall(healed, log)}
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), steps
    assert set(range(1, last + 1)) - set(steps) <= writer_healed, (steps, writer_healed)
    after = [r for r in records if r["step"] > KILL_AT]
    back = [r["step"] for r in after if r["participants"] == 3]
    assert back and back[-1] == last, "the lost group never rejoined"
    healed_from = healed_at
    assert all(r["participants"] == 3 for r in records if r["step"] >= healed_from)
    assert all(r["step_sequences"] == 8 for r in after if r["participants"] == 2)
    # from the heal on, every group holds the same parameters
    assert all(r["replica_spread"] is not None and r["replica_spread"] <= 1e-12 for r in records
               if r["step"] >= healed_from)
    # the survivors' step during the loss: at most a few seconds late
    gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:]) if b["step"] > KILL_AT]
    normal = sorted(b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records[1:KILL_AT], records[2:KILL_AT + 1]))
    events = [json.loads(line) for line in (run_dir / "logs" / "events.jsonl").read_text().splitlines()]
    restarts = [e for e in events if e["event"] == "replica_group_restart"]
    assert [(e["group"], e["attempt"]) for e in restarts] == [(2, 1)], events
    restart_s = restarts[0]["time"] - killed_at
    by_step = {r["step"]: r for r in records}
    rejoin_s = by_step[healed_from]["elapsed_s"] - by_step[KILL_AT]["elapsed_s"]
    assert "replica2 rank0" in log and "healed from a live group" in log
    print(f"survivor step gaps after the kill: max {max(gaps):.2f} s (median before {normal[len(normal) // 2]:.2f} "
          f"s); group restarted {restart_s:.1f} s after the kill, rejoined and healed at step {healed_from}, "
          f"{rejoin_s:.1f} s after it")
    assert max(gaps) <= 10.0, gaps


def _restarted_at(run_dir: Path) -> float | None:
    """When usp's launcher restarted the lost group (logs/events.jsonl), if it has."""
    events = run_dir / "logs" / "events.jsonl"
    starts = [e["time"] for e in read_jsonl(events) if e["event"] == "replica_group_restart"] if events.exists() else []
    return starts[0] if starts else None


def _wait_for_rejoin(run_dir: Path, proc: subprocess.Popen, timeout: float = 300) -> int:
    """Until a step committed after the lost group's restart has all 3 groups again (the old group's ranks are
    gone by then); that step. The survivors may have stepped without it meanwhile, or (the restart back within
    the lighthouse's join timeout, as under CI's load) not at all."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        restarted = _restarted_at(run_dir)
        records = read_jsonl(run_dir / "metrics.jsonl")
        back = [r["step"] for r in records if restarted is not None and r["time"] > restarted
                and r["participants"] == 3]
        if back:
            return back[0]
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    raise AssertionError("the lost group did not rejoin")
