#!/usr/bin/env python
"""Input pipeline headroom: tokens/s the trainer's batch path delivers (BatchSampler ->
get_batch from the memory-mapped token file -> tensors on the device: Trainer._batch) against
tokens/s one training step of the tiny model consumes, measured in alternating rounds in one
process. The ratio must be >> 1: the data path never makes the model wait.

    python scripts/bench/dataloader.py [--rounds 5] [--json]
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def loader_tokens_per_s(trainer, first_step: int, seconds: float = 1.0) -> float:
    """Whole optimizer steps of batches (every micro batch of this rank) for about `seconds`."""
    tokens, step, start = 0, first_step, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for starts in trainer.sampler.micro_batches(step):
            x, _, _ = trainer._batch(trainer.train_tokens, starts)
            tokens += x.numel()
        step += 1
    return tokens / (time.perf_counter() - start)


def step_tokens_per_s(trainer, first_step: int, steps: int) -> float:
    times = []
    for step in range(first_step, first_step + steps):
        start = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - start)
    return trainer.global_tokens / _common.median(times)


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="training steps per round")
    args = p.parse_args()
    import torch

    from usp.engine.parallel import mesh as udist
    from usp.engine.parallel.mesh import make_context
    from usp.engine.trainer import Trainer

    with tempfile.TemporaryDirectory() as runs:
        plan = _common.plan_for([f"train.steps={args.rounds * (args.steps + 200)}", "train.measure_memory=false"], 1,
                                runs)
        udist.init_process_group(plan)
        torch.manual_seed(0)
        trainer = Trainer(plan, make_context(plan))
        step_tokens_per_s(trainer, 0, 2)  # warm-up
        loader, train = [], []
        for r in range(args.rounds):
            loader.append(loader_tokens_per_s(trainer, 1000 * r))
            train.append(step_tokens_per_s(trainer, 2 + r * args.steps, args.steps))
    ratios = [a / b for a, b in zip(loader, train)]
    out = {"loader_tokens_per_s": loader, "train_tokens_per_s": train, "ratio_per_round": ratios,
           "ratio": _common.median(ratios), "loader_median": _common.median(loader),
           "train_median": _common.median(train), "tokens_per_step": trainer.global_tokens,
           "seq_len": trainer.seq_len, **_common.machine()}
    lines = [f"input pipeline (tiny model, {trainer.global_tokens} tokens/step, seq {trainer.seq_len}; median of "
             f"{args.rounds} rounds):",
             f"  batches delivered {out['loader_median']:>12,.0f} tokens/s",
             f"  training consumes {out['train_median']:>12,.0f} tokens/s",
             f"  ratio {out['ratio']:,.0f}x (must be >> 1)"]
    _common.emit(out, args, lines)


if __name__ == "__main__":
    main()
