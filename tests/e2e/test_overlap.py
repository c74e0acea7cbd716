"""A real 2-rank DDP profile (gloo, `usp train`): usp/report/overlap.py finds the bucket all-reduces
partly hidden behind the backward with 1 MB buckets (the synthetic traces: tests/unit/test_overlap.py)."""
from __future__ import annotations

import pytest

from tests.helpers import run_usp
from usp.report import write_report
from usp.report.overlap import step_overlaps, totals
from usp.report.trace import read_trace


@pytest.mark.distributed
def test_real_ddp_profile_overlaps_the_backward(shakespeare, tmp_path):
    """2 ranks on gloo, DDP with 1 MB buckets, steps 3-4 profiled."""
    proc = run_usp("train", "cluster.procs_per_node=2", "parallelism.dp_replicate=2", "parallelism.ddp_bucket_mb=1",
                   "train.steps=4", f"train.runs_dir={tmp_path}", "train.name=ddp", "profile.enabled=true",
                   "profile.steps=[3,4]", "train.log_interval=1", "train.sample_tokens=0", "train.eval_interval=0",
                   "checkpoint.enabled=false", "logging.console=plain")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "ddp"
    for rank in (0, 1):
        events = read_trace(run / "profile" / f"rank_{rank}.json")
        overlaps = step_overlaps(events, rank)
        assert [o.step for o in overlaps] == [3, 4] and {o.source for o in overlaps} == {"CPU threads"}
        for o in overlaps:
            span = next(e for e in events if e["name"] == f"usp_step_{o.step}")
            # gloo's worker-thread spans (bucket all-reduces, DDP's buffer broadcast), unioned
            inside = [e["dur"] / 1e3 for e in events if e["name"].startswith("gloo:") and e["tid"] != span["tid"]
                      and span["ts"] <= e["ts"] <= span["ts"] + span["dur"]]
            assert inside and max(inside) <= o.comm_ms + 1e-3 and o.comm_ms <= sum(inside) + 1e-3  # float ts ~1e12 us
            assert 0 <= o.overlapped_ms <= o.comm_ms and 0 <= o.fraction <= 1
        assert totals(overlaps)["overlapped_ms_per_step"] > 0, overlaps  # the all-reduce ran under the backward
    md = write_report([str(run)], tmp_path / "report").markdown.read_text()
    assert "### Communication overlapped by compute: ddp" in md and "| 1 | 3, 4 | CPU threads |" in md
