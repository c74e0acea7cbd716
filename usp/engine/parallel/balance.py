"""MoE load balancing over the global batch (formulas and sources: docs/moe.md).

Every MoE layer's routing statistics (tokens per expert) are summed over the ranks that share a
global batch: the data-parallel and context-parallel ranks of the layer's (pp, tp) slice, which
include the expert-parallel ones. TP ranks route the same tokens (a MoE layer is replicated over
tp) and each pipeline stage holds its own layers, so neither joins the sum. With the counts
global, the load-balancing loss and the aux-loss-free bias update equal one process's on the
same global batch, under every layout.

The counts need no gradient (f_e is a count), so a plain `all_reduce` in the forward is enough:
the loss's gradient flows through P_e, this rank's mean router probability, and the
data-parallel gradient average sums it over the ranks (usp.models.moe.MoE.balance_loss).
DeepSeek-V3's sequence-wise loss (model.aux_loss_scope=sequence) needs only each sequence's counts:
summed over the context-parallel ranks, which hold parts of the same sequences.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from usp.engine.parallel.mesh import DistContext
from usp.models.moe import MoE, moe_layers

BATCH_DIMS = ("dp_replicate", "dp_shard", "cp")  # the ranks whose tokens make up one global batch


def _sum_over(stats: torch.Tensor, group) -> torch.Tensor:
    out = stats.clone()
    dist.all_reduce(out, group=group)
    return out


def apply_moe_balancing(model: nn.Module, group, aux_loss_coef: float, grad_accum: int,
                        sequence_group=None) -> None:
    """Install the global-batch statistics on every MoE layer of `model` (a model or a pipeline
    stage): counts summed over `group` (the BATCH_DIMS ranks; None = one rank), a sequence-wise
    loss's per-sequence counts over `sequence_group` (the context-parallel ranks, which hold parts of
    the same sequences; None = one rank), and the aux loss's gradient scale: coef / micro batches per
    step, attached to each layer's output (usp.models.moe.AttachAuxLoss), so the trainer and the
    pipeline schedule never add the aux loss to the loss themselves."""
    for moe in moe_layers(model):
        moe.reduce_stats = functools.partial(_sum_over, group=group) if group is not None else None
        moe.reduce_sequence_stats = functools.partial(_sum_over, group=sequence_group) \
            if sequence_group is not None else None
        moe.aux_loss_scale = aux_loss_coef / grad_accum


def finish_step(modules: list[nn.Module], update_bias: bool = True) -> dict[int, torch.Tensor]:
    """After a step's optimizer update: each MoE layer's tokens per expert of the step
    ({global layer index: int64 (E,)}, this rank's layers only), its bias moved from them
    (aux-loss-free balancing; not for a skipped step), the counts cleared for the next step."""
    load = {}
    for module in modules:
        for name, sub in module.named_modules():
            tokens = sub.take_step_tokens() if isinstance(sub, MoE) else None
            if tokens is None:
                continue
            if update_bias:
                sub.update_expert_bias(tokens)
            load[_layer_index(name)] = tokens
    return load


def _layer_index(name: str) -> int:
    """`layers.<i>.feed_forward` (wrappers' infixes in between): the global layer index, which
    pipeline stages keep."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def expert_load(load: dict[int, torch.Tensor], ctx: DistContext, n_layers: int, n_experts: int) -> dict[str, dict]:
    """Per MoE layer of the whole model, the step's tokens per expert (all of them, and min / max /
    mean) and imbalance = max / mean (1 = balanced; what the slowest expert costs over a balanced one).
    Called by every rank at the same steps: the pipeline ranks' layers are summed over pp."""
    if not load and ctx.degrees["pp"] == 1:
        return {}
    if ctx.degrees["pp"] > 1:  # each layer lives on one pp rank: a sum gathers them
        table = torch.zeros(n_layers, n_experts, dtype=torch.int64, device=ctx.device)
        for i, tokens in load.items():
            table[i] = tokens
        dist.all_reduce(table, group=ctx.group("pp"))
        load = {i: table[i] for i in range(n_layers) if table[i].sum() > 0}
    out = {}
    for i in sorted(load):
        t = load[i].double()
        mean = float(t.mean())
        out[str(i)] = {"tokens_min": int(t.min()), "tokens_max": int(t.max()), "tokens_mean": mean,
                       "imbalance": float(t.max()) / mean if mean > 0 else 1.0, "tokens": load[i].tolist()}
    return out
