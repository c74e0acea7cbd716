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


PROFILES = {
    "usp": Profile("usp", "usp's own engine (this repository), as it trains"),
    "nanotron": Profile("nanotron", "nanotron as the Ultra-Scale Playbook's benchmark sweep ran it: bf16 with fp32 "
                        "gradient-accumulation buffers, sequence parallel (reduce-scatter), 1F1B, flash attention, "
                        "fused AdamW"),
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise PlanError(f"unknown planner profile {name!r}", key="planner.profile", value=name,
                        fix=f"one of: {', '.join(PROFILES)}") from None
