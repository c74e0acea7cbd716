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
# `make test` runs two xdist workers on two cores: a second OpenMP thread per process only spins
# (a 20-step one-process run, the other core busy: 26.6 CPU-s with 2 threads, 14.9 with 1, measured).
# usp honours OMP_NUM_THREADS when cluster.threads_per_proc is 0 (usp/plan/plan.py).
os.environ["OMP_NUM_THREADS"] = "1"


# The files that take longest, longest first. `make test` runs the suite on two pytest-xdist
# workers that each take whole files in collection order (--dist loadfile --no-loadscope-reorder):
# starting these first keeps both cores busy to the end instead of leaving one file running alone.
# Much of their time is single-process (CLI start-up, rank 0's reference, Slurm scheduling), so two
# at once overlap well on two cores.
LONGEST_FIRST = ("test_parallel.py", "test_checkpoint.py", "test_slurm.py", "test_training.py",
                 "test_memory_calibration.py", "test_multinode.py", "test_bench_smoke.py", "test_hf_checkpoint.py",
                 "test_failures.py", "test_moe.py", "test_pipeline.py", "test_build.py", "test_context_parallel.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise


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
    """Run the real `usp` console script as a user would (its own process: for commands that train,
    start torchrun, or whose start-up is what the test is about)."""
    env = dict(os.environ, USP_CACHE_DIR=str(_CACHE), COLUMNS="200")
    return subprocess.run([USP, *args], cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout)


def usp_cli(*args: str, cwd: Path, env: dict | None = None, columns: int = 200) -> subprocess.CompletedProcess:
    """The same `usp` command line run in this process (typer's CliRunner): the commands that only
    plan, print or write files, where a fresh interpreter per call would cost ~1 s and test nothing
    more (tests/test_import_boundary.py runs every command in its own process). The result reads
    like run_usp's: returncode, stdout, stderr; an unexpected exception is exit 1 with its traceback
    on stderr, as the console script would show it."""
    import traceback

    from typer.testing import CliRunner

    from usp.cli import app

    env = {"USP_CACHE_DIR": str(cwd / "cache"), "COLUMNS": str(columns), **(env or {})}
    here = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, list(args), env=env, prog_name="usp")
    finally:
        os.chdir(here)
    stderr, code = result.stderr, result.exit_code
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
        code = 1
    return subprocess.CompletedProcess(["usp", *args], code, result.stdout, stderr)
