"""The plan's check of profile.steps: a window outside the run is refused with a fix, and not checked
when profiling is off."""
from __future__ import annotations

import pytest

from tests.helpers import usp_cli


@pytest.mark.parametrize("window, steps", [("[5,3]", 150), ("[1,200]", 150), ("[0,2]", 150), ("[10]", 150)])
def test_bad_profile_steps_are_refused_by_the_plan(window, steps, tmp_path):
    proc = usp_cli("plan", "profile.enabled=true", f"profile.steps={window}", f"train.steps={steps}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:]
    err = " ".join(proc.stderr.split())
    assert "profile.steps=" in err and "train.steps (150)" in err and "fix: profile.steps=[10,12]" in err, err
    assert "Traceback" not in proc.stderr + proc.stdout


def test_profile_steps_are_not_checked_when_profiling_is_off(tmp_path):
    proc = usp_cli("plan", "profile.steps=[5,3]", "train.steps=4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
