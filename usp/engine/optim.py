"""The optimizer (AdamW, Adam or SGD: PyTorch's own) and its learning-rate schedule (LambdaLR over
usp/contract/schedule.py's curve), as the plan records them (RunPlan.decisions.optimizer); ZeRO-1
shards the optimizer's states over the data-parallel ranks with ZeroRedundancyOptimizer."""
from __future__ import annotations

import torch

from usp.contract.schedule import OptimSettings, lr_factor
from usp.engine.accel import fused_adamw


def param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights) only; none on norms and biases, the
    1-D tensors (as Megatron-LM and nanoGPT do). A DTensor's dim() is the full tensor's, so FSDP2 and
    TP shards fall in the same group as the whole parameter."""
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def optimizer_class_and_args(o: OptimSettings, device: torch.device) -> tuple[type[torch.optim.Optimizer], dict]:
    if o.name == "sgd":
        return torch.optim.SGD, dict(lr=o.lr, momentum=o.momentum, nesterov=o.nesterov)
    betas = (o.beta1, o.beta2)
    if o.name == "adam":  # L2 weight decay (added to the gradient), as torch.optim.Adam does
        return torch.optim.Adam, dict(lr=o.lr, betas=betas, eps=o.eps)
    if o.name == "adamw":
        return torch.optim.AdamW, dict(lr=o.lr, betas=betas, eps=o.eps, fused=fused_adamw(device.type))
    raise ValueError(f"optimizer.name={o.name!r}: the plan's rules should have refused it")


def build_optimizer(params: list[torch.nn.Parameter], o: OptimSettings, device: torch.device,
                    zero1_group=None) -> torch.optim.Optimizer:
    cls, kw = optimizer_class_and_args(o, device)
    groups = param_groups(params, o.weight_decay)
    if zero1_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        kw.pop("fused", None)
        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=zero1_group, **kw)
    return cls(groups, **kw)


def build_scheduler(optimizer, o: OptimSettings):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, o))
