"""The report's PNG plots of runs (loss, lr, throughput, memory); sweep_plots.py and
profile_plots.py draw the others with the helpers here. Each function draws one figure and
returns a Plot with the numbers it drew (`data`: label -> {"x": [...], "y": [...]}, or a table),
so tests and readers can check a plot against its source. matplotlib is imported lazily, with
the Agg backend (no display needed)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from usp.report.runs import RunData


@dataclass
class Plot:
    name: str
    path: Path
    caption: str  # what is shown and where the numbers came from
    data: dict = field(default_factory=dict)


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """A PNG in the report directory, which write_report swaps into place whole (usp.run.files.staged)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    finally:
        _plt().close(fig)
    return path


def plot_loss(runs: list[RunData], out: Path) -> Plot | None:
    data = {}
    for r in runs:
        for key, kind in (("loss", "train"), ("val_loss", "val")):
            x, y = r.series(key)
            if x:
                data[f"{r.label} {kind}"] = {"x": x, "y": y}
    if not data:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colors = {}
    for label, s in data.items():
        run = label.rsplit(" ", 1)[0]
        if label.endswith(" train"):
            colors[run] = ax.plot(s["x"], s["y"], label=label, lw=1.4)[0].get_color()
        else:
            ax.plot(s["x"], s["y"], "o--", ms=4, lw=0.9, color=colors.get(run), label=label)
    ax.set(xlabel="step", ylabel="loss (cross-entropy, nats)", title="loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return Plot("loss", _save(fig, out / "loss.png"), "Training loss (lines) and validation loss (dots) per "
                "logged step. Measured: `loss` / `val_loss` of metrics.jsonl (rank 0).", data)


def _by_label(runs: list[RunData], key: str, suffix: str = "") -> dict:
    """label + suffix -> {"x": steps, "y": values} of `key`, for the runs that logged it."""
    series = ((r.label + suffix, r.series(key)) for r in runs)
    return {label: {"x": x, "y": y} for label, (x, y) in series if x}


def plot_lr(runs: list[RunData], out: Path) -> Plot | None:
    data = _by_label(runs, "lr")
    if not data:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    for label, s in data.items():
        ax.plot(s["x"], s["y"], label=label, lw=1.4)
    ax.set(xlabel="step", ylabel="learning rate", title="learning rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return Plot("lr", _save(fig, out / "lr.png"), "Learning rate per logged step: `lr` of metrics.jsonl "
                "(the scheduler's value after the step).", data)


def plot_throughput(runs: list[RunData], out: Path) -> Plot | None:
    data, mfu = _by_label(runs, "tokens_per_s", " tokens/s"), _by_label(runs, "mfu", " mfu")
    if not data:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if mfu else 1, figsize=(9.6 if mfu else 6.4, 3.6), squeeze=False)
    for label, s in data.items():
        axes[0][0].plot(s["x"], s["y"], "o-", ms=3, lw=1.2, label=label.rsplit(" ", 1)[0])
    axes[0][0].set(xlabel="step", ylabel="tokens/s (all ranks)", title="throughput")
    for label, s in mfu.items():
        axes[0][1].plot(s["x"], [100 * v for v in s["y"]], "o-", ms=3, lw=1.2, label=label.rsplit(" ", 1)[0])
        axes[0][1].set(xlabel="step", ylabel="MFU (%)", title="model FLOPs utilisation")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    caption = ("Throughput per logged step: `tokens_per_s` of metrics.jsonl (global batch tokens / wall time "
               "of that step, measured on rank 0; step 1 includes warm-up, the memory-probe step and profiled steps "
               "are slower)")
    caption += ("; MFU: the records' `mfu` field." if mfu else
                ". No MFU plot: the records have no `mfu` field (the tables derive it from tokens/s).")
    return Plot("throughput", _save(fig, out / "throughput.png"), caption, {**data, **mfu})


def plot_memory(runs: list[RunData], out: Path, max_bars: int = 32) -> Plot | None:
    """Per rank: predicted tensor memory, predicted total (with the overhead allowance) and the
    measured peak (logs/rank_<R>.log, else the run's max over ranks for rank 0)."""
    labels: list[str] = []
    data: dict[str, dict[str, list]] = {"predicted": {"x": [], "y": []}, "predicted_total": {"x": [], "y": []},
                                        "measured": {"x": [], "y": []}}
    hows = set()
    for r in runs:
        predicted = r.memory_predicted_gib()
        measured = dict(r.rank_memory_gib)
        value, how = r.memory_measured()
        if not measured and value is not None:
            measured = {0: value}
        if measured:
            hows.add("memory probe" if how == "probe" else "allocator peak")
        for rank in sorted(set(predicted) | set(measured)):
            if len(labels) >= max_bars:
                break
            label = f"{r.label} r{rank}" if len(runs) > 1 else f"rank {rank}"
            labels.append(label)
            tensor, total = predicted.get(rank, (math.nan, math.nan))
            for key, value in (("predicted", tensor), ("predicted_total", total),
                               ("measured", measured.get(rank, math.nan))):
                data[key]["x"].append(label)
                data[key]["y"].append(value)
    if not labels or all(math.isnan(v) for s in data.values() for v in s["y"]):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(labels) + 2.5), 3.8))
    width, xs = 0.27, range(len(labels))
    for i, (key, name) in enumerate((("predicted", "predicted tensor memory (plan.yaml)"),
                                     ("predicted_total", "predicted total incl. overhead (plan.yaml)"),
                                     ("measured", f"measured peak ({' / '.join(sorted(hows)) or 'none'})"))):
        ax.bar([x + (i - 1) * width for x in xs], [0 if math.isnan(v) else v for v in data[key]["y"]], width,
               label=name, alpha=0.85)
    ax.set_xticks(list(xs), labels, rotation=30 if len(labels) > 4 else 0, ha="right" if len(labels) > 4 else "center",
                  fontsize=7)
    ax.set_xlim(-0.6, len(labels) - 0.4)  # one rank: keep the bars narrow
    ax.set_ylim(0, 1.35 * max(v for s in data.values() for v in s["y"] if not math.isnan(v)))  # room for the legend
    ax.set(ylabel="GiB", title="memory per rank: predicted vs measured")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    return Plot("memory", _save(fig, out / "memory.png"), "Memory per rank. Predicted: plan.yaml `memory` of the "
                "rank's pipeline stage, tensor memory (total - overhead) and the total with the framework "
                "allowance. Measured: the memory probe's peak tensor memory of one step (logs/rank_<R>.log; when "
                "a rank logged none, rank 0 shows the run's max over ranks from summary.json); without the probe, "
                "the CUDA/XPU allocator's peak allocated memory, max over ranks and logged steps (`memory_peak_gib` "
                "of metrics.jsonl).", data)
