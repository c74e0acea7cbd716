#!/usr/bin/env python
"""Per-rank memory of a real `usp train`, measured outside the engine, next to the planner's figure.

Each layout trains issue 27's 0.5 B Llama (model=tiny, dim 1024, 32 layers, 16/8 heads, ffn 4096;
SGD, seq_len 64, global batch 8, micro batch 1, 2 steps) on 8 processes. While `usp train` runs,
every rank process's VmHWM (peak resident set, monotone) is read from /proc/<pid>/status every
0.1 s; a rank's last reading is its peak. The same layout with `model=tiny` (0.95 M parameters)
gives each rank's process baseline (Python, torch, gloo, data), subtracted rank by rank. The net
peak is printed next to the planner's per-rank peak for that rank's stage (`usp plan`) and their
ratio (target <= 1.15), with the time each rank took from its process start to a ready trainer
and, when the engine logs it (logs/rank_<R>.log "build:"), the time to build its model.

    python scripts/bench/build_memory.py                        # fsdp8, tp2_fsdp4, pp2_tp2_fsdp2
    python scripts/bench/build_memory.py --layouts fsdp8 --json
    python scripts/bench/build_memory.py --usp /work/main/.venv/bin/usp --need-gib 22   # another checkout's engine
    python scripts/bench/build_memory.py --malloc-mmap-threshold 131072   # glibc returning freed tensors
    python scripts/bench/build_memory.py --gross    # the plan's promise as printed: gross peak / planned

--gross: the plan promises its printed per-rank peak whole, Python, torch and gloo included (the fixed
allowance, usp/perf/memory.py FIXED_OVERHEAD_GIB): each rank's VmHWM itself, no baseline run, against
the printed figure (target <= 1.05), on the layouts of issue 42's probe (GROSS): a 130 M Llama (dim 1024,
8 layers, AdamW, seq_len 256, global batch 8, 2 steps) over 1 to 8 processes, and a MoE. Each rank's
resident set is also split at its largest reading: private (RssAnon) and file-backed (RssFile, torch's
libraries). Before each run the libraries are put in the page cache as a fresh install leaves them, the
larger of the two ways a rank maps them (libraries_as_installed; --page-cache-as-is leaves them).

It refuses to start a run when the machine's available memory (MemAvailable) is below --need-gib
(default: 1.15 x the planned per-rank peak x 8 ranks, what the target allows), and stops a run
(killing its processes) when MemAvailable falls below --min-available-gib (default 1.5): the
peaks read so far are then printed as lower bounds: other people's jobs share this machine. A
layout whose plan doesn't fit the machine at all (8 x planned > MemTotal), like llama3_2_1b with
AdamW here, is reported as skipped.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from usp.launch.stop_signals import descendants  # noqa: E402

GIB = 2 ** 30
TARGET = 1.15  # net peak / planned peak, at most
GROSS_TARGET = 1.05  # --gross: peak / planned peak, at most
WORLD = 8
RUN = ["train.seq_len=64", "train.global_batch=8", "train.micro_batch=1",
       "train.steps=2", "logging.console=plain"]
HALF_B = ["model=tiny", "model.dim=1024", "model.n_layers=32", "model.n_heads=16", "model.n_kv_heads=8",
          "model.ffn_dim=4096", "optimizer=sgd"]
LAYOUTS = {  # name -> (model overrides, layout overrides)
    "fsdp8": (HALF_B, ["parallelism.dp_shard=8"]),
    "tp2_fsdp4": (HALF_B, ["parallelism.tp=2", "parallelism.dp_shard=4"]),
    "pp2_tp2_fsdp2": (HALF_B, ["parallelism.pp=2", "parallelism.tp=2", "parallelism.dp_shard=2"]),
    "llama3_2_1b_adamw": (["model=llama3_2_1b", "optimizer=adamw"], ["parallelism.dp_shard=8"]),
}
DEFAULT = ("fsdp8", "tp2_fsdp4", "pp2_tp2_fsdp2", "llama3_2_1b_adamw")
M130 = ["model=tiny", "model.dim=1024", "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=8",
        "model.ffn_dim=4096", "optimizer=adamw", "train.seq_len=256", "train.global_batch=8", "train.micro_batch=1",
        "train.steps=2", "logging.console=plain"]
MOE = ["model=moe_tiny", "model.dim=512", "model.n_layers=4", "model.n_heads=8", "model.ffn_dim=1024",
       "model.n_experts=8", *M130[6:]]
GROSS = {  # name -> (world, overrides): --gross
    "pp2_cp2_fsdp2": (8, M130 + ["parallelism.pp=2", "parallelism.cp=2", "parallelism.dp_shard=2"]),
    "pp2_tp2_fsdp2": (8, M130 + ["parallelism.pp=2", "parallelism.tp=2", "parallelism.dp_shard=2"]),
    "fsdp4": (4, M130 + ["parallelism.dp_shard=4"]),
    "tp2_fsdp2": (4, M130 + ["parallelism.tp=2", "parallelism.dp_shard=2"]),
    "moe_ep4": (4, MOE + ["parallelism.dp_shard=4", "parallelism.ep=4"]),
    # no parameter gathered (pp aside): the training threshold at glibc's ceiling (usp.contract.decide.cpu_memory_first)
    "single": (1, M130),
    "ddp2": (2, M130 + ["parallelism.dp_replicate=2"]),
    "zero1_2": (2, M130 + ["parallelism.dp_replicate=2", "parallelism.zero1=true"]),
    "tp2": (2, M130 + ["parallelism.tp=2"]),
    "pp2": (2, M130 + ["parallelism.pp=2"]),
}
BASELINE = ["model=tiny"]
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank(\d+) (placement|build): ?(?:(\S+) s)?")


def meminfo_gib(field: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2 ** 20
    raise RuntimeError(f"no {field} in /proc/meminfo")


def _rank_of(pid: int) -> int | None:
    """The RANK of a usp worker process (torchrun sets it in the worker's environment)."""
    try:
        if b"usp.engine.worker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None


def _status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _status_kib_all(pid: int) -> dict[str, int]:
    """Every kB field of /proc/<pid>/status ({} once the process is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in lines) if v.strip().endswith("kB")}


def _start_time(pid: int) -> float | None:
    """The process's start, seconds since the epoch (/proc/<pid>/stat starttime + boot time)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except OSError:
        return None
    boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def libraries_as_installed(usp: str) -> None:
    """Put the measured environment's shared libraries (torch's, above all) in the page cache as a fresh
    install leaves them: written (or read) whole, in large folios, a fault on one of which maps all of it.
    Loaded by faults instead (a long-used environment) they map a fraction: measured, a rank's file-backed
    resident set at its peak was 0.10 GiB one way and 0.20 GiB the other (docs/benchmarks.md, "The plan's
    figure, gross"). The plan promises the larger; dropping the cached pages then reading each file once
    gives it. Pages another process maps stay as they are."""
    site = Path(subprocess.run([str(Path(usp).with_name("python")), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for lib in sorted(site.rglob("*.so*")):
        if not lib.is_file():
            continue
        fd = os.open(lib, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while os.read(fd, 1 << 20):
                pass
        finally:
            os.close(fd)


def train_and_sample(usp: str, overrides: list[str], runs_dir: Path, name: str, opts, world: int = WORLD) -> dict:
    """Run `usp train`; return {rank: {"hwm": bytes, "start": epoch s, ...}}, with "stopped" (why)
    when it had to be stopped: past opts.timeout, or the machine's MemAvailable below
    opts.min_available_gib (the peaks read so far are then lower bounds)."""
    cmd = [usp, "train", f"cluster.procs_per_node={world}", *overrides, f"train.runs_dir={runs_dir}",
           f"train.name={name}"]
    env = dict(os.environ, COLUMNS="200")
    if opts.malloc_mmap_threshold:  # glibc reads it as each process starts: every rank gets it
        env["MALLOC_MMAP_THRESHOLD_"] = str(opts.malloc_mmap_threshold)
    with open(runs_dir / f"{name}.out", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        ranks, stopped = _sample(proc, time.monotonic() + opts.timeout, opts.min_available_gib,
                                 in_process=world == 1)
    if stopped:
        return {"stopped": stopped, "ranks": ranks}
    if proc.returncode != 0:
        raise SystemExit(f"{name}: usp train exited {proc.returncode}; its output: {log.name}")
    if sorted(ranks) != list(range(world)) or any("hwm" not in r for r in ranks.values()):
        raise SystemExit(f"{name}: sampled ranks {sorted(ranks)}, expected {world}")
    _read_log_times(runs_dir / name, ranks)
    return {"ranks": ranks}


def _sample(proc: subprocess.Popen, deadline: float, min_available_gib: float,
            each=None, interval: float = 0.1, in_process: bool = False) -> tuple[dict, str | None]:
    """Every `interval` s until the run ends: each rank process's VmHWM (monotone: the last reading is
    its peak so far), and each(rank, pid, info) when given. Stops the run (its processes, killed) past
    the deadline or when memory runs low. in_process: one rank, run by `usp train`'s own process."""
    ranks: dict[int, dict] = {}
    pid_rank: dict[int, int] = {}
    while proc.poll() is None:
        pids = [proc.pid] if in_process else descendants(proc.pid)  # parents first: reversed, workers first
        for pid in pids:
            if pid not in pid_rank:  # asked again until it is a worker: a fork shows torchrun's until exec
                rank = 0 if in_process and pid == proc.pid else _rank_of(pid)
                start = _start_time(pid) if rank is not None else None
                if rank is None or start is None:
                    continue
                pid_rank[pid] = rank
                ranks.setdefault(rank, {})["start"] = start
            status = _status_kib_all(pid)
            info = ranks[pid_rank[pid]]
            if "VmHWM" in status:
                info["hwm"] = status["VmHWM"] * 1024
            if status.get("VmRSS", 0) * 1024 > info.get("rss", 0):  # the split of the largest resident set seen
                info.update(rss=status["VmRSS"] * 1024, anon=status.get("RssAnon", 0) * 1024,
                            file=status.get("RssFile", 0) * 1024)
            if each is not None:
                each(pid_rank[pid], pid, ranks[pid_rank[pid]])
        why = "timeout" if time.monotonic() > deadline else \
            "machine memory low" if meminfo_gib("MemAvailable") < min_available_gib else None
        if why:
            for pid in [*reversed(pids), proc.pid]:  # the workers first, then torchrun and usp
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            return ranks, why
        time.sleep(interval)
    return ranks, None


def _read_log_times(run_dir: Path, ranks: dict[int, dict]) -> None:
    """ready_s: process start -> the worker's 'placement' line (logged once the trainer is built);
    build_s: the engine's own 'build:' line, when it logs one."""
    for rank, info in ranks.items():
        for line in (run_dir / "logs" / f"rank_{rank}.log").read_text().splitlines():
            m = _LOG_TIME.match(line)
            if not m:
                continue
            if m.group(3) == "build":
                info["build_s"] = float(m.group(4))
            elif "ready_s" not in info:
                at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                info["ready_s"] = at - info["start"]


def planned_per_rank(overrides: list[str], runs_dir: str, world: int = WORLD) -> dict[int, float]:
    """The planner's peak (GiB) of each rank's pipeline stage, as `usp plan` prints it."""
    plan = _common.plan_for(overrides, world, runs_dir)
    stages = {s.stage: s.total / GIB for s in plan.memory.stages}
    return {r.rank: stages[r.coords["pp"]] for r in plan.ranks}


def measure(name: str, opts) -> dict:
    model, layout = LAYOUTS[name]
    with tempfile.TemporaryDirectory(prefix="usp-build-mem-") as tmp:
        planned = planned_per_rank(model + layout + RUN, tmp)
        peak_plan = max(planned.values())
        skip = _skip(peak_plan, opts.need_gib)
        if skip:
            return {"layout": name, "skipped": skip}
        runs = Path(tmp)
        same_optimizer = [o for o in model if o.startswith("optimizer=")]
        base = train_and_sample(opts.usp, BASELINE + same_optimizer + layout + RUN, runs, f"{name}-baseline", opts)
        big = train_and_sample(opts.usp, model + layout + RUN, runs, name, opts)
    if "stopped" in base:
        return {"layout": name, "skipped": f"the baseline run was stopped ({base['stopped']})"}
    rows = rank_rows(big, base, planned)
    return {"layout": name, "overrides": model + layout + RUN, "ranks": rows, "stopped": big.get("stopped"),
            "malloc_mmap_threshold": opts.malloc_mmap_threshold,
            "max_ratio": max(r["ratio"] for r in rows), "max_net_gib": max(r["net_gib"] for r in rows),
            "planned_peak_gib": peak_plan,
            "max_build_s": max((r["build_s"] for r in rows if r["build_s"] is not None), default=None),
            "max_ready_s": max((r["ready_s"] for r in rows if r["ready_s"] is not None), default=None)}


def measure_gross(name: str, opts) -> dict:
    """--gross: each rank's whole peak (VmHWM, no baseline subtracted) against the plan's printed figure."""
    world, overrides = GROSS[name]
    with tempfile.TemporaryDirectory(prefix="usp-gross-mem-") as tmp:
        planned = planned_per_rank(overrides, tmp, world)
        skip = _skip(max(planned.values()), opts.need_gib, world)
        if skip:
            return {"layout": name, "skipped": skip}
        if not opts.page_cache_as_is:
            libraries_as_installed(opts.usp)
        run = train_and_sample(opts.usp, overrides, Path(tmp), name, opts, world)
    rows = [{"rank": rank, "peak_gib": info["hwm"] / GIB, "planned_gib": planned[rank],
             "ratio": info["hwm"] / GIB / planned[rank], "anon_gib": info.get("anon", 0) / GIB,
             "file_gib": info.get("file", 0) / GIB} for rank, info in sorted(run["ranks"].items())]
    return {"layout": name, "overrides": overrides, "ranks": rows, "stopped": run.get("stopped"),
            "max_ratio": max(r["ratio"] for r in rows), "min_ratio": min(r["ratio"] for r in rows)}


def gross_lines(result: dict) -> list[str]:
    if "skipped" in result:
        return [f"{result['layout']}: skipped: {result['skipped']}", ""]
    out = [f"{result['layout']}: {' '.join(result['overrides'])}",
           "| rank | peak VmHWM (GiB) | anon / file at the peak | planned (GiB) | peak / planned |",
           "|---:|---:|---:|---:|---:|"]
    out += [f"| {r['rank']} | {r['peak_gib']:.3f} | {r['anon_gib']:.3f} / {r['file_gib']:.3f} | "
            f"{r['planned_gib']:.3f} | {r['ratio']:.3f} |" for r in result["ranks"]]
    if result["stopped"]:
        out.append(f"STOPPED ({result['stopped']}): the peaks above are lower bounds")
    out.append(f"peak / planned {result['min_ratio']:.3f}-{result['max_ratio']:.3f} (target <= {GROSS_TARGET})")
    return [*out, ""]


def rank_rows(big: dict, base: dict, planned: dict[int, float]) -> list[dict]:
    """Each rank's peak, its baseline run's, the net of the two and the plan's figure (GiB)."""
    rows = []
    for rank in sorted(big["ranks"]):
        got, ref = big["ranks"][rank], base["ranks"][rank]
        net = (got["hwm"] - ref["hwm"]) / GIB
        rows.append({"rank": rank, "peak_gib": got["hwm"] / GIB, "baseline_gib": ref["hwm"] / GIB,
                     "net_gib": net, "planned_gib": planned[rank], "ratio": net / planned[rank],
                     "ready_s": got.get("ready_s"), "build_s": got.get("build_s")})
    return rows


def _skip(peak_plan: float, need_gib: float | None, world: int = WORLD) -> str | None:
    """Why not to start this layout here, or None."""
    total = meminfo_gib("MemTotal")
    if world * peak_plan > total:
        return f"its plan ({world} x {peak_plan:.2f} GiB) doesn't fit this machine ({total:.1f} GiB)"
    need = need_gib if need_gib is not None else TARGET * world * peak_plan
    if meminfo_gib("MemAvailable") < need:
        return f"{meminfo_gib('MemAvailable'):.1f} GiB available, the run needs {need:.1f} (--need-gib)"
    return None


def lines_for(result: dict) -> list[str]:
    if "skipped" in result:
        return [f"{result['layout']}: skipped: {result['skipped']}", ""]
    mmap = result["malloc_mmap_threshold"]
    allocator = f" (MALLOC_MMAP_THRESHOLD_={mmap})" if mmap else ""
    out = [f"{result['layout']}: {' '.join(result['overrides'])}{allocator}",
           "| rank | peak VmHWM (GiB) | baseline (GiB) | net (GiB) | planned (GiB) | net / planned "
           "| start -> trainer ready (s) | build (s) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["ranks"]:
        ready = f"{r['ready_s']:.1f}" if r["ready_s"] is not None else "-"
        build = f"{r['build_s']:.1f}" if r["build_s"] is not None else "-"
        out.append(f"| {r['rank']} | {r['peak_gib']:.2f} | {r['baseline_gib']:.2f} | {r['net_gib']:.2f} "
                   f"| {r['planned_gib']:.2f} | {r['ratio']:.2f} | {ready} | {build} |")
    if result["stopped"]:
        out.append(f"STOPPED ({result['stopped']}): the peaks above are lower bounds")
    out.append(f"max net / planned: {result['max_ratio']:.2f} (target <= {TARGET})")
    return [*out, ""]


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--layouts", nargs="+", choices=sorted({*LAYOUTS, *GROSS}), default=None,
                   help=f"default: {' '.join(DEFAULT)}; with --gross: {' '.join(GROSS)}")
    p.add_argument("--gross", action="store_true", help="each rank's whole peak against the plan's printed figure")
    p.add_argument("--usp", default=str(Path(sys.executable).parent / "usp"),
                   help="the usp executable to measure (default: this environment's)")
    p.add_argument("--need-gib", type=float, default=None, help="MemAvailable required before each layout")
    p.add_argument("--min-available-gib", type=float, default=1.5,
                   help="stop a run when the machine's MemAvailable falls below this")
    p.add_argument("--malloc-mmap-threshold", type=int, default=0,
                   help="run the ranks with glibc's MALLOC_MMAP_THRESHOLD_=N (bytes): see docs/benchmarks.md")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per `usp train`")
    p.add_argument("--page-cache-as-is", action="store_true",
                   help="--gross: leave the libraries' cached pages as they are (default: as a fresh install "
                        "leaves them, the larger resident set)")
    opts = p.parse_args()
    names = opts.layouts or list(GROSS if opts.gross else DEFAULT)
    results = [(measure_gross if opts.gross else measure)(name, opts) for name in names]
    lines = [line for r in results for line in (gross_lines if opts.gross else lines_for)(r)]
    _common.emit({"machine": _common.machine(), "usp": opts.usp, "results": results}, opts, lines)


if __name__ == "__main__":
    main()
