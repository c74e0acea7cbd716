"""Gradient clipping over every rank that holds a piece of the model: DTensor gradients
(TP / FSDP) are reduced by DTensor itself; pipeline stages add their squared norms. A tied
embedding's LM-head copy on the last stage (usp/engine/parallel/tied.py) holds the same gradient
as the embedding: it is clipped but left out of the norm, so the weight counts once."""
from __future__ import annotations

import torch
import torch.distributed as dist


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, pp_group=None,
                   duplicate: torch.nn.Parameter | None = None) -> float:
    grads = [p.grad for p in params if p.grad is not None and p is not duplicate]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):  # DTensor: the norm over all shards
        total = total.full_tensor()
    if pp_group is not None:  # each stage holds different layers: sum of squares across stages
        total = total.pow(2)
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)
