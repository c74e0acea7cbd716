"""Shared by the benchmark scripts: command-line flags, the machine description, medians,
planning a run in-process, and printing a result as text or JSON.

Every script prints one comparable figure, measured side by side in one run, and with --json
one JSON object (for machines: CI, docs tables)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # dist.harness: one torchrun launch for many cases
os.environ.setdefault("USP_CACHE_DIR", str(Path(tempfile.gettempdir()) / "usp-bench-cache"))


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def machine() -> dict:
    """What the figures were measured on (torch only if it is already imported)."""
    out = {"machine": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name()
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def step_times(history: list[dict], warmup: int, steps: int) -> list[float]:
    """Seconds of each step after the warm-up, from the trainer's records (train.log_interval=1):
    whole iterations, the loop's own overhead included."""
    at = {r["step"]: r["elapsed_s"] for r in history}
    return [at[s + 1] - at[s] for s in range(warmup, warmup + steps)]


def plan_for(overrides: list[str], world: int, runs_dir: str):
    """Compose + plan a run in-process (pure Python), with its tokenized data prepared: the RunPlan
    `usp train` would hand the engine, as a rank reads it back from plan.yaml."""
    from usp.config.compose import compose_config
    from usp.contract.plan_file import plan_from_dict
    from usp.data.tokenized import ensure_dataset
    from usp.plan.plan import build_plan

    base = [f"cluster.procs_per_node={world}", "cluster.nodes=1", f"train.runs_dir={runs_dir}",
            "logging.console=quiet", "train.sample_tokens=0", "train.eval_interval=0", "checkpoint.enabled=false"]
    cfg, choices = compose_config(None, base + list(overrides))
    plan = build_plan(cfg, choices)
    path, meta = ensure_dataset(cfg.data)
    plan.dataset_dir, plan.data_meta = str(path), dict(meta)
    return plan_from_dict(plan.to_dict())


def emit(result: dict, args, lines: list[str]) -> None:
    """The result as JSON (--json) or as the given human-readable lines."""
    if args.json:
        print(json.dumps(result, indent=2, default=float))
    else:
        print("\n".join(lines))
