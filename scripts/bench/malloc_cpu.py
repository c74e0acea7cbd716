#!/usr/bin/env python
"""What glibc's mmap threshold costs a CPU rank: CPU seconds per rank and step, and the net peak.

Trains a 130 M-parameter Llama (model=tiny, dim 1024, 8 layers, 16/8 heads, ffn 4096; SGD, seq_len
64, global batch 4, micro batch 1) over 4 FSDP ranks for 10 steps, once per threshold given (each
value is set as MALLOC_MMAP_THRESHOLD_ for every rank, which the launcher then leaves alone; 0 runs
usp's own settings, usp/run/allocator.py), in the order given, so alternating values share the
machine's load. Each rank process's CPU time (utime + stime, /proc/<pid>/stat) is read when
metrics.jsonl first shows step 2 and step 10; the difference over 8 steps is the cost per step.
VmHWM is sampled as build_memory.py does, minus the same run with model=tiny (0.95 M parameters).
--world, --layout, --model and --batch measure another run (e.g. a small model under DDP).

    python scripts/bench/malloc_cpu.py --thresholds 1048576 4194304 1048576 4194304
    python scripts/bench/malloc_cpu.py --thresholds 0 1048576 0 1048576   # usp's default vs a fixed 1 MiB
    python scripts/bench/malloc_cpu.py --world 2 --layout parallelism=ddp --model model.dim=256 \
        model.n_layers=4 model.n_heads=4 model.ffn_dim=768 --batch train.seq_len=256 train.micro_batch=8 \
        train.global_batch=16 --thresholds 0 1048576 0 1048576
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import build_memory as bm  # noqa: E402

WORLD = 4
BIG = ["model.dim=1024", "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=8", "model.ffn_dim=4096"]
RUN = ["optimizer=sgd", "train.seq_len=64", "train.global_batch=4", "train.micro_batch=1", "train.steps=10",
       "train.log_interval=1", "logging.console=plain"]
FIRST, LAST = 2, 10


def _cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _last_step(metrics: Path) -> int:
    from usp.run.files import read_jsonl  # skips a line being written

    return max((int(r.get("step") or 0) for r in read_jsonl(metrics)), default=0)


def run(usp: str, threshold: int, runs: Path, name: str, model: list[str], layout: list[str]) -> dict:
    """{rank: {"cpu": {step: seconds}, "hwm": bytes, ...}} of one `usp train`."""
    from usp.run.files import metrics_path

    def cpu_at_steps(rank: int, pid: int, info: dict) -> None:
        step, cpu = _last_step(metrics_path(runs / name)), _cpu_s(pid)
        if cpu is not None and step in (FIRST, LAST):
            info.setdefault("cpu", {}).setdefault(step, cpu)

    env = dict(os.environ, COLUMNS="200")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if threshold:  # 0: usp's own settings (usp/run/allocator.py: 1 MiB while building, 32 MiB while training)
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    cmd = [usp, "train", "model=tiny", *model, *RUN, *layout, f"train.runs_dir={runs}", f"train.name={name}"]
    with open(runs / f"{name}.out", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        ranks, stopped = bm._sample(proc, float("inf"), 0.0, each=cpu_at_steps, interval=0.05)
    if stopped or proc.returncode != 0:
        raise SystemExit(f"{name}: usp train exited {proc.returncode}; its output: {log.name}")
    return ranks


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--thresholds", nargs="+", type=int, default=[1 << 20, 4 << 20, 1 << 20, 4 << 20])
    p.add_argument("--usp", default=str(Path(sys.executable).parent / "usp"))
    p.add_argument("--world", type=int, default=WORLD, help="ranks (one machine)")
    p.add_argument("--layout", nargs="*", default=["parallelism.dp_shard=4"], help="the layout's overrides")
    p.add_argument("--model", nargs="*", default=BIG, help="the measured model's overrides (on model=tiny)")
    p.add_argument("--batch", nargs="*", default=[], help="overrides of the run's batch (seq_len, micro batch)")
    opts = p.parse_args()
    layout = [f"cluster.procs_per_node={opts.world}", *opts.layout, *opts.batch]
    rows, lines = [], []
    with tempfile.TemporaryDirectory(prefix="usp-malloc-cpu-") as tmp:
        runs = Path(tmp)
        plan = _common.plan_for(["model=tiny", *opts.model, *RUN, *opts.layout, *opts.batch], opts.world,
                                str(runs / "plans"))
        planned = plan.memory.stages[0].total
        for i, threshold in enumerate(opts.thresholds):
            base = run(opts.usp, threshold, runs, f"base{i}", [], layout)
            big = run(opts.usp, threshold, runs, f"run{i}", opts.model, layout)
            per_step = [(r["cpu"][LAST] - r["cpu"][FIRST]) / (LAST - FIRST) for r in big.values()
                        if FIRST in r.get("cpu", {}) and LAST in r.get("cpu", {})]
            net = [(big[k]["hwm"] - base[k]["hwm"]) / bm.GIB for k in sorted(big)]
            row = {"threshold": threshold, "cpu_s_per_rank_step": per_step, "net_peak_gib": net,
                   "planned_gib": planned / bm.GIB}
            rows.append(row)
            label = threshold or "usp's (1 MiB building, the plan's training threshold)"
            lines.append(f"threshold {label}: CPU s per rank and step {min(per_step):.2f}-{max(per_step):.2f}, "
                         f"net peak {min(net):.2f}-{max(net):.2f} GiB (planned {planned / bm.GIB:.2f}, "
                         f"net / planned {min(net) * bm.GIB / planned:.2f}-{max(net) * bm.GIB / planned:.2f})")
    _common.emit({"machine": _common.machine(), "results": rows}, opts, lines)


if __name__ == "__main__":
    main()
