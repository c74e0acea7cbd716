"""Names that become directories (train.name, `usp sweep --name`): one rule (usp/run/names.py), checked
at plan time, so `usp plan` refuses what `usp train` refuses and nothing is written outside
train.runs_dir. And train.steps >= 1, checked at the same place."""
from __future__ import annotations

import pytest

from tests.helpers import usp_cli
from usp.config.compose import compose_config
from usp.errors import PlanError, UspError
from usp.launch.sweep import expand_grid, plan_grid
from usp.plan.plan import build_plan
from usp.run.names import check_dir_name, name_problem

BAD_NAMES = ["../../elsewhere", "..", ".", "/abs/path", "a/b", "", " lead", "a b", "tab\there", "nl\nx", "-opt",
             ".hidden", "x" * 256]


pytestmark = pytest.mark.usefixtures("fresh_cache")  # planning computes the dataset's path from it


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused(name):
    assert name_problem(name) is not None
    with pytest.raises(UspError) as err:
        check_dir_name(name, key="k", fix="k=ok")
    assert err.value.key == "k" and err.value.value == name and "fix: k=ok" in str(err.value)


@pytest.mark.parametrize("name", ["run1", "llama3_8b-tp4", "v1.2", "A", "0_x", "x" * 255])
def test_good_names_pass(name):
    assert name_problem(name) is None and check_dir_name(name, key="k", fix="") == name


@pytest.mark.parametrize("name", ["../../elsewhere", "/tmp/abs", "a/b", "", "a b"])
def test_train_name_is_refused_at_plan_time(tmp_path, name):
    cfg, choices = compose_config(None, [f"train.name={name}", f"train.runs_dir={tmp_path / 'runs'}"])
    with pytest.raises(PlanError) as err:
        build_plan(cfg, choices)
    assert err.value.key == "train.name" and err.value.value == name


def test_a_derived_name_follows_the_same_rule(tmp_path):
    cfg, choices = compose_config(None, ["model.name=../up", f"train.runs_dir={tmp_path}"])
    with pytest.raises(PlanError) as err:
        build_plan(cfg, choices)
    assert err.value.key == "model.name" and err.value.value == "../up-single"


def test_plan_and_train_refuse_an_escaping_name_and_write_nothing(tmp_path):
    for command in ("plan", "train"):
        proc = usp_cli(command, "train.name=../../elsewhere", "train.runs_dir=runs/inner", cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "train.name='../../elsewhere'" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no runs/, no elsewhere/, no data cache


@pytest.mark.parametrize("steps", ["0", "-5"])
def test_steps_below_one_are_refused_by_plan_and_train(tmp_path, steps):
    for command in ("plan", "train"):
        proc = usp_cli(command, f"train.steps={steps}", "train.name=neg", cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"train.steps={steps}" in proc.stderr and "at least one" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_sweep_points_live_in_the_sweep_directory_under_plain_names(tmp_path):
    sweep = plan_grid("tiny_demo", expand_grid(["train.micro_batch=4,8"]), "s", str(tmp_path))
    assert [p.plan.name for p in sweep.points] == ["p00_mb4", "p01_mb8"]
    assert [p.plan.run_dir for p in sweep.points] == [str(tmp_path / "s" / "p00_mb4"), str(tmp_path / "s" / "p01_mb8")]
    assert [p.run_dir for p in sweep.points] == [p.plan.run_dir for p in sweep.points]
    with pytest.raises(UspError) as err:
        plan_grid("tiny_demo", expand_grid(["train.micro_batch=4,8"]), "../s", str(tmp_path))
    assert err.value.key == "--name"
