"""`usp verify`: prove a layout exact before a big run. Plans the layout at small scale on this
machine (world = product of the requested degrees) and a single-process reference with the
same model, seed, data and global batch; runs both; prints a step-by-step comparison."""
from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from usp.config.reference import reference_grad_accum, reference_overrides
from usp.errors import PlanError
from usp.launch.local import torchrun_command
from usp.launch.pre_launch import prepare_run
from usp.run.files import VERIFY, logs_dir

QUIET = ["logging.console=quiet", "train.sample_tokens=0", "train.log_interval=1", "train.eval_interval=0",
         "checkpoint.enabled=false"]


def requested_world(cfg) -> int:
    """Ranks the layout needs: the product of the degrees the user asked for (-1 counts as 1)."""
    par = cfg.parallelism
    world = 1
    for dim in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
        value = int(par[dim])
        if dim == "dp_replicate" and par.dp is not None:
            value = int(par.dp)
        world *= max(1, value)
    return world


def verify(conf: str | None, overrides: list[str], steps: int, rtol: float, param_atol: float) -> int:
    from usp.config.compose import compose_config

    console = Console()
    base = [f"train.steps={steps}", *QUIET]
    cfg, _ = compose_config(conf, base + overrides)
    world = requested_world(cfg)
    if cfg.cluster.launcher != "local" or cfg.cluster.nodes != 1:
        raise PlanError("usp verify runs on this machine", key="cluster", value=cfg.cluster.name,
                        fix="cluster=local_cpu (or local_gpu)")
    runs = Path(cfg.train.runs_dir) / "verify"
    layout_ov = base + overrides + [f"cluster.procs_per_node={world}", f"train.runs_dir={runs}"]
    cfg, choices = compose_config(conf, layout_ov)
    plan, plan_path = prepare_run(cfg, choices, console)
    accum = reference_grad_accum(cfg.model, plan.batch.grad_accum)
    ref_cfg, ref_choices = compose_config(conf, reference_overrides(layout_ov, accum) +
                                          [f"train.name={plan.name}-reference"])
    ref_plan, ref_path = prepare_run(ref_cfg, ref_choices, Console(quiet=True))
    out = Path(plan.run_dir) / VERIFY
    out.unlink(missing_ok=True)
    console.print(f"verify: {plan.name} on {world} process(es) vs one process, {steps} steps")
    code = _run(plan, plan_path, ref_path, out)
    if code or not out.exists():
        console.print(f"[red]verify: the run failed (exit code {code}); logs in {logs_dir(plan.run_dir)}")
        return code or 1
    return report(json.loads(out.read_text()), rtol, param_atol, console)


def _run(plan, plan_path: Path, ref_path: Path, out: Path) -> int:
    args = ["--plan", str(plan_path), "--reference", str(ref_path), "--out", str(out)]
    if plan.world_size == 1:
        from usp.engine.startup_gc import importing_torch

        with importing_torch():
            from usp.engine.verify_worker import run_verify

        return run_verify(*args[1::2])
    import subprocess

    from usp.launch.local import worker_env

    cmd = torchrun_command(plan, plan_path)
    cmd = cmd[: cmd.index("--module") + 1] + ["usp.engine.verify_worker", *args]
    return subprocess.run(cmd, env=worker_env(plan)).returncode


def report(result: dict, rtol: float, param_atol: float, console: Console) -> int:
    table = Table(title="loss per step: layout vs single-process reference", title_justify="left")
    for col in ("step", "reference loss", "layout loss", "|Δ|", "rel Δ", "grad-norm Δ", f"≤ {rtol:g}"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        ok = r["rel_diff"] <= rtol
        table.add_row(str(r["step"]), f"{r['ref_loss']:.7f}", f"{r['loss']:.7f}",
                      f"{abs(r['loss'] - r['ref_loss']):.2e}", f"{r['rel_diff']:.2e}", f"{r['grad_norm_diff']:.2e}",
                      "[green]pass" if ok else "[red]FAIL")
    console.print(table)
    params_ok = result["max_param_diff"] <= param_atol and not result["missing_params"]
    console.print(f"final parameters: max |Δ| {result['max_param_diff']:.2e} in {result.get('worst_param')} "
                  f"(tolerance {param_atol:g})"
                  + (f"; missing: {result['missing_params'][:5]}" if result["missing_params"] else ""))
    flip = result.get("routing_diverged_at")
    if flip:
        console.print(f"MoE routing differs from step {flip['step']} (layer {flip['layer']}: tokens per expert "
                      f"{flip['layout']} vs the reference's {flip['reference']}): a token whose top-k candidates "
                      "were within rounding of each other chose another expert; later steps follow other routes")
    good = (result["steps"] == result["steps_expected"] and params_ok and not math.isnan(result["max_rel_loss_diff"])
            and result["max_rel_loss_diff"] <= rtol)
    console.print("[bold green]PASS[/]: the layout is exact" if good else "[bold red]FAIL[/]: the layout differs")
    return 0 if good else 1
