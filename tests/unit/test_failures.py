"""`usp status` of a completed run written by hand, and the pre-launch check that the checkpoint
directory has room for keep_last + 1 checkpoints (failure records: tests/engine/test_failures.py)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.helpers import usp_cli
from usp.config.compose import compose_config
from usp.contract.plan_file import read_plan, write_plan
from usp.contract.run_plan import RunPlan
from usp.errors import LaunchError
from usp.launch.checkpoints import check_checkpoint_dir
from usp.plan.plan import build_plan


def make_run(tmp_path: Path, *overrides: str, name: str = "run") -> tuple[Path, RunPlan]:
    """A run directory with the real plan.yaml of `overrides`."""
    cfg, choices = compose_config(None, [f"train.runs_dir={tmp_path / 'runs'}", f"train.name={name}", *overrides])
    plan = build_plan(cfg, choices, training=False)
    path = write_plan(plan)
    return path.parent, read_plan(path)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _fake_checkpoint(ckpt_dir: Path, step: int, manifest: bool = True) -> Path:
    d = ckpt_dir / f"step_{step:08d}"
    d.mkdir(parents=True)
    files = {".metadata": b"m" * 10, "__0_0.distcp": b"w" * 100,
             "trainer_state.json": json.dumps({"step": step}).encode()}
    for name, data in files.items():
        (d / name).write_bytes(data)
    if manifest:
        (d / "manifest.json").write_text(json.dumps({"files": {k: len(v) for k, v in files.items()}, "step": step}))
    return d


def test_status_completed_run(tmp_path):
    run_dir, _ = make_run(tmp_path)
    _write_jsonl(run_dir / "metrics.jsonl", [{"step": 10, "loss": 5.0}, {"step": 20, "loss": 3.25, "val_loss": 3.5}])
    _write_jsonl(run_dir / "logs" / "events.jsonl", [{"event": "restart", "time": time.time(), "restart": 1,
                                                     "resumed_from_step": 10}])
    _fake_checkpoint(run_dir / "checkpoints", 20)
    (run_dir / "summary.json").write_text(json.dumps({"steps": 20}))
    proc = usp_cli("status", cwd=tmp_path)  # default: the newest directory under ./runs
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "run: run" in out and "completed" in out and "single process" in out
    assert "20 / 150: loss 3.2500, val loss 3.5000" in out
    assert "step_00000020" in out and "complete" in out and "resumed from step 10" in out


def test_status_refuses_a_directory_that_is_no_run(tmp_path):
    """A directory no launch wrote into is named as such (it printed a 'stopped' run and exited 0)."""
    (tmp_path / "notes").mkdir()
    proc = usp_cli("status", str(tmp_path / "notes"), cwd=tmp_path)
    assert proc.returncode != 0
    assert "is not a run directory" in proc.stdout + proc.stderr and "stopped" not in proc.stdout


def test_checkpoint_dir_needs_room_for_keep_last_plus_one(tmp_path):
    cfg, choices = compose_config(None, [f"train.runs_dir={tmp_path}", "train.name=x", "checkpoint.keep_last=2"])
    plan = build_plan(cfg, choices, training=False)
    need = 3 * plan.model.params * 12
    with pytest.raises(LaunchError) as err:
        check_checkpoint_dir(plan, disk_free=lambda path: need - 1)
    msg = str(err.value)
    assert msg.startswith("checkpoint.dir: ") and "keep_last + 1 = 3" in msg
    assert f"{plan.model.params:,} parameters" in msg
    assert f"{need - 1:,} bytes" in msg and f"{need:,} bytes" in msg
    assert "checkpoint.keep_last=1" in msg and "checkpoint.enabled=false" in msg
    assert check_checkpoint_dir(plan, disk_free=lambda path: need) == tmp_path / "x" / "checkpoints"
    plan.config.checkpoint.enabled = False
    assert check_checkpoint_dir(plan, disk_free=lambda path: 0) is None
