"""Run a layout next to its single-process reference and compare them step by step.

Used by `usp verify` (one layout) and by the parity-matrix tests (many layouts in one
torchrun launch). The reference is the same model, seed, data and global batch on one
process with every degree 1; it runs on rank 0 while the other ranks wait."""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from usp.engine.dist import make_context
from usp.engine.trainer import Trainer

_STRIP = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def plan_dict(overrides: list[str], world: int, runs_dir: str) -> dict:
    """Compose + plan in-process (the plan layer is pure Python) with the dataset prepared."""
    from usp.config.compose import compose_config
    from usp.data.prepare import ensure_dataset
    from usp.plan.plan import build_plan

    base = [f"cluster.procs_per_node={world}", "cluster.nodes=1", f"train.runs_dir={runs_dir}",
            "logging.console=quiet", "train.sample_tokens=0", "train.log_interval=1", "train.eval_interval=0"]
    cfg, choices = compose_config(None, base + list(overrides))
    plan = build_plan(cfg, choices)
    path, meta = ensure_dataset(cfg.data)
    plan.dataset_dir, plan.data_meta = str(path), dict(meta)
    return plan.to_dict()


def reference_overrides(overrides: list[str]) -> list[str]:
    """The same run on one process: every parallel degree 1, the same global batch."""
    dims = ("dp", "dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
    kept = [o for o in overrides if not o.lstrip("+").startswith(tuple(f"parallelism.{d}=" for d in dims))
            and not o.startswith(("train.micro_batch=", "train.grad_accum=", "parallelism.pp_", "parallelism.zero1",
                                  "parallelism.ddp_comm_hook", "parallelism=", "cluster"))]
    return kept + ["parallelism=single", "parallelism.dp_replicate=1", "train.micro_batch=-1", "train.grad_accum=-1"]


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
    param_err, missing = 0.0, []
    for name, ref in ref_params.items():
        other = params.get(name)
        if other is None:
            missing.append(name)
            continue
        other = other[: ref.shape[0]] if other.shape != ref.shape else other  # padded vocab rows
        param_err = max(param_err, float((other - ref).abs().max()))
    return {"rows": rows, "max_rel_loss_diff": worst, "max_param_diff": param_err, "missing_params": missing,
            "steps": len(rows), "steps_expected": len(reference)}


def reference_run(overrides: list[str]) -> tuple[list[dict], dict]:
    with tempfile.TemporaryDirectory() as tmp:
        plan = plan_dict(reference_overrides(overrides), 1, tmp)
        ctx = make_context(plan)
        trainer = Trainer(plan, ctx, write_outputs=False)
        trainer.fit()
        return trainer.history, gather_full_params(trainer)


def verify_case(overrides: list[str], world: int) -> dict:
    """Rank 0 runs the reference, then every rank runs the layout; rank 0 compares."""
    ref = reference_run(overrides) if dist.get_rank() == 0 else None
    with tempfile.TemporaryDirectory() as tmp:
        history, params = run_layout(plan_dict(overrides, world, tmp))
    if dist.get_rank() != 0:
        return {}
    return compare(ref[0], history, ref[1], params)


def passed(result: dict, rtol: float, param_atol: float) -> bool:
    return (result["steps"] == result["steps_expected"] and not result["missing_params"]
            and result["max_rel_loss_diff"] <= rtol and result["max_param_diff"] <= param_atol
            and not math.isnan(result["max_rel_loss_diff"]))
