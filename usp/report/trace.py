"""Step-time breakdown from the profiler's Chrome trace, <run_dir>/profile/rank_<R>.json (written by
usp/engine/observe/profiler.py; no torch here). The trainer wraps each profiled optimizer step in a
`usp_step_<N>` span and its phases in `usp_forward` / `usp_backward` (once per micro batch),
`usp_pipeline_forward_backward` (pipelines) and `usp_optimizer` (clip + step). Per step:

    phases = the summed durations of those spans inside the step span
    data wait = metrics.jsonl `data_wait_s` of that step (rank 0's own measurement: rank 0 only)
    other = step span - phases - data wait (loss all-reduce, gradient sync outside the spans, ...)

so the phases add up to the step's wall time. Communication (ops named like collectives) is
reported beside them: it overlaps the phases (DDP all-reduces during the backward)."""
from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

from usp.run.files import (
    SPAN_BACKWARD,
    SPAN_FORWARD,
    SPAN_OPTIMIZER,
    SPAN_PIPELINE,
    SPAN_PREFIX,
    SPAN_STEP_PREFIX,
    is_comm,
)

SPANS = {SPAN_FORWARD: "forward", SPAN_BACKWARD: "backward",
         SPAN_PIPELINE: "forward+backward (pipeline)", SPAN_OPTIMIZER: "optimizer"}
PHASES = (*SPANS.values(), "data wait", "other")  # stacking order
_STEP = re.compile(re.escape(SPAN_STEP_PREFIX) + r"(\d+)")
Interval = tuple[float, float]


@dataclass
class StepBreakdown:
    step: int
    rank: int
    total_ms: float  # the usp_step_<N> span (CPU wall time)
    phases_ms: dict[str, float]  # PHASES present in this step -> ms; they sum to total_ms
    comm_ms: float | None  # union of communication intervals inside the step; None: no such op
    comm_source: str = ""  # "device kernels" or "CPU ops"


def merge(intervals) -> list[Interval]:
    """Sorted, disjoint union of (start, end) intervals."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """Intersection of two merged interval lists (two-pointer sweep)."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _span(e: dict) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def read_trace(path: Path) -> list[dict]:
    """The trace's events ([] when the file is missing or not a Chrome trace)."""
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError, EOFError):
        return []
    events = data.get("traceEvents") if isinstance(data, dict) else data
    return [e for e in events or [] if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]


def step_breakdowns(events: list[dict], rank: int, data_wait_s: dict[int, float] | None = None) -> list[StepBreakdown]:
    """One StepBreakdown per usp_step_<N> span, in step order. data_wait_s: step -> seconds."""
    # CPU-side spans only: on GPU the profiler also copies annotations onto the device timeline.
    spans = [e for e in events
             if e.get("cat") != "gpu_user_annotation" and str(e.get("name", "")).startswith(SPAN_PREFIX)]
    comm = [e for e in events if is_comm(str(e.get("name", "")))]
    on_device = [e for e in comm if e.get("cat") == "kernel"]  # NCCL kernels: the real transfer time
    comm, source = (on_device, "device kernels") if on_device else (comm, "CPU ops")
    out = []
    for span in spans:
        match = _STEP.fullmatch(span["name"])
        if not match:
            continue
        start, end = float(span["ts"]), float(span["ts"]) + float(span["dur"])
        step, total = int(match.group(1)), float(span["dur"]) / 1e3
        phases: dict[str, float] = {}
        for e in spans:
            if e["name"] in SPANS and start <= float(e["ts"]) and float(e["ts"]) + float(e["dur"]) <= end + 1:
                phases[SPANS[e["name"]]] = phases.get(SPANS[e["name"]], 0.0) + float(e["dur"]) / 1e3
        rest = total - sum(phases.values())
        wait = (data_wait_s or {}).get(step) if rank == 0 else None
        if wait is not None:
            phases["data wait"] = min(max(rest, 0.0), 1e3 * wait)
            rest -= phases["data wait"]
        phases["other"] = max(rest, 0.0)
        out.append(StepBreakdown(step, rank, total, phases, _union_ms(comm, start, end) if comm else None,
                                 source if comm else ""))
    return sorted(out, key=lambda b: b.step)


def _union_ms(events: list[dict], start: float, end: float) -> float:
    """Time inside [start, end] covered by at least one event (nested ops counted once)."""
    return length(intersect(merge(_span(e) for e in events), [(start, end)])) / 1e3


def run_events(run) -> dict[int, list[dict]]:
    """rank -> events of each trace of a RunData (read once, for run_breakdowns and run_overlaps)."""
    return {rank: read_trace(path) for rank, path in run.traces.items()}


def run_breakdowns(run, events: dict[int, list[dict]] | None = None) -> list[StepBreakdown]:
    """Every profiled step of every rank of a RunData that has traces, rank by rank.
    events: run_events(run), when already read."""
    waits = {int(r["step"]): float(r["data_wait_s"]) for r in run.metrics
             if isinstance(r.get("data_wait_s"), (int, float))}
    events = run_events(run) if events is None else events
    return [b for rank, evs in events.items() for b in step_breakdowns(evs, rank, waits)]
