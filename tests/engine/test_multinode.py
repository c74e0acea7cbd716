"""A plan saved by `usp plan --save` and run by hand through the worker entry torchrun runs: without
prepared data a clear error naming `usp prepare-data`, with it training."""
from __future__ import annotations

import os

import pytest
import yaml

from tests.helpers import usp_cli
from tests.unit.test_multinode import TINY


def test_a_saved_plan_runs_by_hand_once_its_data_is_prepared(tmp_path, shakespeare):
    """`usp plan --save` then the worker entry torchrun runs (`python -m usp.engine.worker`):
    without prepared data a clear error naming `usp prepare-data`, with it training."""
    from usp.engine.worker import main as worker_main

    args = ("plan", "--save", *TINY, "train.steps=2", "train.name=saved", "checkpoint.enabled=false")
    saved = usp_cli(*args, cwd=tmp_path)  # its own empty data cache
    assert saved.returncode == 0, saved.stderr
    plan_file = tmp_path / "runs" / "saved" / "plan.yaml"
    assert not yaml.safe_load(plan_file.read_text())["data_meta"]
    with pytest.raises(SystemExit) as exit_:
        worker_main(["--plan", str(plan_file)])
    assert exit_.value.code == 2

    cache = {"USP_CACHE_DIR": os.environ["USP_CACHE_DIR"]}  # the session's prepared corpus
    assert usp_cli("prepare-data", cwd=tmp_path, env=cache).returncode == 0
    assert usp_cli(*args, cwd=tmp_path, env=cache).returncode == 0
    with pytest.raises(SystemExit) as exit_:
        worker_main(["--plan", str(plan_file)])
    assert exit_.value.code == 0
    assert len((plan_file.parent / "metrics.jsonl").read_text().splitlines()) == 2
