"""Reading what a run directory records (no torch): plan.yaml (predictions), metrics.jsonl
(measured, rank 0, per logged step), summary.json (end of run), logs/rank_<R>.log (each
rank's measured peak memory) and, when the run was profiled, profile/rank_<R>.json (Chrome
trace) and profile/summary_rank_<R>.txt (top ops)."""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from usp.contract.plan_file import read_plan_if_any
from usp.contract.run_plan import RunPlan
from usp.errors import UspError
from usp.run.files import (
    PLAN,
    PROFILE_SUMMARY_RE,
    PROFILE_TRACE_RE,
    RANK_LOG_GLOB,
    RANK_LOG_RE,
    SWEEP,
    logs_dir,
    metrics_path,
    plan_path,
    profile_dir,
    read_jsonl,
    summary_path,
)

GIB = 1024 ** 3
_RANK_MEMORY = re.compile(r"memory: measured peak ([0-9.]+) GiB")  # the memory probe's log line
_FIX = f"usp report runs/<name> (a directory with {PLAN}) or runs/<sweep> (with {SWEEP})"


@dataclass
class RunData:
    dir: Path
    label: str  # legend name
    plan: RunPlan | None
    metrics: list[dict]  # one record per logged step, deduplicated by step
    summary: dict | None
    rank_memory_gib: dict[int, float] = field(default_factory=dict)  # measured, from logs/rank_<R>.log
    profiles: dict[int, Path] = field(default_factory=dict)  # rank -> profile/summary_rank_<R>.txt
    traces: dict[int, Path] = field(default_factory=dict)  # rank -> profile/rank_<R>.json (Chrome trace)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the records where `key` is a number."""
        pairs = [(r["step"], float(r[key])) for r in self.metrics if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    @property
    def world_size(self) -> int:
        if self.plan is not None:
            return self.plan.world_size
        return int((self.summary or {}).get("world_size") or 1)

    def profiled_steps(self) -> set[int]:
        """Steps the profiler slowed down: profile.steps [first, last] and the step before it,
        which the profiler's schedule traces as its warm-up (usp/engine/observe/profiler.py)."""
        cfg = self.plan.config.profile if self.plan is not None else None
        if cfg is None or not cfg.enabled or not cfg.steps:
            return set()
        first, last = int(cfg.steps[0]), int(cfg.steps[-1])
        return set(range(max(1, first - 1), last + 1))

    def steady_records(self) -> list[dict]:
        """Logged steps without the warm-up (step 1), the memory-probe step and the profiled steps
        (all slowed down by something other than training); all records if none remain."""
        slow = self.profiled_steps() | {1}
        rest = [r for r in self.metrics if r.get("step") not in slow and "memory_measured_gib" not in r]
        return rest or list(self.metrics)

    def tokens_per_s(self) -> float | None:
        """Measured: median tokens/s over the steady logged steps (metrics.jsonl)."""
        values = [r["tokens_per_s"] for r in self.steady_records() if isinstance(r.get("tokens_per_s"), (int, float))]
        return statistics.median(values) if values else None

    def mfu(self) -> tuple[float | None, str]:
        """(MFU, how): the records' own `mfu` (median), else derived from the measured tokens/s,
        the plan's model FLOPs per token and the planner's peak FLOP/s per device."""
        values = [r["mfu"] for r in self.steady_records() if isinstance(r.get("mfu"), (int, float))]
        if values:
            return statistics.median(values), "measured"
        timing, tps = self.plan.timing if self.plan is not None else None, self.tokens_per_s()
        if tps is None or timing is None or not timing.peak_tflops or not timing.model_flops_per_token:
            return None, "-"
        return tps * timing.model_flops_per_token / (timing.peak_tflops * 1e12 * self.world_size), "derived"

    def final_loss(self) -> float | None:
        if self.summary and isinstance(self.summary.get("final_loss"), (int, float)):
            return float(self.summary["final_loss"])
        steps, losses = self.series("loss")
        return losses[-1] if losses else None

    def memory_measured(self) -> tuple[float | None, str]:
        """(peak tensor memory in GiB, max over ranks; how it was measured). The memory probe
        (summary.json, its metrics record, else its rank log lines) when it ran; otherwise the
        accelerator allocator's peak the engine logs as `memory_peak_gib` (max over ranks and
        logged steps; CUDA/XPU only)."""
        for source in [self.summary or {}] + self.metrics:
            for key in ("memory_measured_peak_gib", "memory_measured_max_gib"):
                if isinstance(source.get(key), (int, float)):
                    return float(source[key]), "probe"
        if self.rank_memory_gib:
            return max(self.rank_memory_gib.values()), "probe"
        _, peaks = self.series("memory_peak_gib")
        return (max(peaks), "allocator") if peaks else (None, "-")

    def memory_predicted_gib(self) -> dict[int, tuple[float, float]]:
        """rank -> (predicted tensor memory, predicted total with the overhead allowance), GiB,
        from plan.yaml: the memory of the rank's pipeline stage."""
        plan = self.plan
        if plan is None or plan.memory is None or not plan.memory.stages:
            return {}
        memory, out = plan.memory, {}
        for r in plan.ranks:
            pp = int(r.coords.get("pp", 0))
            s = memory.stages[pp] if pp < len(memory.stages) else memory.peak
            out[r.rank] = ((s.total - s.overhead) / GIB, s.total / GIB)
        return out


def is_run_dir(path: Path) -> bool:
    return plan_path(path).is_file()


def load_run(path, label: str | None = None) -> RunData:
    path = Path(path)
    if not path.is_dir():
        raise UspError("no such directory", key="RUN_DIR", value=str(path), fix=_FIX)
    if not is_run_dir(path):
        raise UspError("not a run directory (no plan.yaml)", key="RUN_DIR", value=str(path), fix=_FIX)
    plan = read_plan_if_any(path)
    by_step = {int(r["step"]): r for r in read_jsonl(metrics_path(path)) if isinstance(r.get("step"), int)}
    summary = read_json_object(summary_path(path))
    return RunData(path, label or (plan.name if plan is not None else path.name), plan,
                   [by_step[s] for s in sorted(by_step)], summary, _rank_memory(path),
                   _per_rank(profile_dir(path), PROFILE_SUMMARY_RE), _per_rank(profile_dir(path), PROFILE_TRACE_RE))


def read_json_object(path: Path) -> dict | None:
    """One JSON object (summary.json); None when missing, torn or not an object."""
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _rank_memory(run_dir: Path) -> dict[int, float]:
    out = {}
    for log in logs_dir(run_dir).glob(RANK_LOG_GLOB):
        match = re.fullmatch(RANK_LOG_RE, log.name)
        found = _RANK_MEMORY.findall(log.read_text(errors="replace")) if match else []
        if found and match is not None:
            out[int(match.group(1))] = float(found[-1])
    return dict(sorted(out.items()))


def _per_rank(folder: Path, pattern: str) -> dict[int, Path]:
    """rank -> file, for the files in `folder` whose name matches `pattern` (group 1: the rank)."""
    out = {}
    for path in folder.glob("*"):
        match = re.fullmatch(pattern, path.name)
        if match:
            out[int(match.group(1))] = path
    return dict(sorted(out.items()))


def unique_labels(runs: list[RunData]) -> None:
    """Two runs with the same name (from different runs dirs): add the parent directory."""
    names = [r.label for r in runs]
    for r in runs:
        if names.count(r.label) > 1:
            r.label = f"{r.dir.parent.name}/{r.dir.name}"
