#!/usr/bin/env python
"""Communication / compute overlap in real profiler traces: DDP (25 MB buckets, the default),
DDP with 1 MB buckets and FSDP2 (ZeRO-3), tiny model, 2 ranks, each one `usp train` with
`profile.enabled=true`. Per layout and rank: collective time per profiled step, the part of it
during which compute ran, and overlapped / communication, as usp/report/overlap.py defines them
(CPU: gloo worker-thread spans vs the main thread's aten ops; GPU: NCCL kernels vs compute kernels
on other streams). The run directories (traces: profile/rank_<R>.json) are kept with --runs-dir.

    python scripts/bench/overlap.py [--json] [--runs-dir DIR] [--gpu N]

--gpu N: cluster=local_gpu with N processes (one per GPU) instead of 2 CPU processes on gloo.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from usp.report.overlap import step_overlaps, totals  # noqa: E402
from usp.report.trace import read_trace  # noqa: E402

USP = str(Path(sys.executable).parent / "usp")
LAYOUTS = {
    "ddp": ["parallelism.dp_replicate=-1"],
    "ddp_1mb_buckets": ["parallelism.dp_replicate=-1", "parallelism.ddp_bucket_mb=1"],
    "fsdp_zero3": ["parallelism.dp_replicate=1", "parallelism.dp_shard=-1"],
}
STEPS, PROFILED = 6, (3, 5)  # step 2 is the profiler's warm-up; DDP rebuilds its buckets after step 1


def profile_run(name: str, overrides: list[str], cluster: list[str], runs_dir: Path) -> Path:
    """One profiled `usp train`; returns its run directory."""
    argv = [USP, "train", *cluster, *overrides, f"train.steps={STEPS}", f"train.runs_dir={runs_dir}",
            f"train.name={name}", "profile.enabled=true", f"profile.steps=[{PROFILED[0]},{PROFILED[1]}]",
            "train.log_interval=1", "train.sample_tokens=0", "train.eval_interval=0", "checkpoint.enabled=false",
            "logging.console=quiet"]
    proc = subprocess.run(argv, cwd=_common.REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv[1:])} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return runs_dir / name


def measure(run_dir: Path) -> dict:
    """Per rank: totals() of its profiled steps; all ranks: the same over every rank's steps."""
    traces = sorted((run_dir / "profile").glob("rank_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    ranks = {int(p.stem.split("_")[1]): step_overlaps(read_trace(p), int(p.stem.split("_")[1])) for p in traces}
    if not ranks or not all(ranks.values()):
        raise SystemExit(f"no collective found in the traces of {run_dir}/profile")
    out = {"ranks": {r: {**totals(ov), "source": ov[0].source} for r, ov in ranks.items()}}
    return {**totals([o for ov in ranks.values() for o in ov]), **out, "run_dir": str(run_dir)}


def pct(fraction: float | None) -> str:
    return "    -" if fraction is None else f"{100 * fraction:4.0f}%"


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--runs-dir", help="keep the profiled runs here (default: a temporary directory)")
    p.add_argument("--gpu", type=int, metavar="N", help="profile on N local GPUs (cluster=local_gpu)")
    args = p.parse_args()
    cluster = (["cluster=local_gpu", f"cluster.procs_per_node={args.gpu}"] if args.gpu
               else ["cluster=local_cpu", "cluster.procs_per_node=2"])
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(args.runs_dir or tmp).expanduser().resolve()
        layouts = {name: {"overrides": ov, **measure(profile_run(name, ov, cluster, runs))}
                   for name, ov in LAYOUTS.items()}
    if not args.runs_dir:
        for result in layouts.values():
            result.pop("run_dir")
    out = {"cluster": cluster, "profiled_steps": list(range(PROFILED[0], PROFILED[1] + 1)), "layouts": layouts,
           **_common.machine()}
    where = f"{args.gpu} GPUs (NCCL)" if args.gpu else "2 CPU ranks (gloo)"
    lines = [f"communication overlapped by compute, tiny model, {where}, profiled steps {PROFILED[0]}-{PROFILED[1]}",
             f"  {'layout':<17} {'rank':>4} {'comm ms/step':>13} {'overlapped ms/step':>19} {'overlap':>8}"]
    for name, res in layouts.items():
        for rank, t in res["ranks"].items():
            lines.append(f"  {name:<17} {rank:>4} {t['comm_ms_per_step']:13.1f} {t['overlapped_ms_per_step']:19.1f} "
                         f"{pct(t['fraction']):>8}")
        lines.append(f"  {name:<17} {'all':>4} {res['comm_ms_per_step']:13.1f} {res['overlapped_ms_per_step']:19.1f} "
                     f"{pct(res['fraction']):>8}")
    source = next(iter(next(iter(layouts.values()))["ranks"].values()))["source"]
    lines.append(f"(communication from {source}; on gloo it includes waiting for the other rank: "
                 "see usp/report/overlap.py)")
    _common.emit(out, args, lines)


if __name__ == "__main__":
    main()
