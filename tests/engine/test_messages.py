"""`usp export --out` to a place that can't take a file is one clean error, before the checkpoint is
looked for; a plan.yaml edited to hold a bad value is refused by the worker in one line (the other
messages: tests/unit/test_messages.py, tests/unit/test_field_rules.py)."""
from __future__ import annotations

from tests.helpers import usp_cli
from tests.unit.test_messages import _flat, _unwritable


def test_export_out_to_an_unwritable_place_before_loading(tmp_path):
    """Checked before the checkpoint is even looked for (a long load would be wasted)."""
    for directory, says in _unwritable(tmp_path):
        proc = usp_cli("export", str(tmp_path / "no_such_run"), "--out", f"{directory}/model", cwd=tmp_path)
        out = _flat(proc.stderr)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert says in out and "--out=" in out, out


def test_an_edited_plan_is_refused_by_the_engine_in_one_line(tmp_path, shakespeare):
    """A rank reads plan.yaml back as a RunPlan (usp/contract/plan_file.py): a value of the wrong type, an
    inconsistent layout or another version is refused in a real worker process with one message naming
    the key and the fix (plan again), no traceback, before torch does any work. (Each value's range is a
    plan-time rule; the engine trusts the plan for those.)"""
    import io
    import subprocess
    import sys

    import yaml
    from rich.console import Console

    from usp.config.compose import compose_config
    from usp.launch.pre_launch import prepare_run
    from usp.run.lock import release

    cfg, choices = compose_config(None, ["train.name=edited", "train.steps=2", f"train.runs_dir={tmp_path}"])
    plan, path = prepare_run(cfg, choices, console=Console(file=io.StringIO()))
    release(plan.run_dir)
    saved = yaml.safe_load(path.read_text())
    edits = [(("config", "train", "nan_policy"), "ignore"), (("config", "checkpoint", "async_mode"), "maybe"),
             (("world_size",), 3), (("version",), 0), (("config", "train", "seed"), "1234")]
    for keys, bad in edits:
        edited = yaml.safe_load(path.read_text())
        node = edited
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = bad
        path.write_text(yaml.safe_dump(edited))
        proc = subprocess.run([sys.executable, "-m", "usp.engine.worker", "--plan", str(path)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
        said = " ".join(proc.stderr.split())
        assert f"usp: error on rank 0: {'.'.join(keys)}={bad!r}" in said and "fix: plan the run again" in said, said
        path.write_text(yaml.safe_dump(saved))
