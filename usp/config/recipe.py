"""A recipe file as Hydra reads it: checked first, so its mistakes name the file and the line
(YAML syntax, a missing `defaults:` list) instead of Hydra's or omegaconf's tracebacks; a `.yml`
recipe is handed to Hydra, which reads only `.yaml`, under a `.yaml` name."""
from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from usp.errors import ConfigError

DEFAULTS_FIX = ("start the recipe with the defaults list it extends, e.g.\n"
                "    defaults:\n      - config\n      - override model: tiny\n      - _self_")


def check_recipe_file(path: Path) -> None:
    """The recipe parses as YAML, is a mapping, and has a `defaults:` list (without it Hydra composes
    the file alone: no schema, no groups)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        opened = exc.context_mark if exc.context and exc.context_mark and exc.context_mark is not mark else None
        context = f" ({exc.context} that starts at line {opened.line + 1})" if opened else ""
        raise ConfigError(f"YAML syntax error at {where}: {exc.problem or exc.context}{context}", key="conf",
                          value=str(path),
                          fix=f"fix line {mark.line + 1} of {path.name} (a bracket, quote or indentation)" if mark
                          else f"fix the YAML in {path.name}") from None
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"can't read the recipe {path}: {exc}", key="conf", value=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a YAML mapping of config keys", key="conf", value=str(path),
                          fix=DEFAULTS_FIX)
    if not isinstance(data.get("defaults"), list):
        raise ConfigError(f"{path} has no `defaults:` list, so it would not build on usp's config", key="conf",
                          value=str(path), fix=DEFAULTS_FIX)


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
