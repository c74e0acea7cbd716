"""Process group, device and the one DeviceMesh of a run, all taken from the plan.

The mesh always has the five dims of the plan (pp, dp_replicate, dp_shard, cp, tp), size-1
dims included, so code can ask for any dim without special cases. Groups over several dims
(e.g. dp_replicate x dp_shard x cp for the loss) are flattened sub-meshes, cached by name.
Expert parallelism adds a second mesh over the same ranks (`DistContext.expert_mesh`)."""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from usp.contract.run_plan import RunPlan
from usp.engine import signals

EXPERT_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
EXPERT_CHECKPOINT_DIMS = ("pp", "dp_replicate", "ep", "dp_shard_mod_ep", "tp")


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    degrees: dict[str, int]
    coords: dict[str, int]
    mesh: DeviceMesh | None  # None for a single process
    _flat: dict = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads a different slice of the global batch."""
        return self.degrees["dp_replicate"] * self.degrees["dp_shard"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp_replicate"] * self.degrees["dp_shard"] + self.coords["dp_shard"]

    def size(self, *dims: str) -> int:
        out = 1
        for d in dims:
            out *= self.degrees[d]
        return out

    def submesh(self, *dims: str) -> DeviceMesh | None:
        """The (flattened, if several) mesh over `dims`; None when it has one rank."""
        if self.mesh is None or self.size(*dims) == 1:
            return None
        if len(dims) == 1:
            return self.mesh[dims[0]]
        name = "_".join(dims)
        if name not in self._flat:
            self._flat[name] = self.mesh[dims]._flatten(name)
        return self._flat[name]

    def group(self, *dims: str):
        mesh = self.submesh(*dims)
        return mesh.get_group() if mesh is not None else None

    def expert_mesh(self, ep: int) -> DeviceMesh:
        """Expert parallelism on the sharded data-parallel ranks (as torchtitan): the dp_shard x cp
        ranks of a slice (row-major, S of them) split into dp_shard_mod_ep (S/ep, outer) x ep
        (inner). Returns the mesh EXPERT_DIMS over the same ranks as the run's mesh: "ep" exchanges
        tokens; ("dp_replicate", "dp_shard_mod_ep") holds copies of the same experts (FSDP shards
        them over dp_shard_mod_ep and replicates them over dp_replicate). Built once, by every rank."""
        if "ep" not in self._flat:
            if self.mesh is None:
                raise RuntimeError("expert parallelism needs several ranks")
            d = self.degrees
            shape = (d["pp"], d["dp_replicate"], d["dp_shard"] * d["cp"] // ep, ep, d["tp"])
            self._flat["ep"] = DeviceMesh(self.mesh.device_type, self.mesh.mesh.reshape(shape),
                                          mesh_dim_names=EXPERT_DIMS)
        return self._flat["ep"]

    def expert_checkpoint_mesh(self, ep: int) -> DeviceMesh:
        """The expert mesh's ranks with ep outside dp_shard_mod_ep (EXPERT_CHECKPOINT_DIMS): DTensor
        shards a tensor dim over mesh dims in their order, and an EP rank's experts come before its
        FSDP shards of them (parallel/expert.py: global_expert_state). Built once, by every rank."""
        if "ep_checkpoint" not in self._flat:
            ranks = self.expert_mesh(ep).mesh.permute(0, 1, 3, 2, 4)  # EXPERT_DIMS -> EXPERT_CHECKPOINT_DIMS
            self._flat["ep_checkpoint"] = DeviceMesh(self.device.type, ranks, mesh_dim_names=EXPERT_CHECKPOINT_DIMS)
        return self._flat["ep_checkpoint"]


def init_process_group(plan: RunPlan) -> None:
    """Once per process, before building any context."""
    torch.set_num_threads(int(plan.threads_per_proc))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.world_size:
        raise RuntimeError(f"launched with WORLD_SIZE={world} but the plan expects {plan.world_size} ranks")
    if world > 1 and not dist.is_initialized():
        device = _device(plan.device, int(os.environ.get("LOCAL_RANK", "0")))
        timeout = timedelta(seconds=int(plan.config.cluster.timeout_s))
        store = _attempt_store(world, timeout)
        given = {"store": store, "rank": int(os.environ["RANK"]), "world_size": world} if store else {}
        dist.init_process_group(backend=plan.backend, timeout=timeout,
                                device_id=device if device.type != "cpu" else None, **given)


def _attempt_store(world: int, timeout: timedelta):
    """The store torchrun's agent serves (on a port it holds from the start: nothing for another
    launch to take), with this attempt's keys under a prefix of their own, or None outside torchrun's
    shared store. torch's env:// rendezvous uses the agent's store without one ("a new TCPStore for
    every retry"), but the server is the same across restarts (train.max_restarts): a restarted rank
    could read its dead peer's gloo address and hang or fail (measured: 3 of 5 kill -9 restarts under
    load, before this prefix)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"usp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)


def make_context(plan: RunPlan) -> DistContext:
    """Device and mesh for this rank under `plan` (the process group must already exist for
    several ranks). Can be called again with another plan of the same world size."""
    world = int(plan.world_size)
    rank = dist.get_rank() if world > 1 else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(plan.device, local_rank)
    mesh = None
    if world > 1:
        mesh = init_device_mesh(device.type, tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.mesh_dims))
    coords = dict(plan.ranks[rank].coords)
    return DistContext(rank, world, local_rank, device, dict(plan.degrees), coords, mesh)


def setup(plan: RunPlan) -> DistContext:
    with signals.rendezvous():  # a stop signal here while a peer is gone ends the rank (usp/engine/signals.py)
        init_process_group(plan)
        return make_context(plan)


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("cluster.device=cuda but no CUDA device is visible; use cluster=local_cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if kind == "xpu":  # Intel GPUs: device type "xpu", backend xccl (plan); ROCm GPUs are "cuda" (RCCL as nccl)
        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise RuntimeError("cluster.device=xpu but no XPU device is visible (needs a PyTorch build with XPU "
                               "support); use cluster=local_cpu")
        torch.xpu.set_device(local_rank)
        return torch.device("xpu", local_rank)
    return torch.device("cpu")


def all_reduce_mean(value: float | torch.Tensor, ctx: DistContext, *dims: str) -> float:
    """Mean of a scalar over the ranks of `dims` (default: every rank that computes a loss on
    different tokens, i.e. dp_replicate x dp_shard x cp). For logging only. A tensor stays on the
    device until after the reduction: one host sync, not one before and one after."""
    if isinstance(value, torch.Tensor):
        value = value.full_tensor() if hasattr(value, "full_tensor") else value  # a loss_parallel DTensor
        t = value.detach().reshape(1).to(device=ctx.device, dtype=torch.float64)
    else:
        t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dims = dims or ("dp_replicate", "dp_shard", "cp")
    group = ctx.group(*dims)
    if group is None:
        return t.item()
    dist.all_reduce(t, group=group)
    return t.item() / ctx.size(*dims)


def teardown(clean: bool) -> None:
    """Destroy the process group. After a clean run all ranks meet at a barrier first, so no
    collective is in flight; after an error they don't (a peer may be gone)."""
    gc.collect()
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
