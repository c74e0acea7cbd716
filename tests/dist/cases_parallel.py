"""Parity matrix worker: every layout of LAYOUTS[world] trains the tiny model next to its
single-process reference; rank 0 records the comparison. Launched by tests/test_parallel.py."""
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from dist.harness import run_cases  # noqa: E402
from dist.layouts import LAYOUTS  # noqa: E402
from usp.engine.parity import verify_case  # noqa: E402

STEPS = ["train.steps=5", "train.seq_len=64", "optimizer.warmup_steps=2"]

if __name__ == "__main__":
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))  # a broken case fails, not hangs
    cases = {name: (lambda ov=overrides: verify_case(STEPS + ov, world)) for name, overrides in LAYOUTS[world].items()}
    run_cases(cases)
