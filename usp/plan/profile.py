"""Whose training recipe the planner predicts: usp's own engine, or a named foreign recipe whose
published runs the planner is calibrated against. A profile holds the recipe's choices that change
memory or time (gradient buffers, sequence-parallel activations, allocator behaviour, overlap) so
the same layout can be predicted as usp runs it or as, say, nanotron ran it. Pure Python.

Selected with `planner.profile=<name>`."""
from __future__ import annotations

from dataclasses import dataclass

from usp.errors import PlanError


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    # time (usp/plan/timing.py): how the recipe runs its communication and optimizer
    dp_overlap: float = 0.8  # share of the data-parallel window (the last backward) its gradient reduction hides behind
    cp_overlap: float = 0.8  # share of a layer's attention the CP ring exchange hides behind
    reduce_bytes: int = 0  # bytes per gradient value reduced over dp; 0 = the precision's gradient bytes
    zero1_once_per_step: bool = False  # ZeRO-1 with TP/PP: one gradient reduction + all-gather per step (not FSDP2)
    optimizer_bytes_per_param: int = 34  # AdamW (+ clipping) streams fp32 master, m, v, the gradient, writes bf16


PROFILES = {
    "usp": Profile("usp", "usp's own engine (this repository), as it trains"),
    "nanotron": Profile("nanotron", "nanotron as the Ultra-Scale Playbook's benchmark sweep ran it: bf16 with fp32 "
                        "gradient-accumulation buffers, sequence parallel (reduce-scatter), 1F1B, flash attention, "
                        "fused AdamW",
                        dp_overlap=0.8, reduce_bytes=4, zero1_once_per_step=True),
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise PlanError(f"unknown planner profile {name!r}", key="planner.profile", value=name,
                        fix=f"one of: {', '.join(PROFILES)}") from None
