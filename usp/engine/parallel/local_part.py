"""This rank's part of a parameter whose whole value is known (an initialisation) or stored (a
Hugging Face checkpoint): `place_local_part` cuts it out of the whole tensor, `local_index` says
where it lies in the whole tensor, so a reader fetches only those bytes."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


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


def local_tensor(param: nn.Parameter) -> torch.Tensor:
    """The storage this rank holds of `param`: a DTensor's local shard, a plain parameter itself."""
    return param.to_local() if isinstance(param, DTensor) else param


def local_index(param: nn.Parameter, rows: slice = slice(None)) -> tuple[slice, ...]:
    """Where `local_tensor(param)` lies in the whole tensor: one slice per dimension. `rows` is the
    part of the whole tensor's first dimension that `param`'s global shape covers (expert
    parallelism's experts, Llama.full_parameters), everything by default.

    A DTensor's chunk is the one DCP reads into it when it loads a checkpoint
    (`DTensor.__create_chunk_list__`, torch's `compute_local_shape_and_global_offset`: Shard,
    uneven shards, FSDP2-over-TP's `_StridedShard`); a replicated or plain parameter holds its
    whole (global) shape."""
    if isinstance(param, DTensor):
        chunks = param.__create_chunk_list__()
        local = tuple(param.to_local().shape)
        if len(chunks) != 1 or tuple(chunks[0].sizes) != local:
            raise RuntimeError(f"a DTensor with placements {param.placements} holds no single chunk of its "
                               f"whole tensor ({chunks}, local shape {local})")
        offsets, sizes = tuple(chunks[0].offsets), local
    else:
        offsets, sizes = (0,) * param.dim(), tuple(param.shape)
    start = rows.start or 0
    index = [slice(o, o + s) for o, s in zip(offsets, sizes)]
    if index:
        index[0] = slice(start + index[0].start, start + index[0].stop)
    return tuple(index)
