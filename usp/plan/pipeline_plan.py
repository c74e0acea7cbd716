"""The pipeline part of the run plan: schedule, micro batches, layer -> stage split and the
stages each pp rank holds. Pure Python; the engine builds exactly these stages."""
from __future__ import annotations

from usp.errors import PlanError
from usp.plan.model_math import param_breakdown
from usp.plan.pipeline_split import check_tied_embeddings, split_layers, stage_ranks, validate_schedule


def plan_pipeline(par, model, degrees: dict[str, int], grad_accum: int) -> dict | None:
    """None without pipeline parallelism; else the stage layout (validated)."""
    pp = degrees["pp"]
    if pp == 1:
        return None
    schedule, virtual = str(par.pp_schedule), int(par.pp_virtual_stages)
    check_tied_embeddings(bool(model.tie_embeddings), pp)
    # The schedule splits a rank's batch (micro_batch x grad_accum sequences) into grad_accum micro batches.
    validate_schedule(schedule, pp, virtual, grad_accum)
    n_stages = pp * virtual
    if model.n_layers < n_stages:
        raise PlanError(f"{model.n_layers} layers can't fill pp x virtual stages = {pp} x {virtual} = {n_stages}",
                        key="parallelism.pp_virtual_stages", value=virtual,
                        fix="fewer virtual stages, a smaller parallelism.pp, or more layers")
    parts = param_breakdown(model.dim, model.n_layers, model.n_heads, model.n_kv_heads, model.ffn_dim,
                            model.vocab_size, model.tie_embeddings)
    layer = parts["attention"] + parts["mlp"] + parts["norms"]
    explicit = list(par.pp_layers) if par.pp_layers is not None else None
    stages = split_layers(model.n_layers, n_stages, parts["embedding"], parts["final_norm"] + parts["lm_head"],
                          layer, explicit)
    return {"schedule": schedule, "virtual_stages": virtual, "n_microbatches": grad_accum,
            "stage_layers": stages, "rank_stages": stage_ranks(pp, virtual, schedule)}
