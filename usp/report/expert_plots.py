"""The expert-load plot of MoE runs: how evenly the router spread the tokens over the experts
(metrics.jsonl `expert_load`, per MoE layer: the logged step's tokens per expert over the whole
global batch, min / max / mean, and imbalance = max / mean)."""
from __future__ import annotations

from pathlib import Path

from usp.report.plots import Plot, _plt, _save
from usp.report.runs import RunData


def _load_series(run: RunData) -> dict[str, dict]:
    """layer -> {"x": steps, "y": imbalance, "min", "max", "mean": tokens per expert}."""
    out: dict[str, dict] = {}
    for record in run.metrics:
        for layer, load in (record.get("expert_load") or {}).items():
            s = out.setdefault(layer, {"x": [], "y": [], "min": [], "max": [], "mean": []})
            s["x"].append(record["step"])
            s["y"].append(float(load["imbalance"]))
            for key in ("min", "max", "mean"):
                s[key].append(float(load[f"tokens_{key}"]))
    return out


def plot_expert_load(runs: list[RunData], out: Path) -> Plot | None:
    series = {r.label: _load_series(r) for r in runs}
    series = {label: layers for label, layers in series.items() if layers}
    if not series:
        return None
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.4, 3.8))
    data: dict[str, dict] = {}
    ticks: list[str] = []
    for label, layers in series.items():
        prefix = f"{label} " if len(series) > 1 else ""
        for layer in sorted(layers, key=int):
            s = layers[layer]
            data[f"{prefix}layer {layer}"] = s
            left.plot(s["x"], s["y"], lw=1.2, label=f"{prefix}layer {layer}")
            x = len(ticks)
            ticks.append(f"{prefix}L{layer}")
            right.vlines(x, s["min"][-1], s["max"][-1], lw=6, alpha=0.6)
            right.plot([x], [s["mean"][-1]], "k_", ms=14)
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.set_xlim(-0.6, len(ticks) - 0.4)
    left.set(xlabel="step", ylabel="max / mean tokens per expert", title="expert load imbalance")
    right.set_xticks(range(len(ticks)), ticks, fontsize=7, rotation=30 if len(ticks) > 8 else 0)
    right.set(ylabel="tokens per expert", title="last logged step: min-max (bar), mean (tick)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=7, ncol=2 if len(data) > 8 else 1)
    return Plot("expert_load", _save(fig, out / "expert_load.png"),
                "MoE expert load per layer: imbalance = max / mean tokens per expert of each logged step (1 = "
                "balanced; the slowest expert's work over a balanced one's), and the last logged step's range. "
                "Measured: `expert_load` of metrics.jsonl, counted over the whole global batch (every rank's "
                "tokens).", data)
