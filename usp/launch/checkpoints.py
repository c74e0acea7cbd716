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

from usp.contract.plan_file import read_plan
from usp.contract.run_plan import RunPlan
from usp.errors import LaunchError, PlanError
from usp.run.files import PLAN, TRAINER_STATE, latest_complete

# Bytes per parameter in a checkpoint: fp32 weights (4) + AdamW's first and second moments (4 + 4).
CHECKPOINT_BYTES_PER_PARAM = 4 + 8


def predicted_checkpoint_bytes(params: int) -> int:
    return int(params) * CHECKPOINT_BYTES_PER_PARAM


def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_checkpoint_dir(plan: RunPlan, disk_free: Callable[[Path], int] = _disk_free) -> Path | None:
    """Before launch: the checkpoint directory must be creatable and writable, and have room for
    keep_last + 1 checkpoints (the newest is written before the oldest is deleted). Returns the
    directory, or None when checkpointing is off. `disk_free(path) -> bytes` is injectable.
    Directories made only to check are removed again (the first checkpoint makes them): a launch
    that fails later leaves no empty checkpoints/ behind."""
    ckpt = plan.config.checkpoint
    if not ckpt.enabled:
        return None
    path = Path(plan.decisions.checkpoint_dir)
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        return _check_room(path, ckpt, plan, disk_free)
    finally:
        for directory in made:  # the deepest first; rmdir leaves a directory that isn't empty
            with contextlib.suppress(OSError):
                directory.rmdir()


def _check_room(path: Path, ckpt, plan: RunPlan, disk_free: Callable[[Path], int]) -> Path:
    off = "or checkpoint.enabled=false (no checkpoints)"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".usp-write-test-"):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise LaunchError(f"the checkpoint directory {path} can't be created or written to: {reason}",
                          key="checkpoint.dir", value=ckpt.dir,
                          fix=f"checkpoint.dir=<a writable directory>, {off}") from None
    keep = max(1, int(ckpt.keep_last))
    params = int(plan.model.params)
    one = predicted_checkpoint_bytes(params)
    need, free = (keep + 1) * one, int(disk_free(path))
    if free < need:
        raise LaunchError(
            f"the checkpoint directory {path} has {_bytes(free)} free, but keep_last + 1 = {keep + 1} checkpoints "
            f"need {_bytes(need)}: {params:,} parameters x {CHECKPOINT_BYTES_PER_PARAM} bytes (fp32 weights 4 + "
            f"AdamW m and v 8) = {_bytes(one)} per checkpoint",
            key="checkpoint.dir", value=ckpt.dir,
            fix=f"free up space, checkpoint.dir=<a disk with more room>, checkpoint.keep_last=1, {off}")
    return path


def _bytes(n: float) -> str:
    for div, unit in ((2 ** 40, "TiB"), (2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if n >= div:
            return f"{n / div:.2f} {unit} ({int(n):,} bytes)"
    return f"{int(n):,} bytes"


# The model keys that decide the parameters' names and shapes: a checkpoint saved with other values
# can't be loaded. (rope_theta, init_std, norm_eps, ... change no shape.)
SHAPE_KEYS = ("family", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "qk_norm", "ffn_dim", "vocab_size",
              "tie_embeddings", "n_experts", "moe_ffn_dim", "shared_expert", "n_shared_experts", "router_score",
              "n_dense_layers", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "mtp_depth")


class RunAlreadyDone(Exception):
    """The checkpoint to resume is already at train.steps or beyond: nothing to train, nothing written."""


def model_shape(plan: RunPlan) -> dict:
    """SHAPE_KEYS of a plan, defaults resolved (the vocabulary the plan's)."""
    model = plan.config.model
    shape = {k: getattr(model, k) for k in SHAPE_KEYS}
    shape["n_kv_heads"] = model.n_kv_heads or model.n_heads
    shape["head_dim"] = model.head_dim or model.dim // model.n_heads
    shape["vocab_size"] = plan.model.vocab_size
    shape["moe_ffn_dim"] = (model.moe_ffn_dim or model.ffn_dim) if model.n_experts else None
    return shape


def resume_source(plan: RunPlan) -> Path | None:
    """The checkpoint directory the engine would resume from (None: none, or checkpoint.resume=never)."""
    ckpt = plan.config.checkpoint
    resume = str(ckpt.resume)
    if not ckpt.enabled or resume == "never":
        return None
    if resume == "auto":
        found = latest_complete(plan.decisions.checkpoint_dir)
        return found.path if found else None
    path = Path(resume).expanduser()
    return path if path.is_dir() else None


def check_resume(plan: RunPlan) -> None:
    """Before anything is written: refuse a checkpoint saved with another model shape (naming the
    saved and the new values); raise RunAlreadyDone when it is at train.steps or beyond."""
    source = resume_source(plan)
    if source is None:
        return
    fixes = ("checkpoint.resume=never (train from scratch here; this run's checkpoints are replaced as new ones "
             "are saved), or train.name=<a new name> (a new run directory)")
    saved_plan = _saved_plan(source)
    if saved_plan is not None:
        saved, new = model_shape(saved_plan), model_shape(plan)
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
    steps = int(plan.config.train.steps)
    if step >= steps:
        run_dir = plan.run_dir
        raise RunAlreadyDone(f"usp: {run_dir} is already at step {step} (checkpoint {source.name}), "
                             f"and train.steps={steps}: nothing to train, nothing was changed. To train on: "
                             f"train.steps=<more than {step}>; to start over: {fixes}")


def _saved_plan(checkpoint: Path) -> RunPlan | None:
    """The plan a checkpoint was saved under; None without one, or when it can't be read (a damaged
    checkpoint: the engine checks its files and falls back to an older one)."""
    if not (checkpoint / PLAN).is_file():
        return None
    try:
        return read_plan(checkpoint / PLAN)
    except PlanError:
        return None
