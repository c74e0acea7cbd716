"""What the launcher knows about checkpoints, without torch: where they live, which ones are
complete, and whether the checkpoint directory can hold them before a run starts.

A checkpoint is `<checkpoint dir>/step_<N:08d>/` (a torch.distributed.checkpoint save plus
rank-0 files). Its `manifest.json` = {"files": {relative name: size in bytes}, "step": N} is
written last: a checkpoint is complete iff the manifest exists and every file it lists exists
with that size. Saves in progress (or interrupted) live in `.tmp-step_<N>` directories."""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

from usp.errors import LaunchError

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp-step_(\d+)")
# Bytes per parameter in a checkpoint: fp32 weights (4) + AdamW's first and second moments (4 + 4).
CHECKPOINT_BYTES_PER_PARAM = 4 + 8


class CheckpointInfo(NamedTuple):
    step: int
    path: Path
    complete: bool
    problem: str | None  # why it is not complete (None when it is)


def checkpoint_dir(plan) -> Path:
    """The checkpoint directory of a plan (RunPlan or the dict of plan.yaml):
    checkpoint.dir, or <run_dir>/checkpoints when that is unset."""
    config = _field(plan, "config")
    configured = (config.get("checkpoint") or {}).get("dir")
    return Path(configured) if configured else Path(_field(plan, "run_dir")) / "checkpoints"


def check_manifest(path: Path) -> str | None:
    """None if the checkpoint directory `path` is complete, else what is wrong with it."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST}: the save did not finish"
    try:
        data = json.loads(manifest.read_text())
        files = dict(data["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    for name, size in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"missing file {name} (listed in {MANIFEST})"
        actual = f.stat().st_size
        if actual != int(size):
            return f"{name} is {actual:,} bytes, {MANIFEST} says {int(size):,} (truncated or corrupt)"
    match = _STEP_DIR.match(path.name)
    if match and "step" in data and int(data["step"]) != int(match.group(1)):
        return f"{MANIFEST} says step {data['step']} but the directory is {path.name}"
    return None


def list_checkpoints(ckpt_dir) -> list[CheckpointInfo]:
    """Every checkpoint under `ckpt_dir`, oldest step first: (step, path, complete, problem).
    Unfinished `.tmp-step_<N>` directories are listed too, as incomplete."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        if match := _STEP_DIR.match(entry.name):
            problem = check_manifest(entry)
            out.append(CheckpointInfo(int(match.group(1)), entry, problem is None, problem))
        elif match := _TMP_DIR.match(entry.name):
            out.append(CheckpointInfo(int(match.group(1)), entry, False, "unfinished save (temporary directory)"))
    return sorted(out, key=lambda c: (c.step, c.complete))


def latest_complete(ckpt_dir) -> CheckpointInfo | None:
    done = [c for c in list_checkpoints(ckpt_dir) if c.complete]
    return done[-1] if done else None


def predicted_checkpoint_bytes(params: int) -> int:
    return int(params) * CHECKPOINT_BYTES_PER_PARAM


def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_checkpoint_dir(plan, disk_free: Callable[[Path], int] = _disk_free) -> Path | None:
    """Before launch: the checkpoint directory must be creatable and writable, and have room for
    keep_last + 1 checkpoints (the newest is written before the oldest is deleted). Returns the
    directory, or None when checkpointing is off. `disk_free(path) -> bytes` is injectable."""
    ckpt = _field(plan, "config").get("checkpoint") or {}
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
    params = int(_field(_field(plan, "model"), "params"))
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


def _field(obj, name: str):
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


__all__ = ["CheckpointInfo", "checkpoint_dir", "check_manifest", "list_checkpoints", "latest_complete",
           "predicted_checkpoint_bytes", "check_checkpoint_dir", "MANIFEST"]
