"""Shared test fixtures. Every test run gets its own data cache (never ~/.cache/usp), and
the Shakespeare corpus is tokenized once per session for the tests that train."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
USP = str(Path(sys.executable).parent / "usp")
_CACHE = Path(tempfile.mkdtemp(prefix="usp-test-cache-"))
os.environ["USP_CACHE_DIR"] = str(_CACHE)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def shakespeare():
    """The default dataset, prepared once: (directory, meta)."""
    from usp.config.compose import compose_config
    from usp.data.prepare import ensure_dataset

    cfg, _ = compose_config(None, [])
    return ensure_dataset(cfg.data)


def run_usp(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real `usp` console script as a user would."""
    env = dict(os.environ, USP_CACHE_DIR=str(_CACHE), COLUMNS="200")
    return subprocess.run([USP, *args], cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout)
