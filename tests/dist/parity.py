"""Plan a layout and its single-process reference from overrides, in-process, and verify them
with the engine's own comparison (usp/engine/verify_worker.py, what `usp verify` runs). Used by
the parity-matrix cases (many layouts in one torchrun launch) and the memory tests."""
from __future__ import annotations

import tempfile

import torch.distributed as dist

from usp.config.reference import reference_grad_accum, reference_overrides
from usp.contract.run_plan import RunPlan
from usp.engine.verify_worker import train_reference, verify_against


def plan_dict(overrides: list[str], world: int, runs_dir: str, train: dict | None = None) -> RunPlan:
    """Compose + plan in-process (the plan layer is pure Python) with the dataset prepared, as a rank
    reads it back from plan.yaml. `train`: train.* values set in the plan after planning (and the
    engine's choices decided again from them), for what the planner refuses on CPU but the engine
    runs here all the same (train.fp8: torch's CPU _scaled_mm)."""
    from usp.config.compose import compose_config
    from usp.contract.plan_file import plan_from_dict
    from usp.data.tokenized import ensure_dataset
    from usp.plan.plan import build_plan, decisions

    base = [f"cluster.procs_per_node={world}", "cluster.nodes=1", f"train.runs_dir={runs_dir}",
            "logging.console=quiet", "train.sample_tokens=0", "train.log_interval=1", "train.eval_interval=0",
            "checkpoint.enabled=false"]
    cfg, choices = compose_config(None, base + list(overrides))
    plan = build_plan(cfg, choices)
    path, meta = ensure_dataset(cfg.data)
    plan.dataset_dir, plan.data_meta = str(path), dict(meta)
    for key, value in (train or {}).items():
        setattr(plan.config.train, key, value)
    plan.decisions = decisions(plan.config, plan.degrees, plan.device, plan.run_dir, plan.model.vocab_size)
    return plan_from_dict(plan.to_dict())


_REFERENCES: dict[tuple, tuple] = {}  # reference overrides -> (metrics, parameters), rank 0 of one launch


def verify_case(overrides: list[str], world: int, train: dict | None = None) -> dict:
    """Plan a layout and its reference from overrides (tests), then verify them as `usp verify`
    does. Layouts of one launch share references (same model, data, dtype): each is trained once.
    `train`: plan_dict's train.* values, set in both."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = _planned_once(overrides, world, tmp, train)
        accum = reference_grad_accum(plan.config.model, int(plan.batch.grad_accum))
        ref_overrides = reference_overrides(overrides, accum)
        key = (*ref_overrides, *sorted((train or {}).items()))
        ref = None
        if dist.get_rank() == 0:
            if key not in _REFERENCES:
                _REFERENCES[key] = train_reference(plan_dict(ref_overrides, 1, tmp, train))
            ref = _REFERENCES[key]
        return verify_against(plan, ref)


def _planned_once(overrides: list[str], world: int, runs_dir: str, train: dict | None = None) -> RunPlan:
    """Rank 0 composes and plans (Hydra's compose is ~0.2-0.4 s a call, measured), the others
    receive its plan: one compose per case instead of one per rank."""
    box = [plan_dict(overrides, world, runs_dir, train) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
