"""Hydra's and omegaconf's errors as one ConfigError each, as good from a YAML file as from the command
line: the full key path, the value, a did-you-mean, the fix, and, when a file set it (a recipe, a
conf/ group file, a cluster=<path.yaml>), the file and the line (usp.config.recipe.key_line)."""
from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Callable
from dataclasses import is_dataclass
from pathlib import Path

import yaml

from usp.config import schema
from usp.config.paths import group_options
from usp.config.recipe import duplicate_key_error, key_line, yaml_syntax_error
from usp.contract.config_schema import UspConfig
from usp.errors import ConfigError

# What omegaconf says (the first line of its message), and what it means.
_UNKNOWN = re.compile(r"Key '([^']+)' not in '\w+'")
_ENUM = re.compile(r"Invalid value '(.*)', expected one of \[(.*)\]")
_CONVERT = re.compile(r"Value '(.*)' of type '\w+' could not be converted to (\w+)")
_NOT_CONTAINER = re.compile(r"(?:Invalid value assigned: \w+ is not a ListConfig|Cannot assign \w+ to (Dict))")
_NOT_OPTIONAL = re.compile(r"(?:[Nn]on optional field cannot be assigned None|is not Optional)")
_IN_CONFIG = re.compile(r"^In '([^']+)':", re.M)
_FULL_KEY = re.compile(r"full_key: (\S+)")
TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}


def translate(exc: Exception, config_file: Callable[[str], Path | None]) -> ConfigError:
    """One ConfigError for an exception raised while Hydra composed. `config_file(name)`: the YAML file of
    a config name Hydra loaded (the primary 'my_recipe', a group's 'model/tiny'), or None."""
    if isinstance(exc, yaml.MarkedYAMLError):  # Hydra's loader: a syntax error or a key set twice
        mark = exc.problem_mark or exc.context_mark
        path = Path(mark.name) if mark is not None and mark.name and Path(mark.name).is_file() else None
        if path is not None:  # a group's file (a recipe's own mistakes are found before Hydra reads it)
            group = path.parent.name if path.parent.name in schema.GROUPS else ""
            return duplicate_key_error(path, group) or yaml_syntax_error(path, exc, group or "conf")
    cause = exc.__cause__ or exc
    text = f"{exc}\n{cause}"
    missing = re.search(r"Could not find '(\w+)/([^']+)'", str(exc))  # 'cluster/cal/x': group cluster, option cal/x
    if missing:
        return _group_option(missing.group(1), missing.group(2))
    named = _FULL_KEY.search(text) or _key_in_message(text)
    found_key = getattr(cause, "full_key", None) or (named.group(1) if named else None)
    source = _IN_CONFIG.search(str(exc))
    where = _where(config_file(source.group(1)), source.group(1), found_key) if source and found_key else ""
    inner = _inner_message(exc, cause)
    if found_key:
        return _key_error(str(found_key), inner, text, where)
    unquoted = _unquoted_override(str(exc))
    if unquoted is not None:
        return unquoted
    return ConfigError(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                       + (f" ({inner})" if cause is not exc else ""),
                       fix=_known_fix(str(exc)) or "check the override syntax: key=value, +key=value to add, "
                                                   "~key to delete")


def _unquoted_override(message: str) -> ConfigError | None:
    """An override whose value holds characters Hydra's grammar takes only quoted (train.name=ünïcødé: the
    lexer's 'LexerNoViableAltException'), named with its key and the quoting that lets it through."""
    found = re.search(r"LexerNoViableAltException: ([\w.+~/]+)=(.*)$", message.strip().splitlines()[0])
    if found is None or found.group(2).isascii():
        return None
    key, value = found.group(1).lstrip("+~"), found.group(2)
    if key.endswith(".name"):  # a run's or a model's name becomes a directory: ASCII only, quoted or not
        return ConfigError(f"{value!r} holds letters beyond ASCII; a name becomes a directory", key=key, value=value,
                           fix=f"{key}=my_run (letters, digits, '.', '_', '-')")
    return ConfigError(f"{value!r} holds characters an unquoted override can't (letters beyond ASCII)", key=key,
                       value=value, fix=f"quote the value, as '{key}=\"{value}\"'")


def _inner_message(exc: Exception, cause: BaseException) -> str:
    """omegaconf's own first line: the cause's, or the line after Hydra's 'In <config>: ... composing config:'."""
    lines = [ln for ln in str(cause if cause is not exc else exc).strip().splitlines() if ln.strip()]
    if lines and _IN_CONFIG.match(lines[0]) and len(lines) > 1:
        return lines[1].strip()
    return lines[0].strip() if lines else type(cause).__name__


def _where(path: Path | None, name: str, full_key: str) -> str:
    """', set at <file>:<line>' for a key a YAML file set (its package, the group, comes off the path)."""
    if path is None:
        return f", set in config '{name}'"
    group = name.rpartition("/")[0]
    in_file = full_key[len(group) + 1:] if group and full_key.startswith(f"{group}.") else full_key
    line = key_line(path, in_file)
    return f", set at {path}:{line}" if line else f", set in {path}"


def _key_error(full_key: str, inner: str, text: str, where: str) -> ConfigError:
    parent, _, leaf = full_key.rpartition(".")
    leaf = re.sub(r"\[\d+\]$", "", leaf)
    candidates = _schema_keys(parent)
    if _UNKNOWN.search(inner) or (candidates and leaf not in candidates):
        return ConfigError(f"unknown key{where}", key=full_key,
                           fix=suggest(leaf, candidates, "key", f"{parent}." if parent else "")
                           + f"keys of {parent or 'the config'}: {', '.join(candidates)}")
    enum = _ENUM.search(inner)
    if enum:
        choices = [c.strip() for c in enum.group(2).split(",")]
        close = difflib.get_close_matches(enum.group(1), choices, n=1, cutoff=0.6)
        return ConfigError(f"not one of {', '.join(choices)}{where}", key=full_key, value=enum.group(1),
                           fix=f"{full_key}={close[0]} (did you mean it?)" if close
                           else f"{full_key}={schema.default_of(full_key) or choices[0]} (the default)")
    convert = _CONVERT.search(inner)
    if convert:
        return ConfigError(f"not {TYPE_WORDS.get(convert.group(2), convert.group(2).lower())}{where}", key=full_key,
                           value=convert.group(1), fix=_type_fix(full_key))
    if _NOT_OPTIONAL.search(inner):
        return ConfigError(f"can't be null{where}", key=full_key, fix=_type_fix(full_key))
    container = _NOT_CONTAINER.search(inner)
    if container:
        return ConfigError(f"expects {'a mapping' if container.group(1) else 'a list'}{where}", key=full_key,
                           fix=_type_fix(full_key))
    return ConfigError(f"{inner}{where}", key=full_key, fix=_known_fix(text) or _type_fix(full_key))


def _group_option(group: str, option: str) -> ConfigError:
    options = group_options(group)
    return ConfigError(f"no option '{option}' in config group '{group}'", key=group, value=option,
                       fix=suggest(option, options, "option") + f"available: {', '.join(options)}; "
                           f"or a YAML file: {group}=path/to/my_{group}.yaml")


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


def _key_in_message(message: str) -> re.Match | None:
    return re.search(r"(?:override|Key) '([\w.]+)'", message)


def _schema_keys(dotted: str) -> list[str]:
    """The keys of a schema section (dotted, list indexes dropped), or [] when it isn't one."""
    cls: typing.Any = UspConfig
    for part in filter(None, re.sub(r"\[\d+\]", "", dotted).split(".")):
        hint = typing.get_type_hints(cls).get(part)
        args = typing.get_args(hint)
        hint = args[0] if typing.get_origin(hint) is list and args and is_dataclass(args[0]) else hint
        if not is_dataclass(hint):
            return []
        cls = hint
    return list(typing.get_type_hints(cls))


def _type_fix(full_key: str) -> str | None:
    hint = schema.schema_keys().get(re.sub(r"\[\d+\]", "[]", full_key))
    if hint is None:
        return None
    default = schema.default_of(full_key)
    example = f", e.g. {full_key}={default} (the default)" if default not in (None, "", [], {}) else ""
    return f"{full_key} expects {_type_name(hint)}{example}"


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def suggest(word: str, candidates: list[str], what: str, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"did you mean {what} '{prefix}{close[0]}'? " if close else ""
