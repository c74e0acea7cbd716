"""The plan page's charts, drawn by Plotly from the plan's plain values (`usp plan --json`, plan.yaml's
fields): memory per pipeline stage against the device, the step time's parts, the pipeline schedule per
pp rank. Each returns a figure as Plotly's JSON (a dict), which the page hands to Plotly.react. plotly is
imported here only, when a page is built (usp[ui])."""
from __future__ import annotations

import json

from usp.contract.predictions import TERM_LABELS, TERMS
from usp.errors import UspError
from usp.perf.pipeline_timeline import Slot, stage_times, timeline

GIB = 2**30
BUILD_TERMS = (("parameters", "build: parameters"), ("transient", "build/load transient"),
               ("read_buffer", "load read buffer"), ("overhead", "build: overhead"))
TEXT_SLOTS = 96  # micro batch numbers written on the bars up to this many (text costs the browser most)
KIND_COLOURS = {"forward": "#4c78a8", "backward": "#f58518", "idle": "#d9d9d9"}


def require_plotly(key: str) -> None:
    """plotly is usp[ui]'s, not usp's: without it, say so before any work (key: the option that needs it)."""
    import importlib.util

    if importlib.util.find_spec("plotly") is None:
        raise UspError("the page is drawn with plotly, which is not installed here", key=key,
                       fix="pip install 'usp[ui]' (or pip install plotly==7.1.0)")


def _go():
    import plotly.graph_objects as go  # not at import time: usp plan without --html never loads plotly

    return go


def _plain(fig) -> dict:
    return json.loads(fig.to_json())


def stage_label(stage: dict) -> str:
    last = stage["first_rank"] + stage["n_ranks"] - 1
    ranks = f"rank {last}" if stage["n_ranks"] == 1 else f"ranks {stage['first_rank']}-{last}"
    return f"pp {stage['stage']} ({ranks})"


def memory_figure(memory: dict) -> dict:
    """Stacked bars per pp rank: the training peak's terms, and beside it the build (or load), against the
    device's memory."""
    go = _go()
    stages = memory["stages"]
    x = [[stage_label(s) for s in stages for _ in (0, 1)], ["training", "build"] * len(stages)]
    fig = go.Figure()
    for term in TERMS:
        values = [v for s in stages for v in (s[term] / GIB, None)]
        if any(values):
            fig.add_bar(name=TERM_LABELS[term], x=x, y=values, hovertemplate="%{y:.2f} GiB")
    for term, label in BUILD_TERMS:
        values = [v for s in stages for v in (None, (s["build"] or {}).get(term, 0.0) / GIB)]
        if any(values):
            fig.add_bar(name=label, x=x, y=values, hovertemplate="%{y:.2f} GiB")
    fig.add_hline(y=memory["capacity_gib"], line_dash="dash", line_color="#c0392b",
                  annotation_text=f"{memory['device_name']}: {memory['capacity_gib']:g} GiB")
    fig.update_layout(barmode="stack", title="Memory per rank, by pipeline stage (GiB)", yaxis_title="GiB",
                      height=420, margin={"t": 50, "b": 40}, legend={"orientation": "v"})
    return _plain(fig)


def time_figure(timing: dict) -> dict:
    """The step time as a waterfall: compute, exposed TP/CP/EP/PP, bubble, exposed DP, the fixed part."""
    go = _go()
    parts = [("compute", timing["compute_s"]), ("exposed TP/CP/EP/PP", timing["exposed_path_comm_s"]),
             ("pipeline bubble", timing["bubble_s"]), ("exposed DP", timing["exposed_dp_comm_s"]),
             ("accumulation, optimizer, fixed", timing["fixed_s"])]
    fig = go.Figure(go.Waterfall(
        x=[name for name, _ in parts] + ["step"], y=[v for _, v in parts] + [timing["step_s"]],
        measure=["relative"] * len(parts) + ["total"], texttemplate="%{y:.4g} s", textposition="outside",
        hovertemplate="%{x}: %{y:.4g} s<extra></extra>"))
    fig.update_layout(title="Step time, predicted (s)", yaxis_title="seconds", height=380, showlegend=False,
                      margin={"t": 50, "b": 40})
    return _plain(fig)


def schedule_slots(plan: dict) -> list[Slot]:
    """One step's forwards and backwards per pp rank, from the plan's pipeline (one stage, every micro
    batch, without pipeline parallelism). ValueError when the schedule is not drawn."""
    timing, pipe = plan["timing"], plan["pipeline"]
    if pipe is None:
        schedule, rank_stages, n_micro = "1f1b", [[0]], plan["batch"]["grad_accum"]
    else:
        schedule, rank_stages, n_micro = pipe["schedule"], pipe["rank_stages"], pipe["n_microbatches"]
    forward, backward = stage_times(timing["micro_batch_s"], timing["recompute_s"], len(rank_stages[0]))
    return timeline(schedule, rank_stages, n_micro, forward, backward)


def schedule_figure(plan: dict) -> dict:
    """The pipeline schedule as a timeline: a bar per forward and backward (its micro batch written on
    it when they are few; in the hover always), the idle time between them grey."""
    go = _go()
    slots = schedule_slots(plan)
    pp = 1 + max(s.rank for s in slots)
    end = max(s.end for s in slots)
    rows = {kind: [s for s in slots if s.kind == kind] for kind in ("forward", "backward")}
    rows["idle"] = _idle(slots, pp, end)
    fig = go.Figure()
    labelled = len(slots) <= TEXT_SLOTS
    for kind, items in rows.items():
        fig.add_bar(name=kind, orientation="h", y=[f"pp {s.rank}" for s in items], x=[s.end - s.start for s in items],
                    base=[s.start for s in items], marker_color=KIND_COLOURS[kind],
                    text=[str(s.micro) if s.micro >= 0 and labelled else "" for s in items],
                    textposition="inside" if labelled else "none", insidetextanchor="middle",
                    customdata=[[s.stage, s.micro, s.start, s.end] for s in items],
                    hovertemplate=(f"{kind}: stage %{{customdata[0]}}, micro batch %{{customdata[1]}}, "
                                   "%{customdata[2]:.4g}-%{customdata[3]:.4g} s<extra></extra>") if kind != "idle"
                    else "idle %{customdata[2]:.4g}-%{customdata[3]:.4g} s<extra></extra>")
    schedule = plan["pipeline"]["schedule"] if plan["pipeline"] else "no pipeline parallelism"
    fig.update_layout(barmode="overlay", title=f"Pipeline schedule, one step ({schedule}): compute of the busiest "
                      "pp rank per stage", xaxis_title="seconds", height=120 + 40 * pp,
                      yaxis={"autorange": "reversed"}, margin={"t": 50, "b": 40})
    return _plain(fig)


def _idle(slots: list[Slot], pp: int, end: float) -> list[Slot]:
    gaps = []
    for rank in range(pp):
        t = 0.0
        for s in sorted((s for s in slots if s.rank == rank), key=lambda s: s.start):
            if s.start > t:
                gaps.append(Slot(rank, -1, -1, "idle", t, s.start))
            t = s.end
        if end > t:
            gaps.append(Slot(rank, -1, -1, "idle", t, end))
    return gaps
