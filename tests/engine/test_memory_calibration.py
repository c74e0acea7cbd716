"""The memory probe (usp/engine/observe/memory_probe.py) on known allocations and one optimizer step,
and a real run's metrics.jsonl and summary.json holding predicted and measured memory (the planner
against measurement over every layout: tests/e2e/test_memory_calibration.py)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from usp.engine.observe.memory_probe import (
    MemTrackerProbe,
    ddp_bucket_bytes,
    optimizer_state_tensors,
    predicted_tensor_bytes,
    storage_bytes,
)

TOLERANCE = 0.15  # |predicted - measured| / measured
MIB = 2 ** 20


def test_probe_measures_a_known_allocation():
    """Parameters tracked from before the step, plus a 4 MiB tensor created (and freed) inside the
    measured region, then a 1 MiB one: the peak is parameters + 4 MiB, not the sum of all three."""
    model = torch.nn.Linear(256, 256, bias=False)  # 256 KiB of fp32 parameters
    optimizer = torch.optim.AdamW(model.parameters())
    probe = MemTrackerProbe([model], [optimizer])
    with probe.measure():
        big = torch.ones(1024, 1024)  # 4 MiB
        del big
        small = torch.ones(256, 1024)  # 1 MiB
        del small
    assert probe.result["peak"] == 4 * MIB + 256 * 1024
    assert probe.result["breakdown"]["params"] == 256 * 1024
    assert probe.result["breakdown"]["activations"] == 4 * MIB


def test_probe_measures_one_optimizer_step():
    """A step of a known model: the peak (inside AdamW's step) holds the parameters, the gradient,
    AdamW's two states (created in the step, 2 x params); ddp_bucket_bytes is 0 without DDP."""
    model = torch.nn.Linear(512, 512, bias=False)  # 1 MiB
    optimizer = torch.optim.AdamW(model.parameters())
    probe = MemTrackerProbe([model], [optimizer])
    x = torch.ones(4, 512)
    with probe.measure():
        model(x).sum().backward()
        optimizer.step()
    by = probe.result["breakdown"]
    assert by["params"] == MIB and by["grads"] == MIB
    assert storage_bytes(optimizer_state_tensors([optimizer])) == 2 * MIB  # exp_avg, exp_avg_sq
    assert by["optimizer"] >= 2 * MIB  # at the peak, inside the step: the states + AdamW's temporaries
    assert probe.result["peak"] == sum(by.values()) and ddp_bucket_bytes([model]) == 0


def test_metrics_and_summary_hold_predicted_and_measured(shakespeare):
    """A real 2-step run: metrics.jsonl has the measured and predicted memory on step 2, every
    record the predicted step time; summary.json the measured peak and step time."""
    from tests.dist.parity import plan_dict
    from usp.engine.parallel.mesh import make_context
    from usp.engine.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        plan = plan_dict(["train.steps=3", "optimizer.warmup_steps=1", "train.eval_batches=1",
                          "train.log_interval=10"], 1, tmp)
        Trainer(plan, make_context(plan)).fit()
        run = Path(plan.run_dir)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run / "summary.json").read_text())
    assert [r["step"] for r in records] == [1, 2, 3]  # step 2 is logged because it is measured
    measured = records[1]
    assert measured["memory_measured_by"] == "MemTracker"
    assert measured["memory_predicted_gib"] == pytest.approx(predicted_tensor_bytes(plan.memory.stages[0])
                                                             / 2 ** 30)
    assert abs(measured["memory_error"]) <= TOLERANCE
    assert all("memory_measured_gib" not in r for r in (records[0], records[2]))
    assert all(r["step_time_predicted_s"] == plan.timing.step_s for r in records)
    assert summary["memory_measured_peak_gib"] == pytest.approx(measured["memory_measured_gib"])
    assert summary["memory_predicted_peak_gib"] == pytest.approx(measured["memory_predicted_gib"])
    assert summary["step_time_measured_s"] > 0 and summary["step_time_predicted_s"] == plan.timing.step_s


def test_measure_memory_off(shakespeare):
    from tests.dist.parity import plan_dict
    from usp.engine.parallel.mesh import make_context
    from usp.engine.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        plan = plan_dict(["train.steps=2", "train.eval_batches=1", "train.measure_memory=false"], 1, tmp)
        trainer = Trainer(plan, make_context(plan), write_outputs=False)
        summary = trainer.fit()
    assert trainer.probe is None and "memory_measured_peak_gib" not in summary
    assert all("memory_measured_gib" not in r for r in trainer.history)
