"""Pipeline parallelism in the engine: build this rank's stages from plan["pipeline"] (each
stage parallelized like a whole model), and run / evaluate one batch through the schedule."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from usp.engine.dist import DistContext
from usp.engine.model_setup import ModelParts
from usp.engine.parallel.pipeline import build_pipeline, lm_loss
from usp.engine.parallelize import parallelize
from usp.plan.pipeline_split import last_stage_rank


def build_pipeline_parts(plan: dict, ctx: DistContext, build) -> ModelParts:
    pipe = plan["pipeline"]
    pp_rank = ctx.coords["pp"]
    mine = pipe["rank_stages"][pp_rank]
    n_stages = len(pipe["stage_layers"])
    raw = []

    def parallelize_stage(module):
        raw.append(module)
        return parallelize(module, plan, ctx)

    schedule, wrapped = build_pipeline(build, pipe["stage_layers"], mine, ctx.group("pp"), ctx.device,
                                       int(pipe["n_microbatches"]), pipe["schedule"], lm_loss,
                                       parallelize_fn=parallelize_stage)
    parts = ModelParts(modules=wrapped, raw=None, schedule=schedule, is_first_stage=0 in mine,
                       is_last_stage=n_stages - 1 in mine, stage_modules=wrapped)
    parts.last_pp_rank = last_stage_rank(ctx.degrees["pp"], int(pipe["virtual_stages"]), pipe["schedule"])
    parts.stage_indices = list(mine)
    parts.stage_owner = {stage: rank for rank, stages in enumerate(pipe["rank_stages"]) for stage in stages}
    parts.hidden_dim = int(plan["config"]["model"]["dim"])
    return parts


def pipeline_step(parts: ModelParts, ctx: DistContext, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward + backward of this rank's batch through the pipeline schedule; returns the
    batch-mean loss on every pp rank."""
    losses = [] if parts.is_last_stage else None
    args = (x,) if parts.is_first_stage else ()
    parts.schedule.step(*args, target=y if parts.is_last_stage else None, losses=losses, return_outputs=False)
    # micro-batch losses are mean / n_microbatches: their sum is the batch mean
    return _broadcast(parts, ctx, sum(_float(loss) for loss in losses) if parts.is_last_stage else 0.0)


@torch.no_grad()
def pipeline_eval(parts: ModelParts, ctx: DistContext, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward only, the whole batch through the stages in order, hidden states passed
    point-to-point between the ranks that own consecutive stages. Independent of the schedule
    (torch's forward-only `eval` of the zbv schedule hangs in 2.13)."""
    group, me, loss = ctx.group("pp"), ctx.coords["pp"], 0.0
    modules = dict(zip(parts.stage_indices, parts.modules))
    h = None
    n_stages = len(parts.stage_owner)
    for stage in range(n_stages):
        owner = parts.stage_owner[stage]
        prev = parts.stage_owner.get(stage - 1)
        if stage > 0 and owner != prev:  # hidden states cross ranks
            if me == prev:
                dist.send(h.contiguous(), dist.get_global_rank(group, owner), group=group)
            elif me == owner:
                s_local = x.shape[1] // ctx.degrees["tp"]  # sequence-parallel shard under TP
                h = torch.empty((x.shape[0], s_local, parts.hidden_dim), device=ctx.device)
                dist.recv(h, dist.get_global_rank(group, prev), group=group)
        if me == owner:
            h = modules[stage](x if stage == 0 else h)
            if stage == n_stages - 1:
                loss = _float(F.cross_entropy(h.flatten(0, 1).float(), y.flatten(0, 1)))
    return _broadcast(parts, ctx, loss)


def _broadcast(parts: ModelParts, ctx: DistContext, loss: float) -> float:
    """The loss from the pp rank that holds the last stage, on every pp rank (for logging)."""
    value = torch.tensor(loss, dtype=torch.float64, device=ctx.device)
    group = ctx.group("pp")
    dist.broadcast(value, src=dist.get_global_rank(group, parts.last_pp_rank), group=group)
    return float(value)


def _float(loss) -> float:
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
