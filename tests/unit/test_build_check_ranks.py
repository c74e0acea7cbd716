"""`usp plan --build-check`'s ranks: the default ones and the checks of those named (torch-free; the
build itself: tests/e2e/test_build_check.py)."""
from __future__ import annotations

from functools import partial

import pytest

from tests.helpers import plan_for
from usp.errors import PlanError
from usp.launch.build_check import check_ranks, default_ranks

pytestmark = pytest.mark.usefixtures("fresh_cache")
plan_for = partial(plan_for, training=False)
HALF_B = ["model=tiny", "model.dim=1024", "model.n_layers=32", "model.n_heads=16", "model.n_kv_heads=8",
          "model.ffn_dim=4096", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=1",
          "cluster.procs_per_node=8"]


def test_the_build_check_ranks_default_to_each_stage_and_the_last():
    plan = plan_for(*HALF_B, "parallelism.pp=2", "parallelism.tp=2", "parallelism.dp_shard=2")
    assert default_ranks(plan) == [0, 4, 7]
    assert check_ranks(plan, [7, 0, 7]) == [0, 7]
    assert check_ranks(plan, []) == [0, 4, 7]
    with pytest.raises(PlanError, match="0..7"):
        check_ranks(plan, [8])
