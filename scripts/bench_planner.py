#!/usr/bin/env python
"""Time the planner: the layout search for Llama-3.1 70B on 64 nodes x 8 H100 (512 GPUs), and
one `build_plan` with its memory / time prediction. Pure Python, no torch.

    python scripts/bench_planner.py [extra overrides...]
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("USP_CACHE_DIR", tempfile.mkdtemp(prefix="usp-bench-"))

from usp.config.compose import compose_config  # noqa: E402
from usp.plan.plan import build_plan  # noqa: E402
from usp.plan.search import explain, search_config  # noqa: E402

OVERRIDES = ["model=llama3_1_70b", "cluster=slurm_h100", "cluster.nodes=64", "train.seq_len=4096",
             "train.global_batch=1024"]


def main() -> None:
    overrides = OVERRIDES + sys.argv[1:]
    cfg, choices = compose_config(None, overrides)
    start = time.perf_counter()
    result = search_config(cfg, top_k=5)
    search_s = time.perf_counter() - start
    best = result.best
    print(f"search: {' '.join(overrides)}")
    print(f"  {search_s:.2f} s: {result.evaluated} memory predictions, {result.fitting} fitting layouts")
    if best is not None:
        print(f"  best: {best.describe()}, {best.peak_gib:.1f} GiB, "
              f"{best.tokens_per_s_per_device:,.0f} tokens/s/device, MFU {best.timing.mfu:.1%}")
        for line in explain(result)[1:]:
            print(f"  {line}")
        cfg, choices = compose_config(None, overrides + best.layout.overrides())
        start = time.perf_counter()
        build_plan(cfg, choices, training=False)
        print(f"build_plan of the best layout (512 ranks): {time.perf_counter() - start:.3f} s")
    assert "torch" not in sys.modules, "the planner imported torch"


if __name__ == "__main__":
    main()
