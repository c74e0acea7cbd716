"""Messages for the user's mistakes: a broken recipe names its file and line (a YAML syntax error, an
unknown key, a wrong value, a key set twice: as on the command line, plus where), a `.yml` recipe works,
a recipe without `defaults:` says what to add, and read-only output targets (`usp plan --save`,
`usp config cp`; `usp export --out`: tests/engine/test_messages.py) are one clean error. Tests run
as root, where chmod doesn't stop writes: the unwritable targets are a file where a directory is
expected and /proc/1 (a directory no one can create files in), plus a chmod 0o500 directory when
not root."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import usp_cli

REPO = Path(__file__).resolve().parents[2]
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


# --- a recipe's (or a group file's) mistakes, as good as the same mistake on the command line (issue 31) ---

RECIPE_MISTAKES = [  # (the recipe's last lines, the key named, what the message says, what the fix says)
    ("train:\n  steps: 7\n  sede: 3\n", "train.sede", "unknown key, set at {file}:6",
     "did you mean key 'train.seed'? keys of train: name, runs_dir"),
    ("optimzer:\n  lr: 1\n", "optimzer", "unknown key, set at {file}:4", "did you mean key 'optimizer'?"),
    ("cluster:\n  slurm:\n    partitoin: gpu\n", "cluster.slurm.partitoin", "unknown key, set at {file}:6",
     "did you mean key 'cluster.slurm.partition'? keys of cluster.slurm:"),
    ("train:\n  steps: seven\n", "train.steps", "train.steps='seven': not an integer, set at {file}:5",
     "train.steps expects int, e.g. train.steps=150"),
    ("train:\n  nan_policy: ignore\n", "train.nan_policy", "not one of stop, skip, set at {file}:5",
     "train.nan_policy=stop"),
    ("profile:\n  steps: 3\n", "profile.steps", "expects a list, set at {file}:5", "profile.steps expects list"),
    ("model: 3\n", "model", "`model: 3` makes the model section a number; it is a mapping of model.* keys, set at "
     "{file}:4", "put its keys under `model:`"),  # was Hydra's ConfigCompositionException
    ("train:\n  steps: 7\n  seed: 1\n  steps: 8\n", "train.steps", "set twice in {file}, at lines 5 and 7",
     "keep one of lines 5 and 7 of mine.yaml"),
]


@pytest.mark.parametrize("body,key,says,fix", RECIPE_MISTAKES)
def test_a_recipe_mistake_names_file_line_key_and_fix(tmp_path, body, key, says, fix):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults:\n  - config\n  - _self_\n" + body)
    proc = usp_cli("plan", f"conf={recipe}", cwd=tmp_path, columns=400)
    out = _flat(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in out and "Exception" not in out, out
    assert f"error: {key}" in out and says.format(file=recipe) in out and f"fix: {fix}" in out, out


def test_the_same_mistake_on_the_command_line_says_the_same_without_a_file(tmp_path):
    proc = usp_cli("plan", "train.sede=3", cwd=tmp_path, columns=400)
    out = _flat(proc.stderr)
    assert "error: train.sede: unknown key fix: did you mean key 'train.seed'? keys of train:" in out, out


def test_a_group_file_mistake_names_it_with_the_groups_key_path(tmp_path):
    """A cluster group given by path and a conf/ group file (a copy of the catalogue: USP_CONF_DIR) name
    their own file and line, and the key under its group."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("name: mine\nnodez: 2\n")
    out = _flat(usp_cli("plan", f"cluster={mine}", cwd=tmp_path, columns=400).stderr)
    assert f"error: cluster.nodez: unknown key, set at {mine}:2" in out and "'cluster.nodes'" in out, out
    mine.write_text("name: mine\nnodes: 1\nname: again\n")
    out = _flat(usp_cli("plan", f"cluster={mine}", cwd=tmp_path, columns=400).stderr)
    assert f"error: cluster.name: set twice in {mine}, at lines 1 and 3" in out, out
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    tiny = conf / "model" / "tiny.yaml"
    tiny.write_text(tiny.read_text() + "dim: 64\n")
    lines = tiny.read_text().splitlines()
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("dim:"))
    out = _flat(usp_cli("plan", cwd=tmp_path, env={"USP_CONF_DIR": str(conf)}, columns=400).stderr)
    assert f"error: model.dim: set twice in {tiny}, at lines {first} and {len(lines)}" in out, out
    tiny.write_text("\n".join(lines[:-1]) + "\nffn_dm: 64\n")
    out = _flat(usp_cli("plan", cwd=tmp_path, env={"USP_CONF_DIR": str(conf)}, columns=400).stderr)
    assert f"error: model.ffn_dm: unknown key, set at {tiny}:{len(lines)}" in out and "'model.ffn_dim'" in out, out


@pytest.mark.parametrize("override,says,fix", [
    ("train.name=ünïcødé", "letters beyond ASCII; a name becomes a directory", "train.name=my_run"),
    ("data.tokenizer_path=/tmp/tökenizer", "an unquoted override can't", "quote the value"),
])
def test_an_override_with_letters_beyond_ascii_names_its_key(tmp_path, override, says, fix):
    """Hydra's lexer refuses them unquoted ('LexerNoViableAltException'); usp names the key and the fix."""
    proc = usp_cli("plan", override, cwd=tmp_path, columns=400)
    out = _flat(proc.stderr)
    key = override.split("=")[0]
    assert proc.returncode == 2 and "Exception" not in out, out
    assert f"error: {key}=" in out and says in out and f"fix: {fix}" in out, out
