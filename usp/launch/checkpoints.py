"""Before launch, without torch: can the checkpoint directory hold the run's checkpoints, and can
the checkpoint the run would resume from be loaded by this config (same model shape) and does it
leave anything to train? (Where checkpoints live and which are complete is usp.run.files's.)"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from usp.errors import LaunchError
from usp.run.files import PLAN, TRAINER_STATE, checkpoint_dir, latest_complete, plan_field, read_plan

# Bytes per parameter in a checkpoint: fp32 weights (4) + AdamW's first and second moments (4 + 4).
CHECKPOINT_BYTES_PER_PARAM = 4 + 8


def predicted_checkpoint_bytes(params: int) -> int:
    return int(params) * CHECKPOINT_BYTES_PER_PARAM


def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_checkpoint_dir(plan, disk_free: Callable[[Path], int] = _disk_free) -> Path | None:
    """Before launch: the checkpoint directory must be creatable and writable, and have room for
    keep_last + 1 checkpoints (the newest is written before the oldest is deleted). Returns the
    directory, or None when checkpointing is off. `disk_free(path) -> bytes` is injectable.
    Directories made only to check are removed again (the first checkpoint makes them): a launch
    that fails later leaves no empty checkpoints/ behind."""
    ckpt = plan_field(plan, "config").get("checkpoint") or {}
    if not ckpt.get("enabled", True):
        return None
    path = checkpoint_dir(plan)
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        return _check_room(path, ckpt, plan, disk_free)
    finally:
        for directory in made:  # the deepest first; rmdir leaves a directory that isn't empty
            with contextlib.suppress(OSError):
                directory.rmdir()


def _check_room(path: Path, ckpt: dict, plan, disk_free: Callable[[Path], int]) -> Path:
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


# The model keys that decide the parameters' names and shapes: a checkpoint saved with other values
# can't be loaded. (rope_theta, init_std, norm_eps, ... change no shape.)
SHAPE_KEYS = ("family", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings",
              "n_experts", "moe_ffn_dim", "shared_expert")


class RunAlreadyDone(Exception):
    """The checkpoint to resume is already at train.steps or beyond: nothing to train, nothing written."""


def model_shape(plan) -> dict:
    """SHAPE_KEYS of a plan (RunPlan or plan.yaml's dict), defaults resolved (vocab from the plan)."""
    model = dict(plan_field(plan, "config")["model"])
    shape = {k: model.get(k) for k in SHAPE_KEYS}
    shape["n_kv_heads"] = model.get("n_kv_heads") or model.get("n_heads")
    shape["vocab_size"] = plan_field(plan_field(plan, "model"), "vocab_size")
    shape["moe_ffn_dim"] = (model.get("moe_ffn_dim") or model.get("ffn_dim")) if model.get("n_experts") else None
    return shape


def resume_source(plan) -> Path | None:
    """The checkpoint directory the engine would resume from (None: none, or checkpoint.resume=never)."""
    ckpt = plan_field(plan, "config").get("checkpoint") or {}
    resume = str(ckpt.get("resume", "auto"))
    if not ckpt.get("enabled", True) or resume == "never":
        return None
    if resume == "auto":
        found = latest_complete(checkpoint_dir(plan))
        return found.path if found else None
    path = Path(resume).expanduser()
    return path if path.is_dir() else None


def check_resume(plan) -> None:
    """Before anything is written: refuse a checkpoint saved with another model shape (naming the
    saved and the new values); raise RunAlreadyDone when it is at train.steps or beyond."""
    source = resume_source(plan)
    if source is None:
        return
    fixes = ("checkpoint.resume=never (train from scratch here; this run's checkpoints are replaced as new ones "
             "are saved), or train.name=<a new name> (a new run directory)")
    if (source / PLAN).is_file():
        saved, new = model_shape(read_plan(source / PLAN)), model_shape(plan)
        diffs = [k for k in SHAPE_KEYS if saved[k] != new[k]]
        if diffs:
            what = ", ".join(f"model.{k}: saved {saved[k]!r}, now {new[k]!r}" for k in diffs)
            back = " ".join(f"model.{k}={saved[k]}" for k in diffs)
            raise LaunchError(f"the checkpoint {source} was saved with another model shape ({what}): it can't be "
                              f"resumed with this config; nothing was changed", key=f"model.{diffs[0]}",
                              value=new[diffs[0]], fix=f"{fixes}; or {back} to resume it")
    try:
        step = int(json.loads((source / TRAINER_STATE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # the engine reads it again, and says what is wrong with it
    steps = int(plan_field(plan, "config")["train"]["steps"])
    if step >= steps:
        run_dir = plan_field(plan, "run_dir")
        raise RunAlreadyDone(f"usp: {run_dir} is already at step {step} (checkpoint {source.name}), "
                             f"and train.steps={steps}: nothing to train, nothing was changed. To train on: "
                             f"train.steps=<more than {step}>; to start over: {fixes}")
