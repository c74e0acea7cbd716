"""Hangs and stragglers without torch (docs/hangs.md): the window the planner resolves, which rank a
hang is about from heartbeat records and real processes' /proc state, the heartbeat file rewritten in
place, the straggler rule, and how `usp status`, `usp plan` and the Slurm script read a hung run.
The real thing, a SIGSTOPped rank under torchrun: tests/e2e/test_hangs.py."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import plan_for, usp_cli
from usp.contract.plan_file import write_plan
from usp.engine.observe.hang import Heartbeat
from usp.engine.observe.hang_verdict import SILENT, classify, entries, process_state, read_heartbeat, verdict
from usp.engine.observe.stragglers import INTERVALS, StragglerDetector
from usp.launch.hang_status import hang_line
from usp.launch.slurm_outcome import outcome
from usp.run.files import append_event, hang_path, heartbeat_path, stacks_path
from usp.run.lock import pid_start
from usp.run.state import HUNG, STOPPED, analyse_failures, run_state

pytestmark = pytest.mark.usefixtures("fresh_cache")  # planning computes the dataset's path from it
TWO = ("cluster.procs_per_node=2",)


# -- the window ---------------------------------------------------------------------------------
def test_the_window_is_the_predicted_step_times_the_factor_with_a_floor_and_its_own_allowances():
    plan = plan_for(*TWO, training=False)
    hang, predicted = plan.decisions.hang, plan.timing.step_s
    assert 20 * predicted < 120 and hang.step_s == 120.0  # tiny's 0.12 s step: the floor
    assert "x predicted step" in hang.source and "raised to the 120 s floor" in hang.source
    timeout = plan.config.cluster.timeout_s  # 600 on local_cpu: no allowance reaches 0.75 of it
    assert hang.first_step_s == min(1200, 0.75 * timeout) and hang.eval_s == min(120 * 5, 0.75 * timeout)
    assert (hang.grace_s, hang.poll_s) == (60.0, 5.0) and hang.checkpoint_s > hang.step_s
    longer = plan_for(*TWO, "train.hang_factor=2000", training=False).decisions.hang
    assert longer.step_s == pytest.approx(2000 * predicted) and "floor" not in longer.source


def test_a_set_timeout_wins_and_the_phases_scale_with_it():
    hang = plan_for(*TWO, "train.hang_timeout_s=5", "train.eval_batches=3", training=False).decisions.hang
    assert (hang.step_s, hang.first_step_s, hang.eval_s, hang.grace_s, hang.poll_s) == (5, 50, 20, 5, 0.25)
    assert hang.source == "train.hang_timeout_s" and 5 < hang.checkpoint_s < 5.1


def test_calibration_slack_widens_the_window_and_the_collective_timeout_caps_it():
    factor = round(150 / plan_for(*TWO, training=False).timing.step_s)  # 150 s: above the floor, x 1.5 below the cap
    base = plan_for(*TWO, f"train.hang_factor={factor}", training=False)
    slack = plan_for(*TWO, f"train.hang_factor={factor}", "cluster.timing.calibrated.source=runs.csv",
                     "cluster.timing.calibrated.ratio_p90=1.5", training=False).decisions.hang
    assert slack.step_s == pytest.approx(1.5 * base.decisions.hang.step_s) and "slack 1.50" in slack.source
    capped = plan_for(*TWO, "cluster.timeout_s=100", training=False)
    assert capped.decisions.hang.step_s == 50 and capped.decisions.hang.first_step_s == 75
    assert any("shortened to 50 s, half of cluster.timeout_s=100" in w for w in capped.warnings), capped.warnings


def test_off_on_one_process_or_when_asked_and_the_plan_says_so(tmp_path):
    assert plan_for(training=False).decisions.hang is None
    assert plan_for(training=False).decisions.straggler_measure == ""
    off = plan_for(*TWO, "train.hang_timeout_s=0", training=False)
    assert off.decisions.hang is None and off.decisions.straggler_measure == "runnable"
    shown = " ".join(usp_cli("plan", *TWO, cwd=tmp_path, columns=250).stdout.split())
    assert "hangs │ 120 s without a step dumps every rank's stack and stops the run" in shown, shown
    shown = " ".join(usp_cli("plan", *TWO, "train.hang_timeout_s=0", cwd=tmp_path, columns=250).stdout.split())
    assert "off (train.hang_timeout_s=0)" in shown


def test_under_torchft_the_window_outlasts_a_live_groups_wait_for_a_stopped_one(tmp_path):
    ft = ("fault_tolerance=torchft", "cluster.procs_per_node=4", "parallelism.dp_replicate=2",
          "parallelism.dp_shard=2", "train.global_batch=8")
    plan = plan_for(*ft, "train.hang_timeout_s=20", "fault_tolerance.timeout_s=5", training=False)
    assert plan.fault_tolerance is not None and plan.decisions.hang.step_s == 20
    assert plan.decisions.straggler_measure == ""  # no straggler detector across groups
    # derived: at least twice the wait (timeout 100 + join 5 + heartbeat 2), above the 120 s floor
    derived = plan_for(*ft, "fault_tolerance.timeout_s=100", training=False).decisions.hang
    assert derived.step_s == 214 and "raised to the 214 s floor" in derived.source
    r = usp_cli("plan", *ft, "train.hang_timeout_s=10", cwd=tmp_path, columns=250)
    text = " ".join(r.stderr.split())
    assert r.returncode == 2 and "a live replica group may wait for a stopped one before it trains on without it " \
        "(37 s" in text and "fix: train.hang_timeout_s=74 (or more), or lower fault_tolerance.timeout_s" in text, text


def test_under_torchft_a_ranks_files_are_named_by_its_replica_group(tmp_path):
    assert heartbeat_path(tmp_path, 1).name == "heartbeat_rank1.json"
    assert heartbeat_path(tmp_path, 1, 0).name == "heartbeat_group0_rank1.json"
    assert stacks_path(tmp_path, 1, 2).name == "stacks_group2_rank1.txt"
    assert hang_path(tmp_path).name == "hang.json" and hang_path(tmp_path, 1).name == "hang_group1.json"


def test_the_hang_rules_name_the_fix(tmp_path):
    r = usp_cli("plan", *TWO, "train.hang_timeout_s=400", cwd=tmp_path, columns=250)
    text = " ".join(r.stderr.split())
    assert r.returncode == 2 and "fix: train.hang_timeout_s=300 (or less), or raise cluster.timeout_s to 800 or more" \
        in text, text


# -- which rank ---------------------------------------------------------------------------------
LAUNCH, SINCE = "run/0/0", 1000.0


def beat(rank: int, step: int = 6, detected: float | None = None, collective: str | None = None,
         frames: tuple = ("torch/distributed/distributed_c10d.py:2950 all_reduce",), peers: dict | None = None,
         launch: str = LAUNCH) -> dict:
    record = {"rank": rank, "pid": 100 + rank, "host": "node7", "launch": launch, "step": step, "phase": "step",
              "since": SINCE - 5}
    if detected is not None:
        record["detected"] = {"time": detected, "stalled_s": 5.1, "frames": list(frames), "collective": collective,
                              "peers": peers or {}}
    return record


def test_the_rank_that_did_not_respond_is_stuck_and_a_neighbour_says_its_state():
    beats = {0: beat(0, detected=SINCE + 5, collective="gloo:all_reduce #42", peers={"1": "T (stopped), ..."}),
             1: beat(1), 2: beat(2, detected=SINCE + 5.2), 3: None}
    hang = verdict(beats, LAUNCH, SINCE, {"rank": 0, "time": SINCE + 5, "step": 6, "phase": "step", "stalled_s": 5.1,
                                          "window_s": 5.0})
    assert hang["stuck"] == [1, 3] and hang["reason"] == SILENT and hang["responded"] == 2
    by_rank = {e["rank"]: e for e in hang["ranks"]}
    assert by_rank[1]["process"] == "T (stopped), ..." and by_rank[1]["where"] == "in step 6"
    assert by_rank[3]["process"] == "unknown: it wrote no heartbeat in this launch"
    assert hang["live_waiting_in"][0] == ["gloo:all_reduce #42", 1]


def test_an_earlier_launch_or_an_earlier_hang_is_no_answer():
    found = entries({0: beat(0, detected=SINCE + 5), 1: beat(1, detected=SINCE - 50),
                     2: beat(2, detected=SINCE + 5, launch="run/1/0")}, LAUNCH, SINCE)
    assert [e["responded"] for e in found] == [True, False, False] and not found[2]["beat"]


def test_when_every_rank_responded_the_one_behind_or_outside_a_collective_is_named():
    behind = entries({0: beat(0, 7, SINCE + 5), 1: beat(1, 6, SINCE + 5), 2: beat(2, 7, SINCE + 5)}, LAUNCH, SINCE)
    assert classify(behind) == ([1], "still in step 6 while the others were in step 7")
    data = ("usp/engine/trainer.py:371 _batch", "usp/data/sampler.py:88 get_batch")
    loader = entries({0: beat(0, detected=SINCE + 5, collective="gloo:all_reduce #42"),
                      1: beat(1, detected=SINCE + 5, frames=data)}, LAUNCH, SINCE)
    assert classify(loader)[0] == [1] and "not in a collective" in classify(loader)[1]
    waiting = entries({0: beat(0, detected=SINCE + 5), 1: beat(1, detected=SINCE + 5)}, LAUNCH, SINCE)
    assert classify(waiting) == ([], "no rank stood out: every rank responded, in the same step; compare their stacks")


def test_process_state_of_a_real_stopped_running_and_gone_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = pid_start(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        deadline = time.time() + 10
        while not (process_state(proc.pid, start) or "").startswith("T (stopped)") and time.time() < deadline:
            time.sleep(0.02)
        state = process_state(proc.pid, start)
        assert state.startswith("T (stopped), wchan ") and state.endswith(" threads"), state
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.2)
        assert process_state(proc.pid, start).startswith("S (sleeping)")
        assert process_state(proc.pid, "1") == "gone"  # the pid names another process now
    finally:
        proc.kill()
        proc.wait()
    assert process_state(proc.pid, start) == "gone"


def test_the_heartbeat_is_rewritten_in_place_and_always_reads_whole(tmp_path):
    path = tmp_path / "heartbeat_rank3.json"
    hb = Heartbeat(path, {"rank": 3})
    hb.write({"step": 1, "detected": {"frames": ["x" * 500]}})
    inode = path.stat().st_ino
    hb.write({"step": 2})
    assert read_heartbeat(path) == {"rank": 3, "step": 2} and path.stat().st_ino == inode
    assert path.read_text().rstrip().endswith("}")  # padded with spaces: no tail of the longer record
    hb.close()
    assert read_heartbeat(tmp_path / "none.json") is None


# -- stragglers ---------------------------------------------------------------------------------
def test_a_rank_slower_than_its_peers_in_three_intervals_in_a_row_is_flagged_then_unflagged():
    d = StragglerDetector([0, 0, 0, 0])
    slow = [0.010, 0.011, 0.030, 0.010]
    for _ in range(INTERVALS - 1):
        assert d.update(slow)[1] == []
    ratios, new = d.update(slow)
    assert new == [2] and d.flagged == {2} and ratios[2] == pytest.approx(3.0)
    assert d.update([0.010, 0.011, 0.010, 0.010])[1] == [] and d.flagged == {2}  # one normal interval: kept
    for _ in range(INTERVALS):
        d.update([0.010, 0.011, 0.010, 0.010])
    assert d.flagged == set()


def test_noise_a_broken_streak_other_stages_and_missing_times_flag_nobody():
    d = StragglerDetector([0, 0])
    for times in ([0.0010, 0.0014], [0.0010, 0.0014], [0.0010, 0.0014]):  # 40 % slower but 0.4 ms: jitter
        assert d.update(times)[1] == []
    d = StragglerDetector([0, 0])
    for times in ([0.01, 0.02], [0.01, 0.02], [0.01, 0.011], [0.01, 0.02], [0.01, 0.02]):
        assert d.update(times)[1] == []
    stages = StragglerDetector([0, 1])  # pipeline stages do different work: never compared
    assert stages.update([0.01, 0.05]) == ([None, None], [])
    assert StragglerDetector([0, 0, 0]).update([None, 0.01, 0.01])[0] == [None, 1.0, 1.0]
    assert math.isclose(StragglerDetector([0, 0, 0]).compare([0.01, 0.02, 0.04])[2][0], 4 / 1.5)


# -- a hung run as status, usp train and Slurm read it -------------------------------------------
SHARDED = {"why": "the state is sharded (fsdp: each rank holds a part of it), so a checkpoint needs every rank"}


def hung_run(tmp_path: Path, cleared: bool = False, checkpoint: dict | None = None) -> Path:
    plan = plan_for(*TWO, "train.name=hung", runs_dir=tmp_path, training=False)
    run = Path(plan.run_dir)
    run.mkdir(parents=True)
    write_plan(plan)
    hang = verdict({0: beat(0, detected=SINCE + 5, collective="gloo:all_reduce #42 of process group 0 (default_pg)",
                            peers={"1": "T (stopped), wchan do_signal_stop, 17 threads"}), 1: beat(1)},
                   LAUNCH, SINCE, {"rank": 0, "time": time.time(), "step": 6, "phase": "step", "stalled_s": 5.1,
                                   "window_s": 5.0})
    hang.update(outcome="cleared" if cleared else "stuck", grace_s=5.0, **({} if cleared else
                                                                          {"checkpoint": checkpoint or SHARDED}))
    hang_path(run).parent.mkdir()
    hang_path(run).write_text(json.dumps(hang))
    append_event(run, "hung", step=6, phase="step", where="in step 6", stuck=[1], stalled_s=10.1, window_s=5.0,
                 cleared=cleared, detected_by=0)
    return run


def test_usp_status_names_the_stuck_rank_where_it_was_and_what_the_others_waited_in(tmp_path):
    run = hung_run(tmp_path)
    r = usp_cli("status", str(run), cwd=tmp_path, columns=250)
    text = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stderr  # restartable, like a stop
    assert ("state │ hung (rank 1 made no progress in step 6 (T (stopped), wchan do_signal_stop, 17 threads); after "
            "10.1 s the live ranks exited with code 75; no new checkpoint (the state is sharded (fsdp: each rank "
            "holds a part of it), so a") in text, text  # the table wraps the rest
    assert "the last one is kept; resume by running the same command)" in text, text
    assert "outcome │ still stuck after 5 s of grace: the live ranks exited with code 75; no new checkpoint (the " \
           "state is sharded" in text, text
    for says in ("stuck rank 1 │ node 0, local rank 1, host node7, pid 101", "why this rank │ did not respond",
                 "1 of 2 responded, waiting in gloo:all_reduce #42 of process group 0 (default_pg) (1 rank)",
                 "hung at ", "rank(s) 1 in step 6, stuck after 10.1 s"):
        assert says in text, (says, text)


def test_a_restart_or_a_later_stop_ends_the_hung_state_and_a_cleared_hang_stays_it(tmp_path):
    run = hung_run(tmp_path, cleared=True)
    append_event(run, "stopped", step=7, signal="hang", checkpoint=True)
    assert run_state(run, analyse_failures(run, None), None) == HUNG
    assert "moved again: every rank stopped at the next step boundary with a checkpoint" in \
        " ".join(usp_cli("status", str(run), cwd=tmp_path, columns=250).stdout.split())
    assert outcome(run, 0.0, 1) == "hung"  # the Slurm script requeues it
    append_event(run, "stopped", step=9, signal="SIGINT", checkpoint=True)
    assert run_state(run, analyse_failures(run, None), None) == STOPPED
    assert outcome(run, 0.0, 1) == "stopped SIGINT"
    other = hung_run(tmp_path / "b")
    append_event(other, "restart", restart=1, resumed_from_step=5)
    assert run_state(other, analyse_failures(other, None), None) == STOPPED
    assert outcome(other, 0.0, 1) == "failed" and outcome(other, time.time() + 60, 0) == "done"


def test_the_stragglers_row_reads_the_last_logged_step(tmp_path):
    run = hung_run(tmp_path)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 5.0, "work_s_median": 0.02,
                                                   "work_s_by_rank": [0.01, 0.03], "work_s_slowest_rank": 1,
                                                   "work_s_slowest_ratio": 3.0, "stragglers": [1]}) + "\n")
    text = " ".join(usp_cli("status", str(run), cwd=tmp_path, columns=250).stdout.split())
    assert "stragglers │ rank 1 (1.50x the median), at step 10" in text, text


def test_a_save_without_the_stuck_rank_is_what_status_and_usp_train_say_was_kept(tmp_path):
    saved = {"step": 6, "path": str(tmp_path / "ck" / "step_00000006"), "saved_s": 0.2, "by": 0}
    run = hung_run(tmp_path, checkpoint=saved)
    text = " ".join(usp_cli("status", str(run), cwd=tmp_path, columns=250).stdout.split())
    assert "exited with code 75; rank 0 saved the state after step 6 without the stuck rank, to" in text, text
    assert (f"outcome │ still stuck after 5 s of grace: the live ranks exited with code 75; rank 0 saved the state "
            f"after step 6 without the stuck rank, to {saved['path']}") in text, text
    assert f"rank 0 saved the state after step 6 without the stuck rank, to {saved['path']}" in \
        hang_line(run, {"stuck": [1], "stalled_s": 10.1})
