"""Several machines without Slurm: `usp train` runs on each with the same config and its own
cluster.node_rank; torchrun meets the other nodes at cluster.rdzv_endpoint (no torch here).

torchrun's static rendezvous is used, not c10d's dynamic one: static gives each node the rank
the user set (c10d orders nodes by host name and pid, so cluster.node_rank would not decide
which machine holds global rank 0 and writes the run's files). Node 0's torchrun hosts the
store on the endpoint's port; when the port is not given it is derived from the run (its name
and config), the same on every node and different for another run, as the Slurm path derives
one from the job id."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from usp.contract.typed import plain
from usp.plan.rules import RDZV_ENDPOINT
from usp.run.files import plan_path

PORT_BASE, PORT_SPAN = 20000, 10000  # as the Slurm script: 20000 + job id % 10000


@dataclass(frozen=True)
class Rendezvous:
    host: str
    port: int
    run_id: str  # the same on every node of this run; differs for another run or config
    node_rank: int
    nodes: int

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


def is_multinode_local(plan) -> bool:
    """Several machines started by hand (launcher local, nodes > 1)."""
    cluster = plan.config.cluster
    return cluster.launcher == "local" and int(cluster.nodes) > 1


def node_rank(plan) -> int:
    """This machine's node rank (0 when the run has one node or is not started by hand)."""
    value = plan.config.cluster.node_rank
    return int(value) if value is not None and is_multinode_local(plan) else 0


def rendezvous(plan) -> Rendezvous:
    """Where and how this node meets the others. The plan has passed the plan-time rules
    (usp.plan.rules: local_multinode_rendezvous), so both keys are set and well formed."""
    cluster = plan.config.cluster
    match = RDZV_ENDPOINT.match(str(cluster.rdzv_endpoint))
    assert match is not None, "checked at plan time"
    run_id = _run_id(plan)
    port = int(match["port"]) if match["port"] else PORT_BASE + int(run_id.rsplit("-", 1)[1], 16) % PORT_SPAN
    return Rendezvous(match["host"].strip("[]"), port, run_id, int(cluster.node_rank), int(cluster.nodes))


def torchrun_rendezvous_args(plan) -> list[str]:
    """torchrun's options for this node: the node count, its rank and the endpoint."""
    rdzv = rendezvous(plan)
    host = f"[{rdzv.host}]" if ":" in rdzv.host else rdzv.host
    return [f"--nnodes={rdzv.nodes}", f"--node-rank={rdzv.node_rank}", "--rdzv-backend=static",
            f"--rdzv-endpoint={host}:{rdzv.port}", f"--rdzv-id={rdzv.run_id}"]


def node_plan_path(run_dir, plan) -> Path:
    """Where this node's `usp train` writes the plan its ranks read. Node 0 writes the run's
    plan.yaml (and, through global rank 0, every run-level file); node R > 0 writes
    plan.node<R>.yaml beside it (its plan differs only in cluster.node_rank), so a run directory
    on a shared file system is never written by two nodes at once."""
    rank = node_rank(plan)
    return plan_path(run_dir) if rank == 0 else Path(run_dir) / f"plan.node{rank}.yaml"


def _run_id(plan) -> str:
    """usp-<name>-<hash of the config without the node rank>: a node started with another config
    gets another id (and, without a port, another port), so it can't join this run by mistake."""
    config = plain(plan.config)
    config["cluster"].pop("node_rank", None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(plan.name))[:48]
    return f"usp-{name}-{digest}"
