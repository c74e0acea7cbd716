"""usp checkpoints written before the RoPE layout change (usp/models/rope_layout.py): told apart by
their trainer_state.json, which has no "rope_layout", and converted as they load, both where a run
resumes from one (sharded tensors, usp/engine/checkpoint.py) and where one is exported (whole
tensors, usp/engine/export.py). Checkpoints written since are in the model's layout and load as
they are."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from usp.models.rope_layout import LEGACY_ROPE_LAYOUT, interleaved_to_halves, qk_heads
from usp.run.files import TRAINER_STATE

LAYOUT_KEY = "rope_layout"  # in trainer_state.json


def checkpoint_rope_layout(ckpt: Path) -> str:
    """The RoPE layout of a checkpoint directory's q/k rows, from its trainer_state.json."""
    state = json.loads((Path(ckpt) / TRAINER_STATE).read_text())
    return str(state.get(LAYOUT_KEY, LEGACY_ROPE_LAYOUT))


@torch.no_grad()
def upgrade_rope_rows(tensors: dict, n_heads: int, n_kv_heads: int | None) -> list[str]:
    """In place: every q/k tensor of `tensors` (parameters by FQN, or flattened optimizer states of
    them; plain tensors or DTensors) from the legacy interleaved layout to rotate_half. Returns the
    keys converted. A DTensor's shard may cut through a head, so it is gathered whole, converted,
    and this rank's part kept: one q/k matrix at a time is the transient, and every rank of its mesh
    goes through the same keys in the same order (the state dicts of one pipeline stage's ranks)."""
    n_kv_heads = int(n_kv_heads or n_heads)
    done = []
    for key, t in tensors.items():
        heads = qk_heads(key, n_heads, n_kv_heads)
        if heads is None or not isinstance(t, torch.Tensor) or t.dim() != 2:
            continue  # not a q/k matrix (an optimizer's step count, a param group's lr)
        if isinstance(t, DTensor):
            whole = interleaved_to_halves(t.full_tensor(), heads)
            t.to_local().copy_(distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local())
        else:
            t.copy_(interleaved_to_halves(t, heads))
        done.append(key)
    return done
