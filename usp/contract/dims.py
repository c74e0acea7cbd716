"""The parallel degrees of a run, in one place (torchtitan's ParallelDims is the model): the degrees
resolved from the config and checked against the world size, the mesh they make, the rank table
(which rank sits on which node, at which mesh coordinates), the layout's label, and how the data-
parallel ranks reduce their gradients. The planner and the engine both read them from here; the
engine builds its DeviceMesh from exactly this. Pure Python, on usp.errors alone."""
from __future__ import annotations

import math
from dataclasses import dataclass

from usp.errors import PlanError

# Mesh dimension order, outermost first (as torchtitan): ranks that differ only in tp are
# neighbours, so a TP group stays inside a node whenever tp <= processes per node.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The data-parallel kinds the engine builds with FSDP2's fully_shard (the others: DDP, or nothing).
FSDP_KINDS = ("fsdp", "hsdp", "replicate", "zero1_fsdp")
_SHORT = {"dp_replicate": "dp", "dp_shard": "fsdp"}


@dataclass(frozen=True)
class RankInfo:
    rank: int
    node: int
    local_rank: int
    coords: dict[str, int]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the mesh dims, and ep: expert parallelism over dp_shard x cp ranks (not a mesh dim)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, degrees: dict[str, int], ep: int = 1) -> ParallelDims:
        return cls(**{d: int(degrees[d]) for d in MESH_DIMS}, ep=int(ep))

    @classmethod
    def resolve(cls, par, world_size: int) -> ParallelDims:
        """The degrees of parallelism.* for `world_size` ranks: one of them may be -1 (derived so that
        the product is the world size); `parallelism.dp` is shorthand for dp_replicate."""
        degrees = {dim: int(getattr(par, dim)) for dim in MESH_DIMS}
        if getattr(par, "dp", None) is not None:
            if par.dp < 1 and par.dp != -1:
                raise PlanError("a degree must be a positive integer or -1 (derive)", key="parallelism.dp",
                                value=par.dp, fix="parallelism.dp=-1")
            if degrees["dp_replicate"] not in (-1, par.dp):
                raise PlanError(f"conflicts with parallelism.dp_replicate={degrees['dp_replicate']}",
                                key="parallelism.dp", value=par.dp, fix="set only one of them")
            degrees["dp_replicate"] = int(par.dp)
        for dim, value in degrees.items():
            if value == 0 or value < -1:
                raise PlanError("a degree must be a positive integer or -1 (derive)", key=f"parallelism.{dim}",
                                value=value, fix=f"parallelism.{dim}=1")
        derived = [d for d, v in degrees.items() if v == -1]
        fixed = math.prod(v for v in degrees.values() if v != -1)
        if len(derived) > 1:
            raise PlanError(f"only one degree may be -1 (derived); got {', '.join(derived)}",
                            key=f"parallelism.{derived[1]}", value=-1, fix=f"set parallelism.{derived[1]} explicitly")
        layout = " x ".join(f"{d}={v}" for d, v in degrees.items() if v != 1)
        if world_size % fixed:
            raise PlanError(f"the degrees ({layout}) multiply to {fixed}, which does not divide the world size "
                            f"{world_size} (cluster.nodes x cluster.procs_per_node)", key="parallelism",
                            value=layout, fix=f"pick degrees whose product divides {world_size}, "
                            f"or set cluster.procs_per_node / cluster.nodes to match")
        if derived:
            degrees[derived[0]] = world_size // fixed
        elif fixed != world_size:
            raise PlanError(f"the degrees ({layout or 'all 1'}) multiply to {fixed}, but the world size is "
                            f"{world_size}", key="parallelism", value=layout or "1",
                            fix=f"set one degree to -1 to fill the world, or set cluster.procs_per_node={fixed}")
        return cls.of(degrees, int(getattr(par, "ep", 1) or 1))

    @property
    def mesh(self) -> dict[str, int]:
        """{mesh dim: degree}, outermost first."""
        return {d: getattr(self, d) for d in MESH_DIMS}

    @property
    def mesh_shape(self) -> list[int]:
        return [getattr(self, d) for d in MESH_DIMS]

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def rank_table(self, procs_per_node: int) -> list[RankInfo]:
        return rank_table(self.mesh, procs_per_node)

    def label(self, with_ep: bool = True) -> str:
        """The layout's short name, e.g. 'dp2-tp2' ('single' when every degree is 1). Run names leave
        ep out (with_ep=False): a default run directory keeps the name earlier usp versions gave it."""
        parts = [f"{_SHORT.get(d, d)}{v}" for d, v in self.mesh.items() if v > 1]
        parts += [f"ep{self.ep}"] if with_ep and self.ep > 1 else []
        return "-".join(parts) or "single"

    def describe(self) -> str:
        """The degrees above 1 spelled out, e.g. 'dp_replicate=2 x tp=2' ('single process')."""
        return describe(self.mesh)

    def data_parallel_kind(self, zero1: bool = False) -> str:
        return data_parallel_kind(self.mesh, zero1)


def describe(degrees: dict[str, int]) -> str:
    return " x ".join(f"{d}={v}" for d, v in degrees.items() if int(v) > 1) or "single process"


def rank_table(degrees: dict[str, int], procs_per_node: int) -> list[RankInfo]:
    shape = [degrees[d] for d in MESH_DIMS]
    table = []
    for rank in range(math.prod(shape)):
        coords, rest = {}, rank
        for dim, size in reversed(list(zip(MESH_DIMS, shape))):
            coords[dim] = rest % size
            rest //= size
        ordered = {d: coords[d] for d in MESH_DIMS}
        table.append(RankInfo(rank, rank // procs_per_node, rank % procs_per_node, ordered))
    return table


def data_parallel_kind(degrees: dict[str, int], zero1: bool = False) -> str:
    """How gradients are reduced across data-parallel (and context-parallel) ranks:
    none | ddp | zero1 | fsdp | hsdp | replicate (FSDP2 replication, for DTensor models) |
    zero1_fsdp (zero1 with TP/PP: FSDP2 sharded over the dp_replicate ranks, reshard_after_forward=False)."""
    shard = degrees["dp_shard"] * degrees["cp"]
    if shard > 1:
        return "hsdp" if degrees["dp_replicate"] > 1 else "fsdp"
    if degrees["dp_replicate"] == 1:
        return "none"
    if degrees["tp"] > 1 or degrees["pp"] > 1:
        return "zero1_fsdp" if zero1 else "replicate"
    return "zero1" if zero1 else "ddp"


def shard_index(degrees: dict[str, int], coords: dict[str, int], zero1: bool = False) -> int:
    """A rank's place in its FSDP2 shard group (usp/engine/parallel/data.py's meshes, row-major):
    dp_shard x cp flattened for FSDP / HSDP, dp_replicate for ZeRO-1 over TP/PP, else 0. Its expert
    shard group's place (expert parallelism) is this // ep."""
    kind = data_parallel_kind(degrees, zero1)
    if kind in ("fsdp", "hsdp"):
        return coords["dp_shard"] * degrees["cp"] + coords["cp"]
    return coords["dp_replicate"] if kind == "zero1_fsdp" else 0
