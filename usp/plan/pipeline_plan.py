"""The pipeline part of the run plan: schedule, micro batches, layer -> stage split and the
stages each pp rank holds. Pure Python; the engine builds exactly these stages. The rules
(schedule vs micro batches, layers per stage) are in usp.plan.rules."""
from __future__ import annotations

from usp.contract.run_plan import PipelinePlan
from usp.perf.pipeline_split import arch_split, stage_ranks
from usp.perf.specs import Arch


def plan_pipeline(par, arch: Arch, degrees: dict[str, int], grad_accum: int) -> PipelinePlan | None:
    """None without pipeline parallelism; else the stage layout (the rules have passed)."""
    pp = degrees["pp"]
    if pp == 1:
        return None
    schedule, virtual = str(par.pp_schedule), int(par.pp_virtual_stages)
    # The schedule splits a rank's batch (micro_batch x grad_accum sequences) into grad_accum micro batches.
    stages = arch_split(arch, pp * virtual, list(par.pp_layers) if par.pp_layers is not None else None)
    return PipelinePlan(schedule=schedule, virtual_stages=virtual, n_microbatches=grad_accum,
                        stage_layers=[list(s) for s in stages],
                        rank_stages=[list(r) for r in stage_ranks(pp, virtual, schedule)])
