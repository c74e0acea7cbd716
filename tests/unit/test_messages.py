"""Messages for the user's mistakes: a broken recipe names its file and line, a `.yml` recipe works,
a recipe without `defaults:` says what to add, and read-only output targets (`usp plan --save`,
`usp config cp`; `usp export --out`: tests/engine/test_messages.py) are one clean error. Tests run
as root, where chmod doesn't stop writes: the unwritable targets are a file where a directory is
expected and /proc/1 (a directory no one can create files in), plus a chmod 0o500 directory when
not root."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import usp_cli

RECIPE = "defaults:\n  - config\n  - _self_\ntrain:\n  steps: 7\n  name: mine\n"


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    (tmp_path / "broken.yaml").write_text("defaults:\n  - config\n  - _self_\ntrain:\n  steps: [1, 2\n  name: x\n")
    proc = usp_cli("plan", "conf=broken.yaml", cwd=tmp_path)
    out = _flat(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"YAML syntax error at {tmp_path / 'broken.yaml'}:6:" in out and "starts at line 5" in out, out


@pytest.mark.parametrize("conf", ["mine.yml", "./mine"])
def test_yml_recipe_works(tmp_path, conf):
    (tmp_path / "mine.yml").write_text(RECIPE)
    proc = usp_cli("plan", f"conf={conf}", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "steps: 7" in proc.stdout and "name: mine" in proc.stdout and "model:" in proc.stdout


def test_recipe_without_defaults_says_what_to_add(tmp_path):
    (tmp_path / "nodefaults.yaml").write_text("train:\n  steps: 7\n")
    proc = usp_cli("plan", "conf=nodefaults.yaml", cwd=tmp_path)
    out = _flat(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "has no `defaults:` list" in out and "defaults: - config" in out and "- _self_" in out, out


def _unwritable(tmp_path: Path) -> list[tuple[str, str]]:
    """(directory, what the error says) that can't take a file, whoever runs the tests."""
    (tmp_path / "a_file").write_text("not a directory")
    out = [(str(tmp_path / "a_file" / "sub"), f"{tmp_path / 'a_file'} is a file, not a directory"),
           ("/proc/1", "can't write a file in /proc/1")]
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        out.append((str(locked / "sub"), "Permission denied"))
    return out


def test_plan_save_to_an_unwritable_runs_dir(tmp_path):
    for directory, says in _unwritable(tmp_path):
        proc = usp_cli("plan", "--save", f"train.runs_dir={directory}", cwd=tmp_path)
        out = _flat(proc.stderr)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert says in out and "train.runs_dir=" in out and "fix:" in out, out


def test_config_cp_to_an_unwritable_destination(tmp_path):
    for directory, says in _unwritable(tmp_path):
        proc = usp_cli("config", "cp", "tiny_demo", f"{directory}/x.yaml", cwd=tmp_path)
        out = _flat(proc.stderr)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert says in out and "dest=" in out, out
