"""Resuming a run directory that has checkpoints: a config with another model shape is refused
before anything is written; a run already at train.steps changes nothing (exit 0, says so);
a checkpoint that fails to load is classified (mismatch, corrupt, missing)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.helpers import run_usp, usp_cli

FAST = ["data.tokenizer=bytes", "model.dim=32", "model.ffn_dim=64", "train.seq_len=32", "train.global_batch=4",
        "train.eval_batches=1", "train.sample_tokens=0", "logging.console=plain", "train.log_interval=1",
        "train.eval_interval=0"]


def _snapshot(run_dir: Path) -> dict[str, tuple[bytes, float]]:
    return {str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_changed_shape_is_refused_and_a_finished_run_is_left_alone(tmp_path):
    first = run_usp("train", f"train.runs_dir={tmp_path}", "train.name=r", *FAST, "train.steps=3")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = tmp_path / "r"
    before = _snapshot(run_dir)
    assert "summary.json" in before and "checkpoints/step_00000003/plan.yaml" in before

    # another model shape: refused before plan.yaml (or anything) is rewritten, naming both values
    changed = usp_cli("train", f"train.runs_dir={tmp_path}", "train.name=r", *FAST, "train.steps=6",
                      "model.dim=64", cwd=tmp_path)
    assert changed.returncode == 2, changed.stdout + changed.stderr
    err = " ".join(changed.stderr.split())
    assert "model.dim: saved 32, now 64" in err and "checkpoint.resume=never" in err and "train.name=" in err
    assert "Traceback" not in changed.stderr
    # fewer steps, or the same: nothing to do, exit 0, nothing rewritten
    for steps in (2, 3):
        again = usp_cli("train", f"train.runs_dir={tmp_path}", "train.name=r", *FAST, f"train.steps={steps}",
                        cwd=tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "already at step 3" in again.stdout and "nothing was changed" in again.stdout
    assert _snapshot(run_dir) == before
    # checkpoint.resume=never is the way to start over with the new shape: the plan accepts it
    fresh = usp_cli("plan", f"train.runs_dir={tmp_path}", "train.name=r", *FAST, "model.dim=64",
                    "checkpoint.resume=never", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_load_errors_are_classified(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from usp.engine.checkpoint import CORRUPT, MISMATCH, MISSING, classify_load_error

    logging.disable(logging.CRITICAL)  # DCP logs each failed metadata read with a traceback
    try:
        dcp.save({"model": torch.nn.Linear(8, 4).state_dict()}, checkpoint_id=str(tmp_path))

        def failure(state: dict) -> BaseException:
            with pytest.raises(BaseException) as err:  # DCP's CheckpointException is not an Exception
                dcp.load({"model": state}, checkpoint_id=str(tmp_path))
            return err.value

        assert classify_load_error(failure(torch.nn.Linear(8, 5).state_dict()))[0] == MISMATCH  # shape
        kind, detail = classify_load_error(failure(torch.nn.Sequential(torch.nn.Linear(8, 4)).state_dict()))
        assert kind == MISMATCH and "Missing key" in detail  # architecture
        meta = (tmp_path / ".metadata").read_bytes()
        (tmp_path / ".metadata").write_bytes(bytes(b ^ 0xFF for b in meta))
        kind, detail = classify_load_error(failure(torch.nn.Linear(8, 4).state_dict()))
        assert kind == CORRUPT and "invalid load key" in detail
        (tmp_path / ".metadata").write_bytes(meta)
        next(tmp_path.glob("*.distcp")).unlink()
        assert classify_load_error(failure(torch.nn.Linear(8, 4).state_dict()))[0] == MISSING
    finally:
        logging.disable(logging.NOTSET)
