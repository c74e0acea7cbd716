"""A blend of HF-datasets sources through a real `usp train`, SIGKILLed after a checkpoint and run
again: it resumes with the identical batch sequence (the blend itself: tests/engine/test_blend.py)."""
from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.test_checkpoint import spawn, train, wait_for_step
from tests.engine.test_blend import blend_recipe, write_sources
from tests.engine.test_training import QUIET
from tests.helpers import losses, train_in_process


@pytest.mark.slow
def test_blend_resumes_the_identical_batches_after_a_kill(tmp_path):
    """A real `usp train` on the blend, SIGKILLed after its step-4 checkpoint, then run again: it
    resumes, and every step's loss equals an uninterrupted run's (the same batches)."""
    directory = tmp_path / "mix"
    directory.mkdir()
    jsonl, parquet = write_sources(directory)
    recipe = blend_recipe(directory, jsonl, parquet, cache_dir=str(directory / "cache"))
    common = [f"data.cache_dir={directory / 'cache'}", "checkpoint.interval=2"]
    train_in_process(f"train.runs_dir={tmp_path}", *QUIET, *common, "train.name=straight", conf=str(recipe))
    straight = losses(tmp_path / "straight")
    common.insert(0, f"conf={recipe}")
    proc = spawn(tmp_path, *common, "train.name=killed")
    wait_for_step(tmp_path / "killed", 5, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(losses(tmp_path / "killed"))
    assert killed_at < 8
    resumed = train(tmp_path, *common, "train.name=killed")
    assert "resumed from" in resumed.stdout
    again = losses(tmp_path / "killed")
    assert sorted(again) == sorted(straight) == list(range(1, 9))
    for step in range(1, 9):
        assert again[step] == pytest.approx(straight[step], rel=1e-6), step
