"""AdamW with linear warmup and cosine decay (PyTorch's own optimizer and LambdaLR); ZeRO-1
shards its states over the data-parallel ranks with ZeroRedundancyOptimizer."""
from __future__ import annotations

import math

import torch

from usp.engine.accel import fused_adamw


def build_optimizer(params: list[torch.nn.Parameter], opt, device: torch.device,
                    zero1_group=None) -> torch.optim.Optimizer:
    if opt.name != "adamw":
        raise ValueError(f"optimizer.name={opt.name!r}: only 'adamw' is implemented")
    # No weight decay on norms (1-D weights), as in Llama/nanoGPT.
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kw = dict(lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)
    if zero1_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=zero1_group, **kw)
    return torch.optim.AdamW(groups, fused=fused_adamw(device.type), **kw)


def lr_factor(step: int, opt, total_steps: int) -> float:
    """Multiplier of optimizer.lr at a (0-based) step."""
    if step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return 1.0
    progress = (step - opt.warmup_steps) / max(1, total_steps - opt.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * cosine


def build_scheduler(optimizer, opt, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, opt, total_steps))
