"""Data parallelism, one PyTorch building block per flavour:

| layout                                   | wrapper                                                  |
|------------------------------------------|----------------------------------------------------------|
| dp_replicate > 1, plain model            | DDP (bucketed all-reduce overlapped with backward)       |
|   + parallelism.zero1=true               | DDP + ZeroRedundancyOptimizer (optimizer states sharded) |
| dp_shard x cp > 1                        | FSDP2 fully_shard: ZeRO-3 (reshard_after_forward=true)   |
|                                          | or ZeRO-2 (false); HSDP when dp_replicate > 1 too        |
| dp_replicate > 1 with TP/PP              | FSDP2 with a shard group of one rank (pure replication:  |
|                                          | DDP does not take DTensor parameters)                    |
|   + parallelism.zero1=true               | FSDP2 sharded over dp_replicate, reshard_after_forward   |
|                                          | =False: optimizer states and gradients sharded (ZeRO-2;  |
|                                          | ZeroRedundancyOptimizer cannot broadcast DTensors)       |

Context-parallel ranks see different tokens of the same sequences, so their gradients are
averaged like data-parallel ones: FSDP shards over dp_shard x cp (as torchtitan), DDP reduces
over dp_replicate x cp. Gradient accumulation turns gradient sync off on inner micro batches
(DDP.no_sync / FSDP2 set_requires_gradient_sync)."""
from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from usp.engine.parallel.mesh import DistContext
from usp.errors import PlanError

COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")


def apply_fsdp(model: nn.Module, ctx: DistContext, reshard_after_forward: bool, mp_policy=None,
               shard_replicas: bool = False, ep: int = 1) -> nn.Module:
    """fully_shard every block, then the root (embedding, final norm, head). shard_replicas: ZeRO-1
    with TP/PP, sharded over the dp_replicate ranks (1-D mesh) instead of replicated across them.
    Under expert parallelism each block's experts are their own FSDP unit first (`_shard_experts`)."""
    mesh = ctx.mesh["dp_replicate"] if shard_replicas else _fsdp_mesh(ctx)
    kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for block in model.layers.values():
        if ep > 1 and hasattr(block.feed_forward, "experts"):
            _shard_experts(block.feed_forward.experts, ctx, ep, kw)
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _shard_experts(experts: nn.Module, ctx: DistContext, ep: int, kw: dict) -> None:
    """This EP rank's experts, sharded over dp_shard_mod_ep and replicated over dp_replicate (as
    torchtitan). After backward each expert's gradient already sums the dL_s/dw of its EP group's
    ranks (the reverse all_to_all brings them back), so the reduction over the copies is a SUM
    divided by the whole data-parallel size, not by the number of copies. gloo has no PREMUL_SUM,
    hence a plain sum and a division after it (force_sum_reduction) -- except when the shard group
    has one rank (ep = dp_shard x cp): FSDP2 (torch 2.13, foreach_reduce) then divides while
    copying instead of reduce-scattering, and would divide a second time after a forced sum
    (measured, one rank, factor 4: gradient x 1/16 with the forced sum, x 1/4 without)."""
    mesh = ctx.expert_mesh(ep)
    dims = ("dp_replicate", "dp_shard_mod_ep") if ctx.degrees["dp_replicate"] > 1 else ("dp_shard_mod_ep",)
    sharded = fully_shard(experts, **{**kw, "mesh": mesh[dims]})
    sharded.set_gradient_divide_factor(float(ctx.size("dp_replicate", "dp_shard", "cp")))
    sharded.set_force_sum_reduction_for_comms(mesh["dp_shard_mod_ep"].size() > 1)


def _fsdp_mesh(ctx: DistContext):
    """1-D shard mesh (dp_shard x cp), or 2-D (dp_replicate, shard) for HSDP / replication."""
    if ctx.degrees["dp_shard"] > 1 and ctx.degrees["cp"] > 1:
        ctx.submesh("dp_shard", "cp")  # registers the flattened dim "dp_shard_cp" on the root mesh
        shard = "dp_shard_cp"
    else:
        shard = "cp" if ctx.degrees["cp"] > 1 else "dp_shard"
    if ctx.degrees["dp_replicate"] > 1:
        return ctx.mesh[("dp_replicate", shard)]
    return ctx.mesh[shard]


def apply_ddp(model: nn.Module, ctx: DistContext, bucket_mb: int, comm_hook: str = "none",
              powersgd_rank: int = 2) -> DDP:
    group = ctx.group("dp_replicate", "cp")
    ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_mb,
              device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    register_comm_hook(ddp, group, comm_hook, powersgd_rank)
    return ddp


def register_comm_hook(ddp: DDP, group, name: str, powersgd_rank: int) -> None:
    """Gradient compression through DDP's communication hooks. Off by default: bf16/fp16 round
    the averaged gradient to 8/11 significant bits; PowerSGD sends a rank-r approximation
    (with error feedback), so the loss no longer matches an uncompressed run exactly."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "none":
        return
    if name == "bf16":
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif name == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise PlanError(f"choose one of {', '.join(COMM_HOOKS)}", key="parallelism.ddp_comm_hook", value=name,
                        fix="parallelism.ddp_comm_hook=none")


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool):
    """Gradient accumulation without communication on inner micro batches: DDP.no_sync, or
    FSDP2's set_requires_gradient_sync (grads stay unsharded and local until the last one)."""
    if isinstance(module, DDP) and not enabled:
        with module.no_sync():
            yield
        return
    if hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(enabled)
    yield
