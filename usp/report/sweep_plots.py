"""A sweep's plots: the heatmap (grid from heatmap.py) and scaling efficiency (rows from
sweep_tables.scaling). Same conventions as plots.py: each returns a Plot with the numbers drawn."""
from __future__ import annotations

import math
from pathlib import Path

from usp.report.plots import Plot, _plt, _save


def plot_heatmap(grid: dict | None, out: Path) -> Plot | None:
    if not grid:
        return None
    plt = _plt()
    import numpy as np

    mfu = grid["metric"] == "MFU"
    scale = 100.0 if mfu else 1.0  # MFU shown in %
    values = np.array([[math.nan if v is None else scale * v for v in row] for row in grid["values"]], dtype=float)
    fig, ax = plt.subplots(figsize=(1.3 * len(grid["col_values"]) + 3.2, 0.8 * len(grid["row_values"]) + 1.9))
    cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd")  # grey: no successful run
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, aspect="auto")
    label = "best MFU (%)" if mfu else "best tokens/s (no MFU measured)"
    fig.colorbar(image, ax=ax, label=label)
    finite = values[np.isfinite(values)]
    middle = (finite.min() + finite.max()) / 2 if finite.size else 0
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            if math.isnan(v):
                text = grid["notes"][i][j]
            else:
                text = f"{v:.1f}%" if mfu else f"{v:,.0f}" if v >= 10 else f"{v:.3g}"
            ax.text(j, i, text, ha="center", va="center", fontsize=8, wrap=True,
                    color="black" if math.isnan(v) or v > middle else "white")
    ax.set_xticks(range(len(grid["col_values"])), grid["col_values"])
    ax.set_yticks(range(len(grid["row_values"])), grid["row_labels"])
    ax.set(xlabel=grid["cols"] or "", ylabel=grid["rows"],
           title=f"{label} by {grid['rows']}" + (f" x {grid['cols']}" if grid["cols"] else ""))
    how = ("the runs' median `mfu` over their steady logged steps (metrics.jsonl)" if mfu else
           "median tokens/s over each run's steady logged steps (metrics.jsonl)")
    caption = (f"{label[0].upper()}{label[1:]} per cell of the sweep, measured: {how}, the best point of the cell. "
               f"Rows: {grid['rows']}" + (" (by parameter count, plan.yaml)" if grid["rows"] == "model" else "")
               + (f"; columns: {grid['cols']}" if grid["cols"] else "")
               + ". Grey: no successful run (the points' status, or 'no point'). " + grid.get("caption_extra", ""))
    return Plot("heatmap", _save(fig, out / "heatmap.png"), caption.strip(), grid)


def plot_scaling(rows: list[dict], out: Path) -> Plot | None:
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    data: dict = {}
    for row in rows:  # one curve per kind and group (global batch / batch per rank + the fixed swept values)
        curve = data.setdefault(f"{row['kind']}: {row['group']}", {"x": [], "y": []})
        curve["x"].append(row["world"])
        curve["y"].append(row["efficiency"])
    for label, s in data.items():
        ax.plot(s["x"], [100 * v for v in s["y"]], "o-" if label.startswith("strong") else "s--", label=label)
    ax.axhline(100, color="grey", lw=0.8, ls=":")
    worlds = sorted({w for s in data.values() for w in s["x"]})
    ax.set_xticks(worlds)
    ax.set(xlabel="world size (ranks)", ylabel="scaling efficiency (%)", title="scaling efficiency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return Plot("scaling", _save(fig, out / "scaling.png"), "Scaling efficiency from measured tokens/s (median "
                "over steady steps): (tokens/s per rank at n ranks) / (tokens/s per rank at the smallest world "
                "of the curve). Strong: same global batch; weak: same batch per rank; each curve also holds the "
                "other swept values (model, ...) named in its legend fixed.", data)
