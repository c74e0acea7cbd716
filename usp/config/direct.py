"""Compose the catalogue's common shapes with omegaconf alone, the way Hydra would.

Why: importing Hydra and its compose cost ~0.3 s, half of `usp plan`'s 0.6 s budget
(docs/benchmarks.md, start-up). What is composed here is what the catalogue and most command
lines are made of: `conf/config.yaml` or a `.yaml` recipe whose defaults list holds `config`,
`usp_schema`, `group: option`, `override group: option` and `_self_`; overrides `group=option`
and `dotted.key=value` with an unquoted scalar (int, float, bool, null or a plain string, typed by
Hydra's own lexer rules below) or a one-level list of them. The steps are Hydra 1.3's: configs
merged in defaults-list order into an empty root, group files placed under their group, the root
set to struct mode, then the value overrides applied with `OmegaConf.update(..., merge=True)`.

Anything else (`+key`, `~key`, nested lists, dicts, quotes, interpolations, sweeps, a `.yml`
recipe, a recipe folder with its own groups, a file with a `# @package` header or a nested
defaults list, or an override omegaconf refuses) returns None: Hydra composes it and words its
errors. tests/test_compose_direct.py checks that both give the same config on every recipe."""
from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

from usp.config import schema
from usp.config.paths import conf_dir

# Hydra's override lexer (hydra/grammar/OverrideLexer.g4): a value that is one INT / FLOAT / BOOL /
# NULL token becomes that type; anything else made of these characters is a plain string.
_UINT = r"(?:0|[1-9](?:_?\d)*)"
_DIGITS = r"\d(?:_?\d)*"
_POINT = rf"(?:{_UINT}?\.{_DIGITS}|{_UINT}\.)"
_FLOAT = re.compile(rf"[+-]?(?:(?:{_POINT}|{_UINT})[eE][+-]?{_DIGITS}|{_POINT}|[Ii][Nn][Ff]|[Nn][Aa][Nn])")
_INT = re.compile(rf"[+-]?{_UINT}")
_PLAIN = re.compile(r"[A-Za-z0-9_./+*?-]+")  # no quote, bracket, comma, `$`, `\`, `:`, `=` or space
_LIST = re.compile(r"\[\s*(.*?)\s*\]")  # [a,b]: one level, plain scalars; `*` and `?` stay text (globs)
_KEY = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_OPTION = re.compile(r"[\w-]+")  # and not a number, bool or null (see _option)
_PACKAGE_HEADER = re.compile(r"^\s*#\s*@package", re.MULTILINE)


class _NeedsHydra(Exception):
    """This input is outside what is composed here."""


def scalar(text: str) -> Any:
    """An unquoted override value as Hydra types it; _NeedsHydra for anything but a plain scalar."""
    if not _PLAIN.fullmatch(text):
        raise _NeedsHydra(text)
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return None if lowered == "null" else text


def value(text: str) -> Any:
    """A scalar, or a one-level list of scalars (`data.paths=[a.txt,/data/*.jsonl]`), as Hydra types them."""
    found = _LIST.fullmatch(text)
    if found is None:
        return scalar(text)
    return [scalar(item) for item in re.split(r"\s*,\s*", found.group(1))] if found.group(1) else []


def _option(text: str) -> str:
    """A group's option name: a plain string (`3d` is one, `3` would be an int to Hydra)."""
    if not _OPTION.fullmatch(text) or not isinstance(scalar(text), str):
        raise _NeedsHydra(text)
    return text


def compose_direct(directory: Path, name: str, suffix: str, overrides: list[str] | tuple[str, ...]):
    """(cfg, choices) as Hydra would compose them, or None when Hydra has to."""
    try:
        return _compose(directory, name, suffix, list(overrides))
    except Exception:  # _NeedsHydra, or omegaconf refused a file or an override: Hydra words the error
        return None


def _compose(directory: Path, name: str, suffix: str, overrides: list[str]):
    from omegaconf import OmegaConf, flag_override

    conf = conf_dir()
    if suffix != ".yaml" or (conf / f"{schema.SCHEMA_NAME}.yaml").exists():
        raise _NeedsHydra(name)
    if directory != conf and any((directory / entry).exists()
                                 for entry in ("config.yaml", f"{schema.SCHEMA_NAME}.yaml", *schema.GROUPS)):
        raise _NeedsHydra(directory)  # the recipe's folder would shadow the catalogue
    group_picks, values = _split_overrides(overrides)
    steps, choices = _defaults(directory / f"{name}.yaml", conf)
    for group, option in group_picks.items():
        if group not in choices:
            raise _NeedsHydra(group)  # adding a group needs `+group=option`: Hydra's message
        choices[group] = option
    cfg = OmegaConf.create()
    with flag_override(cfg, "no_deepcopy_set_nodes", True):
        for kind, content in steps:
            if kind == "schema":
                cfg.merge_with(OmegaConf.structured(schema.UspConfig))
            elif kind == "group":
                node = OmegaConf.create()
                OmegaConf.update(node, content, _load(conf / content / f"{choices[content]}.yaml"), merge=False)
                cfg.merge_with(node)
            else:
                cfg.merge_with(content)
    OmegaConf.set_struct(cfg, True)
    for key, typed in values:
        OmegaConf.update(cfg, key, typed, merge=True)
    return cfg, {group: choices.get(group) for group in schema.GROUPS}


def _split_overrides(overrides: list[str]) -> tuple[dict[str, str], list[tuple[str, Any]]]:
    groups: dict[str, str] = {}
    values: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for line in overrides:
        key, sep, text = line.partition("=")
        if not sep or not _KEY.fullmatch(key) or key.split(".")[0] == "hydra" or key in seen:
            raise _NeedsHydra(line)  # not key=value, Hydra's own node, or a key given twice
        seen.add(key)
        if key in schema.GROUPS:
            groups[key] = _option(text)
        else:
            values.append((key, value(text)))
    return groups, values


def _defaults(path: Path, conf: Path, depth: int = 0) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """The merge steps of a config file's defaults list, in order: ("schema", None), ("group", name),
    ("self", content); and the option picked per group, `override` entries applied."""
    if depth > 1:
        raise _NeedsHydra(path)
    content = _load(path, keep_defaults=True)
    defaults = content.pop("defaults", None)
    if defaults is None:
        raise _NeedsHydra(path)
    steps: list[tuple[str, Any]] = []
    choices: dict[str, str] = {}
    overridden: dict[str, str] = {}
    has_self = False
    for entry in defaults:
        if entry == "_self_" and not has_self:
            steps.append(("self", content))
            has_self = True
        elif entry == schema.SCHEMA_NAME:
            steps.append(("schema", None))
        elif entry == "config" and depth == 0 and path != conf / "config.yaml":
            nested_steps, nested_choices = _defaults(conf / "config.yaml", conf, depth + 1)
            steps += nested_steps
            choices.update(nested_choices)
        elif hasattr(entry, "items") and len(entry) == 1:
            (key, option), = entry.items()
            words = str(key).split()
            if not isinstance(option, str) or words[-1] not in schema.GROUPS:
                raise _NeedsHydra(entry)
            option = _option(option)
            if words == ["override", words[-1]] and words[-1] not in overridden:
                overridden[words[-1]] = option
            elif len(words) == 1 and words[0] not in choices:
                steps.append(("group", words[0]))
                choices[words[0]] = option
            else:
                raise _NeedsHydra(entry)
        else:
            raise _NeedsHydra(entry)
    if not has_self or set(overridden) - set(choices):
        raise _NeedsHydra(path)
    choices.update(overridden)
    return steps, choices


def _load(path: Path, keep_defaults: bool = False):
    """A YAML file as Hydra's file source reads it (OmegaConf.load), refusing what it would treat
    specially: a `# @package` header, or a defaults list in a group file."""
    from omegaconf import DictConfig, OmegaConf

    text = path.read_text(encoding="utf-8")
    if _PACKAGE_HEADER.search(text[:512]):
        raise _NeedsHydra(path)
    loaded = OmegaConf.load(io.StringIO(text))
    if not isinstance(loaded, DictConfig) or (not keep_defaults and "defaults" in loaded):
        raise _NeedsHydra(path)
    return loaded
