"""Restart and checkpoint costs read back from a run's logs/events.jsonl (usp/perf/calibration/restarts.py):
the job start counted from the failed attempt's last progress, the build with the first step's extra,
and a save's time split into overhead and bandwidth only where the sizes say how."""
from __future__ import annotations

import json

import pytest

from usp.contract.config_schema import ReliabilityConfig, StorageConfig
from usp.perf.calibration.restarts import Sample, fitted, read_costs, split


def write_run(run_dir, events, step_times):
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "step_time_s": t}) + "\n"
                                                   for i, t in enumerate(step_times)))


def attempt(n, started, last=None, **kw):
    base = {"event": "attempt", "attempt": n, "process_started": started, "imports_s": 1.5, "rendezvous_s": 0.5,
            "build_s": 2.0, "first_step_s": 0.6, "load_s": 0.0, "loaded_bytes": 0, "previous_progress": last}
    return {**base, **kw}


def test_restarts_saves_and_loads_from_events(tmp_path):
    events = [attempt(0, 1000.0),
              {"event": "checkpoint", "step": 10, "bytes": 1e9, "blocking_s": 1.5, "mode": "none"},
              {"event": "checkpoint", "step": 20, "bytes": 3e9, "blocking_s": 2.5, "mode": "none"},
              {"event": "checkpoint", "step": 25, "bytes": 5e9, "blocking_s": 9.0, "mode": "async"},  # not a sync cost
              attempt(1, 1100.0, last=1096.0, load_s=1.2, loaded_bytes=4e9)]
    write_run(tmp_path / "run", events, [0.2, 0.1, 0.1, 0.1])
    costs = read_costs([tmp_path / "run", tmp_path / "no_events"])
    assert costs.runs == 1 and costs.restarts == 1
    assert costs.job_starts == [pytest.approx(4.0 + 1.5)]  # the failure noticed, the ranks started and imported
    assert costs.builds == [pytest.approx(2.0 + 0.5)] * 2  # + the first step's 0.6 s over the median 0.1 s
    values = fitted(costs, ReliabilityConfig(), StorageConfig())
    # 1 GB in 1.5 s, 3 GB in 2.5 s: 1 s of overhead, 2 GB/s
    assert values["reliability.checkpoint_overhead_s"] == pytest.approx(1.0)
    assert values["storage.write_gbps_per_node"] == pytest.approx(2.0)
    assert values["reliability.job_start_s"] == pytest.approx(5.5) and values["reliability.rendezvous_s"] == 0.5
    assert "storage.read_gbps_per_node" in values  # one load: its bandwidth stays, the overhead is the rest


def test_one_save_size_keeps_the_configured_bandwidth():
    overhead, gbps = split([Sample(1e9, 0.7), Sample(1e9, 0.9)], 5.0)
    assert gbps == 5.0 and overhead == pytest.approx(0.8 - 0.2)
