"""Several machines without Slurm (usp/launch/rendezvous.py): a saved plan without its data run by
hand, and two `usp train` processes as two nodes (over loopback, and in network namespaces of
their own) matching one process's losses."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers import REPO, USP, losses, usp_cli
from tests.unit.test_multinode import TINY


def test_unprepared_saved_plan_names_prepare_data(tmp_path, capsys):
    out = usp_cli("plan", "--save", *TINY, "train.name=bare", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    proc = subprocess.run([sys.executable, "-m", "usp.engine.worker", "--plan",
                           str(tmp_path / "runs" / "bare" / "plan.yaml")],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "USP_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "usp prepare-data" in proc.stderr and "Traceback" not in proc.stderr


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
    # the in-process run took its allocator settings back: later launches from this process (the FSDP memory-promise
    # runs) inherited its 32 MiB training threshold as their user's own, and peaked at 1.5x their plan
    assert "USP_TRAIN_MMAP_THRESHOLD" not in os.environ and "MALLOC_MMAP_THRESHOLD_" not in os.environ
    assert one.returncode == 0, one.stderr

    two_dir = tmp_path / "runs" / "two"
    assert losses(two_dir) == pytest.approx(losses(tmp_path / "runs" / "one"), rel=1e-5)
    assert sorted(losses(two_dir)) == [1, 2, 3]
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
    assert losses(tmp_path / "runs" / "two") == pytest.approx(losses(tmp_path / "runs" / "one"), rel=1e-5)
    assert f"rendezvous {NETNS_ADDR[0]}:" in outputs[0]
