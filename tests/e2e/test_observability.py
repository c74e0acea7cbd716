"""Two ranks under torchrun with the profiler on: one trace each, holding their communication."""
from __future__ import annotations

import json
import re

import pytest

from tests.engine.test_observability import FAST
from tests.helpers import run_usp


@pytest.mark.distributed
def test_two_ranks_write_one_trace_each_with_their_communication(tmp_path, shakespeare):
    proc = run_usp("train", "conf=tiny_ddp", f"train.runs_dir={tmp_path}", *FAST, "train.steps=3",
                   "checkpoint.enabled=false", "train.measure_memory=false", "profile.enabled=true",
                   "profile.steps=[2,3]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = tmp_path / "tiny_ddp" / "profile"
    for rank in (0, 1):
        names = {e.get("name") for e in json.loads((profile / f"rank_{rank}.json").read_text())["traceEvents"]}
        assert {"usp_step_2", "usp_step_3"} <= names
        assert any("allreduce" in str(n) or "all_reduce" in str(n) for n in names)  # DDP's gradient sync
        summary = (profile / f"summary_rank_{rank}.txt").read_text()
        share = float(re.search(r"communication: ([\d.]+)% of self CPU time", summary)[1])
        assert f"rank {rank}," in summary and 0 < share < 100, summary
