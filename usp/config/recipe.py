"""A recipe file as Hydra reads it: checked first, so its mistakes name the file and the line
(YAML syntax, a key set twice, a missing `defaults:` list) instead of Hydra's or omegaconf's
tracebacks; where a YAML file sets a key (the line of an unknown key or a wrong value,
usp.config.hydra_errors); a `.yml` recipe is handed to Hydra, which reads only `.yaml`, under a
`.yaml` name."""
from __future__ import annotations

import contextlib
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from usp.errors import ConfigError

DEFAULTS_FIX = ("start the recipe with the defaults list it extends, e.g.\n"
                "    defaults:\n      - config\n      - override model: tiny\n      - _self_")


def check_recipe_file(path: Path) -> None:
    """The recipe parses as YAML, sets no key twice, is a mapping, and has a `defaults:` list (without it
    Hydra composes the file alone: no schema, no groups)."""
    data = parsed_yaml(path, "conf")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a YAML mapping of config keys", key="conf", value=str(path),
                          fix=DEFAULTS_FIX)
    if not isinstance(data.get("defaults"), list):
        raise ConfigError(f"{path} has no `defaults:` list, so it would not build on usp's config", key="conf",
                          value=str(path), fix=DEFAULTS_FIX)
    not_a_section = next(((k, v) for k, v in data.items() if k in _sections() and not isinstance(v, dict | None)),
                         None)
    if not_a_section is not None:
        key, value = not_a_section
        kind = {bool: "true/false", int: "number", float: "number", str: "string", list: "list"}.get(type(value))
        raise ConfigError(f"`{key}: {value!r}` makes the {key} section a {kind or type(value).__name__}; it is a "
                          f"mapping of {key}.* keys, set at {path}:{_line_of(path, key)}", key=key, value=value,
                          fix=f"put its keys under `{key}:`, one per line, indented (`  <key>: <value>`), or pick "
                              f"a {key} option in the defaults list (`- override {key}: <option>`)")


def _sections() -> set[str]:
    """The config's top-level sections (each a mapping: model, parallelism, train, ...)."""
    from dataclasses import MISSING, fields

    from usp.contract.config_schema import UspConfig

    return {f.name for f in fields(UspConfig) if f.default_factory is not MISSING}


def _line_of(path: Path, key: str) -> int:
    """The line (1-based) of a top-level key of the YAML file."""
    import yaml

    node = _tree(path)
    lines = [k.start_mark.line + 1 for k, _ in node.value if str(k.value) == key] \
        if isinstance(node, yaml.MappingNode) else []
    return lines[0] if lines else 0


def check_group_file(path: Path, group: str) -> None:
    """A group given as a file (cluster=path/to/mine.yaml): YAML, no key set twice, a mapping."""
    if not isinstance(parsed_yaml(path, group, package=group), dict):
        raise ConfigError(f"{path} is not a YAML mapping of the {group} group's keys (e.g. `nodes: 2`)", key=group,
                          value=str(path), fix=f"a copy of a file in conf/{group}/ to edit (`usp config show "
                          f"{group}=<option>` prints one)")


def parsed_yaml(path: Path, key: str, package: str = ""):
    """The file's YAML, refused naming the file and line for a syntax error or a key set twice (its key
    path under `package`)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as exc:
        raise yaml_syntax_error(path, exc, key) from None
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"can't read {path}: {exc}", key=key, value=str(path),
                          fix="a UTF-8 YAML file (see conf/ for examples)") from None
    twice = duplicate_key_error(path, package)
    if twice is not None:
        raise twice
    return data


def yaml_syntax_error(path: Path, exc, key: str = "conf") -> ConfigError:
    """A YAML syntax error (yaml.MarkedYAMLError) in `path` as one ConfigError naming the file and line."""
    mark = exc.problem_mark or exc.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    opened = exc.context_mark if exc.context and exc.context_mark and exc.context_mark is not mark else None
    context = f" ({exc.context} that starts at line {opened.line + 1})" if opened else ""
    return ConfigError(f"YAML syntax error at {where}: {exc.problem or exc.context}{context}", key=key,
                       value=str(path), fix=f"fix line {mark.line + 1} of {path.name} (a bracket, quote or "
                       "indentation)" if mark else f"fix the YAML in {path.name}")


def _tree(path: Path):
    """The file's YAML node tree (keys with their lines), or None when it doesn't parse."""
    import yaml

    try:
        return yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return None


def key_line(path: Path, dotted: str) -> int | None:
    """The line (from 1) where a YAML file sets a dotted key (train.seed, data.blend[0].weight), or None."""
    import yaml

    node, line = _tree(path), None
    for part in re.findall(r"\[(\d+)\]|([^.\[\]]+)", dotted):
        index, name = part
        if index and isinstance(node, yaml.SequenceNode) and int(index) < len(node.value):
            node = node.value[int(index)]
            line = node.start_mark.line + 1
            continue
        found = [(k, v) for k, v in node.value if k.value == name] if isinstance(node, yaml.MappingNode) else []
        if not found:
            return None
        line, node = found[0][0].start_mark.line + 1, found[0][1]
    return line


def duplicate_key_error(path: Path, package: str = "") -> ConfigError | None:
    """A key set twice in one mapping of the file (YAML allows neither; Hydra's loader refuses the file with
    a raw ConstructorError): its full key path (under `package`, a group file's group) and both lines."""
    import yaml

    def walk(node, prefix: str):
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key, value in node.value:
                name, line = str(key.value), key.start_mark.line + 1
                if name in seen:
                    return f"{prefix}{name}", seen[name], line
                seen[name] = line
                found = walk(value, f"{prefix}{name}.")
                if found:
                    return found
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                found = walk(item, f"{prefix.rstrip('.')}[{i}].")
                if found:
                    return found
        return None

    twice = walk(_tree(path), f"{package}." if package else "")
    if twice is None:
        return None
    key, first, second = twice
    return ConfigError(f"set twice in {path}, at lines {first} and {second}", key=key,
                       fix=f"keep one of lines {first} and {second} of {path.name}: a YAML mapping holds a key once")


@contextlib.contextmanager
def hydra_primary(directory: Path, name: str, suffix: str) -> Iterator[tuple[Path, list[Path]]]:
    """(config dir for Hydra, extra search dirs). A .yml recipe: a temporary dir holding a
    <name>.yaml link to it, with the recipe's own dir searched too (for its own group files)."""
    if suffix != ".yml":
        yield directory, []
        return
    with tempfile.TemporaryDirectory(prefix="usp-recipe-") as tmp:
        (Path(tmp) / f"{name}.yaml").symlink_to(directory / f"{name}{suffix}")
        yield Path(tmp), [directory]
