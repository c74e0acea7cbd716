"""The best layout at a given node count, planned as `usp plan` plans it: the layout search
(usp/plan/search.py) on a cluster of that size, at the config's global batch, then the best
candidate planned again from the config with its overrides, and the next taken while `usp plan`
would refuse one. `usp estimate` and its scaling table size runs with it."""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from omegaconf import OmegaConf

from usp.contract.run_plan import RunPlan
from usp.errors import PlanError
from usp.plan.planner_inputs import PlannerContext
from usp.plan.search import Candidate, search

TOP_CANDIDATES = 5  # the search's best layouts tried, in order, until `usp plan` accepts one


@dataclass
class Sized:
    """One node count: the layout `usp plan` accepts there and its predicted throughput."""

    nodes: int
    devices: int
    global_batch: int  # sequences per step
    candidate: Candidate
    plan: RunPlan  # the layout planned from the config, as `usp plan` plans it
    overrides: list[str]  # what reproduces it from the config: `usp plan <config> <overrides>`

    @property
    def tokens_per_s(self) -> float:
        return self.candidate.timing.tokens_per_s

    @property
    def mfu(self) -> float:
        return self.candidate.timing.mfu


def layout_overrides(nodes: int, layout, global_batch: int) -> list[str]:
    """Every config value the layout sets, and the ones that could contradict it reset."""
    return [f"cluster.nodes={nodes}", *layout.overrides(), f"parallelism.ep={layout.ep}", "parallelism.dp=null",
            "parallelism.pp_layers=null", f"train.global_batch={global_batch}", "train.global_batch_tokens=null",
            "train.grad_accum=-1"]


def sized_at(ctx: PlannerContext, cfg, choices: dict | None, nodes: int, global_batch: int | None = None,
             ) -> Sized | None:
    """The best layout on `nodes` nodes that `usp plan` accepts (None: none fits or every one is refused);
    global_batch: sequences per step (default: the config's)."""
    batch = global_batch or ctx.global_batch
    hw = ctx.hw.with_nodes(nodes)
    settings = replace(ctx.settings, launcher="slurm") if nodes > 1 else ctx.settings  # many nodes: a Slurm job
    found = search(ctx.arch, hw, ctx.prec, ctx.seq_len, batch, top_k=TOP_CANDIDATES, settings=settings,
                   profile=ctx.profile)
    for candidate in found.top:
        plan, overrides = planned(cfg, choices, nodes, candidate, batch)
        if plan is not None:
            return Sized(nodes, hw.world, batch, candidate, plan, overrides)
    return None


def planned(cfg, choices: dict | None, nodes: int, candidate: Candidate,
            global_batch: int) -> tuple[RunPlan | None, list[str]]:
    """The config with this node count, layout and global batch, planned as `usp plan` plans it, and the
    overrides that changed the config; (None, ...) when a rule of either kind (plan, engine) refuses it
    or it does not fit."""
    from usp.plan.plan import build_plan, engine_support_errors

    sized = copy.deepcopy(cfg)
    values = layout_overrides(nodes, candidate.layout, global_batch)
    if nodes > 1 and str(sized.cluster.launcher) == "local":  # many nodes: sized as a Slurm job, as searched
        values.append("cluster.launcher=slurm")
        if not int(sized.cluster.threads_per_proc) and not int(sized.cluster.slurm.cpus_per_task):
            values.append("cluster.threads_per_proc=1")
    changed = []
    for item in values:
        key, _, text = item.partition("=")
        value = _yaml_value(text)
        if OmegaConf.select(sized, key) != value:
            OmegaConf.update(sized, key, value, merge=False)
            changed.append(item)
    try:
        plan = build_plan(sized, choices, training=False)
    except PlanError:
        return None, changed
    return (None if engine_support_errors(plan) else plan), changed


def _yaml_value(text: str):
    import yaml

    return yaml.safe_load(text)
