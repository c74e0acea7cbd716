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
    """The engine's second line (issue 31 item 3): plan.yaml's values against the same field rules as
    `usp plan`'s, in a real worker process: one message naming the key and a fix, no traceback."""
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
    for section, key, bad in (("train", "nan_policy", "ignore"), ("train", "seed", -1),
                              ("checkpoint", "async_mode", "maybe")):
        edited = yaml.safe_load(path.read_text())
        edited["config"][section][key] = bad
        path.write_text(yaml.safe_dump(edited))
        proc = subprocess.run([sys.executable, "-m", "usp.engine.worker", "--plan", str(path)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
        assert f"usp: error on rank 0: {section}.{key}={bad!r}" in proc.stderr and "fix:" in proc.stderr, proc.stderr
        path.write_text(yaml.safe_dump(saved))
