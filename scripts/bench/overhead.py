#!/usr/bin/env python
"""Framework overhead: usp's trainer against a minimal hand-written PyTorch loop.

Both train the same Llama (usp/models/llama.py, the tiny config), same seed, batch, AdamW and
gradient clipping, in the same process, in alternating rounds (usp first in even rounds, the
hand-written loop first in odd ones) so that drift and neighbours' load hit both alike. Each
round times every step after a warm-up (whole iterations, usp's loop overhead included). The
figure: per round, usp's tokens/s over the whole timed window divided by the hand-written
loop's, median over rounds (target >= 0.97). Beside it, the same ratio from each round's fastest
step (the step least disturbed by neighbours on a shared machine). usp runs as `usp train` would
in a batch log: its defaults (memory probe, deterministic algorithms on CPU, a metrics line, a
rank-log line and a plain console line per step).

    python scripts/bench/overhead.py            # single process, then DDP on 2 ranks (gloo)
    python scripts/bench/overhead.py --quick    # CI smoke: single process, a few seconds
    python scripts/bench/overhead.py --json
"""
from __future__ import annotations

import os
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


def measure(world: int, rounds: int, warmup: int, steps: int) -> dict:
    """Runs on every rank; returns tokens/s of both loops per round (rank 0's clock)."""
    import torch

    from usp.engine.parallel import mesh as udist

    with tempfile.TemporaryDirectory() as runs:
        # +1: the last step also evaluates; eval_batches=1 keeps that short (outside the window)
        overrides = [f"train.steps={warmup + steps + 1}", "train.log_interval=1", "train.eval_batches=1",
                     "logging.console=plain"]  # what `usp train` prints under Slurm (stdout is not a TTY)
        if world > 1:
            overrides.append(f"parallelism.dp_replicate={world}")
        plan = _common.plan_for(overrides, world, runs)
        udist.init_process_group(plan)  # as the worker: threads per rank, the process group
        usp, hand = [], []
        for r in range(rounds):
            first, second = (_usp_round, _hand_round) if r % 2 == 0 else (_hand_round, _usp_round)
            for fn in (first, second):
                (usp if fn is _usp_round else hand).append(fn(plan, warmup, steps))
    tokens = int(plan.batch.global_batch) * int(plan.batch.seq_len)
    return {"usp_tokens_per_s": usp, "hand_tokens_per_s": hand, "tokens_per_step": tokens,
            "threads_per_rank": torch.get_num_threads(), **_common.machine()}


def _usp_round(plan: RunPlan, warmup: int, steps: int) -> list[float]:
    """What usp.engine.worker.run_worker does, minus the process-group teardown (kept for the
    next round). Tokens/s of each step after the warm-up."""
    import contextlib

    import torch

    from usp.engine.accel import apply_determinism
    from usp.engine.parallel.mesh import make_context
    from usp.engine.trainer import Trainer

    torch.manual_seed(int(plan.config.train.seed))
    apply_determinism(plan)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # the console lines: written, not shown
        trainer = Trainer(plan, make_context(plan))
        trainer.fit()
    history, tokens = trainer.history, trainer.global_tokens
    del trainer  # free DDP while the process group is alive
    return [tokens / t for t in _common.step_times(history, warmup, steps)]


def _hand_round(plan: RunPlan, warmup: int, steps: int) -> list[float]:
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
    times, last = [], time.perf_counter()
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
        now = time.perf_counter()
        times.append(now - last)
        last = now
    del model
    return [int(batch.global_batch) * seq / t for t in times[warmup:]]


def summarise(raw: dict) -> dict:
    """Per round, each loop's tokens/s over the whole timed window (total tokens / total time),
    and the median over rounds of usp's over the hand-written loop's: the headline. Beside it the
    ratio of each round's fastest steps (the steps least disturbed by other processes)."""
    window_u, window_h = [_window(r) for r in raw["usp_tokens_per_s"]], [_window(r) for r in raw["hand_tokens_per_s"]]
    best_u, best_h = [max(r) for r in raw["usp_tokens_per_s"]], [max(r) for r in raw["hand_tokens_per_s"]]
    per_round = [u / h for u, h in zip(window_u, window_h)]
    return {**raw, "usp_tokens_per_s_window": _common.median(window_u),
            "hand_tokens_per_s_window": _common.median(window_h),
            "ratio": _common.median(per_round), "ratio_per_round": per_round,
            "ratio_of_fastest_steps": _common.median([u / h for u, h in zip(best_u, best_h)]), "target": TARGET}


def _window(rates: list[float]) -> float:
    """Tokens/s over consecutive steps of equal tokens: the harmonic mean of the per-step rates."""
    return len(rates) / sum(1 / r for r in rates)


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="CI smoke: single process, 2 short rounds")
    p.add_argument("--worker", action="store_true", help=argparse_hidden())
    p.add_argument("--single-only", action="store_true", help="skip the 2-rank DDP measurement")
    args = p.parse_args()
    s = _settings(args.quick)
    if args.worker:  # under torchrun: every rank measures, rank 0 reports (tests/dist/harness.py)
        from dist.harness import run_cases

        run_cases({"ddp": lambda: measure(int(os.environ["WORLD_SIZE"]), **s)})
        return
    results = {"single": summarise(measure(1, **s))}
    if not (args.quick or args.single_only):
        from dist.harness import launch

        ddp = launch(Path(__file__), 2, "--worker", timeout=900)["ddp"]
        if not ddp.get("ok"):
            raise SystemExit(f"DDP measurement failed: {ddp.get('error')}\n{ddp.get('trace', '')}")
        results["ddp_2_ranks_gloo"] = summarise({k: v for k, v in ddp.items() if k != "ok"})
    results["settings"] = s
    lines = [f"usp trainer vs hand-written loop (tiny Llama, {results['single']['tokens_per_step']} tokens/step, "
             f"{s['rounds']} interleaved rounds of {s['steps']} steps after {s['warmup']} warm-up)"]
    for name, r in results.items():
        if name == "settings":
            continue
        lines.append(f"  {name:<18} usp {r['usp_tokens_per_s_window']:>8,.0f} tok/s  hand-written "
                     f"{r['hand_tokens_per_s_window']:>8,.0f} tok/s  ratio {r['ratio']:.3f} (target >= {TARGET}; "
                     f"rounds {', '.join(f'{x:.3f}' for x in r['ratio_per_round'])}; "
                     f"ratio of fastest steps {r['ratio_of_fastest_steps']:.3f})")
    _common.emit(results, args, lines)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
