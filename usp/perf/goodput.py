"""Goodput: the share of wall time that trains, failures and checkpoints counted (docs/faults.md).

A job of n nodes stops when any node fails: every M = node MTBF / n seconds on average, failures a
Poisson process. It trains τ seconds between checkpoints, a save blocks it δ seconds, and a failure
costs the restart R (the job started again, the rendezvous, the build, the checkpoint's load) plus
the work since the last checkpoint. Daly's expected wall time per unit of work (2006, "A higher
order estimate of the optimum checkpoint interval for restart dumps", eq. 13: failures may also
strike during a save or a restart):

    wall / work = (M / τ) · e^{R/M} · (e^{(τ+δ)/M} − 1)          goodput = work / wall

which to first order is 1 − δ/τ − (τ/2 + R)/M, minimised by the Young–Daly interval τ = √(2δM).

torchft (replica groups that train on while one restarts): a failure costs its group's restart
and the heal (the group's state copied from a live peer), at 1/G of the job's throughput, with no
rollback; the checkpoints stay for what takes every group down.

Pure Python, no torch: `usp plan` and `usp estimate` call it."""
from __future__ import annotations

import math

from usp.contract.predictions import GoodputPlan, TorchftGoodput

DAY_S = 86400.0
HOUR_S = 3600.0


def young_daly(save_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that waste least: √(2δM) (Young 1974; Daly 2006's
    first order)."""
    return math.sqrt(2.0 * max(save_s, 0.0) * mtbf_s)


def wall_per_work(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected wall seconds per second of training (module docstring; ≥ 1)."""
    if interval_s <= 0:
        raise ValueError("a checkpoint interval is > 0 seconds")
    if math.isinf(mtbf_s):
        return (interval_s + save_s) / interval_s
    # expm1 keeps the precision when (τ+δ)/M is tiny (a one-node job: M is months)
    return mtbf_s / interval_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + save_s) / mtbf_s)


def goodput(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected share of wall time that trains (work / wall)."""
    return 1.0 / wall_per_work(interval_s, save_s, restart_s, mtbf_s)


def lost_per_failure(interval_s: float, save_s: float, restart_s: float) -> float:
    """Mean wall seconds one failure costs: the restart, plus half a checkpoint period's work."""
    return restart_s + (interval_s + save_s) / 2.0


def torchft_goodput(groups: int, interval_s: float, save_s: float, group_restart_s: float,
                    mtbf_s: float) -> float:
    """Goodput with torchft's replica groups (module docstring): the checkpoints' cost, and each
    failure's group restart at 1/groups of the throughput."""
    return interval_s / (interval_s + save_s) * max(0.0, 1.0 - group_restart_s / (groups * mtbf_s))


def transfer_s(total_bytes: float, nodes: int, node_gbps: float, total_gbps: float) -> float:
    """Seconds to move total_bytes spread evenly over the nodes: the slower of each node's share at its
    bandwidth and the whole at the storage's aggregate (total_gbps 0: no aggregate limit)."""
    per_node = total_bytes / max(nodes, 1) / (node_gbps * 1e9)
    return max(per_node, total_bytes / (total_gbps * 1e9)) if total_gbps > 0 else per_node


def state_bytes(memory, params: int, prec) -> tuple[float, float, float]:
    """(written, read, largest rank's) bytes of a checkpoint: each parameter's stored value and
    optimizer states once; every rank's own (usp.perf.memory's LocalBytes, what the build check
    measures) summed; the largest of those."""
    ranks = [(st.n_ranks, st.local.parameters + st.local.optimizer) for st in memory.stages if st.local is not None]
    written = float(params) * (prec.param + prec.optim)
    read = sum(n * b for n, b in ranks) or written
    return written, read, max((b for _, b in ranks), default=written)


def plan_goodput(plan, prec, cluster) -> GoodputPlan:
    """goodput_plan for a RunPlan whose memory and timing are predicted."""
    written, read, rank = state_bytes(plan.memory, plan.model.params, prec)
    ft = plan.fault_tolerance  # fault_tolerance=torchft: the run trains through a lost group
    planned = goodput_plan(nodes=plan.nodes, step_s=plan.timing.step_s, steps=int(plan.config.train.steps),
                           written_bytes=written, read_bytes=read, rank_bytes=rank, reliability=cluster.reliability,
                           storage=cluster.storage, checkpoint=plan.config.checkpoint,
                           replica_groups=ft.replica_groups if ft else int(plan.degrees.get("dp_replicate", 1)),
                           inter_node_gbps=float(cluster.inter_node_gbps))
    planned.mode = "torchft" if ft is not None else "restart"
    return planned


def goodput_plan(*, nodes: int, step_s: float, steps: int, written_bytes: float,
                 read_bytes: float, rank_bytes: float, reliability, storage, checkpoint,
                 replica_groups: int, inter_node_gbps: float) -> GoodputPlan:
    """The plan's goodput section. written_bytes: one checkpoint, each tensor once (DCP deduplicates
    replicas and spreads the writes over the ranks); read_bytes: a load, every rank reading its own
    state; rank_bytes: the largest rank's state (an async save's host copy, torchft's heal).
    reliability / storage / checkpoint: cluster.reliability, cluster.storage, the checkpoint group."""
    mtbf_s = float(reliability.node_mtbf_hours) * HOUR_S / max(nodes, 1)
    overhead = float(reliability.checkpoint_overhead_s)
    write_s = transfer_s(written_bytes, nodes, float(storage.write_gbps_per_node), float(storage.write_gbps_total))
    load_s = transfer_s(read_bytes, nodes, float(storage.read_gbps_per_node), float(storage.read_gbps_total)) + overhead
    is_async = str(checkpoint.async_mode) == "async"
    blocking = rank_bytes / (float(storage.host_copy_gbps) * 1e9) + overhead if is_async else write_s + overhead
    terms = {"job start": float(reliability.job_start_s), "rendezvous": float(reliability.rendezvous_s),
             "build": float(reliability.build_s), "checkpoint load": load_s}
    restart_s = sum(terms.values())
    optimal_s = young_daly(blocking, mtbf_s)
    if is_async:  # the background write must end before the next save starts, or that save waits for it
        optimal_s = max(optimal_s, write_s)
    optimal_steps = max(1, round(optimal_s / step_s)) if step_s > 0 else 1
    configured = checkpoint.interval
    auto = str(configured) == "auto"
    notes = []
    if not bool(checkpoint.enabled):
        interval_steps, notes = 0, ["checkpoint.enabled=false: a failure restarts the run from step 0"]
    elif auto:
        interval_steps = optimal_steps
    else:
        interval_steps = int(configured)
    # between saves: the interval, or the whole run when a save comes only at the end (or never)
    interval_s = step_s * (interval_steps if 0 < interval_steps < steps else steps)
    save_cost = blocking
    if is_async and interval_s < write_s:  # each save waits for the previous one's write
        save_cost += write_s - interval_s
        notes.append(f"async saves every {interval_s:.3g} s but each writes for {write_s:.3g} s: the next save "
                     "waits for it (a longer checkpoint.interval hides the write)")
    share = goodput(max(interval_s, 1e-9), save_cost, restart_s, mtbf_s)
    torchft = None
    if replica_groups > 1:
        heal_s = rank_bytes / (inter_node_gbps * 1e9) if inter_node_gbps > 0 else 0.0
        group_restart = restart_s - load_s + heal_s  # no load: the group heals from a live peer
        torchft = TorchftGoodput(groups=replica_groups, group_restart_s=group_restart, heal_s=heal_s,
                                 goodput=torchft_goodput(replica_groups, max(interval_s, 1e-9), save_cost,
                                                         group_restart, mtbf_s))
    return GoodputPlan(
        node_mtbf_hours=float(reliability.node_mtbf_hours), job_mtbf_s=mtbf_s, failures_per_day=DAY_S / mtbf_s,
        written_bytes=written_bytes, read_bytes=read_bytes, save_write_s=write_s, save_blocking_s=save_cost,
        load_s=load_s, restart_s=restart_s, restart_terms=terms, interval_auto=auto, interval_steps=interval_steps,
        interval_s=interval_s, young_daly_s=optimal_s, young_daly_steps=optimal_steps,
        lost_per_failure_s=lost_per_failure(interval_s, save_cost, restart_s), goodput=share, torchft=torchft,
        notes=notes)
