"""torch.profiler over a window of optimizer steps (profile.steps = [first, last], 1-based like
metrics.jsonl). Every rank writes <run_dir>/profile/rank_<R>.json (Chrome trace: open it in
https://ui.perfetto.dev or chrome://tracing) and summary_rank_<R>.txt: the top ops by self time
and the share of time in communication. profile.memory adds a CUDA memory snapshot
(memory_rank_<R>.pickle, for https://pytorch.org/memory_viz)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, record_function

from usp.run.files import SPAN_PREFIX, SPAN_STEP_PREFIX, is_comm, profile_dir, step_span  # shared with usp report

TOP_OPS = 15


class StepProfiler:
    """Wraps the trainer loop: `step(i)` around optimizer step i (0-based), `region(name)` around
    forward / backward / optimizer inside it, `stop()` at the end (also on errors)."""

    @classmethod
    def create(cls, trainer) -> StepProfiler | None:
        cfg = trainer.plan.config.profile
        if not cfg.enabled:
            return None
        first, last = (int(s) for s in cfg.steps)
        if trainer.start_step >= last:
            trainer.log.info("profile: resumed at step %d, after the profiled steps %d-%d", trainer.start_step,
                             first, last)
            return None
        return cls(cfg, trainer.run_dir, trainer.ctx.rank, trainer.ctx.device, trainer.start_step, first, last,
                   trainer.warn)

    def __init__(self, cfg, run_dir: Path, rank: int, device: torch.device, start_step: int, first: int,
                 last: int, warn):
        self.dir, self.rank, self.device = profile_dir(run_dir), rank, device
        self.dir.mkdir(parents=True, exist_ok=True)
        self.first = max(first, start_step + 1)  # resumed inside the window: profile what is left
        self.last = last
        self.memory = bool(cfg.memory) and device.type == "cuda"
        if cfg.memory and not self.memory and rank == 0:
            warn(f"profile.memory: memory snapshots need a CUDA device; skipped on {device.type}")
        # The schedule counts prof.step() calls from start(): call k runs step start_step + k + 1.
        before = self.first - 1 - start_step
        warmup = 1 if before else 0  # the first recorded step otherwise includes profiler start-up
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = torch.profiler.profile(
            activities=activities, record_shapes=bool(cfg.record_shapes), on_trace_ready=self._write,
            schedule=torch.profiler.schedule(wait=before - warmup, warmup=warmup, active=last - self.first + 1,
                                             repeat=1))
        self.prof.start()
        self._running = True

    @contextlib.contextmanager
    def step(self, step: int):
        n = step + 1
        if self.memory and n == self.first:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        with record_function(step_span(n)):
            yield
        if self.memory and n == self.last:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_rank_{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.prof.step()

    @staticmethod
    def region(name: str):
        return record_function(name)

    def stop(self) -> None:
        """Ends the profiler; stopped inside the window (a signal, an error), it writes what it has."""
        if self._running:
            self._running = False
            self.prof.stop()

    def _write(self, prof) -> None:
        prof.export_chrome_trace(str(self.dir / f"rank_{self.rank}.json"))
        (self.dir / f"summary_rank_{self.rank}.txt").write_text(self.summary(prof))

    def summary(self, prof) -> str:
        on_device = self.device.type == "cuda"
        attr, what = ("self_device_time_total", "self CUDA time") if on_device else ("self_cpu_time_total",
                                                                                     "self CPU time")
        averaged = prof.key_averages()
        # Without the engine's own spans (usp_step_<N>, usp_forward, ...): on a GPU each is also a device-side
        # annotation whose "self" time is its whole length, which tripled the total (H200, 2026-11-27).
        events = EventList([e for e in averaged if not e.key.startswith(SPAN_PREFIX)],
                           use_device="cuda" if on_device else None)
        total = sum(getattr(e, attr) for e in events)
        comm = sorted((e for e in events if is_comm(e.key)), key=lambda e: -getattr(e, attr))
        comm_us = sum(getattr(e, attr) for e in comm)
        share = comm_us / total if total else 0.0
        steps = [e for e in averaged if e.key.startswith(SPAN_STEP_PREFIX) and e.cpu_time_total > 0]  # not the GPU copy
        lines = [f"usp profile, rank {self.rank}, device {self.device}, optimizer steps {self.first}-{self.last}",
                 f"step wall time (CPU, {SPAN_STEP_PREFIX}<N>): " + ", ".join(
                     f"{e.key[len('usp_'):]} {e.cpu_time_total / 1e3:.1f} ms" for e in
                     sorted(steps, key=lambda e: int(e.key.rsplit('_', 1)[1]))),
                 f"communication: {100 * share:.1f}% of {what} ({comm_us / 1e3:.1f} of {total / 1e3:.1f} ms) in "
                 "ops matching c10d/gloo/nccl/all_reduce/all_gather/reduce_scatter/send/recv/broadcast"
                 + (": " + ", ".join(f"{e.key} {getattr(e, attr) / 1e3:.1f} ms" for e in comm[:5]) if comm else ""),
                 "(collectives that run in a background thread, like DDP's gradient all-reduce on gloo, "
                 "overlap the backward: their time is not all exposed)",
                 "", f"top {TOP_OPS} ops by {what}:",
                 events.table(sort_by=attr, row_limit=TOP_OPS)]
        return "\n".join(lines) + "\n"
