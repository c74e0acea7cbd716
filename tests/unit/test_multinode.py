"""Several machines without Slurm (usp/launch/rendezvous.py): the plan-time rule on the node keys and
the torchrun options each node gets (two nodes training: tests/e2e/test_multinode.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import usp_cli

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
