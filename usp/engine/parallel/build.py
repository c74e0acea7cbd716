"""Build what one rank trains from the plan: the model, or this rank's pipeline stages (each
stage parallelized like a whole model), parallelized in the fixed order of
usp/engine/parallel/parallelize.py. Everything is built on the meta device and a rank allocates
only its own part: its stages, and of those its shards (parallel/materialize.py). Running a
pipeline step lives in parallel/pipeline.py."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from usp.contract.run_plan import RunPlan
from usp.engine.accel import set_attention
from usp.engine.parallel.mesh import DistContext
from usp.engine.parallel.parallelize import parallelize
from usp.engine.parallel.tied import tied_embedding
from usp.models.llama import Llama, LlamaArgs


@dataclass
class ModelParts:
    modules: list[nn.Module]  # the (wrapped) modules whose parameters this rank trains
    raw: nn.Module | None  # the bare full model, for sampling; None when pipelined
    schedule: Any = None  # torch.distributed.pipelining schedule when pp > 1
    is_first_stage: bool = True
    is_last_stage: bool = True
    stage_modules: list[nn.Module] = field(default_factory=list)
    # pipelined only: the pp rank holding the last stage, this rank's stages, stage -> pp rank
    last_pp_rank: int = 0
    stage_indices: list[int] = field(default_factory=list)
    stage_owner: dict[int, int] = field(default_factory=dict)
    hidden_dim: int = 0
    tied: Any = None  # parallel/tied.py TiedEmbedding: tied embeddings split over pipeline stages

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()


def model_factory(plan: RunPlan, ctx: DistContext):
    """A function that builds the whole model on the meta device: shapes only, nothing allocated.
    parallelize() allocates and initialises each rank's part (parallel/materialize.py). The
    embedding has the plan's rows: the vocabulary padded to a multiple of tp (masked out of the loss)."""
    args = LlamaArgs.from_config(plan.config.model, plan.decisions.embedding_rows)

    def build() -> Llama:
        with torch.device("meta"):
            model = Llama(args, max_seq_len=int(plan.batch.seq_len))
        set_attention(model, plan.decisions.attention, ctx.device.type)
        return model

    return build


def build_model(plan: RunPlan, ctx: DistContext) -> ModelParts:
    start = time.perf_counter()
    build = model_factory(plan, ctx)
    if ctx.degrees["pp"] > 1:
        parts = build_pipeline_parts(plan, ctx, build)
    else:
        model = build()
        wrapped = parallelize(model, plan, ctx)
        parts = ModelParts(modules=[wrapped], raw=model, stage_modules=[wrapped])
    _log_build(ctx, parts, time.perf_counter() - start)
    return parts


def _log_build(ctx: DistContext, parts: ModelParts, seconds: float) -> None:
    """How long this rank took to build, parallelize and initialise its part, and what it holds
    (logs/rank_<R>.log; scripts/bench/build_memory.py reads it)."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in parts.parameters()]
    n_bytes = sum(t.numel() * t.element_size() for t in local)
    logging.getLogger(f"usp.rank{ctx.rank}").info(
        "build: %.2f s, this rank holds %d parameter elements (%.1f MiB)", seconds,
        sum(t.numel() for t in local), n_bytes / 2 ** 20)


def build_pipeline_parts(plan: RunPlan, ctx: DistContext, build) -> ModelParts:
    """This rank's stages of plan.pipeline and the schedule that runs them."""
    # imported here: torch.distributed.pipelining costs ~1 s of start-up per process (measured),
    # which only pipelined runs need to pay
    from usp.engine.loss import training_loss
    from usp.engine.parallel.pipeline import build_pipeline

    pipe = plan.pipeline
    assert pipe is not None, "pp > 1 has a pipeline plan"
    mine = pipe.rank_stages[ctx.coords["pp"]]
    n_stages = len(pipe.stage_layers)

    schedule, wrapped = build_pipeline(build, pipe.stage_layers, mine, ctx.group("pp"), ctx.device,
                                       int(pipe.n_microbatches), pipe.schedule, training_loss(plan),
                                       parallelize_fn=lambda stage: parallelize(stage, plan, ctx))
    tied = tied_embedding(ctx, list(mine), wrapped, pipe.rank_stages, plan.ranks) \
        if plan.config.model.tie_embeddings else None
    return ModelParts(
        modules=wrapped, raw=None, schedule=schedule, is_first_stage=0 in mine, is_last_stage=n_stages - 1 in mine,
        stage_modules=wrapped, last_pp_rank=pipe.last_stage_rank, stage_indices=list(mine),
        stage_owner={stage: rank for rank, stages in enumerate(pipe.rank_stages) for stage in stages},
        hidden_dim=int(plan.config.model.dim), tied=tied)
