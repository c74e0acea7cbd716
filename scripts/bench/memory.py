#!/usr/bin/env python
"""Planner memory accuracy on CPU: for each calibration layout (tests/dist/cases_memory.py), the
planner's predicted tensor memory per rank (its total without the fixed overhead allowance) next
to the peak the memory probe measures during one training step (torch's MemTracker on CPU; max
over ranks), and the error. One 2-process torchrun launch; the tiny model, seq_len 128, global
batch 16. Prints a Markdown table (MiB).

    python scripts/bench/memory.py            # the layouts tests/e2e/test_memory_calibration.py asserts
    python scripts/bench/memory.py --extra    # + byte vocabulary, accumulation, MoE, pipeline layouts
    python scripts/bench/memory.py --zero     # ZeRO-1 / ZeRO-2 with TP or PP (4 processes)
    python scripts/bench/memory.py --cp-pp    # CP x PP, ZeRO-3 x zero-bubble PP (4 processes)
    python scripts/bench/memory.py --bf16     # train.dtype=bf16: autocast / FSDP2's bf16 policy, as on a GPU
"""
from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("USP_CACHE_DIR", tempfile.mkdtemp(prefix="usp-bench-"))

from dist.cases_memory import BF16_LAYOUTS, CP_PP_LAYOUTS, EXTRA_LAYOUTS, MEMORY_LAYOUTS, ZERO_LAYOUTS  # noqa: E402
from dist.harness import launch  # noqa: E402

MIB = 1024  # GiB -> MiB


def main() -> None:
    extra, zero, cp_pp = "--extra" in sys.argv[1:], "--zero" in sys.argv[1:], "--cp-pp" in sys.argv[1:]
    bf16 = "--bf16" in sys.argv[1:]
    extra = extra or bf16  # the wide bf16 layouts read the byte vocabulary
    from usp.config.compose import compose_config
    from usp.data.tokenized import ensure_dataset

    for overrides in ([], ["data.tokenizer=bytes"] if extra else []):
        ensure_dataset(compose_config(None, overrides)[0].data)  # once, before the ranks start
    start = time.perf_counter()
    flags = ["--zero"] if zero else ["--cp-pp"] if cp_pp else ["--bf16"] if bf16 else ["--extra"] if extra else []
    results = launch(REPO / "tests" / "dist" / "cases_memory.py", 4 if zero or cp_pp else 2, *flags, timeout=900)
    wall = time.perf_counter() - start
    layouts = ZERO_LAYOUTS if zero else CP_PP_LAYOUTS if cp_pp else BF16_LAYOUTS if bf16 else {
        **MEMORY_LAYOUTS, **(EXTRA_LAYOUTS if extra else {})}
    print("| layout | ranks | predicted (MiB) | measured (MiB) | error | peak during "
          "| predicted incl. allowance (MiB) |")
    print("|---|---:|---:|---:|---:|---|---:|")
    worst = 0.0
    for name in layouts:
        r = results.get(name)
        if r is None or not r.get("ok"):
            print(f"| {name} | | | | failed: {r and r.get('error')} | | |")
            continue
        err = (r["predicted_gib"] - r["measured_gib"]) / r["measured_gib"]
        worst = max(worst, abs(err)) if name in MEMORY_LAYOUTS or zero or bf16 else worst
        print(f"| {name} | {r['world']} | {r['predicted_gib'] * MIB:.1f} | {r['measured_gib'] * MIB:.1f} | "
              f"{err:+.1%} | {r['peak_phase']} | {r['predicted_total_gib'] * MIB:.1f} |")
    print(f"\nworst |error| over the asserted layouts: {worst:.1%}; one torchrun launch, {wall:.0f} s; "
          f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}")


if __name__ == "__main__":
    main()
