"""Optimizers (AdamW, Adam, SGD) and learning-rate schedules (cosine, linear, constant, wsd): the
curves and the plan-time checks of optimizer.* (`usp plan` refuses exactly what `usp train`
refuses); weight decay and real training per optimizer: tests/engine/test_optimizer.py."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.helpers import usp_cli
from usp.config.compose import compose_config
from usp.contract.schedule import OptimSettings, lr_factor

REPO = Path(__file__).resolve().parents[2]


def curve(steps: int, **kw) -> list[float]:
    o = OptimSettings(steps=steps, **kw)
    return [lr_factor(s, o) for s in range(steps)]


def test_settings_are_the_schema_fields_and_defaults_plus_steps():
    from dataclasses import fields

    from usp.contract.config_schema import OptimizerConfig, TrainConfig

    schema = {f.name: getattr(OptimizerConfig(), f.name) for f in fields(OptimizerConfig)}
    settings = {f.name: getattr(OptimSettings(), f.name) for f in fields(OptimSettings)}
    assert settings == {**schema, "steps": TrainConfig().steps}
    cfg, _ = compose_config(None, ["optimizer=sgd", "optimizer.lr=0.5", "train.steps=7"])
    read = OptimSettings.from_config(cfg.optimizer, cfg.train.steps)
    assert (read.name, read.lr, read.momentum, read.steps) == ("sgd", 0.5, cfg.optimizer.momentum, 7)
    assert read == OptimSettings.from_config(dict(cfg.optimizer), 7)  # a plan.yaml's plain dict reads alike


def test_cosine_warms_up_then_decays_to_the_floor():
    f = curve(10, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert f[:2] == [0.5, 1.0]
    assert f[2] == 1.0 and all(a > b for a, b in zip(f[2:], f[3:]))
    progress = 7 / 8  # the last step, 8 steps after the warmup
    assert f[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def test_linear_decays_in_equal_steps():
    f = curve(10, schedule="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert f == pytest.approx([1 - s / 10 for s in range(10)])


def test_constant_is_flat_after_warmup():
    assert curve(6, schedule="constant", warmup_steps=3) == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1])


def test_wsd_warmup_stable_then_decay_over_the_last_fraction():
    f = curve(20, schedule="wsd", warmup_steps=4, decay_fraction=0.25, min_lr_ratio=0.0)
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f[4:15] == [1.0] * 11  # stable until the last 25% (5 steps)
    assert f[15:] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    floor = curve(20, schedule="wsd", warmup_steps=0, decay_fraction=0.5, min_lr_ratio=0.5)
    assert floor[10:] == pytest.approx([0.5 + 0.5 * (1 - k / 10) for k in range(10)])


# --- plan time: usp plan and usp train refuse the same values --------------------------------------------

BAD = [
    ("cluster.device=tpu", "cluster.device='tpu': unknown device"),
    ("optimizer.name=lion", "optimizer.name='lion': unknown optimizer"),
    ("optimizer.name=adafactor", "torch.optim.Adafactor fails on the DTensor parameters of FSDP2"),
    ("optimizer.schedule=linearx", "optimizer.schedule='linearx': unknown learning-rate schedule"),
    ("optimizer.lr=nan", "optimizer.lr=nan: the learning rate must be a finite number > 0"),
    ("optimizer.lr=0", "optimizer.lr=0.0: the learning rate must be"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1: must be a finite number >= 0"),
    ("optimizer.beta2=1.0", "optimizer.beta2=1.0: Adam's betas are in [0, 1)"),
    ("optimizer.beta1=inf", "optimizer.beta1=inf: Adam's betas"),
    ("optimizer.eps=0", "optimizer.eps=0.0: must be a finite number > 0"),
    ("optimizer.min_lr_ratio=2", "optimizer.min_lr_ratio=2.0:"),
    ("optimizer.grad_clip=nan", "optimizer.grad_clip=nan:"),
    ("optimizer.warmup_steps=-1", "optimizer.warmup_steps=-1: must be >= 0"),
    ("optimizer=sgd optimizer.momentum=1.5", "optimizer.momentum=1.5: SGD's momentum is in [0, 1)"),
    ("optimizer=sgd optimizer.momentum=0 optimizer.nesterov=true", "Nesterov momentum needs a momentum > 0"),
    ("optimizer.schedule=wsd optimizer.decay_fraction=0", "optimizer.decay_fraction=0.0: warmup-stable-decay"),
    ("optimizer.schedule=wsd train.steps=10 optimizer.warmup_steps=9",
     "warmup (9 steps) and decay (decay_fraction x train.steps = 2 steps) don't fit in train.steps=10"),
    ("data.tokenizer=sentencepiece", "data.tokenizer='sentencepiece': unknown tokenizer"),
]


@pytest.mark.parametrize(("override", "message"), BAD, ids=[b[0] for b in BAD])
def test_plan_and_train_refuse_the_same_values(tmp_path, override, message):
    """Refused at plan time with the key, value and a fix (also by the layout search, not "nothing
    fits"); `usp train` refuses before anything is prepared or written (no run directory, no data cache)."""
    args = [*override.split(), f"train.runs_dir={tmp_path / 'runs'}", "train.name=bad"]
    for command in (["plan"], ["plan", "--search"], ["train"]):
        proc = usp_cli(*command, *args, cwd=tmp_path)
        out = " ".join(proc.stderr.split())
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert message in out and "fix:" in out, (command, out)
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_warmup_longer_than_the_run_is_a_warning_and_strict_refuses_it(tmp_path):
    ok = usp_cli("plan", "train.steps=5", "optimizer.warmup_steps=20", cwd=tmp_path)
    assert ok.returncode == 0 and "the warmup outlasts the run" in " ".join(ok.stdout.split())
    strict = usp_cli("plan", "--strict", "train.steps=5", "optimizer.warmup_steps=20", cwd=tmp_path)
    assert strict.returncode == 2 and "optimizer.warmup_steps=20" in strict.stderr


@pytest.mark.parametrize("group", ["adamw", "adam", "sgd", "adamw_wsd"])
def test_optimizer_groups_compose_and_plan(tmp_path, group):
    proc = usp_cli("plan", f"optimizer={group}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg, _ = compose_config(None, [f"optimizer={group}"])
    assert cfg.optimizer.name in ("adamw", "adam", "sgd")


# --- the engine ----------------------------------------------------------------------------------------
