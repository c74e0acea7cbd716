"""Stragglers (docs/hangs.md#stragglers): a rank that is consistently slower than its peers.

In a synchronous step every rank takes the same wall time: the collectives make the fast ranks wait
for the slowest, so step times find nothing. What differs is each rank's own work, without its waits
for the others, measured as the plan says (RunPlan.decisions.straggler_measure):

- "runnable" (CPU ranks): the time the rank's threads ran on a CPU or waited for one, from Linux's
  /proc/self/task/*/schedstat, over its training steps (logging excluded). A rank blocked in a
  collective sleeps and accrues almost none (measured: 3 % of a 3 s gloo wait); a rank that computes
  slowly, is starved of CPU or throttled by its cgroup accrues more. Nothing where /proc has no
  schedstat (not Linux).
- "data+optimizer" (accelerators): the parts of a step that wait for no other rank: reading the batch
  (host time) and the optimizer step (device events); "data" under ZeRO-1, whose optimizer step
  broadcasts inside it. A slow device, a starved host or a slow disk shows there; slowness only in
  the forward and backward, or in bursts between the sections, does not.

Each rank sums its work; on every logged step one all-gather of two numbers per rank brings them
together, and a rank whose work per step is more than MARGIN above the median of its peers (the
ranks of the same pipeline stage, which do the same work) in INTERVALS logged intervals in a row is
flagged: in metrics.jsonl, on the console, in logs/events.jsonl and `usp status`; as many normal
intervals in a row drop the flag.

No torch at import: the detector is plain Python (tests/unit); the timing and the gather import it."""
from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator

MARGIN = 0.25  # slower than its peers' median by more than a quarter ...
NOISE_S = 0.0005  # ... and by more than half a millisecond per step (timer and scheduler jitter)
INTERVALS = 3  # ... in this many logged intervals in a row
PER_RANK_LIMIT = 64  # metrics.jsonl lists every rank's time up to this world size, else only the summary


class StragglerDetector:
    """The rule above, on per-rank seconds per step (None: a rank that timed no step this interval)."""

    def __init__(self, groups: list[int]):
        self.groups = groups  # rank -> the group of ranks doing the same work (its pipeline stage)
        self.streak = [0] * len(groups)
        self.flagged: set[int] = set()

    def compare(self, per_step: list[float | None]) -> list[tuple[float | None, bool]]:
        """Each rank's time over its peers' median (None: no peer, or no time), and whether that makes
        it slow this interval: more than MARGIN above, and by more than NOISE_S."""
        out: list[tuple[float | None, bool]] = []
        for rank, t in enumerate(per_step):
            peers = [p for r, p in enumerate(per_step) if r != rank and p is not None
                     and self.groups[r] == self.groups[rank]]
            median = statistics.median(peers) if peers else None
            if t is None or not median:
                out.append((None, False))
                continue
            out.append((t / median, t / median > 1 + MARGIN and t - median > NOISE_S))
        return out

    def update(self, per_step: list[float | None]) -> tuple[list[float | None], list[int]]:
        """This interval's ratios, and the ranks newly flagged. A rank is flagged after INTERVALS slow
        intervals in a row and unflagged after as many normal ones, so one noisy interval neither
        raises nor drops a flag (measured on a shared 2-core VM: single intervals up to 2.5x)."""
        compared = self.compare(per_step)
        new = []
        for rank, (_, slow) in enumerate(compared):
            flagged = rank in self.flagged
            self.streak[rank] = self.streak[rank] + 1 if slow != flagged else 0  # intervals against the flag
            if self.streak[rank] >= INTERVALS:
                self.streak[rank] = 0
                if flagged:
                    self.flagged.discard(rank)
                else:
                    self.flagged.add(rank)
                    new.append(rank)
        return [ratio for ratio, _ in compared], new


class SectionTimer:
    """Wall time of a code section, summed: perf_counter on CPU; on an accelerator, device events (the
    host only queues the kernels), read when `take` is called on a logged step."""

    def __init__(self, device):
        import torch

        self.device, self.seconds, self._events = device, 0.0, []
        self._event = getattr(torch, "Event", None) if device.type != "cpu" else None

    @contextlib.contextmanager
    def time(self) -> Iterator[None]:
        if self._event is None:
            t0 = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - t0
            return
        start, end = self._event(self.device, enable_timing=True), self._event(self.device, enable_timing=True)
        start.record()
        yield
        end.record()
        self._events.append((start, end))

    def take(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
            self._events.clear()
        out, self.seconds = self.seconds, 0.0
        return out


def runnable_s(tid: int) -> float | None:
    """Thread `tid`'s time on a CPU or waiting for one, in seconds (None: no schedstat here)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            on_cpu, waiting, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return (int(on_cpu) + int(waiting)) / 1e9


class Stragglers:
    """A rank's side: measure its work, gather on logged steps, flag (rank 0 says so)."""

    def __init__(self, plan, ctx, warn, event):
        self.ctx, self.warn, self.event = ctx, warn, event
        self.measure = plan.decisions.straggler_measure
        self.ranks = plan.ranks
        self.detector = StragglerDetector([r.coords.get("pp", 0) for r in plan.ranks])
        self.optimizer = SectionTimer(ctx.device)
        self.work_s, self.steps, self._started = 0.0, 0, None
        self._tid = threading.get_native_id()  # the training loop's thread

    def step_begins(self) -> None:
        if self.measure == "runnable":
            self._started = runnable_s(self._tid)

    def step_done(self, data_s: float) -> None:
        """The step's own work is over (logging, evaluation and checkpoints are not counted)."""
        if self.measure == "runnable":
            now = runnable_s(self._tid)
            if now is not None and self._started is not None:
                self.work_s += now - self._started
        elif "data" in self.measure:
            self.work_s += data_s
        self.steps += 1

    def optimizer_section(self):
        return self.optimizer.time() if "optimizer" in self.measure else contextlib.nullcontext()

    def record(self, step: int) -> dict:
        """metrics.jsonl's fields of a logged step; every rank calls it (one all-gather)."""
        per_step = self._gather(self.work_s + self.optimizer.take(), self.steps)
        self.work_s, self.steps = 0.0, 0
        ratios, new = self.detector.update(per_step)
        known = [t for t in per_step if t is not None]
        if not known:
            return {}
        worst = max(range(len(ratios)), key=lambda r: ratios[r] or 0.0)
        out = {"work_s_median": statistics.median(known), "work_s_slowest_rank": worst,
               "work_s_slowest_ratio": ratios[worst]}
        if len(per_step) <= PER_RANK_LIMIT:
            out["work_s_by_rank"] = per_step
        if self.detector.flagged:
            out["stragglers"] = sorted(self.detector.flagged)
        for rank in new:
            self._flag(rank, ratios[rank] or 0.0, step)
        return out

    def _gather(self, seconds: float, steps: int) -> list[float | None]:
        import torch
        import torch.distributed as dist

        mine = torch.tensor([seconds, float(steps)], dtype=torch.float64, device=self.ctx.device)
        every = torch.empty(2 * self.ctx.world_size, dtype=torch.float64, device=self.ctx.device)
        dist.all_gather_single(every, mine)
        pairs = every.view(-1, 2).tolist()
        return [s / n if n and s > 0 else None for s, n in pairs]

    def _flag(self, rank: int, ratio: float, step: int) -> None:
        info = self.ranks[rank]
        work = ("time on or waiting for a CPU" if self.measure == "runnable"
                else f"{self.measure.replace('+', ' + ')} time")
        self.warn(f"rank {rank} (node {info.node}, local rank {info.local_rank}) is a straggler: its own work per step "
                  f"({work}) was {ratio:.2f}x its peers' median in {INTERVALS} logged intervals in a row (to step "
                  f"{step}); the other ranks wait for it at every collective")
        if self.ctx.is_main:
            self.event(rank=rank, ratio=round(ratio, 3), step=step, node=info.node, local_rank=info.local_rank)
