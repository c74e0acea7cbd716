"""The step-time breakdown plot: one stacked bar per profiled step (and rank, and run) from the
profiler trace (trace.py), communication as a thin bar beside it (it overlaps the phases)."""
from __future__ import annotations

from pathlib import Path

from usp.report.plots import Plot, _plt, _save
from usp.report.trace import PHASES, StepBreakdown
from usp.run.files import METRICS, PROFILE, SPAN_BACKWARD, SPAN_FORWARD, SPAN_OPTIMIZER, SPAN_PIPELINE, SPAN_STEP_PREFIX

COLORS = {"forward": "tab:blue", "backward": "tab:orange", "forward+backward (pipeline)": "tab:purple",
          "optimizer": "tab:green", "data wait": "tab:red", "other": "tab:gray"}


def plot_step_breakdown(bars: list[tuple[str, StepBreakdown]], out: Path) -> Plot | None:
    """bars: (x label, breakdown). data: phase -> {"x": labels, "y": ms} (+ "communication")."""
    if not bars:
        return None
    labels = [label for label, _ in bars]
    phases = [p for p in PHASES if any(p in b.phases_ms for _, b in bars)]
    data: dict[str, dict[str, list]] = {p: {"x": labels, "y": [b.phases_ms.get(p, 0.0) for _, b in bars]}
                                        for p in phases}
    has_comm = any(b.comm_ms is not None for _, b in bars)
    if has_comm:
        data["communication"] = {"x": labels, "y": [b.comm_ms or 0.0 for _, b in bars]}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5.5, 0.6 * len(bars) + 3.5), 4.0))
    xs, bottom = list(range(len(bars))), [0.0] * len(bars)
    for p in phases:
        ax.bar(xs, data[p]["y"], 0.6, bottom=bottom, label=p, color=COLORS[p], alpha=0.85)
        bottom = [a + b for a, b in zip(bottom, data[p]["y"])]
    if has_comm:
        sources = sorted({b.comm_source for _, b in bars if b.comm_source})
        ax.bar([x + 0.38 for x in xs], data["communication"]["y"], 0.14, color="black",
               label=f"communication ({', '.join(sources)}; overlaps the phases)")
    ax.set_xticks(xs, labels, rotation=30 if len(bars) > 4 else 0, ha="right" if len(bars) > 4 else "center",
                  fontsize=7)
    ax.set_xlim(-0.7, len(bars) - 0.3)
    ax.set_ylim(0, 1.45 * max(max(bottom), max(data.get("communication", {"y": [0]})["y"])))  # legend room
    ax.set(ylabel="time (ms)", title="step-time breakdown (profiled steps)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    caption = (f"Step-time breakdown of the profiled steps, measured by torch.profiler ({PROFILE}/rank_<R>.json): "
               f"each bar is one `{SPAN_STEP_PREFIX}<N>` span, split into the `{SPAN_FORWARD}` / `{SPAN_BACKWARD}` / "
               f"`{SPAN_OPTIMIZER}` (/ `{SPAN_PIPELINE}`) spans inside it, data wait (`data_wait_s` of "
               f"{METRICS}, rank 0's own measurement, so rank 0 only) and other (the rest of the step).")
    if has_comm:
        caption += (" Black: time in communication ops (c10d/gloo/nccl/all_reduce/all_gather/reduce_scatter/...; "
                    "device kernels when the trace has them), which overlaps the phases rather than adding to them.")
    else:
        caption += " No communication op in the trace (one rank, or collectives not recorded)."
    return Plot("step_time", _save(fig, out / "step_time.png"), caption, data)
