"""Restart and checkpoint costs as usp runs measured them, for the goodput model (usp/perf/goodput.py):
what `usp calibrate <runs dir>` fits into cluster.reliability and cluster.storage.

Read from each run's logs/events.jsonl (usp/run/files.py): an "attempt" per launch (its start-up
phases, what it loaded, the failed attempt's last logged progress) and a "checkpoint" per save (bytes,
seconds blocked). Per restart, the job start is the time from the failed attempt's last logged step
to the new processes' start, their imports included (an upper bound by up to train.log_interval
steps); the build counts the first step's extra time over the run's median step (compile, warm-up).
Save and load times are split into a fixed overhead and bytes over a bandwidth per node by least
squares when the sizes vary (at least 1.5x), else the bandwidth stays as configured and the rest is
overhead."""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from usp.contract.plan_file import read_plan_if_any
from usp.run.files import ATTEMPT_EVENT, CHECKPOINT_EVENT, events_path, metrics_path, read_jsonl

SIZE_SPREAD = 1.5  # save (load) sizes must vary this much to fit a bandwidth and an overhead apart


@dataclass
class Sample:
    """One timed transfer: bytes per node, seconds."""
    bytes_per_node: float
    seconds: float


@dataclass
class MeasuredCosts:
    runs: int = 0
    job_starts: list[float] = field(default_factory=list)  # per restart with a known failure time
    rendezvous: list[float] = field(default_factory=list)  # per attempt
    builds: list[float] = field(default_factory=list)  # per attempt: build + the first step's extra
    saves: list[Sample] = field(default_factory=list)  # blocking seconds
    loads: list[Sample] = field(default_factory=list)  # attempts that loaded a checkpoint

    @property
    def restarts(self) -> int:
        return len(self.job_starts)


def read_costs(run_dirs: list[Path]) -> MeasuredCosts:
    """Every run directory's events (directories without an events file are skipped)."""
    costs = MeasuredCosts()
    for run_dir in run_dirs:
        events = read_jsonl(events_path(run_dir))
        if not events:
            continue
        costs.runs += 1
        plan = read_plan_if_any(run_dir)
        nodes = plan.nodes if plan is not None else 1
        steps = [r["step_time_s"] for r in read_jsonl(metrics_path(run_dir)) if isinstance(r.get("step_time_s"), float)]
        step = statistics.median(steps) if steps else 0.0
        previous = None
        for e in events:
            if e.get("event") == ATTEMPT_EVENT:
                # a launch that failed before its first step logged nothing: the next one's job start would
                # span both, so it is not timed (its other phases are)
                _attempt(costs, e, nodes, step, timed_start=previous is not None and e.get("attempt") == previous + 1)
                previous = e.get("attempt")
            elif e.get("event") == CHECKPOINT_EVENT and e.get("mode", "none") == "none":
                costs.saves.append(Sample(float(e["bytes"]) / nodes, float(e["blocking_s"])))
    return costs


def _attempt(costs: MeasuredCosts, e: dict, nodes: int, step: float, timed_start: bool) -> None:
    started, last, imports = e.get("process_started"), e.get("previous_progress"), float(e.get("imports_s", 0.0))
    if timed_start and isinstance(started, float) and isinstance(last, float) and started > last:
        costs.job_starts.append(started - last + imports)  # the failure noticed, the ranks started and imported
    if isinstance(e.get("rendezvous_s"), float):
        costs.rendezvous.append(e["rendezvous_s"])
    costs.builds.append(float(e["build_s"]) + max(0.0, float(e["first_step_s"]) - step))
    if e.get("loaded_bytes"):
        costs.loads.append(Sample(float(e["loaded_bytes"]) / nodes, float(e["load_s"])))


def split(samples: list[Sample], gbps: float) -> tuple[float, float]:
    """(overhead seconds, GB/s per node) of seconds = overhead + bytes / bandwidth (module docstring)."""
    if not samples:
        return 0.0, gbps
    sizes = [s.bytes_per_node for s in samples]
    if min(sizes) > 0 and max(sizes) / min(sizes) >= SIZE_SPREAD:
        mx, my = statistics.fmean(sizes), statistics.fmean(s.seconds for s in samples)
        cov = sum((s.bytes_per_node - mx) * (s.seconds - my) for s in samples)
        var = sum((x - mx) ** 2 for x in sizes)
        slope = cov / var
        if slope > 0:
            return max(0.0, my - slope * mx), 1.0 / slope / 1e9
    overhead = statistics.median(s.seconds - s.bytes_per_node / (gbps * 1e9) for s in samples)
    return max(0.0, overhead), gbps


def fitted(costs: MeasuredCosts, reliability, storage) -> dict[str, float]:
    """cluster.reliability / cluster.storage values the runs measured (keys relative to cluster.);
    what they did not measure is left out. reliability, storage: the cluster group's current values."""
    out: dict[str, float] = {}
    if costs.job_starts:
        out["reliability.job_start_s"] = statistics.median(costs.job_starts)
    if costs.rendezvous:
        out["reliability.rendezvous_s"] = statistics.median(costs.rendezvous)
    if costs.builds:
        out["reliability.build_s"] = statistics.median(costs.builds)
    if costs.saves:
        overhead, write = split(costs.saves, float(storage.write_gbps_per_node))
        out["reliability.checkpoint_overhead_s"] = overhead
        out["storage.write_gbps_per_node"] = write
    if costs.loads:
        _, read = split(costs.loads, float(storage.read_gbps_per_node))
        out["storage.read_gbps_per_node"] = read
    return out


def restart_costs_yaml(root: Path, cluster: str, text: str) -> tuple[str, list[str]]:
    """`usp calibrate <runs dir>`: the cluster group's YAML `text` with the restart and checkpoint costs
    the runs under `root` measured (reliability: and storage: blocks, the keys they don't measure kept),
    and the lines that report them."""
    from usp.perf.calibration.calibrate import load_cluster
    from usp.perf.calibration.measured_runs import cluster_group

    path, _, group = load_cluster(cluster)
    current = cluster_group(group, path)
    costs = read_costs(sorted(p.parent for p in root.rglob("plan.yaml")))
    if not costs.runs:
        return text, [f"restart costs: no run under {root} has logs/events.jsonl: cluster.reliability and "
                      "cluster.storage left as they were"]
    values = fitted(costs, current.reliability, current.storage)
    for block in ("reliability", "storage"):
        mine = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(block + ".")}
        if not mine:
            continue
        merged = {**(group.get(block) or {}), **mine}
        text = re.sub(rf"^{block}:.*?(?=^\S|\Z)", "", text, flags=re.M | re.S).rstrip("\n") + "\n"
        text += (f"{block}:   # measured by usp runs, fitted by `usp calibrate` (docs/faults.md)\n"
                 + "".join(f"  {k}: {v:.4g}\n" for k, v in merged.items()))
    report = [f"restart costs from {costs.runs} run(s): {costs.restarts} restart(s), {len(costs.saves)} save(s), "
              f"{len(costs.loads)} load(s)"]
    report += [f"  cluster.{k}: {v:.4g}" for k, v in values.items()]
    return text, report
