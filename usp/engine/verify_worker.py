"""`usp verify` worker: `python -m usp.engine.verify_worker --plan P --reference R --out F`,
under torchrun (or in-process for one rank). Trains the reference on rank 0, then the layout on
every rank, and writes the step-by-step comparison to F (rank 0, atomically).

The reference is the same model, seed, data and global batch on one process with every degree
1; it runs on rank 0 while the other ranks wait. The parity-matrix tests call `verify_plans`
themselves (tests/dist/parity.py)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from usp.contract.plan_file import read_plan
from usp.contract.run_plan import RunPlan
from usp.engine.accel import apply_determinism
from usp.engine.parallel import mesh as udist
from usp.engine.startup_gc import freeze_imports
from usp.engine.trainer import Trainer
from usp.models.moe import GroupedExperts
from usp.run.files import write_text_atomic

_STRIP = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def run_layout(plan: RunPlan) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Train under `plan` on the current process group; return (metrics, full parameters)."""
    ctx = udist.make_context(plan)
    trainer = Trainer(plan, ctx, write_outputs=False)
    trainer.fit()
    params = gather_full_params(trainer)
    history = trainer.history
    del trainer  # free DDP/FSDP state while the process group is alive
    return history, params


def gather_full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter of the model (and the aux-loss-free balancing biases) as a full CPU tensor,
    on rank 0 (pipeline stages and expert-parallel ranks each contribute the pieces they hold)."""
    local = {}
    for module in trainer.parts.stage_modules:
        # expert-parallel slices: rows [expert_start, expert_start + n_local) of the full tensor
        starts = {id(p): m.expert_start for m in module.modules()
                  if isinstance(m, GroupedExperts) and m.n_local != m.n_experts for p in m.parameters()}
        balance = [(n, b) for n, b in module.named_buffers() if n.endswith("expert_bias")]  # same on every rank
        for name, p in [*module.named_parameters(), *balance]:
            for s in _STRIP:
                name = name.replace(s, "")
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if id(p) in starts:
                name = f"{name}@{starts[id(p)]}"
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
    """Step-by-step loss and grad-norm differences, and the worst final-parameter difference."""
    rows, worst = [], 0.0
    for ref, got in zip(reference, layout):
        rel = abs(ref["loss"] - got["loss"]) / abs(ref["loss"])
        worst = max(worst, rel)
        rows.append({"step": ref["step"], "ref_loss": ref["loss"], "loss": got["loss"], "rel_diff": rel,
                     "grad_norm_diff": abs(ref["grad_norm"] - got["grad_norm"])})
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
    if "output.weight" in params and "output.weight" not in ref_params and "tok_embeddings.weight" in ref_params:
        # tied embeddings over pipeline stages: the last stage's LM-head copy must match the embedding too
        ref, other = ref_params["tok_embeddings.weight"], params["output.weight"]
        err = float((other[: ref.shape[0]] - ref).abs().max())
        if err > param_err:
            param_err, worst_param = err, "output.weight (tied copy)"
    return {"rows": rows, "max_rel_loss_diff": worst, "max_param_diff": param_err, "worst_param": worst_param,
            "missing_params": missing, "steps": len(rows), "steps_expected": len(reference),
            "routing_diverged_at": routing_divergence(reference, layout)}


def routing_divergence(reference: list[dict], layout: list[dict]) -> dict | None:
    """MoE: the first logged step whose tokens per expert (over the global batch) differ from the
    reference's, with the layer; None when the routing matched at every step. A top-k choice whose
    two candidates' probabilities differ by less than the layout's rounding may flip: the runs then
    legitimately part from that step on."""
    for ref, got in zip(reference, layout):
        for layer, load in (ref.get("expert_load") or {}).items():
            theirs = (got.get("expert_load") or {}).get(layer, {}).get("tokens")
            if theirs != load["tokens"]:
                return {"step": ref["step"], "layer": layer, "reference": load["tokens"], "layout": theirs}
    return None


def verify_plans(plan: RunPlan, reference: RunPlan) -> dict:
    """Rank 0 trains the single-process reference, then every rank trains the layout; rank 0
    returns the comparison (other ranks return {})."""
    ref = train_reference(reference) if plan.world_size == 1 or dist.get_rank() == 0 else None
    return verify_against(plan, ref)


def train_reference(reference: dict) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The single-process reference's metrics and final parameters (on rank 0 only: it trains
    alone while the other ranks wait)."""
    trainer = Trainer(reference, udist.make_context(reference), write_outputs=False)
    trainer.fit()
    ref = (trainer.history, gather_full_params(trainer))
    del trainer
    return ref


def verify_against(plan: RunPlan, ref: tuple | None) -> dict:
    """Every rank trains the layout; rank 0 (holding `ref`) returns the comparison, the others {}."""
    history, params = run_layout(plan)
    return {} if ref is None else compare(ref[0], history, ref[1], params)


def run_verify(plan_path: str, reference_path: str, out: str) -> int:
    plan, reference = read_plan(Path(plan_path)), read_plan(Path(reference_path))
    apply_determinism(plan)
    udist.init_process_group(plan)
    clean = False
    try:
        result = verify_plans(plan, reference)
        if result:
            write_text_atomic(Path(out), json.dumps(result, indent=1))
        clean = True
    finally:
        udist.teardown(clean)
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="usp.engine.verify_worker")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--reference", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    sys.exit(run_verify(args.plan, args.reference, args.out))


if __name__ == "__main__":
    freeze_imports()  # the imports above ran with the collector paused (usp/engine/__init__.py)
    main()
