"""Where the config catalogue lives: conf/ (groups) and recipes/ (complete runs).

In a checkout (`pip install -e .`) both are at the repository root; a non-editable install
(`pip install .`, a wheel) puts them under <prefix>/share/usp (pyproject's data-files).
USP_CONF_DIR / USP_RECIPES_DIR point elsewhere, e.g. for a site-wide catalogue."""
from __future__ import annotations

import os
import sysconfig
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=1)
def catalogue_root() -> Path:
    """The folder holding conf/ and recipes/: the checkout around the package, else share/usp of
    the prefix the package is installed in (<prefix>/lib/pythonX.Y/site-packages/usp: a venv,
    `--user`, `--prefix`), else of this interpreter's prefix."""
    prefix = REPO_ROOT.parent.parent.parent  # not .parents[2]: a checkout may sit one level below /
    candidates = (REPO_ROOT, prefix / "share" / "usp", Path(sysconfig.get_path("data")) / "share" / "usp")
    return next((root for root in candidates if (root / "conf" / "config.yaml").is_file()), REPO_ROOT)


def conf_dir() -> Path:
    return Path(os.environ.get("USP_CONF_DIR", catalogue_root() / "conf")).resolve()


def recipes_dir() -> Path:
    return Path(os.environ.get("USP_RECIPES_DIR", catalogue_root() / "recipes")).resolve()


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))
