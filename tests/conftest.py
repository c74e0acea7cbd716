"""Shared fixtures and hooks. The tests come in three kinds, one folder each:

  tests/unit    torch-free, in this process, seconds. `python -m pytest tests/unit -q` imports no
                torch: a unit test (or test file) that does fails, here, with its name.
  tests/engine  torch in this process: models, the parallel pieces, one-rank training through the CLI.
  tests/e2e     other processes: the `usp` console script, torchrun, Slurm, pip.

Every test run gets its own data cache (never ~/.cache/usp, tests/helpers.py), and the
Shakespeare corpus is tokenized once per session for the tests that train."""
from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import SESSION_CACHE

TESTS = Path(__file__).resolve().parent
os.environ["USP_CACHE_DIR"] = str(SESSION_CACHE)
# `make test` runs two xdist workers on two cores: a second OpenMP thread per process only spins
# (a 20-step one-process run, the other core busy: 26.6 CPU-s with 2 threads, 14.9 with 1, measured).
# usp honours OMP_NUM_THREADS when cluster.threads_per_proc is 0 (usp/plan/plan.py).
os.environ["OMP_NUM_THREADS"] = "1"


# The files that take longest, longest first. `make test` runs the engine and e2e tests on two
# pytest-xdist workers that each take whole files in collection order (--dist loadfile
# --no-loadscope-reorder): starting these first keeps both cores busy to the end instead of leaving
# one file running alone. Much of their time is single-process (CLI start-up, rank 0's reference,
# Slurm scheduling), so two at once overlap well on two cores. A name that matches no file fails.
LONGEST_FIRST = ("e2e/test_parallel.py", "e2e/test_checkpoint.py", "e2e/test_slurm.py", "e2e/test_interrupt.py",
                 "e2e/test_moe_checkpoint.py", "e2e/test_training.py", "e2e/test_memory_calibration.py",
                 "e2e/test_readme_examples.py", "e2e/test_multinode.py", "e2e/test_bench_smoke.py", "e2e/test_build.py",
                 "e2e/test_port_taken.py", "e2e/test_hf_checkpoint.py", "e2e/test_export.py", "e2e/test_failures.py",
                 "e2e/test_report.py", "e2e/test_moe.py", "e2e/test_pipeline.py", "e2e/test_context_parallel.py")


def pytest_collection_modifyitems(config, items):
    missing = [name for name in LONGEST_FIRST if not (TESTS / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that don't exist: {missing}")
    rank = {TESTS / name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))  # stable: file order kept otherwise


def pytest_collection_finish(session):
    """What collection imported (torch, for engine and e2e tests) is frozen out of the garbage
    collector's sight, as a rank does after its imports (usp/engine/startup_gc.py): tests/engine in
    one process took 64 s with the collector scanning torch's objects over and over, 56 s without."""
    from usp.engine.startup_gc import freeze_imports

    gc.collect()  # the garbage made so far, before it is frozen for good
    freeze_imports()


_TORCH_BEFORE = pytest.StashKey[bool]()


def _is_unit(path: Path) -> bool:
    return TESTS / "unit" in path.parents


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A unit test file that imports torch (itself, or through what it imports) fails to collect.
    Told only while torch is not yet loaded: in a session of tests/unit alone, always."""
    before = "torch" in sys.modules
    report = yield
    if (not before and "torch" in sys.modules and isinstance(collector, pytest.Module) and _is_unit(collector.path)
            and report.passed):
        report.outcome = "failed"
        report.longrepr = (f"importing {collector.path.relative_to(TESTS)} imported torch: a unit test is "
                           "torch-free (move what needs torch to tests/engine)")
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_TORCH_BEFORE] = "torch" in sys.modules  # before any fixture, module-scoped ones included


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A unit test that imports torch (the code it calls or its fixtures, lazily) fails at teardown, named."""
    result = yield
    if _is_unit(item.path) and not item.stash.get(_TORCH_BEFORE, True) and "torch" in sys.modules:
        raise pytest.fail.Exception(f"{item.nodeid} imported torch: a unit test is torch-free (move it to "
                                    "tests/engine)", pytrace=False)
    return result


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def shakespeare():
    """The default dataset, prepared once in the session's cache: (directory, meta)."""
    from usp.config.compose import compose_config
    from usp.data.tokenized import ensure_dataset

    cfg, _ = compose_config(None, [])
    return ensure_dataset(cfg.data)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> Path:
    """An empty data cache for this test alone: what it plans or prepares can't depend on what
    another test left in the session's cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("USP_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 40 MiB tmpfs to fill (mounting one needs root: skipped otherwise); unmounted afterwards."""
    mount = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
