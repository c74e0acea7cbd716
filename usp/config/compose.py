"""Compose a usp config with Hydra's compose API: primary config (a name in conf/ or a
recipe file) + command-line overrides -> a typed DictConfig.

Hydra is used as a library: it never touches argv, the working directory or logging,
and creates no outputs/ directory."""
from __future__ import annotations

import difflib
import os
import re
import typing
from dataclasses import is_dataclass
from pathlib import Path

from usp.config import schema
from usp.config.init_from import leave_to_checkpoint
from usp.config.paths import conf_dir, group_options, recipe_names, recipes_dir
from usp.config.recipe import check_recipe_file, hydra_primary
from usp.errors import ConfigError


def resolve_primary(conf: str | None) -> tuple[Path, str]:
    """`conf=` value -> (directory, config name). A path (contains '/' or ends in .yaml or .yml)
    is a recipe file; a bare name is looked up in conf/ and then in recipes/."""
    directory, name, _ = resolve_recipe(conf)
    return directory, name


def resolve_recipe(conf: str | None) -> tuple[Path, str, str]:
    """resolve_primary's (directory, name) and the file's suffix (.yaml or .yml)."""
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
                              fix=_suggest(path.stem, recipe_names(), "recipe") + "list them with `usp config list`")
        if path.stem == "config" and path.resolve().parent != conf_dir():
            raise ConfigError("a recipe may not be named config.yaml (it would shadow conf/config.yaml, "
                              "which recipes extend)", key="conf", value=conf, fix="rename the file")
        return path.resolve().parent, path.stem, path.suffix
    for directory in (conf_dir(), recipes_dir()):
        if (directory / f"{conf}.yaml").is_file():
            return directory, conf, ".yaml"
    names = ["config"] + recipe_names()
    raise ConfigError("no primary config or recipe of that name", key="conf", value=conf,
                      fix=_suggest(conf, names, "name") + f"one of: {', '.join(names)}")


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
    """Return (cfg, choices): the composed, validated config and the option picked per group. With
    model.init_from, the model keys neither the recipe nor the command line set are MISSING: the
    planner takes them from the checkpoint's config.json (usp/config/init_from.py)."""
    check_catalogue()
    directory, name, suffix = resolve_recipe(conf)
    check_recipe_file(directory / f"{name}{suffix}")
    cfg, choices = _compose_with_hydra(directory, name, suffix, overrides)
    return leave_to_checkpoint(cfg, directory / f"{name}{suffix}", overrides, choices.get("model")), choices


def _compose_with_hydra(directory: Path, name: str, suffix: str, overrides: list[str] | tuple[str, ...]):
    """Hydra's compose API; its errors become one ConfigError each (_translate)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf, open_dict

    schema.register()
    GlobalHydra.instance().clear()
    try:
        with hydra_primary(directory, name, suffix) as (hydra_dir, extra), \
                initialize_config_dir(config_dir=str(hydra_dir), version_base="1.3"):
            search = f"hydra.searchpath=[{','.join(f'file://{d}' for d in [conf_dir(), *extra])}]"
            cfg = compose(config_name=name, overrides=[*overrides, search], return_hydra_config=True)
    except Exception as exc:  # Hydra raises several unrelated types; all become one clear message
        raise _translate(exc) from None
    finally:
        GlobalHydra.instance().clear()
    choices = {g: cfg.hydra.runtime.choices.get(g) for g in schema.GROUPS}
    with open_dict(cfg):
        del cfg["hydra"]
    # `+key` adds keys even to a typed section: refuse the ones the schema lacks.
    check_known_keys(typing.cast(dict, OmegaConf.to_container(cfg, resolve=False)), schema.UspConfig)
    return cfg, choices


def check_known_keys(node: dict, cls: type, prefix: str = "") -> None:
    """`+section.key=value` is accepted by Hydra even for a typed section: reject keys the
    schema does not declare (free-form dict fields such as cluster.env are allowed)."""
    hints = typing.get_type_hints(cls)
    for key, value in node.items():
        full = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError("unknown key", key=full, fix=_suggest(key, list(hints), "key", prefix)
                              + f"keys of {prefix.rstrip('.') or 'the config'}: {', '.join(hints)}")
        if is_dataclass(hints[key]) and isinstance(value, dict):
            check_known_keys(value, hints[key], f"{full}.")


def _translate(exc: Exception) -> ConfigError:
    cause = exc.__cause__ or exc
    text = str(cause)
    missing = re.search(r"Could not find '([\w/]+)/([^']+)'", str(exc))
    if missing:
        group, option = missing.group(1).split("/")[-1], missing.group(2)
        options = group_options(group)
        return ConfigError(f"no option '{option}' in config group '{group}'", key=group, value=option,
                           fix=_suggest(option, options, "option") + f"available: {', '.join(options)}")
    full_key = getattr(cause, "full_key", None) or _key_in_message(str(exc))
    first_line = text.strip().splitlines()[0] if text.strip() else type(cause).__name__
    if full_key:
        parent, _, leaf = full_key.rpartition(".")
        candidates = _schema_keys(parent)
        if candidates and leaf not in candidates:
            return ConfigError("unknown key", key=full_key,
                               fix=_suggest(leaf, candidates, "key", f"{parent}." if parent else "")
                               + f"keys of {parent or 'the config'}: {', '.join(candidates)}")
        return ConfigError(first_line, key=full_key, fix=_known_fix(text) or _type_fix(full_key))
    return ConfigError(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                       + (f" ({first_line})" if cause is not exc else ""),
                       fix=_known_fix(str(exc))
                       or "check the override syntax: key=value, +key=value to add, ~key to delete")


def _known_fix(message: str) -> str | None:
    if "does not support deletion" in message:
        return ("keys of a typed section can't be deleted, set a value instead "
                "(~ deletes free-form keys such as cluster.env.NAME)")
    if "An item is already at" in message:
        return "the key exists already: drop the leading + (use key=value)"
    if "To append to your config use" in message:
        return "that key is new here: add it with a leading +, e.g. +" + message.split("use +", 1)[1].split()[0]
    if "Ambiguous value" in message:
        return "a comma list is a sweep: run it with `usp sweep`, or quote the value: key='a,b'"
    if "Error parsing override" in message:
        return "overrides are key=value, +key=value (add) or ~key (delete)"
    return None


def _key_in_message(message: str) -> str | None:
    found = re.search(r"(?:override|Key) '([\w.]+)'", message)
    return found.group(1) if found else None


def _schema_keys(dotted: str) -> list[str]:
    cls: typing.Any = schema.UspConfig
    for part in filter(None, dotted.split(".")):
        hint = typing.get_type_hints(cls).get(part)
        if not is_dataclass(hint):
            return []
        cls = hint
    return list(typing.get_type_hints(cls))


def _type_fix(full_key: str) -> str | None:
    parent, _, leaf = full_key.rpartition(".")
    cls: typing.Any = schema.UspConfig
    for part in filter(None, parent.split(".")):
        cls = typing.get_type_hints(cls).get(part)
        if not is_dataclass(cls):
            return None
    hint = typing.get_type_hints(cls).get(leaf)
    return f"{full_key} expects {_type_name(hint)}" if hint is not None else None


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _suggest(word: str, candidates: list[str], what: str, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"did you mean {what} '{prefix}{close[0]}'? " if close else ""
