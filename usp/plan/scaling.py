"""`usp estimate --scaling`: how the best layout's throughput scales with the node count. Per node
count (1, 2, 4, ... up to the largest asked), the best layout `usp plan` accepts there
(usp/plan/sizing.py), twice:

  strong scaling   the config's global batch at every size;
  weak scaling     the global batch grows with the node count, from the first size where a layout fits.

Each with its scaling efficiency: tokens/s per device over the first size's (the measure the
SuperMUC-NG study reports: 93 % weak and 82 % strong at 128 nodes)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from usp.plan.sizing import Sized, sized_at


@dataclass
class ScalingRow:
    nodes: int
    strong: Sized | None  # None: no layout fits at the config's global batch
    weak: Sized | None
    strong_efficiency: float | None = None
    weak_efficiency: float | None = None


def node_counts(largest: int, smallest: int = 1) -> list[int]:
    """Powers of two from `smallest` up to `largest`, and `largest` itself."""
    out, n = [], 1
    while n <= largest:
        if n >= smallest:
            out.append(n)
        n *= 2
    return out if largest in out else [*out, largest]


def scaling(ctx, cfg, choices, counts: list[int], progress: Callable[[str], None] | None = None) -> list[ScalingRow]:
    rows: list[ScalingRow] = []
    first: Sized | None = None
    for nodes in counts:
        if progress is not None:
            progress(f"searching layouts on {nodes:,} node(s)")
        strong = sized_at(ctx, cfg, choices, nodes)
        weak = None
        if first is None and strong is not None:
            first, weak = strong, strong
        elif first is not None:
            weak = sized_at(ctx, cfg, choices, nodes, first.global_batch * nodes // first.nodes)
        rows.append(ScalingRow(nodes, strong, weak, _efficiency(strong, first), _efficiency(weak, first)))
    return rows


def _efficiency(at: Sized | None, first: Sized | None) -> float | None:
    if at is None or first is None:
        return None
    return (at.tokens_per_s / at.devices) / (first.tokens_per_s / first.devices)


def render_scaling(rows: list[ScalingRow], model: str, console) -> None:
    from rich.table import Table

    table = Table(title=f"scaling: {model}, best layout per node count", title_justify="left")
    for col in ("nodes", "devices", "strong: layout", "tokens/s", "MFU", "eff.", "weak: batch", "tokens/s",
                "MFU", "eff."):
        table.add_column(col, justify="left" if "layout" in col else "right")
    for r in rows:
        at = r.strong or r.weak
        table.add_row(f"{r.nodes:,}", f"{at.devices:,}" if at else "-", *_cells(r.strong, r.strong_efficiency, True),
                      *_cells(r.weak, r.weak_efficiency, False))
    console.print(table)


def _cells(at: Sized | None, eff: float | None, strong: bool) -> list[str]:
    if at is None:
        return ["no layout fits", "-", "-", "-"] if strong else ["-", "-", "-", "-"]
    first = at.candidate.layout.label() if strong else f"{at.global_batch:,} seq"
    return [first, f"{at.tokens_per_s:,.0f}", f"{at.mfu:.1%}", f"{eff:.0%}" if eff is not None else "-"]
