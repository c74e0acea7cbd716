"""plan.yaml as the one contract (usp/contract/plan_file.py): read back as the RunPlan that was written,
a plan of another version refused wherever it is read with the fix, a malformed one named in one line,
and a plan of the previous version (tests/golden/plan_v1.yaml, as usp wrote it before version 2) read
with the choices today's planner makes for the same config."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, plan_for, usp_cli
from usp.contract.plan_file import read_plan, write_plan
from usp.contract.run_plan import PLAN_VERSION
from usp.contract.typed import PlanFileError

GOLDEN_V1 = REPO / "tests" / "golden" / "plan_v1.yaml"
V1_OVERRIDES = ["train.name=v1run", "train.steps=4", "checkpoint.interval=2"]


def _run_dir_with(tmp_path: Path, plan_text: str) -> Path:
    """A run directory holding `plan_text` as its plan.yaml and two logged steps."""
    run = tmp_path / "runs" / "v1run"
    run.mkdir(parents=True)
    data = yaml.safe_load(plan_text)
    data["run_dir"] = str(run)
    (run / "plan.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 8.0 - s, "tokens_per_s": 1000.0}) + "\n"
                                               for s in (1, 2)))
    return run


def test_a_previous_version_plan_reads_with_todays_decisions(tmp_path):
    old = read_plan(GOLDEN_V1)
    new = plan_for(*V1_OVERRIDES, runs_dir=tmp_path)
    assert old.version == PLAN_VERSION == new.version
    assert old.decisions == new.decisions.__class__(**{**new.decisions.__dict__,
                                                        "checkpoint_dir": old.decisions.checkpoint_dir})
    assert old.decisions.checkpoint_dir == str(Path(old.run_dir) / "checkpoints")
    assert (old.degrees, old.batch, old.model, old.config) == (new.degrees, new.batch, new.model, old.config)
    assert old.config.train.steps == 4 and old.config.checkpoint.interval == 2


def test_usp_status_and_report_read_a_previous_version_run_directory(tmp_path):
    run = _run_dir_with(tmp_path, GOLDEN_V1.read_text())
    status = usp_cli("status", str(run), cwd=tmp_path)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    assert "v1run" in status.stdout and "2 / 4: loss 6.0000" in status.stdout
    report = usp_cli("report", str(run), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "| v1run |" in (run / "report" / "report.md").read_text()


@pytest.mark.parametrize("version", [0, 4, None])
def test_another_version_is_refused_wherever_it_is_read(tmp_path, version):
    text = GOLDEN_V1.read_text().replace("\nversion: 1\n", f"\nversion: {version if version is not None else 'null'}\n")
    run = _run_dir_with(tmp_path, text)
    with pytest.raises(PlanFileError) as err:
        read_plan(run)
    assert err.value.key == "version" and "plan the run again" in err.value.fix
    for command in (["status", str(run)], ["report", str(run)]):
        proc = usp_cli(*command, cwd=tmp_path)
        said = " ".join(proc.stderr.split())
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        named = f"version={version!r}" if version is not None else "version: "
        assert named in said and f"a plan of version {version!r}; this usp reads versions 1, 2, 3" in said, said
        assert "fix: plan the run again" in said, said


def test_a_malformed_plan_is_named_in_one_line(tmp_path):
    """#42: `usp status` / `usp report` on a plan.yaml that isn't YAML printed yaml's traceback."""
    run = tmp_path / "runs" / "broken"
    run.mkdir(parents=True)
    (run / "plan.yaml").write_text("name: [unclosed\nworld_size: 1\n")
    for command in (["status", str(run)], ["report", str(run)]):
        proc = usp_cli(*command, cwd=tmp_path)
        said = " ".join(proc.stderr.split())
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{run / 'plan.yaml'} is not valid YAML (line" in said and "fix: plan the run again" in said, said


def test_a_value_of_the_wrong_type_names_its_key(tmp_path):
    plan = plan_for(runs_dir=tmp_path)
    path = write_plan(plan, tmp_path / "plan.yaml")
    data = yaml.safe_load(path.read_text())
    data["batch"]["micro_batch"] = "16"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanFileError) as err:
        read_plan(path)
    assert (err.value.key, err.value.value) == ("batch.micro_batch", "16")
    data["batch"]["micro_batch"], data["nonsense"] = 16, 1
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanFileError) as err:
        read_plan(path)
    assert err.value.key == "nonsense"


def test_a_version_2_plan_reads_with_its_timing_constants_renamed_or_dropped(tmp_path):
    """Version 2's cluster.timing held the previous time model's constants: those that kept their meaning are
    renamed (kernel_efficiency -> gemm_efficiency, the ring steps' latencies), the others dropped."""
    plan = plan_for(*V1_OVERRIDES, runs_dir=tmp_path)
    data = plan.to_dict()
    data["version"] = 2
    data["config"]["cluster"]["timing"] = {"kernel_efficiency": 0.6, "kernel_half_tokens": 128.0, "intra_hop_us": 7.0,
                                           "call_overhead_us": 130.0, "eager_overhead": 0.2,
                                           "calibrated": {"source": "old.csv", "runs": 3}}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    back = read_plan(path)
    timing = back.config.cluster.timing
    assert back.version == PLAN_VERSION and (timing.gemm_efficiency, timing.intra_latency_us) == (0.6, 7.0)
    assert timing.eager_overhead == 0.2 and timing.calibrated.source == "old.csv" and timing.calibrated.runs == 3
    assert back.decisions == plan.decisions and back.timing == plan.timing
