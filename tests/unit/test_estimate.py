"""`usp estimate`: devices for a deadline, hours for a device count, cost, and the memory table.
FLOPs/token x tokens = devices x hours x 3600 x peak x MFU, checked by hand."""
from __future__ import annotations

import math

import pytest

from tests.helpers import usp_cli
from usp.config.compose import compose_config
from usp.errors import PlanError
from usp.perf.specs import Arch
from usp.plan.estimate import DEFAULT_MFU, estimate

PEAK = 989e12


pytestmark = pytest.mark.usefixtures("fresh_cache")  # planning computes the dataset's path from it


def est(*overrides: str, **kw):
    cfg, choices = compose_config(None, list(overrides))
    return estimate(cfg, choices, **kw)


def test_devices_for_a_deadline_by_hand():
    e, plan = est("model=llama3_1_70b", "train.tokens=15e12", "cluster=slurm_h100", hours=720, mfu=0.4)
    cfg, _ = compose_config(None, ["model=llama3_1_70b"])
    fpt = Arch.from_model(cfg.model).flops_per_token(128)  # 6·N + 12·L·h·s at the config's seq_len
    assert e.flops_per_token == fpt and e.total_flops == fpt * 15e12
    exact = fpt * 15e12 / (720 * 3600 * PEAK * 0.4)
    assert e.nodes == math.ceil(exact / 8) and e.devices == e.nodes * 8
    assert e.hours == pytest.approx(fpt * 15e12 / (e.devices * PEAK * 0.4) / 3600) and e.hours <= 720
    assert e.mfu_source == "given (--mfu)" and e.cost is None
    assert 5000 < e.devices < 9000  # 6.3e24 FLOPs in 30 days at 40 % of 989 TFLOPS


def test_hours_for_devices_and_cost():
    e, _ = est("model=llama3_1_8b", "train.tokens=1e12", "train.seq_len=4096", "cluster=slurm_h100",
               "cluster.price_per_device_hour=2.5", devices=64, mfu=0.45)
    hours = e.total_flops / (64 * PEAK * 0.45) / 3600
    assert e.hours == pytest.approx(hours) and e.devices == 64 and e.nodes == 8
    assert e.cost == pytest.approx(64 * hours * 2.5)


def test_mfu_from_the_time_model_or_the_search():
    fits, plan = est("model=llama3_1_8b", "train.tokens=1e12", "train.seq_len=4096", "train.global_batch=256",
                     "cluster=slurm_h100", "parallelism.dp_replicate=1", "parallelism.dp_shard=8",
                     "train.micro_batch=1")  # micro batch 2 needs recompute to fit 80 GiB (docs/planner.md)
    assert plan.memory.fits and fits.mfu == plan.timing.mfu and "configured layout" in fits.mfu_source
    assert fits.devices == 8  # the cluster's, without --hours / --devices
    big, plan = est("model=llama3_1_70b", "train.tokens=15e12", "cluster=slurm_h100", hours=720)
    assert not plan.memory.fits and "searched" in big.mfu_source and 0.1 < big.mfu < 0.6 != DEFAULT_MFU
    assert any("does not fit" in n for n in big.notes)


@pytest.mark.parametrize("kw,key", [(dict(hours=10, devices=8), "--hours"), (dict(hours=-1), "--hours"),
                                    (dict(mfu=1.5), "--mfu"), (dict(hours=10), "train.tokens")])
def test_estimate_errors(kw, key):
    with pytest.raises(PlanError) as info:
        est(**kw)
    assert info.value.key == key and info.value.fix


def test_usp_estimate_cli(tmp_path):
    r = usp_cli("estimate", "model=llama3_1_70b", "train.tokens=15e12", "cluster=slurm_h100", "--hours", "720",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "memory per device" in out and "optimizer states" in out  # the breakdown table
    assert "devices" in out and "node(s) x 8" in out and "hours" in out and "MFU" in out
    r = usp_cli("estimate", "train.tokens=1e9", "--devices", "1", "--mfu", "0.3", cwd=tmp_path)
    assert r.returncode == 0 and "30.0% (given (--mfu))" in r.stdout
    r = usp_cli("estimate", "--hours", "5", cwd=tmp_path)
    assert r.returncode == 2 and "train.tokens" in r.stderr
