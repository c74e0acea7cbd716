"""The scaling table as a PNG, like the playbook's heatmap: rows strong and weak scaling, columns the
node counts, colour = the best layout's MFU, each cell labelled with it and its layout
(usp/plan/scaling.py computes the rows)."""
from __future__ import annotations

from pathlib import Path

from usp.plan.scaling import ScalingRow
from usp.report.plots import _plt, _save


def plot_scaling(rows: list[ScalingRow], model: str, out: Path) -> Path:
    plt = _plt()
    kinds = (("strong", "strong scaling\n(global batch fixed)"), ("weak", "weak scaling\n(batch per device fixed)"))
    values = [[getattr(r, kind).mfu if getattr(r, kind) else float("nan") for r in rows] for kind, _ in kinds]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows)), 3.6))
    image = ax.imshow(values, cmap="viridis", aspect="auto", vmin=0.0)
    for i, (kind, _) in enumerate(kinds):
        for j, r in enumerate(rows):
            at = getattr(r, kind)
            text = "no layout\nfits" if at is None else f"{at.mfu:.0%}\n{at.candidate.layout.label()}"
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if at is None or at.mfu < 0.3
                    else "black")
    ax.set_xticks(range(len(rows)), [f"{r.nodes:,}" for r in rows])
    ax.set_yticks(range(len(kinds)), [label for _, label in kinds])
    ax.set_xlabel("nodes")
    ax.set_title(f"{model}: best layout's MFU by node count (usp estimate --scaling)")
    fig.colorbar(image, ax=ax, label="MFU")
    return _save(fig, Path(out))
