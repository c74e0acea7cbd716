"""`usp estimate` on the console: the configured layout's memory and time, then the estimate: the
layout planned at the quoted size, tokens/s, MFU, hours, days, device-hours and cost, and every node
count the search tried on the way (usp/plan/estimate.py)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from usp.plan.estimate import Estimate, estimate
from usp.plan.render import human, memory_table, timing_table


def render_estimate(est: Estimate, plan, console: Console | None = None, command: list[str] | None = None) -> None:
    """`command`: the user's overrides, for the `usp plan` line that reproduces the quoted layout."""
    console = console or Console()
    console.print(memory_table(plan.memory))
    console.print(timing_table(plan.timing))
    # the configured layout's own warnings, under its tables: printed after the estimate they read as the quoted
    # layout's (a recipe's hang window shortened at its size, said under a quote at another size)
    of = " (the configured layout)" if est.overrides else ""
    for warning in plan.warnings:
        console.print(f"[yellow]warning{of}:[/] {warning}")
    table = Table(title=f"estimate: {est.model} ({human(est.params)} parameters)", show_header=False,
                  title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column()
    for key, value in _rows(est):
        table.add_row(key, value)
    console.print(table)
    if len(est.tried) > 1:
        console.print(_tried_table(est))
    if est.overrides:
        console.print("plan it: usp plan " + " ".join(plan_command(command, est.overrides)),
                      highlight=False, markup=False, soft_wrap=True)
    for note in est.notes:
        console.print(f"[dim]note:[/] {note}")


def plan_command(command: list[str] | None, overrides: list[str]) -> list[str]:
    """The user's overrides, less those the estimate's own set again (each key once: `train.global_batch_tokens`
    given by the user and reset by the estimate appeared twice), then the estimate's."""
    def key(override: str) -> str:  # without Hydra's +/++/~ prefix
        return override.partition("=")[0].lstrip("+~")

    ours = {key(o) for o in overrides}
    return [*(c for c in command or ["<the same config>"] if key(c) not in ours), *overrides]


def _rows(est: Estimate) -> list[tuple[str, str]]:
    rows = [("FLOPs / token", f"{human(est.flops_per_token, 'FLOP')} at seq {est.seq_len:,} (6·N + 12·L·h·s)"),
            ("global batch", f"{est.global_batch:,} sequences = {est.global_batch * est.seq_len:,} tokens per step, "
                             "at every size"),
            ("device", f"{est.device_name}, peak {est.peak_tflops:g} TFLOPS")]
    if est.tokens is None:
        return rows + [("MFU", f"{est.mfu:.1%} ({est.mfu_source})"),
                       ("token budget", "not set: add train.tokens=<N> for devices / hours / cost")]
    hours, devices = float(est.hours or 0.0), int(est.devices or 0)
    rows += [("token budget", f"{est.tokens:.3g} tokens = {est.total_flops:.3g} FLOPs"),
             ("devices", f"{devices:,} ({est.nodes:,} node(s) x {est.procs_per_node})")]
    if est.layout:
        rows.append(("layout", est.layout))
    if est.tokens_per_s:
        rows.append(("tokens/s", f"{est.tokens_per_s:,.0f} ({est.tokens_per_s / devices:,.0f} per device)"))
    rows += [("MFU", f"{est.mfu:.1%} ({est.mfu_source})"),
             ("time", f"{hours:,.1f} hours = {hours / 24:,.1f} days = {hours * devices:,.0f} "
                      f"{est.device_name.split()[0]}-hours"),
             *([("failures", f"{est.failures:,.1f} expected in those hours ({est.failures_per_day:.3g}/day); goodput "
                             f"{est.goodput:.1%}: the hours count them, the checkpoints and the restarts")]
               if est.failures is not None else []),
             ("cost", f"${est.cost:,.0f} at ${est.price_per_device_hour:g}/device-hour" if est.cost is not None
              else "unknown (cluster.price_per_device_hour=0)")]
    return rows


def _tried_table(est: Estimate) -> Table:
    table = Table(title="node counts searched", title_justify="left")
    for col in ("nodes", "devices", "hours"):
        table.add_column(col, justify="right")
    for nodes, hours in sorted(est.tried):
        table.add_row(f"{nodes:,}", f"{nodes * est.procs_per_node:,}",
                      "no layout fits" if hours is None else f"{hours:,.0f}")
    return table


def run_estimate(cfg, choices, *, hours=None, gpus=None, mfu=None, command: list[str] | None = None) -> Estimate:
    console = Console()
    with console.status("planning") as status:
        est, plan = estimate(cfg, choices, hours=hours, gpus=gpus, mfu=mfu, progress=status.update)
    render_estimate(est, plan, console, command)
    return est


def run_scaling(cfg, choices, max_nodes: int):
    from usp.plan.planner_inputs import planner_context
    from usp.plan.scaling import node_counts, render_scaling, scaling

    console = Console()
    ctx = planner_context(cfg)
    with console.status("planning") as status:
        rows = scaling(ctx, cfg, choices, node_counts(max_nodes), progress=status.update)
    render_scaling(rows, ctx.arch.name, console)
    return rows
