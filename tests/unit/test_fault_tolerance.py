"""fault_tolerance=torchft at plan time (docs/fault_tolerance.md): what the plan records for the replica groups
(RunPlan.fault_tolerance, which the planner's goodput reads), the layouts and settings the rules refuse with
their fix, and a machine without torchft refused before launch. Torch-free."""
from __future__ import annotations

import pytest

from tests.helpers import plan_for
from usp.config.compose import compose_config
from usp.errors import LaunchError, PlanError
from usp.plan.plan import checked_plan, plan_with_failures

pytestmark = pytest.mark.usefixtures("fresh_cache")

FT = ["fault_tolerance=torchft", "cluster.procs_per_node=6", "parallelism.dp_replicate=3", "parallelism.dp_shard=2",
      "train.global_batch=12"]


def test_the_plan_records_the_replica_groups_and_one_groups_layout():
    plan = plan_for(*FT)
    ft = plan.fault_tolerance
    assert (ft.kind, ft.replica_groups, ft.group_world_size, ft.group_nodes, ft.group_procs_per_node) == \
        ("torchft", 3, 2, 1, 2)
    assert ft.group_degrees == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}
    assert ft.group_dp_kind == "fsdp" and plan.decisions.dp_kind == "hsdp"  # the run is HSDP; a group, FSDP
    assert plan.batch.global_batch == 12 and plan.batch.dp == 6
    assert plan_for().fault_tolerance is None  # the default: restart-only


def test_groups_of_several_nodes_on_slurm():
    plan = plan_for("fault_tolerance=torchft", "cluster=local_slurm", "cluster.nodes=4", "cluster.procs_per_node=2",
                    "parallelism.dp_replicate=2", "parallelism.dp_shard=4")
    ft = plan.fault_tolerance
    assert (ft.replica_groups, ft.group_nodes, ft.group_procs_per_node, ft.group_world_size) == (2, 2, 2, 4)


def _first(*overrides: str) -> PlanError:
    cfg, choices = compose_config(None, list(overrides))
    with pytest.raises(PlanError) as info:
        checked_plan(cfg, choices)
    return info.value


REFUSED = [  # overrides, the key named, words of the message, words of the fix
    (["fault_tolerance=torchft", "cluster.procs_per_node=2", "parallelism=fsdp"], "parallelism.dp_replicate",
     "replicate dimension", "parallelism.dp_replicate=<replica groups"),
    ([*FT, "fault_tolerance.min_replicas=4"], "fault_tolerance.min_replicas", "no step could commit",
     "fault_tolerance.min_replicas=1"),
    (["fault_tolerance=torchft", "cluster=local_slurm", "cluster.nodes=3", "cluster.procs_per_node=2",
      "parallelism.dp_replicate=2", "parallelism.dp_shard=3", "train.global_batch=12"], "cluster.nodes", "whole nodes",
     "cluster.nodes=2"),
    ([*FT, "parallelism.dp_shard=1", "cluster.procs_per_node=3", "parallelism.zero1=true"],
     "parallelism.zero1", "whole copy", "parallelism.zero1=false"),
    ([*FT, "model=moe_tiny"], "model.n_experts", "load-balancing", "a dense model"),
    ([*FT, "checkpoint.async_mode=async"], "checkpoint.async_mode", "background", "checkpoint.async_mode=none"),
    ([*FT, "train.max_restarts=2"], "train.max_restarts", "each lost replica group", "max_group_restarts"),
    ([*FT, "logging.tensorboard=true"], "logging.wandb", "several jobs", "logging.tensorboard=false"),
    ([*FT, "cluster.nodes=3", "cluster.procs_per_node=2"], "cluster.nodes", "this machine only", "Slurm"),
    ([*FT, "fault_tolerance.heartbeat_timeout_s=0"], "fault_tolerance.heartbeat_timeout_s", "> 0", "2.0"),
    ([*FT, "fault_tolerance.lighthouse_port=70000"], "fault_tolerance.lighthouse_port", "TCP port", "=0"),
]


@pytest.mark.parametrize(("overrides", "key", "why", "fix"), REFUSED, ids=[f"{r[1]}{i}" for i, r in enumerate(REFUSED)])
def test_what_torchft_cant_train_is_refused_naming_the_fix(overrides, key, why, fix):
    error = _first(*overrides)
    assert error.key == key, str(error)
    assert why in error.why and fix in (error.fix or ""), str(error)


def test_usp_plan_lists_the_torchft_failures_with_the_others():
    cfg, choices = compose_config(None, [*FT, "parallelism.zero1=true", "checkpoint.async_mode=async"])
    _, errors = plan_with_failures(cfg, choices)
    assert {"checkpoint.async_mode"} <= {e.key for e in errors}


def test_without_torchft_installed_the_launch_is_refused_before_anything_starts(monkeypatch):
    import importlib.util

    from usp.launch import lighthouse
    from usp.launch.local import check_launchable

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(LaunchError) as info:
        check_launchable(plan_for(*FT))
    assert info.value.key == "fault_tolerance.kind" and "usp[ft]" in info.value.fix
    check_launchable(plan_for())  # fault_tolerance=none needs nothing more
    assert lighthouse.BINARY == "torchft_lighthouse"


def test_the_lighthouse_command_carries_the_settings(tmp_path):
    from usp.launch.lighthouse import Lighthouse

    ft = plan_for(*FT, "fault_tolerance.heartbeat_timeout_s=1.5", "fault_tolerance.lighthouse_port=29999",
                  "fault_tolerance.min_replicas=2").fault_tolerance
    cmd = Lighthouse(ft, tmp_path).command("torchft_lighthouse")
    assert cmd == ["torchft_lighthouse", "--min_replicas", "2", "--bind", "0.0.0.0:29999", "--join_timeout_ms",
                   "5000", "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", "1500"]
