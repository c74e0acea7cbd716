"""A measured sweep's rows as usp layouts: the Ultra-Scale Playbook's nanotron runs
(calibration/playbook_h100/: model, nodes, dp/tp/pp, gas, mbs, zero, status, mem_gb) mapped onto
the planner's inputs, once, for scripts/bench/calibration_sweep.py and the calibration tests.

Mapping: the model shape from the archs CSV beside the sweep (a Llama; MHA: kv heads = heads),
dp -> dp_replicate, zero=1 -> parallelism.zero1, tp, pp with 1F1B, mbs -> micro batch, gas ->
gradient accumulation, seq 4096, bf16, no recompute, cluster slurm_h100 with the run's nodes.
The memory model is asked without the rules (the 1.34B ties its embeddings under pp, which usp's
engine refuses, but nanotron ran it). Pure Python, no torch."""
from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from usp.plan.specs import GIB, Arch, Hardware, Layout, Precision

SEQ_LEN = 4096
PLAYBOOK_DIR = Path(__file__).resolve().parents[2] / "calibration" / "playbook_h100"
SWEEP_CSV = PLAYBOOK_DIR / "playbook_sweep_calibration.csv"
ARCHS_CSV = PLAYBOOK_DIR / "playbook_model_archs.csv"
BF16 = Precision.resolve("bf16", "cuda")


@dataclass(frozen=True)
class SweepRun:
    """One measured run: its layout, the model, the node count and what was measured."""

    model: str
    arch: Arch
    nodes: int
    layout: Layout
    ok: bool
    mem_gib: float | None  # peak allocated memory on rank 0 (the first pipeline stage), GiB; None if it failed
    row: dict


def arch_of(a: dict) -> Arch:
    """One row of the archs CSV as the planner's model shape."""
    return Arch(name=a["model"], dim=int(a["hidden"]), n_layers=int(a["layers"]), n_heads=int(a["heads"]),
                n_kv_heads=int(a["kv_heads"]), ffn_dim=int(a["ffn"]), vocab_size=int(a["vocab"]),
                tie_embeddings=a["tie_word_embeddings"].strip().lower() == "true")


def layout_of(row: dict) -> Layout:
    return Layout(pp=int(row["pp"]), dp_replicate=int(row["dp"]), tp=int(row["tp"]), zero1=row["zero"] == "1",
                  micro_batch=int(row["mbs"]), grad_accum=int(row["gas"]), pp_schedule="1f1b")


@cache
def h100_nodes(nodes: int) -> Hardware:
    """conf/cluster/slurm_h100.yaml (8 x H100 80GB per node) with the run's node count (the group's
    YAML read directly: composing a config per node count costs seconds)."""
    import yaml

    group = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "cluster" / "slurm_h100.yaml").read_text())
    return Hardware.from_cluster({**group, "nodes": nodes})


def read_sweep(sweep: Path = SWEEP_CSV, archs: Path | None = None) -> list[SweepRun]:
    archs = archs or sweep.with_name(ARCHS_CSV.name)
    shapes = {a["model"]: arch_of(a) for a in csv.DictReader(archs.open())}
    runs = []
    for row in csv.DictReader(sweep.open()):
        ok = row["status"] == "ok"
        runs.append(SweepRun(row["model"], shapes[row["model"]], int(row["nodes"]), layout_of(row), ok,
                             float(row["mem_gb"]) if ok and row.get("mem_gb") else None, row))
    return runs


@dataclass(frozen=True)
class MemoryCheck:
    run: SweepRun
    predicted_gib: float | None  # tensor memory of pp rank 0 (what mem_gb measures), no overhead allowance;
    # None: the profile cannot place the layout (usp's split needs a layer per stage; nanotron's does not)
    fits: bool  # the whole plan (every stage, with the overhead) within the device

    @property
    def error(self) -> float:
        assert self.run.mem_gib is not None and self.predicted_gib is not None
        return (self.predicted_gib - self.run.mem_gib) / self.run.mem_gib


def check_memory(runs: list[SweepRun], profile) -> list[MemoryCheck]:
    """The planner's memory model (usp.plan.memory.memory_plan) on each run, as the profile's recipe."""
    from usp.errors import PlanError
    from usp.plan.memory import peak_bytes, stage_memory

    out = []
    for run in runs:
        hw = h100_nodes(run.nodes)
        try:  # what memory_plan gives for stage 0 and the peak, without the stages that cannot hold it
            first = stage_memory(run.arch, run.layout, SEQ_LEN, hw, BF16, 0, profile)
            peak, _ = peak_bytes(run.arch, run.layout, SEQ_LEN, hw, BF16, profile)
        except PlanError:
            out.append(MemoryCheck(run, None, False))
            continue
        out.append(MemoryCheck(run, (first.total - first.overhead) / GIB, peak / GIB <= hw.memory_gib))
    return out


def accuracy(checks: list[MemoryCheck]) -> dict:
    """On the ok runs: median |error|, the share within 10 %, ok runs predicted out of memory; on the
    failed runs (an OOM or another failure: the source does not tell): how many are predicted to fit."""
    ok = [c for c in checks if c.run.ok and c.predicted_gib is not None]
    errors = sorted(abs(c.error) for c in ok)
    failed = [c for c in checks if not c.run.ok]
    return {"ok_runs": len(ok), "ok_unplaced": sum(c.run.ok and c.predicted_gib is None for c in checks),
            "median_abs_error": statistics.median(errors) if errors else float("nan"),
            "within_10pct": sum(e <= 0.10 for e in errors) / len(errors) if errors else float("nan"),
            "ok_predicted_oom": sum(not c.fits for c in ok),
            "failed_runs": len(failed), "failed_predicted_fit": sum(c.fits for c in failed)}


def fit_constants(runs: list[SweepRun], profile, scales=(1.0, 1.1, 1.2, 1.3),
                  buffers=(0, 1, 2, 3, 4), accum=(0.0, 50.0, 75.0, 100.0, 125.0)) -> tuple:
    """The profile's three fitted memory constants (activation_scale, sp_full_buffers,
    accum_bytes_per_token_h) chosen on `runs` by a grid search: the smallest median |error| on the ok
    runs, then the larger share within 10 %. Returns (the profile with them, its accuracy on `runs`).
    Everything else in the profile is read from the recipe's code, not fitted."""
    from dataclasses import replace

    best = None
    for scale in scales:
        for n in buffers:
            for extra in accum:
                trial = replace(profile, activation_scale=scale, sp_full_buffers=n, accum_bytes_per_token_h=extra)
                acc = accuracy(check_memory(runs, trial))
                key = (round(acc["median_abs_error"], 4), -acc["within_10pct"])
                if best is None or key < best[0]:
                    best = (key, trial, acc)
    assert best is not None
    return best[1], best[2]
