#!/usr/bin/env python
"""Framework overhead: usp's trainer against a minimal hand-written PyTorch loop.

Both train the same Llama (usp/models/llama.py, the tiny config), same seed, batch, AdamW and
gradient clipping, in alternating rounds (usp first in even rounds, the hand-written loop first in
odd ones) so that drift and neighbours' load hit both alike. Each loop of each round runs in a
process of its own, as each would run for a user: usp's under the environment usp's launcher gives
a rank (its allocator settings, usp/run/allocator.py: a mallopt in one process would stay for the
other loop), the hand-written one under the bench's own environment (glibc's defaults), launched
by torchrun for DDP as a user would. Each round times every step after a warm-up (whole iterations,
usp's loop overhead included). The figure: per round, usp's tokens/s over the whole timed window
divided by the hand-written loop's, median over rounds (target >= 0.97). Beside it, the same ratio
from each round's fastest step (the step least disturbed by neighbours on a shared machine), and the
ratio of CPU seconds per timed step (the process's user + system time, all its threads, from
time.process_time: the hand-written loop's over usp's, median over rounds), which neighbours
disturb far less than the wall clock on a shared machine. usp
runs as `usp train` would in a batch log: its defaults (memory probe, deterministic algorithms on
CPU, a metrics line, a rank-log line and a plain console line per step).

    python scripts/bench/overhead.py            # single process, then DDP on 2 ranks (gloo)
    python scripts/bench/overhead.py --quick    # CI smoke: single process, a few seconds
    python scripts/bench/overhead.py --json
    python scripts/bench/overhead.py --usp-allocator glibc   # usp's loop under glibc's defaults too: the
                                                             # cost of usp's mmap thresholds (usp/run/allocator.py)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from usp.contract.run_plan import RunPlan  # noqa: E402

TARGET = 0.97


def _settings(quick: bool) -> dict:
    return {"rounds": 2, "warmup": 2, "steps": 4} if quick else {"rounds": 5, "warmup": 4, "steps": 15}


RESULT = "OVERHEAD_RESULT "  # the child's line on rank 0: per-step tokens/s as JSON


def overrides(world: int, warmup: int, steps: int) -> list[str]:
    # +1: the last step also evaluates; eval_batches=1 keeps that short (outside the window)
    out = [f"train.steps={warmup + steps + 1}", "train.log_interval=1", "train.eval_batches=1",
           "logging.console=plain"]  # what `usp train` prints under Slurm (stdout is not a TTY)
    return out + ([f"parallelism.dp_replicate={world}"] if world > 1 else [])


def measure(world: int, rounds: int, warmup: int, steps: int, usp_allocator: str = "usp") -> dict:
    """Both loops, `rounds` times each, every run a fresh process (or torchrun's ranks); tokens/s
    of each timed step, rank 0's clock."""
    from usp.launch.local import plan_accelerator_env

    with tempfile.TemporaryDirectory() as runs:
        plan = _common.plan_for(overrides(world, warmup, steps), world, runs)
        plan_path = Path(runs) / "plan.json"
        plan_path.write_text(json.dumps(plan.to_dict()))
        usp_env = plan_accelerator_env(plan, os.environ) if usp_allocator == "usp" else {}
        envs = {"usp": {**os.environ, **usp_env}, "hand": dict(os.environ)}
        out: dict[str, list] = {"usp": [], "hand": []}
        for r in range(rounds):
            for loop in (("usp", "hand") if r % 2 == 0 else ("hand", "usp")):
                out[loop].append(_child(loop, world, plan_path, warmup, steps, envs[loop]))
    tokens = int(plan.batch.global_batch) * int(plan.batch.seq_len)
    return {"usp_tokens_per_s": [o["tokens_per_s"] for o in out["usp"]],
            "hand_tokens_per_s": [o["tokens_per_s"] for o in out["hand"]],
            "usp_cpu_s": [o["cpu_s"] for o in out["usp"]], "hand_cpu_s": [o["cpu_s"] for o in out["hand"]],
            "tokens_per_step": tokens,
            "allocator_env": {k: v for k, v in envs["usp"].items() if "MMAP" in k}, **_common.machine()}


def _child(loop: str, world: int, plan_path: Path, warmup: int, steps: int, env: dict) -> dict:
    args = [str(Path(__file__).resolve()), "--child", loop, "--plan", str(plan_path), "--warmup", str(warmup),
            "--steps", str(steps)]
    cmd = [sys.executable, *args] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *args]
    proc = subprocess.run(cmd, env={**env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{loop} (world {world}) exited {proc.returncode}:\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT):])


def child(loop: str, plan_path: str, warmup: int, steps: int) -> None:
    """One loop's run in this process (every rank under torchrun); rank 0 prints its step rates."""
    import torch.distributed as dist

    from usp.contract.plan_file import plan_from_dict
    from usp.engine.parallel import mesh as udist

    plan = plan_from_dict(json.loads(Path(plan_path).read_text()))
    if loop == "usp":
        udist.init_process_group(plan)  # as the worker: threads per rank, the process group
        rates, cpu = _usp_round(plan, warmup, steps)
    else:
        if int(plan.world_size) > 1:
            dist.init_process_group("gloo")  # a user's own DDP script, under torchrun
        rates, cpu = _hand_round(plan, warmup, steps)
    if int(plan.world_size) == 1 or dist.get_rank() == 0:
        print(RESULT + json.dumps({"tokens_per_s": rates, "cpu_s": cpu}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _usp_round(plan: RunPlan, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """What usp.engine.worker.run_worker does, minus the process-group teardown (kept for the
    next round). Tokens/s and CPU seconds of each step after the warm-up."""
    import contextlib

    import torch

    from usp.engine.accel import apply_determinism
    from usp.engine.parallel.mesh import make_context
    from usp.engine.trainer import Trainer

    torch.manual_seed(int(plan.config.train.seed))
    apply_determinism(plan)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # the console lines: written, not shown
        trainer = Trainer(plan, make_context(plan))
        ticks = _cpu_ticks(trainer.watch)
        trainer.fit()
    history, tokens = trainer.history, trainer.global_tokens
    del trainer  # free DDP while the process group is alive
    cpu = [b - a for a, b in zip(ticks, ticks[1:])][warmup:warmup + steps]
    return [tokens / t for t in _common.step_times(history, warmup, steps)], cpu


def _cpu_ticks(watch) -> list[float]:
    """The process's CPU time at the start of every iteration of the trainer's loop (it calls
    watch.step(step) first thing): consecutive differences are whole iterations."""
    ticks: list[float] = []
    step = watch.step

    def tick(*args, **kwargs):
        ticks.append(time.process_time())
        return step(*args, **kwargs)

    watch.step = tick
    return ticks


def _hand_round(plan: RunPlan, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """The loop one would write by hand: nanoGPT-style random windows, no framework."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from usp.models.llama import Llama, LlamaArgs

    cfg, batch = plan.config, plan.batch
    world = int(plan.world_size)
    rank = dist.get_rank() if world > 1 else 0
    device = torch.device("cuda", torch.cuda.current_device()) if plan.device == "cuda" else torch.device("cpu")
    torch.use_deterministic_algorithms(False)  # PyTorch's default
    torch.manual_seed(int(cfg.train.seed))
    seq, micro = int(batch.seq_len), int(batch.global_batch) // world
    args = LlamaArgs.from_config(cfg.model, int(plan.model.vocab_size))
    model = Llama(args, max_seq_len=seq)
    model.init_weights(seed=int(cfg.train.seed))
    model = model.to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt_cfg = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2),
                            eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay, fused=device.type == "cuda")
    data = np.memmap(Path(plan.dataset_dir) / plan.data_meta["train_bin"], dtype=np.uint16, mode="r")
    rng = np.random.default_rng(int(cfg.train.seed) + rank)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    times, cpu, last, last_cpu = [], [], time.perf_counter(), time.process_time()
    for step in range(warmup + steps):
        ix = rng.integers(0, len(data) - seq - 1, micro)
        rows = torch.from_numpy(np.stack([data[i:i + seq + 1] for i in ix]).astype(np.int64)).to(device)
        with amp:
            logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(opt_cfg.grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            loss.item()  # what a loop that logs every 10 steps synchronises on
        if device.type == "cuda":
            torch.cuda.synchronize()  # per-step times need it (usp syncs every step through .item())
        now, now_cpu = time.perf_counter(), time.process_time()
        times.append(now - last)
        cpu.append(now_cpu - last_cpu)
        last, last_cpu = now, now_cpu
    del model
    return [int(batch.global_batch) * seq / t for t in times[warmup:]], cpu[warmup:]


def summarise(raw: dict) -> dict:
    """Per round, each loop's tokens/s over the whole timed window (total tokens / total time),
    and the median over rounds of usp's over the hand-written loop's: the headline. Beside it the
    ratio of each round's fastest steps (the steps least disturbed by other processes)."""
    window_u, window_h = [_window(r) for r in raw["usp_tokens_per_s"]], [_window(r) for r in raw["hand_tokens_per_s"]]
    best_u, best_h = [max(r) for r in raw["usp_tokens_per_s"]], [max(r) for r in raw["hand_tokens_per_s"]]
    per_round = [u / h for u, h in zip(window_u, window_h)]
    cpu_u, cpu_h = [sum(r) / len(r) for r in raw["usp_cpu_s"]], [sum(r) / len(r) for r in raw["hand_cpu_s"]]
    cpu_per_round = [h / u for u, h in zip(cpu_u, cpu_h)]  # as the speed ratio: above 1, usp is cheaper
    return {**raw, "usp_tokens_per_s_window": _common.median(window_u),
            "hand_tokens_per_s_window": _common.median(window_h),
            "ratio": _common.median(per_round), "ratio_per_round": per_round,
            "usp_cpu_s_per_step": _common.median(cpu_u), "hand_cpu_s_per_step": _common.median(cpu_h),
            "cpu_ratio": _common.median(cpu_per_round), "cpu_ratio_per_round": cpu_per_round,
            "ratio_of_fastest_steps": _common.median([u / h for u, h in zip(best_u, best_h)]), "target": TARGET}


def _window(rates: list[float]) -> float:
    """Tokens/s over consecutive steps of equal tokens: the harmonic mean of the per-step rates."""
    return len(rates) / sum(1 / r for r in rates)


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="CI smoke: single process, 2 short rounds")
    p.add_argument("--single-only", action="store_true", help="skip the 2-rank DDP measurement")
    p.add_argument("--usp-allocator", choices=("usp", "glibc"), default="usp",
                   help="usp's loop under the mmap thresholds usp's launcher sets (default) or glibc's defaults")
    p.add_argument("--child", choices=("usp", "hand"), help=argparse_hidden())  # one loop's process
    p.add_argument("--plan", help=argparse_hidden())
    p.add_argument("--warmup", type=int, help=argparse_hidden())
    p.add_argument("--steps", type=int, help=argparse_hidden())
    args = p.parse_args()
    if args.child:
        child(args.child, args.plan, args.warmup, args.steps)
        return
    s = _settings(args.quick)
    results = {"single": summarise(measure(1, **s, usp_allocator=args.usp_allocator))}
    if not (args.quick or args.single_only):
        results["ddp_2_ranks_gloo"] = summarise(measure(2, **s, usp_allocator=args.usp_allocator))
    results["settings"] = s
    lines = [f"usp trainer vs hand-written loop (tiny Llama, {results['single']['tokens_per_step']} tokens/step, "
             f"{s['rounds']} interleaved rounds of {s['steps']} steps after {s['warmup']} warm-up, "
             f"each loop in its own process)"]
    for name, r in results.items():
        if name == "settings":
            continue
        lines.append(f"  {name:<18} usp {r['usp_tokens_per_s_window']:>8,.0f} tok/s  hand-written "
                     f"{r['hand_tokens_per_s_window']:>8,.0f} tok/s  ratio {r['ratio']:.3f} (target >= {TARGET}; "
                     f"rounds {', '.join(f'{x:.3f}' for x in r['ratio_per_round'])}; "
                     f"ratio of fastest steps {r['ratio_of_fastest_steps']:.3f})")
        lines.append(f"  {'':<18} CPU s/step usp {r['usp_cpu_s_per_step']:.3f}  hand-written "
                     f"{r['hand_cpu_s_per_step']:.3f}  hand / usp {r['cpu_ratio']:.3f} "
                     f"(rounds {', '.join(f'{x:.3f}' for x in r['cpu_ratio_per_round'])})")
    _common.emit(results, args, lines)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
