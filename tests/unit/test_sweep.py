"""`usp sweep`: grid expansion with Hydra's override grammar, planning every point (accepted /
rejected with the planner's reason), sweep.json, and the local runner's bookkeeping. The real
end-to-end sweep (training several points) is in tests/e2e/test_report.py."""
from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import pytest
from rich.console import Console

from tests.helpers import usp_cli
from usp.errors import UspError
from usp.launch.sweep import expand_grid, plan_grid, point_id, run_sweep_local
from usp.run.sweep_record import read_sweep

QUIET = ["train.steps=2", "logging.console=quiet", "train.sample_tokens=0", "train.eval_interval=0"]


def test_expand_grid_is_the_cartesian_product():
    grid = expand_grid(["train.steps=3", "parallelism.tp=1,2,4", "train.micro_batch=1,2"])
    assert len(grid) == 6
    expected = [["train.steps=3", f"parallelism.tp={tp}", f"train.micro_batch={mb}"]
                for tp, mb in itertools.product("124", "12")]
    assert grid == expected


def test_expand_grid_keeps_quoted_values_and_groups():
    grid = expand_grid(["data.train_bin='a,b.bin'", "model=tiny,moe_tiny", "train.seed=range(1,4)"])
    assert len(grid) == 6
    assert all(point[0] == "data.train_bin='a,b.bin'" for point in grid)  # one quoted value, not swept
    assert {p[1] for p in grid} == {"model=tiny", "model=moe_tiny"}
    assert {p[2] for p in grid} == {"train.seed=1", "train.seed=2", "train.seed=3"}


def test_expand_grid_without_comma_lists_is_one_point():
    assert expand_grid(["train.steps=3"]) == [["train.steps=3"]]


@pytest.mark.parametrize("overrides, key", [(["conf=tiny_demo", "train.steps=1,2"], "conf"),
                                            (["train.steps=1,2", "train.steps=3,4"], "train.steps"),
                                            (["train.steps=="], "overrides")])
def test_expand_grid_errors_name_the_key(overrides, key):
    with pytest.raises(UspError) as err:
        expand_grid(overrides)
    assert err.value.key == key and err.value.fix


def test_point_ids_are_readable_and_distinct():
    ids = [point_id(i, {"cluster.procs_per_node": n, "train.micro_batch": mb})
           for i, (n, mb) in enumerate(itertools.product("12", ("4", "16")))]
    assert ids == ["p00_n1_mb4", "p01_n1_mb16", "p02_n2_mb4", "p03_n2_mb16"]
    assert point_id(0, {"model": "'tiny/x'"}) == "p00_modeltiny-x"  # safe as a directory name


def test_plan_grid_splits_accepted_and_rejected(tmp_path):
    grid = expand_grid([*QUIET, "train.micro_batch=4,8,32", "parallelism.ddp_comm_hook=none,fp16"])
    sweep = plan_grid("tiny_demo", grid, "s1", str(tmp_path))
    assert sweep.dir == tmp_path / "s1"
    by_id = {p.id: p for p in sweep.points}
    assert len(by_id) == 6
    # global batch 16 can't be split into micro batches of 32 (build_plan) ...
    assert by_id["p04_mb32_ddp_comm_hooknone"].status == "rejected"
    rejected = by_id["p04_mb32_ddp_comm_hooknone"].reason
    assert "train.global_batch=16" in rejected and "fix:" in rejected
    # ... and a DDP communication hook on one process is refused by engine_support_errors
    assert "parallelism.ddp_comm_hook" in by_id["p01_mb4_ddp_comm_hookfp16"].reason
    assert [p.id for p in sweep.accepted] == ["p00_mb4_ddp_comm_hooknone", "p02_mb8_ddp_comm_hooknone"]
    assert all("\n" not in p.reason for p in sweep.rejected)

    data = read_sweep(tmp_path / "s1")
    assert data["swept"] == {"train.micro_batch": ["4", "8", "32"], "parallelism.ddp_comm_hook": ["none", "fp16"]}
    assert data["base_overrides"] == QUIET
    points = {p["id"]: p for p in data["points"]}
    p00 = points["p00_mb4_ddp_comm_hooknone"]
    assert p00["status"] == "planned" and p00["reason"] is None
    assert p00["run_dir"] == str(tmp_path / "s1" / "p00_mb4_ddp_comm_hooknone")
    assert p00["micro_batch"] == 4 and p00["grad_accum"] == 4
    # the heatmap's axes (model size x nodes) come from the plan, even for points that never run
    assert p00["params"] == 950_912 and p00["nodes"] == 1
    assert points["p04_mb32_ddp_comm_hooknone"]["status"] == "rejected"
    assert not (tmp_path / "s1" / "p00_mb4_ddp_comm_hooknone").exists()  # planning writes no run dir


def test_same_name_with_another_grid_is_refused(tmp_path):
    plan_grid("tiny_demo", expand_grid(["train.micro_batch=4,8"]), "s", str(tmp_path))
    with pytest.raises(UspError) as err:
        plan_grid("tiny_demo", expand_grid(["train.micro_batch=2,4"]), "s", str(tmp_path))
    assert err.value.key == "--name"


def test_failed_point_does_not_stop_the_sweep(tmp_path, shakespeare):
    sweep = plan_grid(None, expand_grid([*QUIET, "train.micro_batch=4,8,16"]), "s", str(tmp_path))
    seen = []

    def fake_launch(plan, plan_path):  # the runner's launcher, without training
        seen.append(plan.name)
        assert json.loads((tmp_path / "s" / "sweep.json").read_text())["points"][len(seen) - 1]["status"] == "running"
        return 1 if plan.batch.micro_batch == 8 else 0

    out = io.StringIO()
    failed = run_sweep_local(sweep, Console(file=out, width=200), launch=fake_launch)
    assert failed == 1 and seen == ["p00_mb4", "p01_mb8", "p02_mb16"]
    statuses = {p["id"]: (p["status"], p["exit_code"]) for p in read_sweep(tmp_path / "s")["points"]}
    assert statuses == {"p00_mb4": ("done", 0), "p01_mb8": ("failed", 1), "p02_mb16": ("done", 0)}
    assert "point 2/3: p01_mb8" in out.getvalue() and "exit 1" in out.getvalue()

    # the same sweep again resumes: only the failed point runs
    seen.clear()
    again = plan_grid(None, expand_grid([*QUIET, "train.micro_batch=4,8,16"]), "s", str(tmp_path))
    assert run_sweep_local(again, Console(file=io.StringIO()), launch=lambda p, path: seen.append(p.name) or 0) == 0
    assert seen == ["p01_mb8"]


def test_a_finished_array_task_is_done_when_the_sweep_runs_again(tmp_path):
    """Slurm array tasks don't write sweep.json; running the sweep again reads their run dirs."""
    grid = expand_grid([*QUIET, "train.micro_batch=4,8"])
    sweep = plan_grid(None, grid, "s", str(tmp_path))
    for point in sweep.points:
        point.status, point.info["slurm_job"] = "submitted", f"7_{point.index}"
    sweep.write()
    finished = Path(sweep.points[0].run_dir)
    finished.mkdir(parents=True)
    (finished / "summary.json").write_text("{}")  # what a completed run leaves
    again = plan_grid(None, grid, "s", str(tmp_path))
    assert [p.status for p in again.points] == ["done", "planned"]


def test_cli_dry_run_prints_the_grid(tmp_path):
    proc = usp_cli("sweep", "conf=tiny_demo", "train.micro_batch=4,8,32", f"train.runs_dir={tmp_path}",
                   "--name", "dry", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for text in ("p00_mb4", "p01_mb8", "p02_mb32", "planned", "rejected", "train.global_batch=16"):
        assert text in proc.stdout
    assert (tmp_path / "dry" / "sweep.json").is_file() and not (tmp_path / "dry" / "p00_mb4").exists()


def test_cli_removing_a_key_with_tilde_is_not_a_sweep_value(tmp_path):
    """`~key` has no '=': it is a shared override, not a crash."""
    proc = usp_cli("sweep", "conf=tiny_demo", "+cluster.env.A=1", "~cluster.env.A", "train.micro_batch=4,8",
                   f"train.runs_dir={tmp_path}", "--name", "tilde", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    data = read_sweep(tmp_path / "tilde")
    assert data["base_overrides"][:2] == ["+cluster.env.A=1", "~cluster.env.A"]
    assert data["swept"] == {"train.micro_batch": ["4", "8"]}


def test_cli_every_point_rejected_exits_1(tmp_path):
    proc = usp_cli("sweep", "train.micro_batch=32,64", f"train.runs_dir={tmp_path}", "--name", "bad", cwd=tmp_path)
    assert proc.returncode == 1
    assert "rejected all 2 points" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_cli_bad_name_is_a_clear_error(tmp_path):
    proc = usp_cli("sweep", "train.micro_batch=4,8", f"train.runs_dir={tmp_path}", "--name", "a/b", cwd=tmp_path)
    assert proc.returncode == 2 and "--name" in proc.stderr and "Traceback" not in proc.stderr


def test_a_point_whose_data_fails_at_launch_is_that_points_failure(tmp_path):
    """A DataError while a point prepares its data (no such corpus file) fails that point, like any
    other UspError there; the sweep goes on and says why."""
    sweep = plan_grid(None, expand_grid([*QUIET, "data=text_files", f"data.paths=[{tmp_path}/nope.txt]",
                                         "train.micro_batch=4,8"]), "s", str(tmp_path))
    out = io.StringIO()
    failed = run_sweep_local(sweep, Console(file=out, width=200), launch=lambda plan, path: 0)
    assert failed == 2, out.getvalue()
    reasons = [p["reason"] for p in read_sweep(tmp_path / "s")["points"]]
    assert all("data.paths: no files match" in r for r in reasons), reasons


def test_data_that_fails_at_planning_stops_the_sweep_before_anything_is_written(tmp_path):
    missing = tmp_path / "no_tokenizer.json"
    proc = usp_cli("sweep", "data.tokenizer=hf", f"data.tokenizer_path={missing}", "train.micro_batch=4,8",
                   f"train.runs_dir={tmp_path}", "--name", "data", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2 and "data.tokenizer_path=" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists()
