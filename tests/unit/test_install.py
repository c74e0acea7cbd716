"""pyproject's data-files list every catalogue folder: a non-editable install carries conf/ and
recipes/ (the install itself: tests/e2e/test_install.py)."""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))


def test_data_files_list_every_catalogue_folder():
    """A new conf/ group folder that pyproject does not list would be missing from every wheel."""
    folders = {"conf", "recipes"} | {f"conf/{d.name}" for d in (REPO / "conf").iterdir() if d.is_dir()}
    assert {dest.removeprefix("share/usp/") for dest in DATA_FILES} == folders
    for dest, patterns in DATA_FILES.items():
        assert all(list(REPO.glob(p)) for p in patterns), (dest, patterns)


DATA_FILES = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
