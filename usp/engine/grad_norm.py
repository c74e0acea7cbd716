"""Gradient clipping over every rank that holds a piece of the model: DTensor gradients
(TP / FSDP) are reduced by DTensor itself, one group of same-mesh gradients at a time (a MoE
model's experts, and its router under TP, live on other meshes than the rest); expert-parallel
ranks add their experts' squared norms; pipeline stages add their squared norms. A tied
embedding's LM-head copy on the last stage (usp/engine/parallel/tied.py) holds the same gradient
as the embedding: it is clipped but left out of the norm, so the weight counts once."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist


class _NormReductionNotice(logging.Filter):
    """Drops DTensor's notice that a norm partial over two mesh dims (dp_shard and tp) is reduced by
    two sequential all-reduces: printed by every rank of every TP x FSDP run (64 lines of a 70B run's
    log), about two all-reduces of one scalar per step. Other redistributions still warn."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not ("sequential" in str(record.msg) and "_NormPartial" in str(record.args))


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_NormReductionNotice())


def _by_mesh(params: list[torch.nn.Parameter], expert_ids: set[int]) -> dict:
    """{(is expert, mesh or None): params with a gradient}."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault((id(p) in expert_ids, getattr(p, "device_mesh", None)), []).append(p)
    return groups


def _norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    return total.full_tensor() if hasattr(total, "full_tensor") else total  # DTensor: over all shards


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, pp_group=None, ep_group=None,
                   expert_ids: set[int] | None = None, duplicate: torch.nn.Parameter | None = None) -> float:
    """expert_ids: ids of the expert-parallel parameters (each EP rank holds different experts:
    their squared norms add up over ep_group). duplicate: a parameter left out of the norm."""
    groups = _by_mesh([p for p in params if p is not duplicate], expert_ids or set())
    if ep_group is None and len(groups) == 1:  # the common case: one norm over one mesh
        total = _norm(next(iter(groups.values())))
    else:
        squares = {key: _norm(ps).pow(2) for key, ps in groups.items()}
        zero = next(iter(squares.values())).new_zeros(()) if squares else torch.zeros(())
        dense = sum((sq for (is_expert, _), sq in squares.items() if not is_expert), zero)
        experts = sum((sq for (is_expert, _), sq in squares.items() if is_expert), zero.clone())
        if ep_group is not None:
            dist.all_reduce(experts, group=ep_group)
        total = (dense + experts).sqrt()
    if pp_group is not None:  # each stage holds different layers: sum of squares across stages
        total = total.pow(2)
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    if max_norm > 0:
        # as torch.nn.utils.clip_grads_with_norm_, on each rank's local shards: a scalar scales every
        # placement alike, and DTensor's sharding propagation for a foreach op over a 3-D mesh's
        # gradients cost 16.6 s per rank on the first step (measured, dp x cp x tp x pp on CPU)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            torch._foreach_mul_([_local(p.grad) for p in params if p.grad is not None], coef)
    return float(total)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad  # under no_grad: the shard itself
