"""Compose a usp config with Hydra's compose API: primary config (a name in conf/ or a
recipe file) + command-line overrides -> a typed DictConfig.

Hydra is used as a library: it never touches argv, the working directory or logging,
and creates no outputs/ directory."""
from __future__ import annotations

import contextlib
import os
import tempfile
import typing
from collections.abc import Iterator
from dataclasses import is_dataclass
from pathlib import Path

from usp.config import schema
from usp.config.hydra_errors import suggest, translate
from usp.config.init_from import leave_to_checkpoint
from usp.config.paths import conf_dir, group_options, recipe_names, recipes_dir
from usp.config.recipe import check_group_file, check_recipe_file, hydra_primary
from usp.contract.config_schema import UspConfig
from usp.errors import ConfigError


def resolve_recipe(conf: str | None) -> tuple[Path, str, str]:
    """`conf=` value -> (directory, config name, the file's suffix: .yaml or .yml). A path (contains '/'
    or ends in .yaml or .yml) is a recipe file; a bare name is looked up in conf/ and then in recipes/."""
    if conf is None:
        return conf_dir(), "config", ".yaml"
    looks_like_path = conf.endswith((".yaml", ".yml")) or "/" in conf or os.sep in conf
    if looks_like_path:
        path = Path(conf).expanduser()
        if not path.suffix:
            path = next((p for p in (path.with_suffix(".yaml"), path.with_suffix(".yml")) if p.is_file()),
                        path.with_suffix(".yaml"))
        if not path.is_file():
            raise ConfigError("no such recipe file", key="conf", value=conf,
                              fix=suggest(path.stem, recipe_names(), "recipe") + "list them with `usp config list`")
        if path.stem == "config" and path.resolve().parent != conf_dir():
            raise ConfigError("a recipe may not be named config.yaml (it would shadow conf/config.yaml, "
                              "which recipes extend)", key="conf", value=conf, fix="rename the file")
        return path.resolve().parent, path.stem, path.suffix
    for directory in (conf_dir(), recipes_dir()):
        if (directory / f"{conf}.yaml").is_file():
            return directory, conf, ".yaml"
    names = ["config"] + recipe_names()
    raise ConfigError("no primary config or recipe of that name", key="conf", value=conf,
                      fix=suggest(conf, names, "name") + f"one of: {', '.join(names)}")


def check_catalogue() -> None:
    """A missing conf/ is an install problem: say so, instead of Hydra's 'config not found'."""
    if (conf_dir() / "config.yaml").is_file():
        return
    if "USP_CONF_DIR" in os.environ:
        raise ConfigError("no config.yaml in this folder", key="USP_CONF_DIR", value=os.environ["USP_CONF_DIR"],
                          fix="point it at a copy of usp's conf/ (config.yaml and the group folders)")
    raise ConfigError(f"usp's config catalogue (conf/config.yaml) is not installed: not in {conf_dir()}",
                      fix="install usp from its checkout (`pip install -e .`) or from a wheel built from it "
                          "(both ship conf/ and recipes/), or set USP_CONF_DIR to a copy of conf/")


def compose_config(conf: str | None = None, overrides: list[str] | tuple[str, ...] = ()):
    """Return (cfg, choices): the composed, validated config and the option picked per group (a group
    given as a YAML file, cluster=path/to/mine.yaml: the file's path). With model.init_from, the model
    keys neither the recipe nor the command line set are MISSING: the planner takes them from the
    checkpoint's config.json (usp/config/init_from.py)."""
    check_catalogue()
    directory, name, suffix = resolve_recipe(conf)
    check_recipe_file(directory / f"{name}{suffix}")
    cfg, choices = _compose_with_hydra(directory, name, suffix, overrides)
    return leave_to_checkpoint(cfg, directory / f"{name}{suffix}", overrides, choices.get("model")), choices


FILE_OPTION = "_file_"  # the option name a group file given by path is linked under (no catalogue option has it)


def _group_file(override: str) -> tuple[str, Path] | None:
    """(group, file) of an override `group=path/to/file.yaml`, checked; None for any other override."""
    group, eq, value = override.partition("=")
    if not eq or group not in schema.GROUPS or not (value.endswith((".yaml", ".yml")) or "/" in value):
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        options = group_options(group)
        raise ConfigError(f"no such {group} file, and no option of that name in config group '{group}'", key=group,
                          value=value, fix=suggest(path.stem, options, "option")
                          + f"a YAML file of the {group} group (e.g. one `usp calibrate --out` wrote), "
                            f"or one of: {', '.join(options)}")
    check_group_file(path.resolve(), group)
    return group, path.resolve()


@contextlib.contextmanager
def _linked_groups(overrides) -> Iterator[tuple[list[str], Path | None, dict[str, Path]]]:
    """Overrides with every `group=<file.yaml>` replaced by `group=_file_<stem>`, the option linked to the
    file in a temporary config dir (searched first), and {group: file}."""
    files = {g: f for g, f in filter(None, (_group_file(o) for o in overrides))}
    if not files:
        yield list(overrides), None, {}
        return
    with tempfile.TemporaryDirectory(prefix="usp-groups-") as tmp:
        out = []
        for override in overrides:
            found = _group_file(override)
            if found is None:
                out.append(override)
                continue
            group, path = found
            (Path(tmp) / group).mkdir(exist_ok=True)
            (Path(tmp) / group / f"{FILE_OPTION}{path.stem}.yaml").symlink_to(path)
            out.append(f"{group}={FILE_OPTION}{path.stem}")
        yield out, Path(tmp), files


def _compose_with_hydra(directory: Path, name: str, suffix: str, overrides: list[str] | tuple[str, ...]):
    """Hydra's compose API; its errors become one ConfigError each (usp.config.hydra_errors)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf, open_dict

    schema.register()
    GlobalHydra.instance().clear()
    roots: list[Path] = []
    try:
        with _linked_groups(overrides) as (linked, group_dir, files), hydra_primary(directory, name, suffix) as \
                (hydra_dir, extra), initialize_config_dir(config_dir=str(hydra_dir), version_base="1.3"):
            roots = [hydra_dir, *([group_dir] if group_dir else []), conf_dir(), *extra]
            search = f"hydra.searchpath=[{','.join(f'file://{d}' for d in roots[1:])}]"
            try:
                cfg = compose(config_name=name, overrides=[*linked, search], return_hydra_config=True)
            except Exception as exc:  # Hydra raises several unrelated types; all become one clear message
                raise translate(exc, lambda config: _config_file(config, roots)) from None
    finally:
        GlobalHydra.instance().clear()
    choices = {g: str(files[g]) if g in files else cfg.hydra.runtime.choices.get(g) for g in schema.GROUPS}
    with open_dict(cfg):
        del cfg["hydra"]
    # `+key` adds keys even to a typed section: refuse the ones the schema lacks.
    check_known_keys(typing.cast(dict, OmegaConf.to_container(cfg, resolve=False)), UspConfig)
    return cfg, choices


def _config_file(config: str, roots: list[Path]) -> Path | None:
    """The YAML file Hydra loaded for a config name ('my_recipe', 'model/tiny', 'cluster/_file_mine'),
    symlinks followed to the user's own file."""
    return next((p.resolve() for root in roots for p in [root / f"{config}.yaml"] if p.is_file()), None)


def check_known_keys(node: dict, cls: type, prefix: str = "") -> None:
    """`+section.key=value` is accepted by Hydra even for a typed section: reject keys the
    schema does not declare (free-form dict fields such as cluster.env are allowed)."""
    hints = typing.get_type_hints(cls)
    for key, value in node.items():
        full = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError("unknown key", key=full, fix=suggest(key, list(hints), "key", prefix)
                              + f"keys of {prefix.rstrip('.') or 'the config'}: {', '.join(hints)}")
        if is_dataclass(hints[key]) and isinstance(value, dict):
            check_known_keys(value, hints[key], f"{full}.")
