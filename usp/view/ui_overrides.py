"""What `usp ui` accepts from a browser: a recipe of the catalogue and overrides of the form the CLI takes
(key=value, group=option), then composed and planned by the same code as `usp plan` (so the same rules
refuse them). On top, because the page may be reached by others than the user at the terminal: no Hydra
call (hydra.*, +key adds, ~key deletes, ${...} interpolations, which can read the environment), and no
path outside the working directory and the catalogue (model.init_from=/etc, cluster=/elsewhere.yaml)."""
from __future__ import annotations

import re
from pathlib import Path

from usp.config.paths import conf_dir, recipe_names, recipes_dir
from usp.errors import ConfigError

KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
FIX_PATH = "a path inside the working directory {cwd} (or a name from `usp config list`)"


def checked_recipe(conf: str) -> str:
    if conf not in recipe_names():
        raise ConfigError("usp ui plans the catalogue's recipes only", key="conf", value=conf,
                          fix=f"one of: {', '.join(recipe_names())}")
    return conf


def checked_overrides(lines: list[str], cwd: Path | None = None) -> list[str]:
    """The overrides, one per line (blank lines dropped), each checked; the first wrong one is refused."""
    cwd = (cwd or Path.cwd()).resolve()
    out = []
    for line in (raw.strip() for raw in lines):
        if line:
            out.append(checked_override(line, cwd))
    return out


def checked_override(item: str, cwd: Path) -> str:
    key, eq, value = item.partition("=")
    key = key.strip()
    if item.startswith(("+", "~")) or not eq:
        raise ConfigError("usp ui takes key=value or group=option only (no +add, ~delete or bare words)",
                          key=key.lstrip("+~") or item, value=item, fix="key=value, e.g. parallelism.tp=2")
    if key == "conf" or key.split(".")[0] == "hydra" or not KEY.fullmatch(key):
        raise ConfigError("not a config key usp ui sets (the recipe is chosen above; Hydra's own settings are "
                          "not the page's)", key=key, value=value,
                          fix="a key of `usp config show`, e.g. train.steps=100")
    if "${" in value:
        raise ConfigError("interpolations are not taken from the page (they can read the environment)", key=key,
                          value=value, fix=f"the value itself, e.g. {key}=<value>")
    for part in _items(value):
        _check_path(key, part, cwd)
    return f"{key}={value}"


def _items(value: str) -> list[str]:
    """A value's parts: the items of [a,b], else the value; quotes dropped."""
    value = value.strip()
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1]
    return [p.strip().strip("'\"") for p in value.split(",")] if "," in value else [value.strip("'\"")]


def _check_path(key: str, value: str, cwd: Path) -> None:
    """A value that names a path lies inside the working directory or the catalogue."""
    if not (value.startswith(("/", "~", ".")) or "/" in value or "\\" in value):
        return
    path = Path(value).expanduser()
    path = (path if path.is_absolute() else cwd / path).resolve()
    if not any(path == root or root in path.parents for root in (cwd, conf_dir(), recipes_dir())):
        raise ConfigError(f"{path} is outside the working directory and the catalogue: usp ui reads nothing there",
                          key=key, value=value, fix=FIX_PATH.format(cwd=cwd))
