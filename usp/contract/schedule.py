"""The optimizer's settings and its learning-rate curve, as the plan records them
(RunPlan.decisions.optimizer): the planner's rules check them (usp/plan/optimizer.py), the engine
builds torch's optimizer and LambdaLR from them (usp/engine/optim.py), so both read the same
values and the same curve. Pure Python."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from usp.contract.config_schema import OptimizerConfig, TrainConfig

_SCHEMA = OptimizerConfig()  # the defaults live once, in the config schema
_TRAIN = TrainConfig()


@dataclass(frozen=True)
class OptimSettings:
    """optimizer.* and train.steps, as the rules and the lr curve read them (the schema's fields and
    defaults: tests/unit/test_optimizer.py checks the two list the same fields)."""

    name: str = _SCHEMA.name
    schedule: str = _SCHEMA.schedule
    lr: float = _SCHEMA.lr
    min_lr_ratio: float = _SCHEMA.min_lr_ratio
    weight_decay: float = _SCHEMA.weight_decay
    beta1: float = _SCHEMA.beta1
    beta2: float = _SCHEMA.beta2
    eps: float = _SCHEMA.eps
    momentum: float = _SCHEMA.momentum
    nesterov: bool = _SCHEMA.nesterov
    warmup_steps: int = _SCHEMA.warmup_steps
    decay_fraction: float = _SCHEMA.decay_fraction
    grad_clip: float = _SCHEMA.grad_clip
    steps: int = _TRAIN.steps

    @classmethod
    def from_config(cls, opt, steps: int) -> OptimSettings:
        """From optimizer.* (a dataclass, a DictConfig or a dict); missing keys keep the defaults."""
        def get(name: str):
            default = getattr(_SCHEMA, name)
            value = opt.get(name, default) if hasattr(opt, "get") else getattr(opt, name, default)
            return type(default)(value)

        return cls(**{f.name: get(f.name) for f in fields(OptimizerConfig)}, steps=int(steps))

    @property
    def decay_steps(self) -> int:
        """wsd: the last steps over which lr decays to lr * min_lr_ratio."""
        return max(1, round(self.decay_fraction * self.steps))


def lr_factor(step: int, o: OptimSettings) -> float:
    """Multiplier of optimizer.lr at a (0-based) step: linear warmup over warmup_steps, then
    cosine: half a cosine from 1 to min_lr_ratio at the last step;
    linear: a straight line from 1 to min_lr_ratio at the last step;
    constant: 1;
    wsd: 1 until the last decay_fraction of the steps, then linearly to min_lr_ratio."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    if o.schedule == "wsd":
        start = o.steps - o.decay_steps
        if step < start:
            return 1.0
        return _toward_floor(1 - (step - start) / o.decay_steps, o.min_lr_ratio)
    progress = min(1.0, (step - o.warmup_steps) / max(1, o.steps - o.warmup_steps))
    if o.schedule == "linear":
        return _toward_floor(1 - progress, o.min_lr_ratio)
    return _toward_floor(0.5 * (1 + math.cos(math.pi * progress)), o.min_lr_ratio)


def _toward_floor(remaining: float, floor: float) -> float:
    """remaining goes 1 -> 0; the factor 1 -> floor."""
    return floor + (1 - floor) * max(0.0, remaining)
