"""The planner's memory model against measurement: the memory probe (usp/engine/observe/memory_probe.py)
measures the peak tensor memory of one training step per rank, and for every layout of the
calibration set (tests/dist/cases_memory.py: single, DDP, ZeRO-1, FSDP ZeRO-3 / ZeRO-2, TP,
full and selective recompute; the tiny model, seq_len 128, global batch 16) the planner's
tensor memory (its total without the fixed overhead allowance) must be within 15 % of it.
One 2-process torchrun launch runs them all; the single-process layouts run on rank 0."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.cases_memory import BF16_LAYOUTS, MEMORY_LAYOUTS, ZERO_LAYOUTS
from tests.dist.harness import launch
from tests.engine.test_memory_calibration import TOLERANCE

# A first test builds its module's torchrun launch: the launch's own limit (tests/dist/harness.py).
pytestmark = pytest.mark.timeout(600)

SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "cases_memory.py"


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
    from usp.data.tokenized import ensure_dataset

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
