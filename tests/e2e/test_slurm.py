"""usp on a real Slurm controller: the local cluster of scripts/local_slurm.sh (slurmctld + two
slurmd "nodes" on this machine, see docs/slurm_local.md). Jobs go through sbatch -> srun ->
torchrun exactly as on a real cluster, and their losses are compared with runs here.

The session fixture starts the cluster when it isn't running (as root; it stops it again at
the end). Where Slurm can't be installed at all the tests are skipped with the reason, and
with USP_REQUIRE_SLURM=1 (CI) that is a failure instead."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, losses, run_usp, train_in_process
from usp.run.files import list_checkpoints, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SCRIPT = REPO / "scripts" / "local_slurm.sh"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
STEPS = 24
TRAIN = ["conf=tiny_demo", f"train.steps={STEPS}", "train.log_interval=1", "train.eval_interval=0",
         "train.sample_tokens=8", "logging.console=plain"]


def _cluster_running() -> bool:
    r = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True)
    return r.returncode == 0 and "running" in r.stdout.splitlines()[0] if r.stdout else False


def _slurm_conf() -> str | None:
    env_file = Path(os.environ.get("USP_SLURM_DIR", "/tmp/usp-slurm")) / "env"
    if env_file.is_file():
        for line in env_file.read_text().splitlines():
            if line.startswith("export SLURM_CONF="):
                return line.split("=", 1)[1].strip().strip("'\"")
    return None


@pytest.fixture(scope="session")
def slurm():
    """A running Slurm cluster with two nodes; SLURM_CONF set for usp and the Slurm commands."""
    started = False
    if not _cluster_running():
        why = None
        if os.geteuid() != 0:
            why = "the local Slurm cluster is not running and starting it needs root"
        else:
            r = subprocess.run(["bash", str(SCRIPT), "start", "--nodes", "2"], capture_output=True, text=True)
            started = r.returncode == 0
            if not started:
                why = f"scripts/local_slurm.sh start failed: {(r.stderr or r.stdout).strip()[-800:]}"
        if why:
            if os.environ.get("USP_REQUIRE_SLURM") == "1":
                pytest.fail(f"USP_REQUIRE_SLURM=1 but no Slurm: {why}")
            pytest.skip(f"NO SLURM, Slurm tests NOT run: {why}")
    conf = _slurm_conf()
    if conf:
        os.environ["SLURM_CONF"] = conf
    yield conf
    if started:
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, text=True)


def submit(runs: Path, name: str, *overrides: str, steps: int = STEPS, verb: str = "submit") -> tuple[str, Path]:
    """`usp submit` (or `usp train`, which submits too with a Slurm cluster group)."""
    train = [o for o in TRAIN if not o.startswith("train.steps=")] + [f"train.steps={steps}"]
    r = run_usp(verb, *train, "cluster=local_slurm", f"train.runs_dir={runs}", f"train.name={name}",
                *overrides, cwd=runs)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = json.loads((runs / name / "job.json").read_text())["jobs"][-1]["job_id"]
    assert f"submitted Slurm job {job_id}" in r.stdout
    return job_id, runs / name


def job_state(job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def wait_for(job_id: str, timeout: float = 240) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = job_state(job_id)
        if state.get("JobState") in TERMINAL:
            return state
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not finish in {timeout} s: {job_state(job_id)}")


def wait_for_line(path: Path, text: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise AssertionError(f"{text!r} never appeared in {path}")


def assert_close(got: dict[int, float], want: dict[int, float], rtol: float) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= rtol, f"largest relative loss difference {worst:.2e} > {rtol:.0e}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("slurm-runs")


@pytest.fixture(scope="module")
def reference(runs):
    """The same training run here, in one process (this one, as `usp train` trains one rank): what
    every layout must reproduce."""
    conf, *overrides = TRAIN  # conf=tiny_demo first
    run_dir, _ = train_in_process(*overrides, "cluster=local_cpu", f"train.runs_dir={runs}", "train.name=reference",
                                  conf=conf.removeprefix("conf="))
    return losses(run_dir)


@pytest.fixture(scope="module")
def two_rank_job(slurm, runs):
    """A 2-process job through sbatch -> srun -> torchrun, with shell-special values in its config."""
    job_id, run_dir = submit(runs, "dp2", f"train.sample_prompt='{NASTY_HYDRA}'",
                             f"+cluster.env.USP_PROBE='{NASTY_HYDRA}'")
    return job_id, run_dir, wait_for(job_id)


NASTY = "it's \"$HOME\" `touch PWNED1`; touch PWNED2 $(touch PWNED3) & | > x"
NASTY_HYDRA = NASTY.replace("'", "\\'")


def test_two_process_job_completes_and_matches_the_local_run(two_rank_job, reference):
    job_id, run_dir, state = two_rank_job
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", state
    assert_close(losses(run_dir), reference, rtol=1e-5)  # DDP over 2 ranks vs one process
    out = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert f"usp: job {job_id} attempt 1" in out and "step exited with code 0: done" in out


def test_shell_special_values_reach_the_ranks_unchanged(two_rank_job):
    job_id, run_dir, _ = two_rank_job
    assert (run_dir / "sample.txt").read_text().startswith(NASTY)  # the prompt, as the rank saw it
    for rank in (0, 1):
        assert f"env: USP_PROBE={NASTY!r}" in (run_dir / "logs" / f"rank_{rank}.log").read_text()
    assert not list(run_dir.parent.rglob("PWNED*")) and not list(REPO.glob("PWNED*"))


def test_status_and_logs_commands_read_the_job(two_rank_job):
    job_id, run_dir, _ = two_rank_job
    r = run_usp("status", str(run_dir))
    assert r.returncode == 0 and f"slurm job {job_id}" in r.stdout and "COMPLETED" in r.stdout, r.stdout
    assert f"{STEPS} / {STEPS}" in r.stdout
    r = run_usp("logs", str(run_dir), "--tail", "1")
    assert r.returncode == 0 and r.stdout.strip() == "usp: step exited with code 0: done"
    r = run_usp("logs", str(run_dir), "--rank", "1")
    assert r.returncode == 0 and "placement: rank 1 " in r.stdout


def test_two_nodes_rendezvous_on_the_head_node_as_the_plan_says(slurm, runs, reference):
    job_id, run_dir = submit(runs, "two_nodes", "cluster.nodes=2")
    state = wait_for(job_id)
    assert state["JobState"] == "COMPLETED" and state["NodeList"] == "node[1-2]", state
    from usp.contract.plan_file import read_plan

    plan = read_plan(run_dir / "plan.yaml")
    assert plan.world_size == 4 and plan.nodes == 2
    for entry in plan.ranks:
        log = (run_dir / "logs" / f"rank_{entry.rank}.log").read_text()
        placed = log.split("placement: ", 1)[1].split("\n", 1)[0]
        # torchrun's node rank and local rank are the plan's, and node rank 0 is the first node
        assert f"local_rank {entry.local_rank} node_rank {entry.node} " in placed, placed
        assert f"slurm_node node{entry.node + 1} " in placed, placed
    # the default rendezvous port is the job's own (20000 + job id % 10000)
    assert f"rendezvous node1:{20000 + int(job_id) % 10000};" in (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert_close(losses(run_dir), reference, rtol=1e-5)


def test_usr1_checkpoints_requeues_and_resumes_to_the_same_loss(slurm, runs, two_rank_job):
    """Preemption: USR1 to the batch shell -> ranks checkpoint -> requeue -> resume."""
    job_id, run_dir = submit(runs, "preempted")
    out = run_dir / "logs" / f"slurm-{job_id}.out"
    wait_for_line(out, "step 3/")  # the batch script and the ranks are up
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    state = wait_for(job_id, timeout=300)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", state
    text = out.read_text()
    assert "usp: got USR1" in text and "requeueing (requeue 1 of at most 2)" in text
    assert f"usp: job {job_id} attempt 2" in text and "usp: resumed from" in text
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert records[-1]["step"] == STEPS and records[-1].get("slurm_restart_count") == 1
    # Same final state as the uninterrupted 2-process job: resuming is exact.
    assert_close(losses(run_dir), losses(two_rank_job[1]), rtol=1e-6)


def wait_for_stop(run_dir: Path, signal: str, timeout: float = 90) -> int:
    """The step after which the ranks stopped on `signal` with a checkpoint (logs/events.jsonl)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        stops = [e for e in read_jsonl(run_dir / "logs" / "events.jsonl") if e["event"] == "stopped"]
        if stops:
            assert (stops[-1]["signal"], stops[-1]["checkpoint"]) == (signal, True), stops
            return int(stops[-1]["step"])
        time.sleep(0.5)
    raise AssertionError(f"the ranks recorded no stop on {signal} in {run_dir / 'logs' / 'events.jsonl'}")


def test_int_to_the_batch_shell_stops_every_rank_with_a_checkpoint_and_no_requeue(slurm, runs):
    """`scancel --signal=INT --batch`: the batch shell passes INT to the job step, where Slurm gives it
    to torchrun and to each rank, and torchrun passes it on again: every rank stops once, after the
    same step, with a checkpoint; the job is not requeued (only USR1 is)."""
    job_id, run_dir = submit(runs, "interrupted", steps=100000)
    out = run_dir / "logs" / f"slurm-{job_id}.out"
    wait_for_line(out, "step 3/")
    subprocess.run(["scancel", "--signal=INT", "--batch", job_id], check=True)
    state = wait_for(job_id, timeout=180)
    assert state["Restarts"] == "0" and state["ExitCode"] == "130:0", state
    step = wait_for_stop(run_dir, "SIGINT")
    text = out.read_text()
    assert "usp: got INT: asking the ranks to checkpoint and stop" in text
    assert "usp: step exited with code 130: stopped SIGINT" in text and "requeueing" not in text
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}"
    assert f"usp: stopped by SIGINT after step {step}, kept in a checkpoint ({checkpoint})" in text
    assert sorted(p.name for p in checkpoint.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    assert "Traceback" not in text and "death signal" not in text
    assert max(losses(run_dir)) == step


def kill_node_ranks(node: str) -> int:
    """SIGKILL the torchrun agent that runs on Slurm node `node` and everything under it: on a
    real cluster, what a dying machine does to its ranks. Returns how many processes were killed."""
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        procs[int(pid)] = (argv, ppid)
    agents = [pid for pid, (argv, _) in procs.items()
              if b"--local-addr" in argv and argv[argv.index(b"--local-addr") + 1:][:1] == [node.encode()]]
    assert agents, f"no torchrun agent found for {node}"
    doomed, frontier = set(agents), list(agents)
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (_, ppid) in procs.items() if ppid == parent and pid not in doomed]
        doomed.update(children)
        frontier.extend(children)
    for pid in doomed:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return len(doomed)


def test_a_failed_node_requeues_the_job_which_resumes_to_the_same_loss(slurm, runs, reference):
    """Node failure: a node of a 2-node job is drained (as a health check does after a GPU error)
    and its ranks die. The step fails, the batch script sees the drained node and requeues; once
    the node is back the job resumes from its last checkpoint and ends with the single-process losses."""
    job_id, run_dir = submit(runs, "node_failure", "cluster.nodes=2", "checkpoint.interval=2")
    out = run_dir / "logs" / f"slurm-{job_id}.out"
    wait_for_line(out, "step 3/")  # checkpoint of step 2 written
    try:
        subprocess.run(["scontrol", "update", "nodename=node2", "state=drain", "reason=usp-test"], check=True)
        assert kill_node_ranks("node2") >= 3  # the agent and its 2 ranks
        wait_for_line(out, "requeueing (requeue 1 of at most 2)", timeout=120)
    finally:
        subprocess.run(["scontrol", "update", "nodename=node2", "state=resume"], check=True)
    state = wait_for(job_id, timeout=300)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", state
    text = out.read_text()
    assert "node_failure node2:" in text and "DRAIN" in text.split("node_failure node2:", 1)[1].split("\n", 1)[0]
    assert f"usp: job {job_id} attempt 2" in text and "usp: resumed from" in text
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert records[-1]["step"] == STEPS and records[-1].get("slurm_restart_count") == 1
    assert_close(losses(run_dir), reference, rtol=1e-5)


def test_cancel_stops_the_job(slurm, runs):
    job_id, run_dir = submit(runs, "cancelled", steps=100000, verb="train")  # usp train submits to Slurm too
    wait_for_line(run_dir / "logs" / f"slurm-{job_id}.out", "step 1/")
    plan_written = (run_dir / "plan.yaml").stat().st_mtime_ns
    # a second submission to the live run would replace the plan its next requeue resumes from
    r = run_usp("submit", *TRAIN, "cluster=local_slurm", f"train.runs_dir={runs}", "train.name=cancelled", cwd=runs)
    error = " ".join(r.stderr.split())  # rich wraps long lines
    assert r.returncode == 2 and f"still has Slurm job(s) {job_id} queued or running" in error, r.stderr
    assert "usp cancel" in error and (run_dir / "plan.yaml").stat().st_mtime_ns == plan_written
    r = run_usp("cancel", str(run_dir))
    assert r.returncode == 0 and f"cancelled Slurm job {job_id}" in r.stdout
    assert wait_for(job_id, timeout=60)["JobState"] == "CANCELLED"
    # scancel's SIGTERM reached every rank (within Slurm's KillWait): they stopped after one step with a checkpoint
    step = wait_for_stop(run_dir, "SIGTERM")
    assert [c[0] for c in list_checkpoints(run_dir / "checkpoints") if c[2]][-1] == step
    r = run_usp("cancel", str(run_dir))
    assert r.returncode == 0 and "nothing to cancel" in r.stdout


def test_a_taken_rendezvous_port_fails_loudly_instead_of_joining_another_store(slurm, runs):
    """The head node hosts the store (is_host=1): with its port taken, torchrun must fail at
    once, not connect to whatever listens there as if it were its own job's store."""
    import socket

    squatter = socket.create_server(("", 0))
    port = squatter.getsockname()[1]
    try:
        job_id, run_dir = submit(runs, "port_taken", f"cluster.slurm.rdzv_port={port}", steps=2)
        state = wait_for(job_id, timeout=60)
    finally:
        squatter.close()
    assert state["JobState"] == "FAILED", state
    out = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert f"rendezvous node1:{port};" in out and "The connection to the C10d store has failed" in out
    assert "address already in use" in out.lower(), out[-2000:]


def test_array_sweep_runs_every_accepted_point_and_reports_them(slurm, runs):
    """`usp sweep ... cluster=local_slurm`: one job array, one task per accepted point (each
    reads its own plan), the rejected point listed and skipped, and `usp report` tabulates them."""
    sweep_overrides = [o for o in TRAIN if not o.startswith("train.steps=")] + ["train.steps=6"]
    r = run_usp("sweep", *sweep_overrides, "cluster=local_slurm", f"train.runs_dir={runs}",
                "train.micro_batch=4,8,3", "--name", "sw", "--max-parallel", "2", cwd=runs)
    assert r.returncode == 0, r.stdout + r.stderr
    sweep_dir = runs / "sw"
    job = json.loads((sweep_dir / "job.json").read_text())["jobs"][-1]
    assert "#SBATCH --array=0-1%2" in (sweep_dir / "job.sbatch").read_text()
    deadline = time.time() + 240
    while True:
        out = subprocess.run(["scontrol", "show", "job", "-o", job["job_id"]], capture_output=True, text=True).stdout
        states = [dict(i.split("=", 1) for i in line.split() if "=" in i) for line in out.splitlines() if line.strip()]
        if len(states) == 2 and all(s["JobState"] in TERMINAL for s in states):
            break
        assert time.time() < deadline, states
        time.sleep(1)
    assert sorted((s["ArrayTaskId"], s["JobState"]) for s in states) == [("0", "COMPLETED"), ("1", "COMPLETED")]
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    assert [p["status"] for p in sweep["points"]] == ["submitted", "submitted", "rejected"]
    endpoints = set()
    for task, point in enumerate(sweep["points"][:2]):
        assert point["slurm_job"] == f"{job['job_id']}_{task}"
        assert (Path(point["run_dir"]) / "summary.json").is_file()
        log = (sweep_dir / "logs" / f"slurm-{job['job_id']}_{task}.out").read_text()
        assert f"plan {point['run_dir']}/plan.yaml" in log
        endpoints.add(log.split("rendezvous ", 1)[1].split(":", 1)[1].split(";", 1)[0])
    # Tasks running side by side on one host must not share a rendezvous store (they did with
    # one fixed port: the task that finished first took the other's store down with it).
    assert len(endpoints) == 2, endpoints
    r = run_usp("report", str(sweep_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    report = (sweep_dir / "report" / "report.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in report.splitlines() if line.startswith("| p0")}
    assert "done" in rows["p00_mb4"] and "done" in rows["p01_mb8"] and "rejected" in rows["p02_mb3"]
