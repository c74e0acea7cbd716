"""Where the config catalogue lives: conf/ (groups) and recipes/ (complete runs).

Both ship at the repository root (usp is installed editable, `pip install -e .`);
USP_CONF_DIR / USP_RECIPES_DIR point elsewhere, e.g. for a site-wide catalogue."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def conf_dir() -> Path:
    return Path(os.environ.get("USP_CONF_DIR", REPO_ROOT / "conf")).resolve()


def recipes_dir() -> Path:
    return Path(os.environ.get("USP_RECIPES_DIR", REPO_ROOT / "recipes")).resolve()


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))
