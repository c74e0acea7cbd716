"""`usp report`'s pieces on numbers given here: profiler text parsed, scaling efficiency, the heatmap's
columns, clear errors (on a real sweep: tests/e2e/test_report.py)."""
from __future__ import annotations

import pytest

from tests.helpers import usp_cli
from usp.report.heatmap import heatmap_grid
from usp.report.profiler_ops import parse_profile
from usp.report.sweep_tables import scaling


def test_parse_plain_lines():
    assert parse_profile("forward: 12.0 ms\nbackward 30 ms\noptimizer = 500 us\n") == [
        ("backward", 30.0), ("forward", 12.0), ("optimizer", 0.5)]


def test_scaling_efficiency_definitions():
    def row(pid, world, tps, gbt):
        return {"id": pid, "world": world, "tokens_per_s": tps, "global_batch_tokens": gbt}

    rows = [row("a", 1, 1000.0, 2048), row("b", 2, 1600.0, 2048), row("c", 4, 2000.0, 2048),
            row("d", 2, 1800.0, 4096)]
    out, note = scaling(rows)
    strong = {r["world"]: r for r in out if r["kind"] == "strong"}
    assert strong[1]["efficiency"] == 1.0 and strong[2]["efficiency"] == pytest.approx(0.8)
    assert strong[4]["efficiency"] == pytest.approx(0.5) and strong[4]["speedup"] == pytest.approx(2.0)
    weak = [r for r in out if r["kind"] == "weak"]  # a (2048 tokens/rank at 1) vs d (2048 tokens/rank at 2)
    assert [(r["point"], r["efficiency"]) for r in weak] == [("a", 1.0), ("d", pytest.approx(0.9))]
    assert note == ""
    assert scaling([row("a", 1, 1000.0, 2048)])[1].startswith("The sweep does not vary")


def test_report_errors_are_clear(tmp_path):
    proc = usp_cli("report", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "RUN_DIR" in proc.stderr and "plan.yaml" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    proc = usp_cli("report", str(tmp_path / "missing"), cwd=tmp_path)
    assert proc.returncode == 2 and "no such directory" in proc.stderr


def test_heatmap_columns_are_world_size_when_nodes_are_not_swept():
    def row(pid, seq, world, tps, status="done"):
        return {"id": pid, "swept": {"train.seq_len": seq, "cluster.procs_per_node": str(world)}, "world": world,
                "status": status, "tokens_per_s": tps, "mfu": None, "mfu_how": "-", "run": None}

    sweep = {"swept": {"train.seq_len": ["128", "256"], "cluster.procs_per_node": ["1", "2"]}}
    grid = heatmap_grid(sweep, [row("a", "128", 1, 10.0), row("b", "128", 2, 30.0), row("c", "256", 1, 20.0),
                                row("d", "256", None, None, "rejected")])
    assert (grid["rows"], grid["cols"], grid["col_values"]) == ("train.seq_len", "world size (ranks)", ["1", "2"])
    assert grid["values"] == [[10.0, 30.0], [20.0, None]] and grid["notes"][1][1] == "no point"
    assert grid["metric"] == "tokens/s" and "1 point(s) without a world size" in grid["caption_extra"]
