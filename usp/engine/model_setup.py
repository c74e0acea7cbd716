"""Build the model for one rank from the plan, then apply the parallel wrappers in one fixed
order (this version: activation recomputation, then DDP)."""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from usp.engine.dist import DistContext
from usp.engine.recompute import apply_recompute
from usp.models.llama import Llama, LlamaArgs


def build_model(plan: dict, ctx: DistContext) -> tuple[torch.nn.Module, Llama]:
    """Returns (the module to train, the bare Llama underneath it)."""
    cfg = plan["config"]
    args = LlamaArgs.from_config(_Attrs(cfg["model"]), plan["model"]["vocab_size"])
    # Same seed on every rank: identical initial weights without a broadcast.
    model = Llama(args, max_seq_len=int(plan["batch"]["seq_len"]))
    model.init_weights(seed=int(cfg["train"]["seed"]))
    model.to(ctx.device)
    apply_recompute(model, cfg["train"]["recompute"])
    if ctx.dp_size > 1:
        bucket = int(cfg["parallelism"]["ddp_bucket_mb"])
        wrapped = DDP(model, process_group=ctx.dp_group, bucket_cap_mb=bucket,
                      device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        return wrapped, model
    return model, model


class _Attrs(dict):
    """Attribute access on a plain dict (the plan's config section)."""

    __getattr__ = dict.__getitem__
