"""Before launch, without torch: can the checkpoint directory hold the run's checkpoints? (Where
they live and which are complete is usp.rundir's.)"""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from usp.errors import LaunchError
from usp.rundir import checkpoint_dir, plan_field

# Bytes per parameter in a checkpoint: fp32 weights (4) + AdamW's first and second moments (4 + 4).
CHECKPOINT_BYTES_PER_PARAM = 4 + 8


def predicted_checkpoint_bytes(params: int) -> int:
    return int(params) * CHECKPOINT_BYTES_PER_PARAM


def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_checkpoint_dir(plan, disk_free: Callable[[Path], int] = _disk_free) -> Path | None:
    """Before launch: the checkpoint directory must be creatable and writable, and have room for
    keep_last + 1 checkpoints (the newest is written before the oldest is deleted). Returns the
    directory, or None when checkpointing is off. `disk_free(path) -> bytes` is injectable."""
    ckpt = plan_field(plan, "config").get("checkpoint") or {}
    if not ckpt.get("enabled", True):
        return None
    path = checkpoint_dir(plan)
    off = "or checkpoint.enabled=false (no checkpoints)"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".usp-write-test-"):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise LaunchError(f"the checkpoint directory {path} can't be created or written to: {reason}",
                          key="checkpoint.dir", value=ckpt.get("dir"),
                          fix=f"checkpoint.dir=<a writable directory>, {off}") from None
    keep = max(1, int(ckpt.get("keep_last", 2)))
    params = int(plan_field(plan_field(plan, "model"), "params"))
    one = predicted_checkpoint_bytes(params)
    need, free = (keep + 1) * one, int(disk_free(path))
    if free < need:
        raise LaunchError(
            f"the checkpoint directory {path} has {_bytes(free)} free, but keep_last + 1 = {keep + 1} checkpoints "
            f"need {_bytes(need)}: {params:,} parameters x {CHECKPOINT_BYTES_PER_PARAM} bytes (fp32 weights 4 + "
            f"AdamW m and v 8) = {_bytes(one)} per checkpoint",
            key="checkpoint.dir", value=ckpt.get("dir"),
            fix=f"free up space, checkpoint.dir=<a disk with more room>, checkpoint.keep_last=1, {off}")
    return path


def _bytes(n: float) -> str:
    for div, unit in ((2 ** 40, "TiB"), (2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if n >= div:
            return f"{n / div:.2f} {unit} ({int(n):,} bytes)"
    return f"{int(n):,} bytes"
