"""Process group, device and DeviceMesh for one worker, all taken from the plan."""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None  # only the dims with degree > 1; None for one process
    dp_rank: int
    dp_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_group(self):
        return self.mesh["dp_replicate"].get_group() if self.mesh is not None and self.dp_size > 1 else None


def setup(plan: dict) -> DistContext:
    torch.set_num_threads(int(plan["threads_per_proc"]))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan["world_size"]:
        raise RuntimeError(f"launched with WORLD_SIZE={world} but the plan expects {plan['world_size']} ranks")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(plan["device"], local_rank)
    mesh = None
    if world > 1:
        dist.init_process_group(backend=plan["backend"], timeout=timedelta(minutes=10),
                                device_id=device if device.type != "cpu" else None)
        names = [d for d, s in zip(plan["mesh_dims"], plan["mesh_shape"]) if s > 1]
        shape = [s for s in plan["mesh_shape"] if s > 1]
        mesh = init_device_mesh(device.type, tuple(shape), mesh_dim_names=tuple(names))
    coords = plan["ranks"][rank]["coords"]
    return DistContext(rank, world, local_rank, device, mesh, coords["dp_replicate"], plan["degrees"]["dp_replicate"])


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("cluster.device=cuda but no CUDA device is visible; use cluster=local_cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if kind == "xpu":
        torch.xpu.set_device(local_rank)
        return torch.device("xpu", local_rank)
    return torch.device("cpu")


def all_reduce_mean(value: float, ctx: DistContext) -> float:
    """Mean of a Python float over the data-parallel ranks (for logging only)."""
    if ctx.dp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, group=ctx.dp_group)
    return t.item() / ctx.dp_size


def teardown(clean: bool) -> None:
    """Destroy the process group. After a clean run all ranks meet at a barrier first, so no
    collective is in flight; after an error they don't (a peer may be gone)."""
    gc.collect()
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
