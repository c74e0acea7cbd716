"""`usp plan --build-check`: the named ranks' parallel model built for real, allocating nothing.

    python -m usp.engine.meta_build --plan <plan.yaml> --ranks 0 511

For each rank, one after the other in this process: a fake process group of the plan's world size
(torch's FakeProcessGroup, as torchtitan's dry run uses it: no peers, a collective does nothing), the
plan's device mesh over it, then usp/engine/parallel/build.py's `build_model` as `usp train` runs it,
on the meta device: the whole model or this rank's pipeline stages built on meta, FP8 -> TP/SP -> CP
-> EP -> recompute -> compile -> FSDP2 applied in parallelize.py's order. On meta, materialize.py
allocates nothing and the DDP wrap (which takes real tensors and broadcasts them) is left out; DDP
holds the same parameters. Then every local parameter gets a meta gradient and the optimizer the
plan names (usp/engine/optim.py, ZeroRedundancyOptimizer for plain-DDP ZeRO-1) takes one step, so
torch's optimizer creates the states it keeps, still on meta.

Prints one JSON line per rank: the bytes of its local parameters, their gradients and the optimizer's
states (a DTensor's local shard), the largest parameter's whole tensor, the seconds it took; or, when
the build raised, the error (a layout that plans but can't build). Exit status 1 if any rank failed.
No GPU, no corpus and no checkpoint are read: model.init_from's tensors are never loaded."""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from usp.contract.plan_file import read_plan
from usp.contract.run_plan import RunPlan
from usp.engine.optim import build_optimizer
from usp.engine.parallel.build import ModelParts, build_model
from usp.engine.parallel.local_part import local_tensor
from usp.engine.parallel.mesh import DistContext
from usp.engine.startup_gc import freeze_imports

META = torch.device("meta")


def _bytes(tensors) -> int:
    """What the tensors' local parts occupy: their storage (FSDP2 keeps each shard padded to the first
    rank's rows, so a rank with fewer rows still holds as many bytes)."""
    return sum(local_tensor(t).untyped_storage().nbytes() for t in tensors)


def meta_context(plan: RunPlan, rank: int) -> DistContext:
    """This rank's DistContext on the meta device, its mesh over the fake process group."""
    world = int(plan.world_size)
    mesh = init_device_mesh("cpu", tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.mesh_dims)) \
        if world > 1 else None
    return DistContext(rank, world, 0, META, dict(plan.degrees), dict(plan.ranks[rank].coords), mesh)


def optimizer_state_bytes(plan: RunPlan, ctx: DistContext, parts: ModelParts) -> int:
    """One step of the plan's optimizer, as the trainer builds it (one per part), over meta gradients;
    the bytes of the states torch creates. A parameter's states follow its local shape and dtype
    (torch makes a DTensor's with its local shape), so one stand-in per distinct local shape steps and
    counts for all of its kind: on meta each tensor op runs torch's Python meta kernels, ~10 ms apiece,
    and a 70B rank holds 723 parameters (one AdamW step over all of them: 5-12 s). ZeRO-1's
    ZeroRedundancyOptimizer partitions the whole list by size: it steps every parameter."""
    zero1 = ctx.group("dp_replicate") if plan.decisions.dp_kind == "zero1" else None
    total = 0
    for module in parts.modules:
        kinds: dict[tuple, list] = {}
        for i, p in enumerate(module.parameters()):
            key = (tuple(local_tensor(p).shape), local_tensor(p).dtype, p.requires_grad)
            kinds.setdefault(key if zero1 is None else (*key, i), []).append(p)
        stand_ins = [torch.nn.Parameter(torch.empty(key[0], dtype=key[1], device=META), requires_grad=key[2])
                     for key in kinds]
        for p in stand_ins:
            p.grad = torch.zeros_like(p)
        optimizer = build_optimizer(stand_ins, plan.decisions.optimizer, META, zero1_group=zero1)
        optimizer.step()
        local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's partition
        for same, p in zip(kinds.values(), stand_ins):
            state = local.state.get(p, {})
            total += len(same) * _bytes(t for t in state.values() if isinstance(t, torch.Tensor))
    return total


def largest_parameter(parts: ModelParts) -> tuple[str, int]:
    """(name, elements) of the largest whole tensor the init draws for this rank (Llama.full_parameters)."""
    best = ("", 0)
    for module in parts.modules:
        for name, _p, shape, _rows in module.full_parameters():
            best = max(best, (name, math.prod(shape)), key=lambda x: x[1])
    return best


def check_rank(plan: RunPlan, rank: int) -> dict:
    """Build `rank`'s part on meta under a fake process group; its local sizes, or the error."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    start, world = time.perf_counter(), int(plan.world_size)
    coords = dict(plan.ranks[rank].coords)
    out: dict = {"rank": rank, "pp": coords["pp"]}
    if world > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ctx = meta_context(plan, rank)
        parts = build_model(plan, ctx)
        params = list(parts.parameters())
        out.update(param_elements=sum(local_tensor(p).numel() for p in params), param_bytes=_bytes(params),
                   grad_bytes=_bytes(params),  # a gradient has its parameter's local shape and dtype
                   optimizer_bytes=optimizer_state_bytes(plan, ctx, parts),
                   stages=parts.stage_indices or [0], meta=all(local_tensor(p).is_meta for p in params))
        out["largest"], out["largest_elements"] = largest_parameter(parts)
    except Exception as exc:  # noqa: BLE001 - any failure of the build is the finding
        out.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc(limit=-4))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
    out["seconds"] = round(time.perf_counter() - start, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="a plan.yaml")
    parser.add_argument("--ranks", type=int, nargs="+", required=True)
    args = parser.parse_args(argv)
    plan = read_plan(args.plan)
    torch.set_num_threads(1)
    failed = False
    for rank in args.ranks:
        result = check_rank(plan, rank)
        failed |= "error" in result
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    freeze_imports()  # the imports above ran with the collector paused (usp/engine/__init__.py)
    sys.exit(main())
