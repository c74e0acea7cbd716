"""Several machines without Slurm (usp/launch/rendezvous.py): the plan-time rule on the node keys,
the torchrun options each node gets, a saved plan run by hand, and two `usp train` processes as
two nodes over loopback matching one process's losses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, USP, usp_cli

TINY = ["model=tiny", "train.sample_tokens=0", "train.eval_interval=0", "train.log_interval=1",
        "train.measure_memory=false", "logging.console=plain"]


def _plan(*overrides: str):
    from usp.config.compose import compose_config
    from usp.plan.plan import checked_plan

    cfg, choices = compose_config(None, list(overrides))
    return checked_plan(cfg, choices)


@pytest.mark.parametrize("command", ["plan", "train"])
def test_local_launcher_with_nodes_needs_the_rendezvous_keys(tmp_path, command):
    """`usp train` refuses before anything is written; `usp plan` shows the same refusal (it describes
    layouts the engine can't run, as "usp train would refuse")."""
    out = usp_cli(command, "cluster.nodes=2", "cluster.node_rank=0", cwd=tmp_path)
    assert out.returncode == (2 if command == "train" else 0), out
    text = " ".join((out.stdout + out.stderr).split())
    assert "cluster.rdzv_endpoint" in text and "cluster.node_rank=<0..1>" in text
    assert not (tmp_path / "runs").exists()  # refused before anything is written


@pytest.mark.parametrize("overrides, key, why", [
    (["cluster.nodes=2"], "cluster.node_rank and cluster.rdzv_endpoint", "needs"),
    (["cluster.nodes=2", "cluster.node_rank=2", "cluster.rdzv_endpoint=10.0.0.1"], "cluster.node_rank", "0..1"),
    (["cluster.nodes=2", "cluster.node_rank=1", "cluster.rdzv_endpoint='a b:29500'"], "cluster.rdzv_endpoint",
     "not host:port"),
    (["cluster.nodes=2", "cluster.node_rank=1", "cluster.rdzv_endpoint=10.0.0.1:70000"], "cluster.rdzv_endpoint",
     "1..65535"),
    (["cluster.node_rank=1"], "cluster.node_rank", "0..0"),
    (["cluster=local_slurm", "cluster.node_rank=0"], "cluster.node_rank", "Slurm"),
])
def test_node_keys_are_checked_at_plan_time(overrides, key, why):
    from usp.errors import PlanError

    with pytest.raises(PlanError) as err:
        _plan(*overrides)
    assert err.value.key == key and why in str(err.value)


def test_each_node_gets_its_rank_and_the_same_per_run_endpoint(tmp_path):
    from usp.launch.local import torchrun_command
    from usp.launch.rendezvous import node_plan_path, rendezvous

    base = ["cluster.nodes=2", "cluster.rdzv_endpoint=node0.example", "train.name=mn"]
    node0, node1 = (_plan(*base, f"cluster.node_rank={r}") for r in (0, 1))
    r0, r1 = rendezvous(node0), rendezvous(node1)
    assert (r0.endpoint, r0.run_id) == (r1.endpoint, r1.run_id)  # the nodes meet
    assert r0.host == "node0.example" and 20000 <= r0.port < 30000
    other = rendezvous(_plan(*base, "cluster.node_rank=0", "train.steps=7"))
    assert (other.run_id, other.port) != (r0.run_id, r0.port)  # another config: another rendezvous
    assert rendezvous(_plan(*base[:1], "cluster.rdzv_endpoint='[::1]:29400'", "cluster.node_rank=0")).port == 29400
    cmd = torchrun_command(node1, Path("plan.node1.yaml"))
    assert "--standalone" not in cmd
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-backend=static", f"--rdzv-endpoint={r1.endpoint}"} <= set(cmd)
    assert node_plan_path(tmp_path, node0) == tmp_path / "plan.yaml"
    assert node_plan_path(tmp_path, node1) == tmp_path / "plan.node1.yaml"
    assert "--standalone" in torchrun_command(_plan("cluster.procs_per_node=2"), Path("plan.yaml"))


def test_a_saved_plan_runs_by_hand_once_its_data_is_prepared(tmp_path, shakespeare):
    """`usp plan --save` then the worker entry torchrun runs (`python -m usp.engine.worker`):
    without prepared data a clear error naming `usp prepare-data`, with it training."""
    from usp.engine.worker import main as worker_main

    args = ("plan", "--save", *TINY, "train.steps=2", "train.name=saved", "checkpoint.enabled=false")
    saved = usp_cli(*args, cwd=tmp_path)  # its own empty data cache
    assert saved.returncode == 0, saved.stderr
    plan_file = tmp_path / "runs" / "saved" / "plan.yaml"
    assert not yaml.safe_load(plan_file.read_text())["data_meta"]
    with pytest.raises(SystemExit) as exit_:
        worker_main(["--plan", str(plan_file)])
    assert exit_.value.code == 2

    cache = {"USP_CACHE_DIR": os.environ["USP_CACHE_DIR"]}  # the session's prepared corpus
    assert usp_cli("prepare-data", cwd=tmp_path, env=cache).returncode == 0
    assert usp_cli(*args, cwd=tmp_path, env=cache).returncode == 0
    with pytest.raises(SystemExit) as exit_:
        worker_main(["--plan", str(plan_file)])
    assert exit_.value.code == 0
    assert len((plan_file.parent / "metrics.jsonl").read_text().splitlines()) == 2


def test_unprepared_saved_plan_names_prepare_data(tmp_path, capsys):
    out = usp_cli("plan", "--save", *TINY, "train.name=bare", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    proc = subprocess.run([sys.executable, "-m", "usp.engine.worker", "--plan",
                           str(tmp_path / "runs" / "bare" / "plan.yaml")],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "USP_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "usp prepare-data" in proc.stderr and "Traceback" not in proc.stderr


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_two_nodes_over_loopback_match_one_process(tmp_path, shakespeare):
    """Two `usp train` processes, node ranks 0 and 1 (one rank each), meet over 127.0.0.1 and train
    the same global batch as one process: the same losses, step by step."""
    common = [*TINY, "train.steps=3", f"train.runs_dir={tmp_path / 'runs'}"]
    nodes = [*common, "train.name=two", "cluster.nodes=2", "cluster.rdzv_endpoint=127.0.0.1"]
    env = {**os.environ, "COLUMNS": "200"}
    procs = [subprocess.Popen([USP, "train", *nodes, f"cluster.node_rank={r}"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path) for r in (1, 0)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    one = usp_cli("train", *common, "train.name=one", cwd=tmp_path, env={"USP_CACHE_DIR": os.environ["USP_CACHE_DIR"]})
    assert one.returncode == 0, one.stderr

    two_dir = tmp_path / "runs" / "two"
    assert _losses(two_dir) == pytest.approx(_losses(tmp_path / "runs" / "one"), rel=1e-5)
    assert len(_losses(two_dir)) == 3
    plan0 = yaml.safe_load((two_dir / "plan.yaml").read_text())
    assert plan0["config"]["cluster"]["node_rank"] == 0 and plan0["world_size"] == 2
    assert yaml.safe_load((two_dir / "plan.node1.yaml").read_text())["config"]["cluster"]["node_rank"] == 1
    assert {p.name for p in (two_dir / "logs").glob("rank_*.log")} == {"rank_0.log", "rank_1.log"}
    assert "node 1 of 2, rendezvous 127.0.0.1:" in outputs[0]


NETNS = ("usp-node0", "usp-node1")  # two "machines": each its own network stack, joined by a veth pair
NETNS_ADDR = ("10.77.0.1", "10.77.0.2")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Two network namespaces with their own addresses (root and iproute2 needed). Inside each the
    link is named usp0, so one GLOO_SOCKET_IFNAME fits both nodes' ranks."""
    for ns in NETNS:
        _ip("netns", "del", ns)
    made = _ip("netns", "add", NETNS[0])
    if made.returncode != 0:
        pytest.skip(f"network namespaces can't be made here (root and iproute2 needed): {made.stderr.strip()}")
    try:
        steps = [["netns", "add", NETNS[1]],
                 ["link", "add", "usp-veth0", "type", "veth", "peer", "name", "usp-veth1"]]
        for i, ns in enumerate(NETNS):
            steps += [["link", "set", f"usp-veth{i}", "netns", ns],
                      ["-n", ns, "link", "set", f"usp-veth{i}", "name", "usp0"],
                      ["-n", ns, "addr", "add", f"{NETNS_ADDR[i]}/24", "dev", "usp0"],
                      ["-n", ns, "link", "set", "usp0", "up"], ["-n", ns, "link", "set", "lo", "up"]]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, (step, done.stderr)
        yield NETNS
    finally:
        for ns in NETNS:
            _ip("netns", "del", ns)


@pytest.mark.distributed
def test_two_nodes_in_their_own_network_namespaces_match_one_process(tmp_path, shakespeare, two_hosts):
    """The same two-node run, each node in its own network namespace with its own address: the
    rendezvous and gloo traffic cross a (virtual) link between hosts, not loopback."""
    common = [*TINY, "train.steps=3", f"train.runs_dir={tmp_path / 'runs'}"]
    nodes = [*common, "train.name=two", "cluster.nodes=2", f"cluster.rdzv_endpoint={NETNS_ADDR[0]}",
             "+cluster.env.GLOO_SOCKET_IFNAME=usp0"]
    env = {**os.environ, "COLUMNS": "200"}
    procs = [subprocess.Popen(["ip", "netns", "exec", two_hosts[r], USP, "train", *nodes, f"cluster.node_rank={r}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
             for r in (1, 0)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    one = usp_cli("train", *common, "train.name=one", cwd=tmp_path, env={"USP_CACHE_DIR": os.environ["USP_CACHE_DIR"]})
    assert one.returncode == 0, one.stderr
    assert _losses(tmp_path / "runs" / "two") == pytest.approx(_losses(tmp_path / "runs" / "one"), rel=1e-5)
    assert f"rendezvous {NETNS_ADDR[0]}:" in outputs[0]
