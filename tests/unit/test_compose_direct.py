"""usp.config.direct composes the catalogue's common shapes without Hydra (start-up time): its
result must be Hydra's, node for node (types, flags, values), on every recipe; what it does not
compose it must leave to Hydra. Both run for real here: Hydra's compose API and its override
parser are the reference."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig

from usp.config.compose import _compose_with_hydra, compose_config, resolve_recipe
from usp.config.direct import _NeedsHydra, compose_direct, scalar, value
from usp.config.paths import recipe_names, recipes_dir

PRIMARIES = [None, *recipe_names()]
OVERRIDE_SETS = [
    [],
    ["model=llama3_1_8b", "cluster=slurm_h100", "parallelism=fsdp"],
    ["parallelism=3d", "cluster.nodes=2", "cluster.procs_per_node=8", "optimizer.lr=1e-4", "train.steps=1_000",
     "train.name=my-run.v2", "model.n_kv_heads=null", "train.compile=True", "optimizer=adamw_wsd"],
    ["data=stdlib", "parallelism.tp=2", "model.rope_theta=500000", "train.runs_dir=/tmp/usp-runs",
     "checkpoint.interval=-1"],
    ["data=files", "data.paths=[/data/web/*.jsonl,notes?.txt, more.md]", "parallelism.pp=2",
     "parallelism.pp_layers=[1,1]", "profile.steps=[]"],
]


def _same_node(a, b, path: str = "cfg") -> None:
    """The two configs are the same tree: node classes, metadata (types, flags) and values."""
    assert type(a) is type(b), path
    for name in ("ref_type", "object_type", "optional", "key", "flags"):
        assert getattr(a._metadata, name) == getattr(b._metadata, name), f"{path}: {name}"
    if not isinstance(a, (DictConfig, ListConfig)) or a._is_none() or a._is_missing() or a._is_interpolation():
        va, vb = a._value(), b._value()
        assert type(va) is type(vb) and (va == vb or (va != va and vb != vb)), f"{path}: {va!r} vs {vb!r}"
        return
    keys = list(a._content) if isinstance(a, DictConfig) else list(range(len(a)))
    assert keys == (list(b._content) if isinstance(b, DictConfig) else list(range(len(b)))), path
    for key in keys:
        _same_node(a._get_node(key), b._get_node(key), f"{path}.{key}")


@pytest.mark.parametrize("overrides", OVERRIDE_SETS, ids=lambda o: " ".join(o) or "none")
@pytest.mark.parametrize("conf", PRIMARIES, ids=lambda c: c or "config")
def test_direct_compose_equals_hydra(conf, overrides):
    where = resolve_recipe(conf)
    direct = compose_direct(*where, overrides)
    assert direct is not None, "the catalogue's own shapes are composed without Hydra"
    cfg, choices = _compose_with_hydra(*where, overrides)
    assert direct[1] == choices
    _same_node(direct[0], cfg)


def test_recipe_outside_the_catalogue_is_composed_directly_too(tmp_path):
    shutil.copy(recipes_dir() / "tiny_ddp.yaml", tmp_path / "mine.yaml")
    where = resolve_recipe(str(tmp_path / "mine.yaml"))
    direct = compose_direct(*where, ["train.steps=7"])
    assert direct is not None
    _same_node(direct[0], _compose_with_hydra(*where, ["train.steps=7"])[0])


VALUES = ["0", "7", "-3", "+5", "1_000", "1__0", "007", "0x10", "1.5", "-0.25", ".5", "5.", "1e-4", "3.0E+2", "1.5.5",
          "1_0.0_1", "inf", "-inf", "NaN", "Infinity", "true", "False", "TRUE", "null", "Null", "nullable", "true_x",
          "tiny", "my-run.v2", "/data/x.bin", "runs/a+b", "8B", "3d", "-", "+", ".", "_", "a.b.c", "5-"]


@pytest.mark.parametrize("text", VALUES)
def test_scalars_are_typed_as_hydra_types_them(text):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    expected = OverridesParser.create().parse_override(f"k={text}").value()
    got = scalar(text)
    assert type(got) is type(expected)
    assert got == expected or (isinstance(got, float) and math.isnan(got) and math.isnan(expected))


@pytest.mark.parametrize("text", ["", "a b", "'x'", '"x"', "[1,2]", "{a:1}", "a,b", "${model.dim}", "a:b", "a=b",
                                  "x\\y", "100%", "a@b"])
def test_scalars_outside_the_plain_subset_go_to_hydra(text):
    with pytest.raises(_NeedsHydra):
        scalar(text)


@pytest.mark.parametrize("text", ["[]", "[ ]", "[1,2]", "[a, b]", "[/data/*.txt]", "[1.5,true,null,x-y]", "[ 3 ,4 ]",
                                  "*.txt", "file?.md"])
def test_lists_are_typed_as_hydra_types_them(text):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    expected = OverridesParser.create().parse_override(f"k={text}").value()
    got = value(text)
    assert got == expected and [type(v) for v in (got if isinstance(got, list) else [got])] == \
        [type(v) for v in (expected if isinstance(expected, list) else [expected])]


@pytest.mark.parametrize("text", ["[[1]]", "[a,'b']", "[a,,b]", "[a]b", "[a],[b]", "[${x}]", "[a:b]"])
def test_lists_outside_the_plain_subset_go_to_hydra(text):
    with pytest.raises(_NeedsHydra):
        value(text)


@pytest.mark.parametrize("overrides", [
    ["+cluster.env.FOO=1"], ["~cluster.env"], ["++train.steps=3"], ["train.micro_batch=4,8"],
    ["data.paths=[[a.txt]]"], ["train.name='x y'"], ["model=no_such_model"], ["train.nope=1"], ["train.steps=abc"],
    ["hydra.job.name=x"], ["train.steps=3", "train.steps=4"], ["model=tiny", "model=llama3_1_8b"], ["model.dim"],
    ["cluster.env.FOO=1"], ["train=3"], ["model=true"],
])
def test_what_direct_does_not_compose_goes_to_hydra(overrides):
    assert compose_direct(*resolve_recipe(None), overrides) is None


def _recipe(folder: Path, text: str) -> tuple[Path, str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "r.yaml").write_text(text)
    return folder, "r", ".yaml"


@pytest.mark.parametrize("text", [
    "defaults:\n  - config\n  - override model: llama3_1_8b\n",  # no _self_: Hydra's placement rules
    "defaults:\n  - config\n  - override nosuchgroup: x\n  - _self_\n",
    "defaults:\n  - config\n  - model: tiny\n  - _self_\n",  # a second model entry: Hydra's error
    "defaults:\n  - tiny_ddp\n  - _self_\n",  # another recipe as the base
    "# @package _global_\ndefaults:\n  - config\n  - _self_\n",
    "defaults:\n  - config\n  - optional model: tiny\n  - _self_\n",
])
def test_recipe_shapes_left_to_hydra(tmp_path, text):
    assert compose_direct(*_recipe(tmp_path, text), []) is None


def test_a_recipe_folder_with_its_own_group_files_goes_to_hydra(tmp_path):
    where = _recipe(tmp_path, "defaults:\n  - config\n  - override model: mine\n  - _self_\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("name: mine\ndim: 64\n")
    assert compose_direct(*where, []) is None
    cfg, choices = compose_config(str(tmp_path / "r.yaml"))  # Hydra finds the recipe's own group file
    assert choices["model"] == "mine" and cfg.model.dim == 64


def test_a_yml_recipe_goes_to_hydra(tmp_path):
    (tmp_path / "r.yml").write_text("defaults:\n  - config\n  - _self_\ntrain:\n  steps: 9\n")
    where = resolve_recipe(str(tmp_path / "r.yml"))
    assert compose_direct(*where, []) is None
    assert compose_config(str(tmp_path / "r.yml"))[0].train.steps == 9
