"""Show a RunPlan as rich tables (what `usp plan` and `usp train` print before launching)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

MAX_RANK_ROWS = 16


def human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g} {suffix}{unit}"
    return f"{n:.3g} {unit}".strip()


def render_plan(plan, console: Console | None = None) -> None:
    console = console or Console()
    b, m = plan.batch, plan.model
    summary = Table(title=f"run plan: {plan.name}", show_header=False, title_justify="left")
    summary.add_column(style="bold cyan")
    summary.add_column()
    layout = " x ".join(f"{d}={v}" for d, v in plan.degrees.items() if v > 1) or "single process"
    rows = [
        ("run dir", plan.run_dir),
        ("config", ", ".join(f"{g}={o}" for g, o in plan.choices.items() if o)),
        ("model", f"{m.name}: {human(m.params)} parameters, vocab {m.vocab_size}"),
        ("world", f"{plan.world_size} = {plan.nodes} node(s) x {plan.procs_per_node} process(es), "
                  f"{plan.device}/{plan.backend}, {plan.threads_per_proc} thread(s) each"),
        ("layout", layout),
        ("mesh", " x ".join(f"{d}:{s}" for d, s in zip(plan.mesh_dims, plan.mesh_shape))),
        ("batch", f"global {b.global_batch} seq x {b.seq_len} = {b.global_batch_tokens:,} tokens/step "
                  f"= micro {b.micro_batch} x grad-accum {b.grad_accum} x dp {b.dp}"),
        ("compute", f"{human(m.flops_per_token, 'FLOP')}/token (6N + 12·L·h·s), "
                    f"{human(m.flops_per_step, 'FLOP')}/step"),
        ("data", plan.dataset_dir),
    ]
    for key, value in rows:
        summary.add_row(key, value)
    console.print(summary)
    console.print(rank_table(plan))
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


def rank_table(plan) -> Table:
    table = Table(title="ranks", title_justify="left")
    for col in ("rank", "node", "local rank", *plan.mesh_dims):
        table.add_column(col, justify="right")
    ranks = plan.ranks
    shown = ranks if len(ranks) <= MAX_RANK_ROWS else ranks[: MAX_RANK_ROWS // 2] + ranks[-MAX_RANK_ROWS // 2:]
    for i, r in enumerate(shown):
        if len(ranks) > MAX_RANK_ROWS and i == MAX_RANK_ROWS // 2:
            table.add_row("…", *[""] * (2 + len(plan.mesh_dims)))
        table.add_row(str(r.rank), str(r.node), str(r.local_rank), *(str(r.coords[d]) for d in plan.mesh_dims))
    if len(ranks) > MAX_RANK_ROWS:
        table.caption = f"{len(ranks)} ranks; all of them are in plan.yaml"
    return table
