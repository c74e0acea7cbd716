"""Expert parallelism (EP) for `usp.models.moe.MoE` layers, with all_to_all token dispatch.

The EP group is made of sharded data-parallel ranks (dp_shard x cp, `DistContext.expert_mesh`, as
torchtitan): every rank of an EP group reads DIFFERENT data (or other tokens of the same sequences
under CP), routes its own tokens, and sends each token to the rank that holds its expert.
EP rank r of an EP group of size ep keeps experts [r*E/ep, (r+1)*E/ep) of every MoE layer.

`apply_expert_parallel` installs `ep_dispatch_combine` as every MoE layer's `expert_dispatch`
hook (the model itself imports nothing from here). Forward of one MoE layer on one rank:
  1. route locally (router, top-k, capacity drops all happen on the source rank, so the result
     equals a single process running the MoE on this rank's tokens);
  2. exchange per-expert token counts (all_to_all_single of an (E,) int64 tensor);
  3. exchange the tokens, sorted by destination rank then expert (all_to_all #1); the local
     expert of each received token follows from the count matrix, so no ids are sent;
  4. run the local experts (tokens regrouped by local expert);
  5. send the outputs back (all_to_all #2, reversed splits); the caller weights them by the
     gate and scatter-adds them into token order.
Both all_to_alls are differentiable (`_AllToAll`: backward = the reverse all_to_all).
(`torch.distributed._functional_collectives.all_to_all_single_autograd` gives the right
values and gradients on gloo too, but 2 of 9 test launches died with "terminate called
without an active exception" at process exit, so a plain autograd.Function is used.)

Checkpoints: `global_expert_state` (below) presents every expert weight and its optimizer
states to DCP as the whole (n_experts, ...) tensor, so checkpoints reshard to any ep (docs/moe.md).

Gradient reduction. In training the engine lets FSDP2 do it (usp/engine/parallel/data.py:
experts are their own FSDP unit over (dp_replicate, dp_shard_mod_ep), gradients summed and divided
by the data-parallel size). tests/dist/cases_expert.py does the same arithmetic by hand
(`reduce_gradients`), for a model without a data-parallel wrapper:
  Let dp = number of data-parallel ranks whose losses are averaged (the EP group lies inside
  them), L = (1/dp) * sum_s L_s the global loss, L_s the mean loss of rank s's batch.
  * non-expert parameters (attention, norms, embeddings, router, shared expert) are replicated
    on all dp ranks and rank s's backward gives dL_s/dθ:
        grad = all_reduce_SUM(grad, dp_group) / dp            (the usual DP average)
  * expert parameters: after backward the owner of expert e already holds
    sum_{s in its EP group} dL_s/dw_e (the reverse all_to_all brings back the gradient of
    every token of the EP group that was routed to e). The other copies of expert e live on
    the edp group (ranks with the same EP rank in the other EP groups, dp/ep ranks), which
    cover the remaining data, so
        grad = all_reduce_SUM(grad, edp_group) / dp           (divide by dp, NOT by edp size)
    With ep = dp the edp group has one rank (None): grad / dp only. With ep = 1 the edp group
    is the dp group and this is the ordinary average.
"""
from __future__ import annotations

import functools
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from usp.models.moe import GroupedExperts, expert_params, moe_layers


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        gx = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(gx, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return gx, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all_to_all_single: x's rows [sum(in_splits[:d]), +in_splits[d]) go
    to rank d of `group`; returns the rows received, out_splits[s] from rank s, in rank order."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def ep_dispatch_combine(experts: GroupedExperts, routed: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
    """The MoE layer's `expert_dispatch` hook under expert parallelism over `group`.
    routed (N, dim): this rank's token copies sorted by global expert id; counts (E,) int64:
    copies per global expert. Returns the expert outputs (N, dim) in the same order."""
    ep = dist.get_world_size(group)
    n_local = experts.n_local
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts.contiguous(), group=group)
    recv = recv_counts.view(ep, n_local)  # recv[s, j] = copies from rank s for local expert j
    send_splits = counts.view(ep, n_local).sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    x = all_to_all(routed, recv_splits, send_splits, group)
    # Received rows are grouped by source rank, then local expert: regroup by local expert.
    local_e = torch.repeat_interleave(torch.arange(n_local, device=x.device).repeat(ep),
                                      recv.flatten().to(x.device))
    order = torch.argsort(local_e, stable=True)
    y_sorted = experts(x[order], recv.sum(0).tolist())
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return all_to_all(y_sorted[inverse], send_splits, recv_splits, group)


def apply_expert_parallel(model: nn.Module, ep_group) -> nn.Module:
    """Shard every MoE layer's experts over `ep_group`, in place: EP rank r keeps rows
    [r*E/ep, (r+1)*E/ep) of the full stacked weights, and forwards dispatch tokens with all_to_all.
    On a meta-built model (the engine's) only the shapes change and the initialisation later draws
    the full tensor and keeps those rows (Llama.full_parameters); on an initialised one the rows'
    values are kept (so the values match a single process). Apply before building the optimizer
    and before any DDP/FSDP wrapping. Returns the model."""
    ep, r = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for m in moe_layers(model):
        E, ex = m.n_experts, m.experts
        if E % ep:
            raise ValueError(f"model.n_experts={E} must divide by parallelism.ep={ep}")
        if ex.n_local != E:
            raise RuntimeError("apply_expert_parallel: experts are already sharded")
        n, start = E // ep, r * (E // ep)
        for name in ("w1", "w2", "w3"):
            full = getattr(ex, name)
            p = nn.Parameter(full.detach()[start:start + n].clone(), requires_grad=full.requires_grad)
            p._ep_shard = (start, E)  # rows of the full tensor (GroupedExperts.expert_start says it too)
            setattr(ex, name, p)
        ex.expert_start = start
        m.expert_dispatch = functools.partial(ep_dispatch_combine, group=ep_group)
    return model


# An expert weight's key in a (flattened) model or optimizer state dict: the weight, or its states
_EXPERT_KEY = re.compile(r"(^|\.)experts\.w[123](\.|$)")


def global_expert_state(state: dict[str, dict], ctx, ep: int) -> dict[str, dict]:
    """The checkpoint layout of expert-parallel weights. Under EP a rank's `experts.w1` is its EP
    rank's slice (n_experts / ep rows), itself sharded by FSDP2 over dp_shard_mod_ep: a DTensor
    whose global shape is the slice, different on every EP rank. Returns a copy of the
    {"model", "optim"} state dicts in which every expert weight and optimizer state is instead a
    DTensor of the whole (n_experts, ...) tensor, Shard(0) over ep then over dp_shard_mod_ep
    (replicated over dp_replicate, and tp), made from this rank's own storage (no copy): DCP
    saves it like any other parameter, and a load writes this rank's rows into the model. Any
    layout then loads the checkpoint (another ep, no EP, another pipeline split): DCP reshards
    by FQN and global offset."""
    if ep <= 1:
        return state
    mesh = ctx.expert_checkpoint_mesh(ep)["dp_replicate", "ep", "dp_shard_mod_ep"]
    return {part: {k: _global(k, v, mesh, ep) if _EXPERT_KEY.search(k) else v for k, v in sd.items()}
            for part, sd in state.items()}


def _global(key: str, value, mesh: DeviceMesh, ep: int):
    if not isinstance(value, torch.Tensor) or value.dim() == 0:  # e.g. AdamW's step count
        return value
    if not isinstance(value, DTensor):  # EP layouts are FSDP layouts: a plain slice would save as the whole
        raise RuntimeError(f"{key}: an expert-parallel slice that is not an FSDP2 DTensor can't be checkpointed")
    shape = torch.Size((value.shape[0] * ep, *value.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(value.to_local(), mesh, [Replicate(), Shard(0), Shard(0)], run_check=False,
                              shape=shape, stride=stride)


def expert_clip_args(modules: list[nn.Module], ctx, ep: int) -> tuple:
    """(ep group, ids of the expert parameters) for `clip_grad_norm`; (None, None) without EP."""
    if ep <= 1:
        return None, None
    return ctx.expert_mesh(ep)["ep"].get_group(), {id(p) for m in modules for p in expert_params(m)}
