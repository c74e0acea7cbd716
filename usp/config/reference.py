"""Overrides that turn a layout into its single-process reference: the same model, seed, data
and global batch with every parallel degree 1 (used by `usp verify` and the parity tests)."""
from __future__ import annotations

DEGREES = ("dp", "dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
_DROPPED = ("parallelism=", "parallelism.pp_", "parallelism.zero1", "parallelism.ddp_comm_hook", "cluster",
            "train.micro_batch=", "train.grad_accum=")


def reference_overrides(overrides: list[str]) -> list[str]:
    dims = tuple(f"parallelism.{d}=" for d in DEGREES)
    kept = [o for o in overrides if not o.lstrip("+").startswith(dims + _DROPPED)]
    return kept + ["parallelism=ddp", "parallelism.dp_replicate=1", "train.micro_batch=-1", "train.grad_accum=-1"]
