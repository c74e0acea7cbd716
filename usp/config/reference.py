"""Overrides that turn a layout into its single-process reference: the same model, seed, data
and global batch with every parallel degree 1 (used by `usp verify` and the parity tests)."""
from __future__ import annotations

from typing import Any

DEGREES = ("dp", "dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
_DROPPED = ("parallelism=", "parallelism.pp_", "parallelism.zero1", "parallelism.ddp_comm_hook", "cluster",
            "train.micro_batch=", "train.grad_accum=")


def reference_overrides(overrides: list[str], grad_accum: int = -1) -> list[str]:
    """grad_accum: the reference's micro-batch steps per step; -1 = one (the whole global batch in
    one forward), what a dense model's reference uses (`reference_grad_accum` says when not)."""
    dims = tuple(f"parallelism.{d}=" for d in DEGREES)
    kept = [o for o in overrides if not o.lstrip("+").startswith(dims + _DROPPED)]
    return kept + ["parallelism=ddp", "parallelism.dp_replicate=1", "train.micro_batch=-1",
                   f"train.grad_accum={grad_accum}"]


def reference_grad_accum(model: Any, grad_accum: int) -> int:
    """The MoE load-balancing loss is a statistic of each micro-batch step's global batch
    (docs/moe.md): its one-process equivalent runs the layout's grad_accum micro-batch steps, each
    the union of the ranks' micro batches. Every other loss is a mean over tokens, and its
    reference takes the whole global batch at once (-1), which also checks the accumulation."""
    moe = int(model.n_experts or 0) > 0 and float(model.aux_loss_coef or 0.0) > 0
    return grad_accum if moe else -1
