"""The goodput model (usp/perf/goodput.py): Daly's expected wall time against a simulation of the same
failure process, the Young–Daly interval against the model's own optimum, the checkpoint's bytes and
transfer times by hand, and what `usp plan` / plan.yaml make of checkpoint.interval=auto."""
from __future__ import annotations

import math
import random

import pytest

from tests.helpers import usp_cli
from usp.config.compose import compose_config
from usp.contract.plan_file import read_plan, write_plan
from usp.errors import PlanError
from usp.perf.goodput import goodput, lost_per_failure, torchft_goodput, transfer_s, wall_per_work, young_daly
from usp.plan.plan import build_plan, plan_with_failures

pytestmark = pytest.mark.usefixtures("fresh_cache")  # planning computes the dataset's path from it


def simulated_wall_per_work(interval: float, save: float, restart: float, mtbf: float, segments: int,
                            seed: int = 0) -> float:
    """Failures a Poisson process over the wall time, also during saves and restarts; a segment (interval
    of training + its save) counts once it completes; a failure loses the segment and restarts."""
    rng, wall = random.Random(seed), 0.0
    for _ in range(segments):
        while True:
            t = rng.expovariate(1 / mtbf)
            if t >= interval + save:
                wall += interval + save
                break
            wall += t
            while True:  # the restart, which a failure may interrupt too
                t = rng.expovariate(1 / mtbf)
                if t >= restart:
                    wall += restart
                    break
                wall += t
    return wall / (segments * interval)


@pytest.mark.parametrize("interval,save,restart,mtbf", [(20, 2, 10, 100), (5, 0.5, 30, 60), (100, 10, 5, 1000)])
def test_daly_matches_a_simulation_of_the_failure_process(interval, save, restart, mtbf):
    expected = wall_per_work(interval, save, restart, mtbf)
    assert simulated_wall_per_work(interval, save, restart, mtbf, 40000) == pytest.approx(expected, rel=0.02)
    assert goodput(interval, save, restart, mtbf) == pytest.approx(1 / expected)


def test_first_order_and_no_failures():
    # no failures: only the saves cost
    assert wall_per_work(100, 5, 60, math.inf) == pytest.approx(1.05)
    # rare failures: 1 + δ/τ + (τ/2 + R)/M
    t, d, r, m = 600.0, 6.0, 300.0, 5e6
    assert wall_per_work(t, d, r, m) == pytest.approx(1 + d / t + (t / 2 + r) / m, rel=1e-5)  # to O(1/M², δ/M)
    assert lost_per_failure(t, d, r) == pytest.approx(r + (t + d) / 2)


def test_young_daly_is_the_models_optimum():
    save, restart, mtbf = 20.0, 600.0, 11136.0  # Llama 3 405B's 2,048 nodes: one failure every 3.1 h
    best = young_daly(save, mtbf)
    assert best == pytest.approx(math.sqrt(2 * save * mtbf)) and best == pytest.approx(667.5, abs=0.1)
    grid = [best * f for f in (0.25, 0.5, 0.8, 1.25, 2, 4)]
    assert all(goodput(best, save, restart, mtbf) > goodput(t, save, restart, mtbf) for t in grid)
    # the exact optimum (a fine search of the same model) lies within a few percent of √(2δM) when δ ≪ M
    exact = max((best * (0.8 + i / 1000) for i in range(400)), key=lambda t: goodput(t, save, restart, mtbf))
    assert exact == pytest.approx(best, rel=0.05)


def test_transfer_is_the_slower_of_the_nodes_and_the_aggregate():
    tb = 1e12
    assert transfer_s(tb, 10, 5.0, 0) == pytest.approx(20.0)  # 100 GB per node at 5 GB/s
    assert transfer_s(tb, 1000, 5.0, 2000.0) == pytest.approx(0.5)  # the aggregate: 1 TB at 2 TB/s
    assert transfer_s(tb, 100, 5.0, 2000.0) == pytest.approx(2.0)  # 10 GB per node at 5 GB/s


def test_torchft_pays_one_group_at_a_fraction_of_the_throughput():
    assert torchft_goodput(4, 1000, 10, 400, 4000) == pytest.approx(1000 / 1010 * (1 - 400 / 16000))
    assert torchft_goodput(4, 1000, 10, 400, 4000) > goodput(1000, 10, 400, 4000)


def plan_of(*overrides: str, conf: str | None = None):
    cfg, choices = compose_config(conf, list(overrides))
    return build_plan(cfg, choices, force=True, training=False)


def test_the_plans_goodput_by_hand():
    """405B on 64 nodes of 8 (its recipe): the bytes, the costs, the interval and the goodput, each
    from the plan's own inputs."""
    plan = plan_of(conf="llama3_1_405b")
    gp, rel, st = plan.goodput, plan.config.cluster.reliability, plan.config.cluster.storage
    assert gp.written_bytes == pytest.approx(plan.model.params * 12)  # fp32 parameters + AdamW's two states
    assert gp.job_mtbf_s == pytest.approx(rel.node_mtbf_hours * 3600 / 64)
    assert gp.failures_per_day == pytest.approx(86400 / gp.job_mtbf_s)
    write = max(gp.written_bytes / 64 / (st.write_gbps_per_node * 1e9), gp.written_bytes / (st.write_gbps_total * 1e9))
    assert gp.save_write_s == pytest.approx(write)
    assert gp.save_blocking_s == pytest.approx(write + rel.checkpoint_overhead_s)  # checkpoint.async_mode=none
    assert gp.restart_s == pytest.approx(rel.job_start_s + rel.rendezvous_s + rel.build_s + gp.load_s)
    assert gp.interval_auto and gp.interval_steps == round(young_daly(gp.save_blocking_s, gp.job_mtbf_s)
                                                         / plan.timing.step_s)
    assert plan.config.checkpoint.interval == gp.interval_steps  # what the engine reads
    assert gp.goodput == pytest.approx(goodput(gp.interval_s, gp.save_blocking_s, gp.restart_s, gp.job_mtbf_s))
    assert 0.9 < gp.goodput < 1.0


def test_more_nodes_fail_more_often_and_train_a_smaller_share():
    small = plan_of("cluster=slurm_h100", "model=llama3_1_8b", "cluster.nodes=16", "train.global_batch=1024")
    large = plan_of("cluster=slurm_h100", "model=llama3_1_8b", "cluster.nodes=1024", "train.global_batch=8192")
    assert large.goodput.failures_per_day == pytest.approx(64 * small.goodput.failures_per_day)
    assert large.goodput.goodput < small.goodput.goodput


def test_a_fixed_interval_is_kept_and_compared_with_young_daly():
    plan = plan_of("checkpoint.interval=7", conf="llama3_1_405b")
    gp = plan.goodput
    assert not gp.interval_auto and gp.interval_steps == 7 and plan.config.checkpoint.interval == 7
    assert gp.interval_s == pytest.approx(7 * plan.timing.step_s) and gp.young_daly_steps > 7
    auto = plan_of(conf="llama3_1_405b").goodput
    assert auto.goodput > gp.goodput  # saving every 7 steps costs more than the optimum


def test_async_blocks_for_the_host_copy_only():
    sync = plan_of(conf="llama3_1_405b").goodput
    plan = plan_of("checkpoint.async_mode=async", conf="llama3_1_405b")
    gp, st = plan.goodput, plan.config.cluster.storage
    rank = max(s.local.parameters + s.local.optimizer for s in plan.memory.stages)
    assert gp.save_blocking_s == pytest.approx(rank / (st.host_copy_gbps * 1e9)
                                               + plan.config.cluster.reliability.checkpoint_overhead_s)
    assert gp.save_blocking_s < sync.save_blocking_s and gp.interval_s >= gp.save_write_s
    assert gp.goodput > sync.goodput


def test_no_checkpoints_lose_the_whole_run():
    gp = plan_of("checkpoint.enabled=false", "train.steps=1000", conf="llama3_1_405b").goodput
    assert gp.interval_steps == 0 and gp.notes and "step 0" in gp.notes[0]
    assert gp.goodput < plan_of(conf="llama3_1_405b").goodput.goodput


def test_replica_groups_compare_with_torchft():
    plan = plan_of("cluster=slurm_h100", "model=llama3_1_8b", "cluster.nodes=64", "parallelism.dp_replicate=64",
                   "parallelism.dp_shard=8", "train.global_batch=1024")
    ft = plan.goodput.torchft
    assert ft is not None and ft.groups == 64 and ft.goodput > plan.goodput.goodput
    assert ft.group_restart_s == pytest.approx(plan.goodput.restart_s - plan.goodput.load_s + ft.heal_s)
    assert plan_of(conf="llama3_1_405b").goodput.torchft is None or plan.degrees["dp_replicate"] > 1


def test_interval_auto_is_a_number_in_plan_yaml(tmp_path):
    plan = plan_of("checkpoint.interval=auto", "train.steps=100000", "cluster=slurm_h100", "model=llama3_1_8b",
                   "cluster.nodes=256", "train.global_batch=2048")
    path = write_plan(plan, tmp_path / "plan.yaml")
    text = path.read_text()
    assert f"interval: {plan.goodput.interval_steps}\n" in text and "interval: auto" not in text
    back = read_plan(path)
    assert back.config.checkpoint.interval == plan.goodput.interval_steps and back.goodput == plan.goodput


@pytest.mark.parametrize("override", ["checkpoint.interval=sometimes", "checkpoint.interval=-1",
                                      "cluster.reliability.node_mtbf_hours=0", "cluster.storage.write_gbps_per_node=0",
                                      "cluster.reliability.job_start_s=-5"])
def test_bad_reliability_values_are_refused_by_key(override):
    key = override.partition("=")[0]
    cfg, choices = compose_config(None, [override])
    plan, errors = plan_with_failures(cfg, choices)
    assert plan is None and errors and isinstance(errors[0], PlanError)
    assert errors[0].key == key and errors[0].fix


def test_usp_plan_prints_failures_save_interval_and_goodput(tmp_path):
    r = usp_cli("plan", "conf=llama3_1_405b", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    for text in ("failures / day", "save blocks", "restart", "checkpoint every", "Young–Daly", "goodput",
                 "MFU x goodput"):
        assert text in out, text


def test_under_torchft_the_plan_expects_torchfts_goodput():
    plan = plan_of("fault_tolerance=torchft", "cluster=slurm_h100", "model=llama3_1_8b", "cluster.nodes=64",
                   "parallelism.dp_replicate=64", "parallelism.dp_shard=8", "train.global_batch=1024")
    gp = plan.goodput
    assert gp.mode == "torchft" and gp.torchft.groups == plan.fault_tolerance.replica_groups == 64
    assert gp.expected == gp.torchft.goodput > gp.goodput
    restart_only = plan_of("cluster=slurm_h100", "model=llama3_1_8b", "cluster.nodes=64", "parallelism.dp_replicate=64",
                           "parallelism.dp_shard=8", "train.global_batch=1024").goodput
    assert restart_only.mode == "restart" and restart_only.expected == restart_only.goodput
