"""Resuming a run directory that has checkpoints, through `usp train`: a config with another model
shape is refused before anything is written; a run already at train.steps changes nothing."""
from __future__ import annotations

import json

import pytest

from tests.engine.test_resume_guard import FAST, _snapshot
from tests.helpers import run_usp, usp_cli


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
