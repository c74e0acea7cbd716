#!/usr/bin/env python
"""Checkpoint checksums: the hash's speed against hashlib's and zlib's on one buffer, and what the
checksums cost a real save and a verify (usp/run/checksums.py).

    python scripts/bench/checksums.py                  # hash speeds, then a 1.2 GiB checkpoint saved 3 times
    python scripts/bench/checksums.py --hashes-only

The save is `usp train` of a wider tiny Llama (dim 1024, 8 layers: 1.2 GiB of weights and AdamW
moments) with a checkpoint every step; each rank log's line "saved ... in X s (checksums Y s)" gives
the whole save and the hashing in it. The verify reads the last checkpoint back from the page cache."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def hash_speeds(size_mib: int = 256) -> dict[str, float]:
    import xxhash

    data = memoryview(os.urandom(size_mib * MIB))
    algorithms = {"xxh3_128": lambda: xxhash.xxh3_128(data).digest(), "blake2b": lambda: hashlib.blake2b(data).digest(),
                  "sha256": lambda: hashlib.sha256(data).digest(), "crc32": lambda: zlib.crc32(data)}
    speeds = {}
    for name, run in algorithms.items():
        best = min(_timed(run) for _ in range(3))
        speeds[name] = size_mib * MIB / best / 1e9
    return speeds


def _timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def save_and_verify() -> tuple[list[tuple[float, float]], float, float]:
    """[(save s, of it checksums s)] per save, the checkpoint's bytes, and the verify's seconds."""
    from usp.run import checksums

    with tempfile.TemporaryDirectory() as tmp:
        usp = Path(sys.executable).with_name("usp")
        subprocess.run([str(usp), "train", f"train.runs_dir={tmp}", "train.name=ck", "model.dim=1024",
                        "model.n_layers=8", "model.ffn_dim=2816", "train.global_batch=2", "train.micro_batch=2",
                        "train.steps=3", "checkpoint.interval=1", "logging.console=plain", "train.sample_tokens=0",
                        "train.eval_interval=0"], check=True, capture_output=True, cwd=tmp)
        log = (Path(tmp) / "ck" / "logs" / "rank_0.log").read_text()
        found = re.findall(r"saved to .* in ([\d.]+) s \(checksums ([\d.]+) s\)", log)
        saves = [(float(a), float(b)) for a, b in found]
        last = sorted((Path(tmp) / "ck" / "checkpoints").glob("step_*"))[-1]
        size = sum(p.stat().st_size for p in last.iterdir())
        started = time.perf_counter()
        assert checksums.verify_checkpoint(last)[0] == "verified"
        return saves, size, time.perf_counter() - started


def main() -> None:
    for name, gbps in hash_speeds().items():
        print(f"{name:9s} {gbps:6.2f} GB/s (256 MiB buffer, best of 3)")
    if "--hashes-only" in sys.argv:
        return
    saves, size, verify_s = save_and_verify()
    for i, (total, hashed) in enumerate(saves, 1):
        print(f"save {i}: {total:.2f} s, checksums {hashed:.2f} s ({hashed / total:.1%})")
    print(f"verify: {size / 2**30:.2f} GiB in {verify_s:.2f} s ({size / verify_s / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
