"""Allocate this rank's part of a model built on the meta device, and fill it.

build.py builds every model and pipeline stage on the meta device (shapes only) and parallelize.py
shards it there (TP/SP, EP, FSDP2); then `materialize` allocates only what this rank holds
(`to_empty`: a sharded parameter's local shard, a replicated one whole) and gives every parameter
its value one at a time: the model's per-name initialisation (usp/models/llama.py
`initial_value`: a function of (seed, name), so every layout starts from the single process's
weights, bit for bit), or a Hugging Face checkpoint's tensor (`model.init_from`). Each value is
made whole on the CPU and `place_local_part` keeps this rank's part of it: the transient is the
largest single parameter, never the model."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from usp.engine.parallel.mesh import DistContext


@torch.no_grad()
def place_local_part(param: nn.Parameter, value: torch.Tensor) -> None:
    """Copy this rank's part of `value` (the parameter's whole, global tensor) into `param`.
    A DTensor parameter (TP, FSDP2, both) takes the local shard that torch's own distribute_tensor
    cuts for its mesh and placements; src_data_rank=None: every rank cuts its shard from its own
    copy of `value`, no communication (every rank computed the same value)."""
    if isinstance(param, DTensor):
        local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(value)


def materialize(model: nn.Module, plan: dict, ctx: DistContext) -> None:
    """Allocate `model`'s (a meta-built Llama or pipeline stage, parallelized or not) parameters on
    this rank's device and initialise them, or load model.init_from into them."""
    if ctx.device.type == "meta":  # the build check (usp/engine/build_check.py): shapes only, nothing allocated
        return
    cfg = plan["config"]
    seed = int(cfg["train"]["seed"])
    model.allocate(ctx.device)
    init_from = cfg["model"].get("init_from")
    if not init_from:
        model.init_weights(seed, place=place_local_part)
        return
    from usp.engine.hf_checkpoint import load_hf_weights

    model.init_buffers()
    load_hf_weights(model, init_from, place=place_local_part, seed=seed)  # replaces the init entirely
