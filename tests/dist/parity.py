"""Plan a layout and its single-process reference from overrides, in-process, and verify them
with the engine's own comparison (usp/engine/verify_worker.py, what `usp verify` runs). Used by
the parity-matrix cases (many layouts in one torchrun launch) and the memory tests."""
from __future__ import annotations

import tempfile

from usp.config.reference import reference_overrides
from usp.engine.verify_worker import verify_plans


def plan_dict(overrides: list[str], world: int, runs_dir: str) -> dict:
    """Compose + plan in-process (the plan layer is pure Python) with the dataset prepared."""
    from usp.config.compose import compose_config
    from usp.data.prepare import ensure_dataset
    from usp.plan.plan import build_plan

    base = [f"cluster.procs_per_node={world}", "cluster.nodes=1", f"train.runs_dir={runs_dir}",
            "logging.console=quiet", "train.sample_tokens=0", "train.log_interval=1", "train.eval_interval=0",
            "checkpoint.enabled=false"]
    cfg, choices = compose_config(None, base + list(overrides))
    plan = build_plan(cfg, choices)
    path, meta = ensure_dataset(cfg.data)
    plan.dataset_dir, plan.data_meta = str(path), dict(meta)
    return plan.to_dict()


def verify_case(overrides: list[str], world: int) -> dict:
    """Plan a layout and its reference from overrides (tests), then verify_plans."""
    with tempfile.TemporaryDirectory() as tmp:
        return verify_plans(plan_dict(overrides, world, tmp), plan_dict(reference_overrides(overrides), 1, tmp))
