"""How much communication is hidden behind compute, from one rank's Chrome trace
(<run_dir>/profile/rank_<R>.json, usp/engine/observe/profiler.py; no torch here). Per profiled step:

    communication = time covered by at least one collective, on the lanes that execute it
    overlapped    = the part of it during which compute runs on another lane
    fraction      = overlapped / communication (None when the step has no communication)

A lane is a (pid, tid) pair of the trace: a CPU thread, or a device stream. Intervals are unioned
(nested or concurrent events count once) and an interval never overlaps its own lane.

GPU (the trace has kernels whose names match the communication pattern, e.g. ncclDevKernel_*):
communication = those kernels, on the stream(s) they run on; compute = every other kernel, on other
streams. A kernel belongs to the step whose `usp_step_<N>` span holds its launch (cudaLaunchKernel,
matched through the "correlation" id), since kernels run after their CPU launch.

CPU (gloo): what the trace really shows. DDP's bucket all-reduce is launched from the backward
(`c10d::allreduce_`, ~0.2 ms on the main thread, inside AccumulateGrad) and executed by one of
gloo's worker threads, as a `gloo:all_reduce` span (FSDP2: `gloo:all_gather`; reduce-scatter runs
as `gloo:all_reduce` on gloo). The main thread records no event while it waits for a collective.
So: communication = events matching the pattern on threads other than the main one (the thread with
the `usp_step_<N>` spans); a backend that ran collectives inline on the main thread would leave only
main-thread events, which are then used, and overlap nothing. Compute = the main thread's `aten::`
ops, except those that contain a collective of that thread (a DTensor `aten::linalg_vector_norm`
all-reduces and waits inside its span). A step owns the collectives that start inside its span.

Limits. (1) On gloo a collective's span includes waiting for the peer ranks to arrive, so rank skew
counts as communication; the fraction says how much of that time the rank kept computing, not how
fast the wire is. (2) CPU compute is time inside aten ops: Python and hook overhead between ops counts
as idle, so the fraction is a lower bound. (3) Concurrency on the timeline is not parallel execution:
on a machine with fewer cores than ranks x threads the gloo thread and the main thread take turns.
(4) Intra-op worker threads (OpenMP) and CUDA memcpy/memset are not traced as compute."""
from __future__ import annotations

from dataclasses import dataclass

# merge / intersect / length live in trace.py (shared with the step breakdown); exposed here too
from usp.report.trace import _STEP, Interval, _span, intersect, is_comm, length, merge, run_events


@dataclass
class StepOverlap:
    step: int
    rank: int
    comm_ms: float  # union of communication intervals
    overlapped_ms: float  # of which under compute on another lane
    source: str  # "device kernels" or "CPU threads"

    @property
    def fraction(self) -> float | None:
        return self.overlapped_ms / self.comm_ms if self.comm_ms > 0 else None


def _lane(e: dict) -> tuple:
    return (e.get("pid"), e.get("tid"))


def _inside(outer: Interval, inner: Interval) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1]


def comm_and_compute(events: list[dict], main: set) -> tuple[list[dict], list[dict], str]:
    """(communication events, compute events, source) as the module docstring defines them."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    comm = [e for e in kernels if is_comm(str(e.get("name", "")))]
    if comm:
        return comm, [e for e in kernels if not is_comm(str(e.get("name", "")))], "device kernels"
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    comm = [e for e in cpu if is_comm(str(e.get("name", "")))]
    workers = [e for e in comm if _lane(e) not in main]
    on_main = [_span(e) for e in comm if _lane(e) in main]
    # aten ops on the main thread; one that holds a collective (and its wait) is not compute
    compute = [e for e in cpu if _lane(e) in main and str(e.get("name", "")).startswith("aten::")
               and not any(_inside(_span(e), c) for c in on_main)]
    return workers or [e for e in comm if _lane(e) in main], compute, "CPU threads"


def step_overlaps(events: list[dict], rank: int) -> list[StepOverlap]:
    """One StepOverlap per usp_step_<N> span, in step order; [] when the trace has no collective."""
    steps = [e for e in events if e.get("cat") != "gpu_user_annotation" and _STEP.fullmatch(str(e.get("name", "")))]
    comm, compute, source = comm_and_compute(events, {_lane(e) for e in steps})
    if not comm:
        return []
    launch = {e["args"]["correlation"]: float(e["ts"]) for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {})}
    lanes = {_lane(e) for e in compute} | {_lane(e) for e in comm}
    busy = {lane: merge(_span(e) for e in compute if _lane(e) == lane) for lane in lanes}
    # compute on every lane but this one: depends on the lane only
    others = {lane: merge(i for other, ivs in busy.items() if other != lane for i in ivs) for lane in lanes}
    out = []
    for span in steps:
        start, end = _span(span)
        mine = [e for e in comm if start <= launch.get((e.get("args") or {}).get("correlation"), float(e["ts"])) <= end]
        hidden = []
        for lane in {_lane(e) for e in mine}:
            hidden += intersect(merge(_span(e) for e in mine if _lane(e) == lane), others[lane])
        step = _STEP.fullmatch(span["name"])
        assert step is not None  # `steps` holds only the usp_step_<N> spans
        out.append(StepOverlap(int(step.group(1)), rank,
                               length(merge(_span(e) for e in mine)) / 1e3, length(merge(hidden)) / 1e3, source))
    return sorted(out, key=lambda o: o.step)


def run_overlaps(run, events: dict[int, list[dict]] | None = None) -> list[StepOverlap]:
    """Every profiled step of every rank of a RunData that has traces, rank by rank.
    events: trace.run_events(run), when already read."""
    events = run_events(run) if events is None else events
    return [o for rank, evs in events.items() for o in step_overlaps(evs, rank)]


def totals(overlaps: list[StepOverlap]) -> dict:
    """Per-step means and the overall fraction (sum overlapped / sum communication) of some steps."""
    comm, hidden = sum(o.comm_ms for o in overlaps), sum(o.overlapped_ms for o in overlaps)
    n = max(len(overlaps), 1)
    return {"steps": [o.step for o in overlaps], "comm_ms_per_step": comm / n, "overlapped_ms_per_step": hidden / n,
            "fraction": hidden / comm if comm > 0 else None}


def overlap_markdown(run, events: dict[int, list[dict]] | None = None) -> list[str]:
    """`usp report`'s lines for one profiled run: one row per rank ([] without collectives)."""
    overlaps = run_overlaps(run, events)
    if not overlaps:
        return []
    rows = []
    for rank in sorted({o.rank for o in overlaps}):
        mine = [o for o in overlaps if o.rank == rank]
        t = totals(mine)
        rows.append(f"| {rank} | {', '.join(map(str, t['steps']))} | {mine[0].source} | {t['comm_ms_per_step']:.1f} | "
                    f"{t['overlapped_ms_per_step']:.1f} | "
                    f"{'-' if t['fraction'] is None else format(100 * t['fraction'], '.0f') + '%'} |")
    return [f"### Communication overlapped by compute: {run.label}", "",
            "| rank | steps | from | communication (ms/step) | overlapped (ms/step) | overlap |",
            "|---|---|---|---|---|---|", *rows, "",
            "*Communication: union of collective spans where they execute (gloo worker threads on CPU, NCCL kernels "
            "on GPU; on gloo this includes waiting for the other ranks). Overlapped: the part during which "
            "compute runs elsewhere (main-thread aten ops on CPU, other streams' kernels on GPU). See "
            "usp/report/overlap.py.*", ""]
