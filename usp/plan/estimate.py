"""`usp estimate`: memory per device for the configured layout, and how many devices / hours /
dollars a token budget (train.tokens) takes.

    train time  = FLOPs/token x tokens / (devices x peak x MFU)       (docs/planner.md)
    devices     = FLOPs/token x tokens / (hours x 3600 x peak x MFU)  (rounded up to whole nodes)

FLOPs/token is the model's 6·N_active + 12·L·h·s at train.seq_len. The MFU comes from --mfu,
else from the time model for the configured layout, else (that layout does not fit) from the
best layout the search finds on the cluster (doubling cluster.nodes until one fits), else
DEFAULT_MFU. An MFU predicted at one scale is assumed to hold at the scale estimated for."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from usp.errors import PlanError

DEFAULT_MFU = 0.40  # the playbook's typical single-node figure (40-47 %), used only when nothing else is known
MAX_NODE_DOUBLINGS = 6


@dataclass
class Estimate:
    model: str
    params: int
    seq_len: int
    flops_per_token: float
    tokens: float | None
    total_flops: float | None
    device_name: str
    peak_tflops: float
    procs_per_node: int
    mfu: float
    mfu_source: str
    devices: int | None = None
    nodes: int | None = None
    hours: float | None = None
    price_per_device_hour: float = 0.0
    cost: float | None = None
    notes: list[str] = field(default_factory=list)


def estimate(cfg, choices: dict | None = None, *, hours: float | None = None, devices: int | None = None,
             mfu: float | None = None, plan=None) -> tuple[Estimate, object]:
    """Returns (estimate, the run plan of the configured layout with memory and timing)."""
    from usp.plan.plan import build_plan
    from usp.plan.planner_inputs import planner_context

    if hours is not None and devices is not None:
        raise PlanError("give either --hours (to get devices) or --devices (to get hours), not both",
                        key="--hours", value=hours, fix="drop one of --hours / --devices")
    for name, value in (("--hours", hours), ("--devices", devices), ("--mfu", mfu)):
        if value is not None and value <= 0:
            raise PlanError("must be positive", key=name, value=value, fix=f"{name} <a positive number>")
    if mfu is not None and mfu > 1:
        raise PlanError("MFU is a fraction of peak (0-1)", key="--mfu", value=mfu, fix="--mfu 0.4")
    plan = plan or build_plan(cfg, choices, force=True, training=False)
    ctx = planner_context(cfg, plan.model.vocab_size)
    hw = ctx.hw
    tokens = cfg.train.tokens
    tokens = float(tokens) if tokens is not None else None
    if tokens is not None and tokens <= 0:
        raise PlanError("the token budget must be positive", key="train.tokens", value=tokens, fix="train.tokens=1e12")
    fpt = plan.timing.model_flops_per_token
    peak = hw.peak_flops(ctx.prec)
    notes: list[str] = []
    if mfu is not None:
        source = "given (--mfu)"
    elif plan.memory.fits:
        mfu, source = plan.timing.mfu, f"predicted for the configured layout ({plan.timing.world} devices)"
    else:
        mfu, source = _searched_mfu(ctx, notes)
    est = Estimate(model=plan.model.name, params=plan.model.params, seq_len=plan.batch.seq_len, flops_per_token=fpt,
                   tokens=tokens, total_flops=fpt * tokens if tokens else None, device_name=hw.device_name,
                   peak_tflops=peak / 1e12, procs_per_node=hw.procs_per_node, mfu=mfu, mfu_source=source,
                   price_per_device_hour=hw.price_per_device_hour, notes=notes)
    if tokens is None:
        if hours is not None or devices is not None:
            raise PlanError("--hours / --devices need a token budget", key="train.tokens", value=None,
                            fix="train.tokens=15e12 (tokens to train on)")
        return est, plan
    rate = peak * mfu  # useful FLOP/s per device
    total_flops = float(est.total_flops or 0.0)  # set: a token budget was given
    if hours is not None:
        need = total_flops / (hours * 3600 * rate)
        est.nodes = max(1, math.ceil(need / hw.procs_per_node - 1e-9))
        est.devices = est.nodes * hw.procs_per_node
        est.hours = total_flops / (est.devices * rate) / 3600
        notes.append(f"{need:,.0f} devices needed exactly; rounded up to {est.nodes} node(s) of {hw.procs_per_node}")
    else:
        est.devices = devices or hw.world
        est.nodes = math.ceil(est.devices / hw.procs_per_node)
        est.hours = total_flops / (est.devices * rate) / 3600
    if hw.price_per_device_hour > 0:
        est.cost = est.devices * est.hours * hw.price_per_device_hour
    if est.devices != plan.timing.world and mfu is not None and "given" not in source:
        notes.append(f"assumes the MFU predicted at {plan.timing.world if plan.memory.fits else 'the searched'} "
                     f"scale holds on {est.devices} devices (it usually falls as data parallelism grows)")
    return est, plan


def _searched_mfu(ctx, notes: list[str]) -> tuple[float, str]:
    from usp.plan.search import search

    hw = ctx.hw
    for k in range(MAX_NODE_DOUBLINGS + 1):
        trial = hw.with_nodes(hw.nodes * 2 ** k)
        # a cluster of more nodes than the local launcher runs is sized as a Slurm one
        settings = replace(ctx.settings, launcher="slurm") if trial.nodes > 1 else ctx.settings
        best = search(ctx.arch, trial, ctx.prec, ctx.seq_len, ctx.global_batch, top_k=1, settings=settings,
                      profile=ctx.profile).best
        if best is not None:
            notes.append("the configured layout does not fit; the MFU is the search's best layout "
                         f"{best.describe()} on {trial.nodes} node(s)")
            return best.timing.mfu, f"predicted for the best searched layout on {trial.world} devices"
    notes.append(f"no layout fits up to {hw.nodes * 2 ** MAX_NODE_DOUBLINGS} node(s) at this global batch; "
                 f"MFU {DEFAULT_MFU:.0%} assumed (the playbook's typical figure)")
    return DEFAULT_MFU, "assumed (nothing fits)"


def render_estimate(est: Estimate, plan, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from usp.plan.render import human, memory_table, timing_table

    console = console or Console()
    console.print(memory_table(plan.memory))
    console.print(timing_table(plan.timing))
    table = Table(title=f"estimate: {est.model} ({human(est.params)} parameters)", show_header=False,
                  title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column()
    rows = [("FLOPs / token", f"{human(est.flops_per_token, 'FLOP')} at seq {est.seq_len} (6·N + 12·L·h·s)"),
            ("device", f"{est.device_name}, peak {est.peak_tflops:g} TFLOPS"),
            ("MFU", f"{est.mfu:.1%} ({est.mfu_source})")]
    if est.tokens is None:
        rows.append(("token budget", "not set: add train.tokens=<N> for devices / hours / cost"))
    else:
        hours, devices = float(est.hours or 0.0), int(est.devices or 0)  # set along with the token budget
        rows += [("token budget", f"{est.tokens:.3g} tokens = {est.total_flops:.3g} FLOPs"),
                 ("devices", f"{est.devices:,} ({est.nodes:,} node(s) x {est.procs_per_node})"),
                 ("time", f"{hours:,.1f} hours = {hours / 24:,.1f} days = {hours * devices:,.0f} device-hours")]
        rows.append(("cost", f"${est.cost:,.0f} at ${est.price_per_device_hour:g}/device-hour" if est.cost is not None
                     else "unknown (cluster.price_per_device_hour=0)"))
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    for note in est.notes:
        console.print(f"[dim]note:[/] {note}")
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


def run_estimate(cfg, choices, *, hours=None, devices=None, mfu=None) -> Estimate:
    est, plan = estimate(cfg, choices, hours=hours, devices=devices, mfu=mfu)
    render_estimate(est, plan)
    return est
