"""plan.yaml: a RunPlan written atomically, and read back as a RunPlan, rebuilt and checked against
its types (usp/contract/typed.py). A plan of another version is refused with one line naming the fix
(plan the run again); one of a previous version (1: usp before 2026-12, its engine choices re-derived
with the rules the planner uses, usp/contract/decide.py; 2: the time model's previous cluster constants) is
brought up to date, so run directories written by those releases still resume, report and show their
status. Every reader (the ranks, `usp status`, `usp report`, `usp export`, the launchers) goes through
read_plan."""
from __future__ import annotations

from pathlib import Path

from usp.contract.config_schema import UspConfig
from usp.contract.decide import engine_choices
from usp.contract.run_plan import PLAN_VERSION, RunPlan
from usp.contract.typed import PlanFileError, plain, rebuild
from usp.run.files import PLAN, plan_path, write_text_atomic

READABLE_VERSIONS = (1, 2, PLAN_VERSION)
# version 2's cluster.timing (the time model before usp 2026-12): the fields it keeps under a new name; the rest
# (kernel_half_tokens, call_overhead_us, p2p_stall_*, ...) belonged to a model the planner no longer has
RENAMED_TIMING = {"kernel_efficiency": "gemm_efficiency", "intra_hop_us": "intra_latency_us",
                  "inter_hop_us": "inter_latency_us"}
HEADER = "# usp run plan: derived from the config below; the engine reads only this file.\n"


def write_plan(plan: RunPlan, path: Path | None = None) -> Path:
    import yaml  # not at import time: pyyaml costs start-up for commands that never write a plan

    path = Path(path or plan_path(plan.run_dir))
    write_text_atomic(path, HEADER + yaml.dump(plan.to_dict(), Dumper=_dumper(yaml), sort_keys=False, width=110))
    return path


def read_plan(path) -> RunPlan:
    """The RunPlan of plan.yaml (`path`: the file, or a run directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / PLAN
    return plan_from_dict(_load(path), path)


def read_plan_if_any(run_dir) -> RunPlan | None:
    """The run directory's plan, or None when it has no plan.yaml."""
    path = plan_path(run_dir)
    return read_plan(path) if path.is_file() else None


def plan_from_dict(data, path: Path | str = PLAN) -> RunPlan:
    if not isinstance(data, dict):
        raise PlanFileError(f"{path} is not a usp run plan (no mapping at its top)", key="plan.yaml", value=str(path),
                            fix="plan the run again (the same usp train / usp submit command writes a new plan.yaml)")
    version = data.get("version")
    if version not in READABLE_VERSIONS:
        raise PlanFileError(f"{path} is a plan of version {version!r}; this usp reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}", key="version", value=version,
                            fix="plan the run again with this usp (the same usp train / usp submit command)")
    if version in (1, 2):
        data = with_current_timing(data)
    if version == 1:
        data = upgraded(data)
    data = {k: v for k, v in data.items() if k != "ranks"}  # version 1 wrote the rank table; it is derived
    data = {**data, "batch": {k: v for k, v in data["batch"].items() if k != "global_batch_tokens"}}
    return _consistent(rebuild(RunPlan, data), path)


def _consistent(plan: RunPlan, path) -> RunPlan:
    """What the engine builds from must agree with itself: the mesh is the degrees', whose product is the
    world size, and every rank has its row (a plan edited by hand; the planner never writes another)."""
    dims = plan.parallel
    problems = [("mesh_shape", plan.mesh_shape, f"the degrees' {dims.mesh_shape}") if plan.mesh_shape != dims.mesh_shape
                else None,
                ("world_size", plan.world_size, f"the degrees' product {dims.world_size}")
                if plan.world_size != dims.world_size else None,
                ("threads_per_proc", plan.threads_per_proc, "at least 1") if plan.threads_per_proc < 1 else None]
    found = next((p for p in problems if p is not None), None)
    if found is not None:
        key, value, wanted = found
        raise PlanFileError(f"{path} is inconsistent: {key} is {value!r}, not {wanted}", key=key, value=value,
                            fix="plan the run again (the same usp train / usp submit command writes a new plan.yaml)")
    return plan


def upgraded(old: dict) -> dict:
    """A version 1 plan.yaml as today's: the engine's choices taken from its config by the rules the planner
    records them with."""
    config = rebuild(UspConfig, old["config"])
    decisions = engine_choices(config, old["degrees"], old["device"], old["model"]["vocab_size"], old["run_dir"])
    return {**old, "decisions": plain(decisions), "version": PLAN_VERSION}


def with_current_timing(old: dict) -> dict:
    """A version 1 or 2 plan.yaml as version 3: its config's cluster.timing in today's fields (renamed where a
    field kept its meaning, dropped where the time model no longer has it); the prediction it recorded stays."""
    import dataclasses

    from usp.contract.config_schema import CalibratedConfig, ClusterTimingConfig

    config = old.get("config") or {}
    cluster = dict(config.get("cluster") or {})
    timing = {RENAMED_TIMING.get(k, k): v for k, v in (cluster.get("timing") or {}).items()}
    known = {f.name for f in dataclasses.fields(ClusterTimingConfig)}
    timing = {k: v for k, v in timing.items() if k in known}
    if isinstance(timing.get("calibrated"), dict):
        kept = {f.name for f in dataclasses.fields(CalibratedConfig)}
        timing["calibrated"] = {k: v for k, v in timing["calibrated"].items() if k in kept}
    cluster["timing"] = timing
    return {**old, "config": {**config, "cluster": cluster}, "version": PLAN_VERSION}


def _load(path: Path):
    import yaml

    with open(path) as f:
        try:
            return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise PlanFileError(f"{path} is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}",
                                key="plan.yaml", value=str(path),
                                fix="plan the run again (the same usp train / usp submit command writes a new "
                                    "plan.yaml)") from None


def _dumper(yaml):
    return getattr(yaml, "CSafeDumper", yaml.SafeDumper)
