"""Run a layout next to its single-process reference and compare them step by step.

Used by `usp verify` (one layout) and by the parity-matrix tests (many layouts in one
torchrun launch). The reference is the same model, seed, data and global batch on one
process with every degree 1; it runs on rank 0 while the other ranks wait."""
from __future__ import annotations

import math
import tempfile

import torch
import torch.distributed as dist

from usp.config.reference import reference_overrides
from usp.engine.dist import make_context
from usp.engine.trainer import Trainer

_STRIP = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


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


def run_layout(plan: dict) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Train under `plan` on the current process group; return (metrics, full parameters)."""
    ctx = make_context(plan)
    trainer = Trainer(plan, ctx, write_outputs=False)
    trainer.fit()
    params = gather_full_params(trainer)
    history = trainer.history
    del trainer  # free DDP/FSDP state while the process group is alive
    return history, params


def gather_full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter of the model as a full CPU tensor, on rank 0 (pipeline stages and
    expert-parallel ranks each contribute the pieces they hold)."""
    local = {}
    for module in trainer.parts.stage_modules:
        for name, p in module.named_parameters():
            for s in _STRIP:
                name = name.replace(s, "")
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if hasattr(p, "_ep_shard"):  # expert-parallel slice: rows [start, start + n) of the full tensor
                name = f"{name}@{p._ep_shard[0]}"
            local[name] = full.detach().float().cpu()
    if trainer.ctx.world_size == 1:
        return local
    gathered = [None] * trainer.ctx.world_size if trainer.ctx.is_main else None
    dist.gather_object(local, gathered, dst=0)
    if not trainer.ctx.is_main:
        return {}
    merged, slices = {}, {}
    for part in gathered:
        for name, t in part.items():
            if "@" in name:
                base, start = name.rsplit("@", 1)
                slices.setdefault(base, {})[int(start)] = t
            else:
                merged.setdefault(name, t)
    for base, pieces in slices.items():
        merged[base] = torch.cat([pieces[k] for k in sorted(pieces)], dim=0)
    return merged


def compare(reference: list[dict], layout: list[dict], ref_params: dict, params: dict) -> dict:
    rows, worst = [], 0.0
    for r, l in zip(reference, layout):
        rel = abs(r["loss"] - l["loss"]) / abs(r["loss"])
        worst = max(worst, rel)
        rows.append({"step": r["step"], "ref_loss": r["loss"], "loss": l["loss"], "rel_diff": rel,
                     "grad_norm_diff": abs(r["grad_norm"] - l["grad_norm"])})
    param_err, worst_param, missing = 0.0, None, []
    for name, ref in ref_params.items():
        other = params.get(name)
        if other is None:
            missing.append(name)
            continue
        other = other[: ref.shape[0]] if other.shape != ref.shape else other  # padded vocab rows
        err = float((other - ref).abs().max())
        if err > param_err:
            param_err, worst_param = err, name
    return {"rows": rows, "max_rel_loss_diff": worst, "max_param_diff": param_err, "worst_param": worst_param,
            "missing_params": missing, "steps": len(rows), "steps_expected": len(reference)}


def verify_plans(plan: dict, reference: dict) -> dict:
    """Rank 0 trains the single-process reference, then every rank trains the layout; rank 0
    returns the comparison (other ranks return {})."""
    ref = None
    if plan["world_size"] == 1 or dist.get_rank() == 0:
        ctx = make_context(reference)
        trainer = Trainer(reference, ctx, write_outputs=False)
        trainer.fit()
        ref = (trainer.history, gather_full_params(trainer))
        del trainer
    history, params = run_layout(plan)
    if ref is None:
        return {}
    return compare(ref[0], history, ref[1], params)


def verify_case(overrides: list[str], world: int) -> dict:
    """Plan a layout and its reference from overrides (tests), then verify_plans."""
    with tempfile.TemporaryDirectory() as tmp:
        return verify_plans(plan_dict(overrides, world, tmp), plan_dict(reference_overrides(overrides), 1, tmp))


def passed(result: dict, rtol: float, param_atol: float) -> bool:
    return (result["steps"] == result["steps_expected"] and not result["missing_params"]
            and result["max_rel_loss_diff"] <= rtol and result["max_param_diff"] <= param_atol
            and not math.isnan(result["max_rel_loss_diff"]))
