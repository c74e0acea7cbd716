"""Allocate this rank's part of a model built on the meta device, and fill it.

build.py builds every model and pipeline stage on the meta device (shapes only) and parallelize.py
shards it there (TP/SP, EP, FSDP2); then `materialize` allocates only what this rank holds
(`to_empty`: a sharded parameter's local shard, a replicated one whole) and gives every parameter
its value one at a time: the model's per-name initialisation (usp/models/llama.py
`initial_value`: a function of (seed, name), so every layout starts from the single process's
weights, bit for bit), or a Hugging Face checkpoint's tensor (`model.init_from`). An initial value
is made whole on the CPU and `place_local_part` (local_part.py) keeps this rank's part of it: the
transient is the largest single parameter, never the model. A checkpoint's tensor is not made whole:
each rank reads only the bytes of its own part (usp/engine/hf_checkpoint.py, `local_index`)."""
from __future__ import annotations

from torch import nn

from usp.contract.run_plan import RunPlan
from usp.engine.parallel.local_part import place_local_part
from usp.engine.parallel.mesh import DistContext


def materialize(model: nn.Module, plan: RunPlan, ctx: DistContext) -> None:
    """Allocate `model`'s (a meta-built Llama or pipeline stage, parallelized or not) parameters on
    this rank's device and initialise them, or load model.init_from into them."""
    if ctx.device.type == "meta":  # the build check (usp/engine/meta_build.py): shapes only, nothing allocated
        return
    seed = int(plan.config.train.seed)
    model.allocate(ctx.device)
    init_from = plan.config.model.init_from
    if not init_from:
        model.init_weights(seed, place=place_local_part)
        return
    from usp.engine.hf_checkpoint import load_hf_weights

    model.init_buffers()
    load_hf_weights(model, init_from, seed=seed)  # replaces the init entirely: each rank reads its own part
