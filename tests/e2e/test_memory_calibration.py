"""The planner's memory model against measurement: the memory probe (usp/engine/observe/memory_probe.py)
measures the peak tensor memory of one training step per rank, and for every layout of the
calibration set (tests/dist/cases_memory.py: single, DDP, ZeRO-1, FSDP ZeRO-3 / ZeRO-2, TP,
full and selective recompute; the tiny model, seq_len 128, global batch 16) the planner's
tensor memory (its total without the fixed overhead allowance) must be within 15 % of it.
One 2-process torchrun launch runs them all; the single-process layouts run on rank 0."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests.dist.cases_memory import BF16_LAYOUTS, MEMORY_LAYOUTS, ZERO_LAYOUTS
from tests.dist.harness import launch
from usp.engine.observe.memory_probe import (
    MemTrackerProbe,
    ddp_bucket_bytes,
    optimizer_state_tensors,
    predicted_tensor_bytes,
    storage_bytes,
)

TOLERANCE = 0.15  # |predicted - measured| / measured
SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "cases_memory.py"
MIB = 2 ** 20


@pytest.fixture(scope="module")
def calibration(shakespeare):
    return launch(SCRIPT, 2, timeout=300)


@pytest.mark.distributed
def test_planner_memory_within_15_percent_of_measured(calibration):
    assert set(calibration) == set(MEMORY_LAYOUTS), set(MEMORY_LAYOUTS) - set(calibration)
    errors = {}
    for name, r in calibration.items():
        assert r["ok"], (name, r.get("trace") or r)
        assert r["measured_by"] == "MemTracker" and r["measured_gib"] > 0
        errors[name] = (r["predicted_gib"] - r["measured_gib"]) / r["measured_gib"]
        # the fixed allowance is not tensor memory: the comparison leaves it out
        assert r["predicted_total_gib"] > r["predicted_gib"] + 0.29
    table = {k: f"{v:+.1%}" for k, v in errors.items()}
    assert all(abs(e) <= TOLERANCE for e in errors.values()), table


def assert_all_within(results: dict, layouts: dict, bar: float) -> None:
    """Every layout ran, and the planner is within `bar` of each measured peak."""
    assert set(results) == set(layouts), set(layouts) - set(results)
    errors = {}
    for name, r in results.items():
        assert r["ok"], (name, r.get("trace") or r)
        errors[name] = (r["predicted_gib"] - r["measured_gib"]) / r["measured_gib"]
    assert all(abs(e) <= bar for e in errors.values()), {k: f"{v:+.1%}" for k, v in errors.items()}


@pytest.fixture(scope="module")
def zero_calibration(shakespeare):
    return launch(SCRIPT, 4, "--zero", timeout=600)


@pytest.mark.distributed
def test_zero_with_tp_pp_memory_within_10_percent_and_states_sharded(zero_calibration):
    """ZeRO-1 with TP / PP (FSDP2 over dp_replicate) and ZeRO-2 with TP: the planner within 10 % of
    the measured peak; each rank holds about half (dp = 2) of the replicated layout's AdamW states."""
    assert_all_within(zero_calibration, ZERO_LAYOUTS, 0.10)
    whole = zero_calibration["replicate_x_tp"]["optimizer_state_bytes"]
    for name in ("zero1_x_tp", "zero1_x_tp_grad_accum", "zero2_x_tp"):
        assert zero_calibration[name]["optimizer_state_bytes"] == pytest.approx(whole / 2, rel=0.05), name
    assert zero_calibration["zero1_x_tp"]["measured_gib"] < zero_calibration["replicate_x_tp"]["measured_gib"]


@pytest.fixture(scope="module")
def bf16_calibration(shakespeare):
    from usp.config.compose import compose_config
    from usp.data.prepare import ensure_dataset

    ensure_dataset(compose_config(None, ["data.tokenizer=bytes"])[0].data)  # the wide layouts' data, once
    return launch(SCRIPT, 2, "--bf16", timeout=600)


@pytest.mark.distributed
def test_bf16_memory_within_10_percent(bf16_calibration):
    """bf16 as usp's engine runs it on a GPU (autocast, or FSDP2's bf16 policy), here on CPU: fp32
    parameters, gradients and AdamW states (4 + 4 + 8 B, not the playbook's 2 + 2 + 12) and bf16
    weight copies; the wide model (weights outweigh activations) with full recompute and accumulation
    is where a cache of every layer's copy would have set the peak (measured 291 MiB with it, 273 without)."""
    assert_all_within(bf16_calibration, BF16_LAYOUTS, 0.10)
    single = bf16_calibration["single_bf16"]
    assert single["measured_breakdown_gib"]["params"] == pytest.approx(single["predicted_breakdown_gib"]["params"])
    assert single["measured_breakdown_gib"]["optimizer"] > 0  # AdamW m, v (fp32)


@pytest.mark.distributed
def test_measurement_follows_the_layout(calibration):
    """Sanity of the measurements themselves: sharding and recompute lower the measured peak."""
    m = {name: r["measured_gib"] for name, r in calibration.items()}
    assert m["recompute_full"] < m["recompute_selective"] < m["single"]
    assert m["fsdp_zero3"] < m["fsdp_zero2"] < m["ddp"] < m["single"]
    assert m["zero1"] < m["ddp"]
    ddp = calibration["ddp"]["measured_breakdown_gib"]
    params = calibration["ddp"]["predicted_breakdown_gib"]["params"]
    assert ddp["comm_buffers"] == pytest.approx(params)  # DDP's flat bucket copy of the (fp32) gradients


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
        run = Path(plan["run_dir"])
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run / "summary.json").read_text())
    assert [r["step"] for r in records] == [1, 2, 3]  # step 2 is logged because it is measured
    measured = records[1]
    assert measured["memory_measured_by"] == "MemTracker"
    assert measured["memory_predicted_gib"] == pytest.approx(predicted_tensor_bytes(plan["memory"]["stages"][0])
                                                             / 2 ** 30)
    assert abs(measured["memory_error"]) <= TOLERANCE
    assert all("memory_measured_gib" not in r for r in (records[0], records[2]))
    assert all(r["step_time_predicted_s"] == plan["timing"]["step_s"] for r in records)
    assert summary["memory_measured_peak_gib"] == pytest.approx(measured["memory_measured_gib"])
    assert summary["memory_predicted_peak_gib"] == pytest.approx(measured["memory_predicted_gib"])
    assert summary["step_time_measured_s"] > 0 and summary["step_time_predicted_s"] == plan["timing"]["step_s"]


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
