"""Config composition (Hydra compose API + typed schema), recipes, error messages, the
catalogue, and the config side of the CLI. Real Hydra, real files, real `usp` processes."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import usp_cli
from usp.config import schema
from usp.config.catalogue import copy_recipe, show_item
from usp.config.compose import compose_config, resolve_recipe
from usp.config.paths import conf_dir, group_options, recipe_names, recipes_dir
from usp.contract.config_schema import ModelConfig
from usp.errors import ConfigError, UspError

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CHOICES = {"model": "tiny", "parallelism": "ddp", "optimizer": "adamw", "cluster": "local_cpu",
                   "data": "shakespeare", "fault_tolerance": "none"}


def config_error(conf=None, overrides=()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        compose_config(conf, list(overrides))
    assert isinstance(info.value, UspError)
    return info.value


# --- composing ------------------------------------------------------------------------------

def test_defaults_compose():
    cfg, choices = compose_config(None, [])
    assert cfg.model.name == "tiny"
    assert choices == DEFAULT_CHOICES
    assert cfg.model.dim == 128 and cfg.model.vocab_size == -1
    assert cfg.train.steps == 150 and cfg.train.runs_dir == "runs"
    assert cfg.cluster.procs_per_node == 1
    assert "hydra" not in cfg  # the hydra node is removed from what usp sees
    assert set(cfg) == {"model", "parallelism", "optimizer", "cluster", "data", "train", "checkpoint", "logging",
                        "profile", "planner", "fault_tolerance"}
    assert cfg.planner.profile == "usp"


def test_group_switch_changes_values_and_choices():
    cfg, choices = compose_config(None, ["parallelism=ddp", "cluster=local_cpu2"])
    assert choices == {**DEFAULT_CHOICES, "parallelism": "ddp", "cluster": "local_cpu2"}
    assert cfg.cluster.name == "local_cpu2" and cfg.cluster.procs_per_node == 2
    assert cfg.parallelism.dp_replicate == -1 and cfg.parallelism.ddp_bucket_mb == 25
    assert cfg.model.name == "tiny"  # untouched groups keep their defaults


def test_gpu_cluster_group():
    cfg, choices = compose_config(None, ["cluster=local_gpu"])
    assert choices["cluster"] == "local_gpu" and cfg.cluster.device == "cuda"


def test_dotted_overrides_are_typed():
    cfg, _ = compose_config(None, ["optimizer.lr=1e-3", "train.steps=7", "train.compile=true",
                                   "train.name=exp1"])
    assert cfg.optimizer.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.lr, float)
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.train.compile is True
    assert cfg.train.name == "exp1"


def test_int_override_of_float_field_becomes_float():
    cfg, _ = compose_config(None, ["optimizer.lr=1"])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


# --- recipes ---------------------------------------------------------------------------------

def test_recipe_by_relative_path(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg, choices = compose_config("recipes/tiny_ddp.yaml", [])
    assert choices == {**DEFAULT_CHOICES, "parallelism": "ddp", "cluster": "local_cpu2"}
    # recipe values beat config.yaml / group defaults (150 steps)
    assert cfg.train.steps == 200 and cfg.train.micro_batch == -1 and cfg.train.name == "tiny_ddp"
    assert cfg.cluster.procs_per_node == 2


def test_recipe_by_name_and_path_agree():
    by_name, choices_name = compose_config("tiny_ddp", [])
    by_path, choices_path = compose_config(str(REPO / "recipes" / "tiny_ddp.yaml"), [])
    by_stem, _ = compose_config(str(REPO / "recipes" / "tiny_ddp"), [])  # '.yaml' is optional in a path
    assert by_name == by_path == by_stem
    assert choices_name == choices_path


def test_resolve_recipe():
    assert resolve_recipe(None) == (conf_dir(), "config", ".yaml")
    assert resolve_recipe("config") == (conf_dir(), "config", ".yaml")
    assert resolve_recipe("tiny_demo") == (recipes_dir(), "tiny_demo", ".yaml")
    assert resolve_recipe(str(REPO / "recipes/tiny_ddp.yaml")) == (recipes_dir(), "tiny_ddp", ".yaml")


def test_user_overrides_beat_recipe_values():
    cfg, choices = compose_config("tiny_ddp", ["train.steps=5", "train.micro_batch=4"])
    assert cfg.train.steps == 5 and cfg.train.micro_batch == 4
    assert cfg.train.name == "tiny_ddp"  # what was not overridden stays as the recipe says


def test_command_line_group_beats_recipe_override_default():
    cfg, choices = compose_config("tiny_ddp", ["parallelism=ddp", "cluster=local_cpu"])
    assert choices["parallelism"] == "ddp" and choices["cluster"] == "local_cpu"
    assert cfg.cluster.procs_per_node == 1
    assert cfg.train.steps == 200  # recipe body still applies


def test_copied_recipe_composes_from_outside_the_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = copy_recipe("tiny_ddp", str(tmp_path))
    assert target == tmp_path / "tiny_ddp.yaml" and target.read_text() == (recipes_dir() / "tiny_ddp.yaml").read_text()
    # edit the copy: the edited file, not the catalogue's, must be what composes
    target.write_text(target.read_text().replace("steps: 200", "steps: 321"))
    cfg, choices = compose_config(str(target), [])
    assert cfg.train.steps == 321 and cfg.train.micro_batch == -1
    assert choices["parallelism"] == "ddp" and choices["cluster"] == "local_cpu2"
    # relative to the working directory, as `usp config cp` tells the user to run it
    cfg_rel, _ = compose_config("tiny_ddp.yaml", ["train.steps=9"])
    assert cfg_rel.train.steps == 9 and cfg_rel.cluster.procs_per_node == 2


def test_copy_recipe_to_a_file_name_and_refuses_to_overwrite(tmp_path):
    target = copy_recipe("tiny_demo", str(tmp_path / "mine.yaml"))
    assert target == tmp_path / "mine.yaml" and target.is_file()
    target.write_text(target.read_text() + "# my edit\n")
    with pytest.raises(UspError) as info:
        copy_recipe("tiny_demo", str(target))
    assert info.value.key == "dest" and "already exists" in str(info.value) and "--force" in info.value.fix
    assert target.read_text().endswith("# my edit\n")  # untouched
    assert copy_recipe("tiny_demo", str(target), force=True) == target
    assert target.read_text() == (recipes_dir() / "tiny_demo.yaml").read_text()


def test_copy_recipe_into_directory_refuses_existing(tmp_path):
    first = copy_recipe("tiny_demo", str(tmp_path))
    assert first == tmp_path / "tiny_demo.yaml"
    with pytest.raises(UspError) as info:
        copy_recipe("tiny_demo", str(tmp_path))
    assert info.value.key == "dest" and info.value.fix


def test_copy_unknown_recipe():
    with pytest.raises(ConfigError) as info:
        copy_recipe("tiny_dpp")
    assert info.value.key == "recipe" and "tiny_ddp" in info.value.fix


# --- free-form keys, adding, deleting ----------------------------------------------------------

def test_plus_adds_free_form_env_key():
    cfg, _ = compose_config(None, ["+cluster.env.NCCL_DEBUG=INFO", "+cluster.env.OMP_PROC_BIND=1"])
    assert dict(cfg.cluster.env) == {"NCCL_DEBUG": "INFO", "OMP_PROC_BIND": "1"}  # Dict[str, str]: "1" is a str


def test_tilde_deletes_an_added_env_key():
    cfg, _ = compose_config(None, ["+cluster.env.NCCL_DEBUG=INFO", "+cluster.env.KEEP=x", "~cluster.env.NCCL_DEBUG"])
    assert dict(cfg.cluster.env) == {"KEEP": "x"}


def test_tilde_on_typed_key_is_refused():
    err = config_error(overrides=["~train.steps"])
    assert err.key == "train.steps" and "deleted" in err.fix


def test_env_key_without_plus_is_an_error_naming_it():
    err = config_error(overrides=["cluster.env.X=1"])
    assert err.key == "cluster.env.X"


@pytest.mark.parametrize("override", ["+parallelism.tpp=4", "parallelism.tpp=4"])
def test_misspelt_key_suggests_the_right_one(override):
    err = config_error(overrides=[override])
    assert err.key == "parallelism.tpp"
    assert "parallelism.tpp" in str(err)
    assert "did you mean" in err.fix and "'parallelism.tp'" in err.fix


def test_misspelt_nested_plus_key_in_typed_section():
    err = config_error(overrides=["+train.stepz=3"])
    assert err.key == "train.stepz" and "'train.steps'" in err.fix


# --- error messages ----------------------------------------------------------------------------

def test_unknown_top_level_key():
    err = config_error(overrides=["trian.steps=3"])
    assert err.key == "trian"
    assert "did you mean key 'train'" in err.fix
    assert "train" in err.fix and "parallelism" in err.fix  # lists the top-level keys


@pytest.mark.parametrize("override,key,type_name", [
    ("train.steps=abc", "train.steps", "int"),
    ("optimizer.lr=fast", "optimizer.lr", "float"),
    ("checkpoint.enabled=maybe", "checkpoint.enabled", "bool"),
    ("cluster.nodes=1.5", "cluster.nodes", "int"),
])
def test_wrong_type_names_key_and_expected_type(override, key, type_name):
    err = config_error(overrides=[override])
    assert err.key == key
    assert key in str(err)
    assert f"expects {type_name}" in err.fix


@pytest.mark.parametrize("override,group,value,suggest", [
    ("model=tinyy", "model", "tinyy", "tiny"),
    ("cluster=local_cpu3", "cluster", "local_cpu3", "local_cpu"),
    ("parallelism=dpp", "parallelism", "dpp", "ddp"),
])
def test_bad_group_option(override, group, value, suggest):
    err = config_error(overrides=[override])
    assert err.key == group and err.value == value
    assert f"'{group}'" in str(err) and value in str(err)
    assert f"did you mean option '{suggest}" in err.fix
    for option in group_options(group):  # lists every option
        assert option in err.fix


def test_bad_group_option_inside_recipe_override():
    err = config_error("tiny_ddp", ["cluster=nowhere"])
    assert err.key == "cluster" and "local_cpu2" in err.fix


def test_unknown_conf_name():
    err = config_error("tiny_dpp")
    assert err.key == "conf" and err.value == "tiny_dpp"
    assert "tiny_ddp" in err.fix and "config" in err.fix


def test_missing_recipe_path(tmp_path):
    missing = tmp_path / "tiny_dpp.yaml"
    err = config_error(str(missing))
    assert err.key == "conf" and err.value == str(missing)
    assert "recipe 'tiny_ddp'" in err.fix


def test_recipe_named_config_outside_conf_is_refused(tmp_path):
    target = copy_recipe("tiny_ddp", str(tmp_path / "config.yaml"))
    err = config_error(str(target))
    assert err.key == "conf" and "config.yaml" in str(err) and err.fix


def test_comma_list_points_to_sweep():
    err = config_error(overrides=["parallelism.tp=1,2"])
    assert "usp sweep" in err.fix


def test_bad_override_syntax_is_a_config_error():
    err = config_error(overrides=["train.steps"])  # no '='
    assert err.fix and "key=value" in err.fix


# --- Hydra as a library: no hijacking ----------------------------------------------------------

def test_hydra_does_not_hijack_process(tmp_path, monkeypatch):
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.chdir(tmp_path)
    argv = list(sys.argv)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    compose_config(None, ["train.steps=3"])
    compose_config("tiny_ddp", [])
    with pytest.raises(ConfigError):
        compose_config(None, ["model=nope"])
    assert os.getcwd() == str(tmp_path)
    assert sys.argv == argv
    assert list(tmp_path.iterdir()) == []  # no outputs/, .hydra/, multirun/
    assert root.handlers == handlers and root.level == level
    assert not GlobalHydra.instance().is_initialized()


# --- catalogue -----------------------------------------------------------------------------------

def test_paths_catalogue():
    assert {"tiny", "llama3_2_1b", "llama3_1_8b", "llama3_1_70b", "llama3_1_405b"} <= set(group_options("model"))
    assert {"local_cpu", "local_cpu2", "local_gpu"} <= set(group_options("cluster"))
    assert {"tiny_ddp", "tiny_demo"} <= set(recipe_names())


def test_show_group_option():
    text = show_item("model=tiny")
    assert text.startswith("# model=tiny\n")
    assert "dim: 128" in text
    body = yaml.safe_load(text)
    assert body["name"] == "tiny" and body["rope_theta"] == 10000.0  # composed with schema defaults
    assert set(body) == {f.name for f in dataclasses.fields(ModelConfig)}


def test_show_recipe_names_picked_groups():
    text = show_item("tiny_ddp")
    first = text.splitlines()[0]
    assert first.startswith("# tiny_ddp:")
    for picked in ("model=tiny", "parallelism=ddp", "cluster=local_cpu2", "optimizer=adamw", "data=shakespeare"):
        assert picked in first
    assert yaml.safe_load(text)["train"]["steps"] == 200


def test_show_bad_group():
    with pytest.raises(ConfigError) as info:
        show_item("modl=tiny")
    assert info.value.key == "modl" and "model" in info.value.fix


def test_show_bad_option():
    with pytest.raises(ConfigError) as info:
        show_item("model=huge")
    assert info.value.key == "model" and info.value.value == "huge"


# --- the CLI, in this process ---------------------------------------------------------------------

def test_cli_config_list(tmp_path):
    out = usp_cli("config", "list", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for group in schema.GROUPS:
        assert group in out.stdout
    for option in ("tiny", "ddp", "adamw", "local_cpu2", "local_gpu", "shakespeare", "token_files"):
        assert option in out.stdout
    assert "recipes" in out.stdout and "tiny_ddp" in out.stdout and "tiny_demo" in out.stdout


def test_cli_train_cfg_job_prints_and_does_not_train(tmp_path):
    runs = tmp_path / "myruns"
    out = usp_cli("train", "--cfg", "job", "model=tiny", "train.steps=3", f"train.runs_dir={runs}",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "steps: 3" in out.stdout
    printed = yaml.safe_load(out.stdout)
    assert printed["train"]["steps"] == 3 and printed["model"]["name"] == "tiny"
    assert printed["train"]["runs_dir"] == str(runs)
    assert not runs.exists() and not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()
    assert not (tmp_path / "outputs").exists()


def test_cli_bad_key_is_one_clear_error(tmp_path):
    out = usp_cli("plan", "parallelism.tpp=4", cwd=tmp_path)
    assert out.returncode == 2
    assert "parallelism.tpp" in out.stderr and "did you mean" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_cli_config_cp_then_plan_the_copy(tmp_path):
    out = usp_cli("config", "cp", "tiny_ddp", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    copied = tmp_path / "tiny_ddp.yaml"
    assert copied.is_file() and str(copied) in out.stdout
    again = usp_cli("config", "cp", "tiny_ddp", str(tmp_path), cwd=tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr and "--force" in again.stderr
    assert "Traceback" not in again.stderr
    planned = usp_cli("plan", f"conf={copied}", f"train.runs_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert "run plan: tiny_ddp" in planned.stdout
    assert "parallelism=ddp" in planned.stdout and "cluster=local_cpu2" in planned.stdout
    assert "micro 8 x grad-accum 1 x dp 2" in planned.stdout
