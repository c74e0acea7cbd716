"""`usp report` on a real local sweep (3 tiny runs of 3 steps + 1 point the planner rejects)
and on single runs: the table rows and statuses, the plots exist, and the plotted numbers are
the ones in metrics.jsonl. Cases a short CPU sweep can't produce (several models x node counts,
profiler traces of two ranks, an allocator memory figure) use run directories built by hand
from a real plan.yaml."""
from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
import yaml

from tests.helpers import run_usp
from usp.engine.observe.metrics import read_metrics
from usp.report import write_report
from usp.report.runs import load_run
from usp.report.sweep_tables import scaling

FAST = ["train.steps=3", "train.log_interval=1", "train.eval_interval=2", "train.sample_tokens=0",
        "logging.console=plain", "checkpoint.enabled=false"]
DONE, REJECTED = ["p00_mb4", "p01_mb8", "p02_mb16"], "p03_mb32"


@pytest.fixture(scope="module")  # `make test-fast` hands whole files to its workers: trained once
def sweep_dir(tmp_path_factory, shakespeare):
    runs = tmp_path_factory.mktemp("runs")
    proc = run_usp("sweep", "conf=tiny_demo", *FAST, "train.micro_batch=4,8,16,32", f"train.runs_dir={runs}",
                   "--name", "s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "point 1/3: p00_mb4" in proc.stdout and "point 3/3: p02_mb16" in proc.stdout
    return runs / "s"


def _png_shape(path: Path) -> tuple[int, ...]:
    import matplotlib.image

    return matplotlib.image.imread(path).shape


def _steady_tokens_per_s(run_dir: Path) -> float:
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] != 1 and "memory_measured_gib" not in r]
    return statistics.median(r["tokens_per_s"] for r in records)


def test_sweep_json_records_every_point(sweep_dir):
    data = json.loads((sweep_dir / "sweep.json").read_text())
    statuses = {p["id"]: p["status"] for p in data["points"]}
    assert statuses == {**{i: "done" for i in DONE}, REJECTED: "rejected"}
    rejected = next(p for p in data["points"] if p["id"] == REJECTED)
    assert "train.global_batch=16" in rejected["reason"]
    for pid in DONE:
        assert (sweep_dir / pid / "summary.json").is_file()
        assert len(read_metrics(sweep_dir / pid / "metrics.jsonl")) == 3
    assert not (sweep_dir / REJECTED).exists()


def test_sweep_report_table_rows_and_statuses(sweep_dir, tmp_path):
    result = write_report([str(sweep_dir)], tmp_path / "rep")
    rows = {r["id"]: r for r in result.sweeps[0]["rows"]}
    assert list(rows) == [*DONE, REJECTED]
    for pid in DONE:
        assert rows[pid]["status"] == "done"
        assert rows[pid]["tokens_per_s"] == pytest.approx(_steady_tokens_per_s(sweep_dir / pid))
        summary = json.loads((sweep_dir / pid / "summary.json").read_text())
        assert rows[pid]["final_loss"] == summary["final_loss"]
        assert rows[pid]["memory_measured_gib"] == summary["memory_measured_peak_gib"]
    assert rows[REJECTED]["status"] == "rejected" and rows[REJECTED]["tokens_per_s"] is None
    md = result.markdown.read_text()
    for pid in DONE:
        lines = [ln for ln in md.splitlines() if ln.startswith(f"| {pid} |")]  # its sweep row and its run's row
        assert any("| done |" in ln and f"{rows[pid]['tokens_per_s']:,.0f}" in ln
                   and f"mb={pid.split('mb')[1]}" in ln for ln in lines), lines  # status, tokens/s, layout column
    rejected_line = next(ln for ln in md.splitlines() if ln.startswith(f"| {REJECTED} |"))
    assert "rejected: train.global_batch=16" in rejected_line
    assert "does not vary the world size" in md  # no scaling table for a one-rank sweep


def test_sweep_report_heatmap_and_batch_guidance(sweep_dir, tmp_path):
    result = write_report([str(sweep_dir)], tmp_path / "rep")
    heat = result.plot("heatmap")  # no model / node count swept: the swept key instead, still coloured by MFU
    assert heat.data["rows"] == "train.micro_batch" and heat.data["row_values"] == ["4", "8", "16", "32"]
    rows = {r["id"]: r for r in result.sweeps[0]["rows"]}
    assert heat.data["metric"] == "MFU" and all(rows[p]["mfu_how"] == "measured" for p in DONE)
    assert [v[0] for v in heat.data["values"]] == [rows[p]["mfu"] for p in DONE] + [None]
    assert heat.data["notes"][3][0] == "rejected"
    assert _png_shape(heat.path)[0] > 100 and heat.path.stat().st_size > 5000
    md = result.markdown.read_text()
    assert "![heatmap](heatmap.png)" in md and "the runs' median `mfu`" in heat.caption  # the MFU caption
    fastest = max(DONE, key=lambda p: rows[p]["tokens_per_s"])
    guidance = result.sweeps[0]["guidance"][0]
    assert f"`train.micro_batch={fastest.split('mb')[1]}`" in guidance
    for pid in DONE:  # every alternative is quoted with its measured tokens/s
        assert f"{rows[pid]['tokens_per_s']:,.0f} tokens/s" in guidance
    assert "### Batch size" in md and "p03_mb32" in md.split("### Batch size")[1]


def test_run_plots_match_metrics(sweep_dir, tmp_path):
    run = sweep_dir / "p01_mb8"
    result = write_report([str(run)])
    assert result.out == run / "report" and result.markdown.is_file()
    metrics = read_metrics(run / "metrics.jsonl")
    loss = result.plot("loss").data
    assert loss["p01_mb8 train"] == {"x": [1, 2, 3], "y": [r["loss"] for r in metrics]}
    assert loss["p01_mb8 val"]["x"] == [2, 3]
    assert result.plot("lr").data["p01_mb8"]["y"] == [r["lr"] for r in metrics]
    assert result.plot("throughput").data["p01_mb8 tokens/s"]["y"] == [r["tokens_per_s"] for r in metrics]
    memory = result.plot("memory").data
    plan_memory = __import__("yaml").safe_load((run / "plan.yaml").read_text())["memory"]["stages"][0]
    assert memory["predicted"]["y"][0] == pytest.approx((plan_memory["total"] - plan_memory["overhead"]) / 2 ** 30)
    probe = next(r for r in metrics if "memory_measured_gib" in r)
    assert memory["measured"]["y"][0] == pytest.approx(probe["memory_measured_gib"], rel=1e-3)  # log line: 4 digits
    md = result.markdown.read_text()
    for plot in result.plots:
        shape = _png_shape(plot.path)
        assert shape[0] > 150 and shape[1] > 300 and plot.path.stat().st_size > 5000, plot.name
        assert f"({plot.path.name})" in md and plot.caption in md
    assert "No profile in these runs" in md
    assert result.plot("expert_load") is None  # a dense model


def test_two_runs_are_overlaid(sweep_dir, tmp_path):
    result = write_report([str(sweep_dir / "p00_mb4"), str(sweep_dir / "p02_mb16")], tmp_path / "two")
    loss = result.plot("loss").data
    assert {"p00_mb4 train", "p02_mb16 train"} <= set(loss)
    assert loss["p02_mb16 train"]["y"] == [r["loss"] for r in read_metrics(sweep_dir / "p02_mb16" / "metrics.jsonl")]
    assert len(result.plot("memory").data["measured"]["x"]) == 2
    md = result.markdown.read_text()
    assert "| p00_mb4 |" in md and "| p02_mb16 |" in md


def test_profile_summary_without_trace_gives_the_top_ops_table(sweep_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(sweep_dir / "p00_mb4", run)
    (run / "profile").mkdir()
    (run / "profile" / "summary_rank_0.txt").write_text(PROFILER_TABLE)
    result = write_report([str(run)])
    md = result.markdown.read_text()
    assert result.plot("step_time") is None and "no per-step breakdown" in md  # that needs the trace
    assert "| aten::mm | 12.500 |\n| aten::_softmax | 0.800 |\n| aten::add | 0.250 |" in md


def test_unparsable_profile_is_shown_as_text(tmp_path, sweep_dir):
    run = tmp_path / "run"
    shutil.copytree(sweep_dir / "p00_mb4", run)
    (run / "profile").mkdir()
    (run / "profile" / "summary_rank_1.txt").write_text("nothing numeric here\n")
    result = write_report([str(run)])
    assert result.plot("step_time") is None and "nothing numeric here" in result.markdown.read_text()


PROFILER_TABLE = """\
-------------------  ------------  ------------  ------------  ------------
               Name    Self CPU %      Self CPU   CPU total %    # of Calls
-------------------  ------------  ------------  ------------  ------------
           aten::mm        80.00%      12.500ms        85.00%            12
     aten::_softmax         5.00%     800.000us         6.00%             4
          aten::add         1.00%     250.000us         1.00%            30
-------------------  ------------  ------------  ------------  ------------
Self CPU time total: 15.625ms
"""


# -- run directories built by hand ------------------------------------------------------------

def _fake_run(sweep_dir: Path, path: Path, records: list[dict], summary: dict | None = None,
              **plan_updates) -> Path:
    """A run directory: a real plan.yaml (p00_mb4's) with `plan_updates` applied (key "a__b" sets
    plan["a"]["b"]), the given metrics.jsonl records and summary.json."""
    plan = yaml.safe_load((sweep_dir / "p00_mb4" / "plan.yaml").read_text())
    for dotted, value in plan_updates.items():
        *parents, last = dotted.split("__")
        node = plan
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path.mkdir(parents=True)
    (path / "plan.yaml").write_text(yaml.safe_dump(plan))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def _records(steps: int, **per_step) -> list[dict]:
    """Records of steps 1..steps; each keyword is a value for every step or a list (one per step)."""
    return [{"step": s, **{k: v[s - 1] if isinstance(v, list) else v for k, v in per_step.items()}}
            for s in range(1, steps + 1)]


# (model, nodes, micro batch) -> MFU of the point; None: the point didn't run (status given)
GRID = {("big", "1", "4"): 0.30, ("big", "1", "8"): 0.35, ("big", "2", "4"): 0.28, ("big", "2", "8"): 0.20,
        ("small", "1", "4"): 0.40, ("small", "1", "8"): 0.45, ("small", "2", "4"): "rejected",
        ("small", "2", "8"): "failed"}
PARAMS = {"big": 2_000_000, "small": 1_000_000}


def _model_nodes_sweep(sweep_dir: Path, root: Path, with_mfu: bool = True) -> Path:
    """sweep.json over model=big,small x cluster.nodes=1,2 x train.micro_batch=4,8 (one rank per
    node), listed big first although it is the larger model. tokens/s = MFU x 10,000 x nodes."""
    points = []
    for index, ((model, nodes, mb), mfu) in enumerate(GRID.items()):
        pid = f"p{index:02d}_{model}_n{nodes}_mb{mb}"
        point = {"index": index, "id": pid, "run_dir": str(root / pid), "status": "done", "reason": None,
                 "swept": {"model": model, "cluster.nodes": nodes, "train.micro_batch": mb}, "world_size": int(nodes)}
        if isinstance(mfu, str):
            point.update(status=mfu, reason=f"{mfu} on purpose", run_dir=str(root / pid) if mfu == "failed" else "")
        else:
            tps = mfu * 10_000 * int(nodes)
            mfus = {"mfu": [0.01, mfu, mfu, mfu]} if with_mfu else {}
            records = _records(4, tokens_per_s=[1.0, tps, tps, tps], **mfus)
            _fake_run(sweep_dir, root / pid, records, {"final_loss": 5.0}, name=pid, world_size=int(nodes),
                      degrees__dp_replicate=int(nodes), mesh_shape=[1, int(nodes), 1, 1, 1], model__name=model,
                      model__params=PARAMS[model], **({} if with_mfu else {"timing": None}))
        points.append(point)
    sweep = {"version": 1, "name": "hm", "dir": str(root), "launcher": "local", "points": points,
             "swept": {"model": ["big", "small"], "cluster.nodes": ["1", "2"], "train.micro_batch": ["4", "8"]}}
    (root / "sweep.json").write_text(json.dumps(sweep))
    return root


def test_heatmap_is_best_mfu_by_model_and_nodes(sweep_dir, tmp_path):
    result = write_report([str(_model_nodes_sweep(sweep_dir, tmp_path / "hm"))], tmp_path / "rep")
    heat = result.plot("heatmap").data
    assert heat["metric"] == "MFU" and heat["rows"] == "model" and heat["cols"] == "nodes (cluster.nodes)"
    assert heat["row_values"] == ["small", "big"] and heat["row_labels"] == ["small (1M)", "big (2M)"]  # by params
    assert heat["col_values"] == ["1", "2"]
    # best MFU over the micro batches; small on 2 nodes never ran: blank, marked with the statuses
    assert heat["values"] == [[pytest.approx(0.45), None], [pytest.approx(0.35), pytest.approx(0.28)]]
    assert heat["best"][1] == ["p01_big_n1_mb8", "p02_big_n2_mb4"]
    assert heat["notes"][0][1] == "rejected, failed"
    assert "train.micro_batch" in result.plot("heatmap").caption
    assert _png_shape(result.plot("heatmap").path)[0] > 100


def test_heatmap_falls_back_to_tokens_per_s_and_says_so(sweep_dir, tmp_path):
    result = write_report([str(_model_nodes_sweep(sweep_dir, tmp_path / "hm", with_mfu=False))], tmp_path / "rep")
    heat = result.plot("heatmap")
    assert heat.data["metric"] == "tokens/s" and "No point has an MFU" in heat.caption
    assert heat.data["values"][1] == [pytest.approx(3500.0), pytest.approx(5600.0)]


def test_scaling_curves_are_per_model(sweep_dir, tmp_path):
    def row(pid, model, world, tps, mb="4"):
        return {"id": pid, "world": world, "tokens_per_s": tps, "global_batch_tokens": 2048,
                "swept": {"model": model, "cluster.nodes": str(world), "train.micro_batch": mb}}

    out, _ = scaling([row("a1", "a", 1, 1000.0), row("a2", "a", 2, 1600.0), row("a2b", "a", 2, 1700.0, "8"),
                      row("b1", "b", 1, 500.0), row("b2", "b", 2, 900.0)])
    strong = {(r["group"], r["world"]): r for r in out if r["kind"] == "strong"}
    assert strong[("global batch 2048 tokens, model=a", 2)]["efficiency"] == pytest.approx(0.85)  # fastest mb
    assert strong[("global batch 2048 tokens, model=b", 2)]["efficiency"] == pytest.approx(0.9)
    assert strong[("global batch 2048 tokens, model=b", 2)]["point"] == "b2"
    # and in a report: the plot's curves are named after their model (small ran on one node only)
    result = write_report([str(_model_nodes_sweep(sweep_dir, tmp_path / "hm"))], tmp_path / "rep")
    curves = result.plot("scaling").data
    assert set(curves) == {"strong: global batch 2048 tokens, model=big"}
    assert curves["strong: global batch 2048 tokens, model=big"]["y"] == [1.0, pytest.approx(0.8)]
    assert "| strong | global batch 2048 tokens, model=big | 2 |" in result.markdown.read_text()


def _span(name: str, ts: float, dur: float, cat: str = "user_annotation", tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


# Chrome trace events like usp/engine/observe/profiler.py's (microseconds): step 3 of rank 0 has two
# micro batches and a gradient all-reduce (an op with a nested one, another on a second thread).
TRACE_RANK0 = [
    _span("ProfilerStep#1", 0, 30_000), _span("usp_step_2", 10, 4_000), _span("usp_forward", 100, 1_000),
    _span("usp_backward", 1_200, 2_000), _span("usp_optimizer", 3_300, 500),
    _span("usp_step_3", 5_000, 10_000), _span("usp_forward", 5_100, 2_000), _span("usp_backward", 7_200, 1_900),
    _span("usp_forward", 9_200, 1_500), _span("usp_backward", 10_800, 2_000), _span("usp_optimizer", 13_000, 1_000),
    _span("usp_forward", 5_100, 2_500, cat="gpu_user_annotation"),  # the device copy: not counted
    _span("c10d::allreduce_", 12_000, 1_000, cat="cpu_op"), _span("record_param_comms", 12_100, 500, cat="cpu_op"),
    _span("gloo:all_reduce", 12_500, 1_000, cat="cpu_op", tid=2), _span("aten::add", 12_000, 3_000, cat="cpu_op")]
TRACE_RANK1 = [_span("usp_step_3", 100, 8_000), _span("usp_forward", 200, 3_000), _span("usp_backward", 3_300, 4_000),
               _span("usp_optimizer", 7_400, 500)]


def test_trace_gives_a_stacked_step_breakdown(sweep_dir, tmp_path):
    waits = {2: 0.0002, 3: 0.0005}
    run = _fake_run(sweep_dir, tmp_path / "run", _records(3, tokens_per_s=1000.0, data_wait_s=[0.001, *waits.values()]),
                    name="prof", config__profile={"enabled": True, "steps": [2, 3]})
    (run / "profile").mkdir()
    (run / "profile" / "rank_0.json").write_text(json.dumps({"schemaVersion": 1, "traceEvents": TRACE_RANK0}))
    (run / "profile" / "rank_1.json").write_text(json.dumps({"traceEvents": TRACE_RANK1}))
    (run / "profile" / "summary_rank_0.txt").write_text(PROFILER_TABLE)
    result = write_report([str(run)])
    data = result.plot("step_time").data
    assert data["forward"] == {"x": ["r0 s2", "r0 s3", "r1 s3"], "y": [1.0, 3.5, 3.0]}  # both micro batches
    assert data["backward"]["y"] == pytest.approx([2.0, 3.9, 4.0]) and data["optimizer"]["y"] == [0.5, 1.0, 0.5]
    assert data["data wait"]["y"] == pytest.approx([0.2, 0.5, 0.0])  # metrics.jsonl is rank 0's: rank 0 only
    assert data["other"]["y"] == pytest.approx([0.3, 1.1, 0.5])  # the step span minus the rest
    assert data["communication"]["y"] == pytest.approx([0.0, 1.5, 0.0])  # [12.0, 13.5] ms, nested op once
    md = result.markdown.read_text()
    assert "| prof | 0 | 3 | 10.0 | 3.5 | 3.9 | 1.0 | 0.5 | 1.1 | 1.5 |" in md
    assert "![step time](step_time.png)" in md and "| aten::mm | 12.500 |" in md  # the top ops stay
    assert _png_shape(result.plot("step_time").path)[0] > 150


def test_tokens_per_s_leaves_out_warm_up_and_profiled_steps(sweep_dir, tmp_path):
    tps = [10.0, 100.0, 20.0, 30.0, 110.0, 120.0]  # step 2: the profiler's warm-up; 3-4 profiled
    profiled = load_run(_fake_run(sweep_dir, tmp_path / "p", _records(6, tokens_per_s=tps, mfu=tps),
                                  config__profile={"enabled": True, "steps": [3, 4]}))
    assert profiled.profiled_steps() == {2, 3, 4}
    assert profiled.tokens_per_s() == 115.0 and profiled.mfu() == (115.0, "measured")
    plain = load_run(_fake_run(sweep_dir, tmp_path / "n", _records(6, tokens_per_s=tps),
                               config__profile={"enabled": False, "steps": [3, 4]}))
    assert plain.tokens_per_s() == 100.0  # median of steps 2-6


def test_allocator_peak_is_the_measured_memory_without_the_probe(sweep_dir, tmp_path):
    run = _fake_run(sweep_dir, tmp_path / "gpu", _records(3, tokens_per_s=1.0, memory_peak_gib=[0.5, 0.75, 0.6]),
                    {"final_loss": 5.0}, name="gpu")
    assert load_run(run).memory_measured() == (0.75, "allocator")
    result = write_report([str(run)])
    assert result.plot("memory").data["measured"]["y"] == [0.75]
    assert "| 0.750 (allocator) |" in result.markdown.read_text()


@pytest.mark.distributed
def test_moe_run_logs_and_plots_its_expert_load(tmp_path, shakespeare):
    """A pipelined MoE run (pp 2: each rank routes half the layers): metrics.jsonl holds every
    layer's tokens per expert over the global batch, the console an imbalance line per logged
    step, and `usp report` the expert-load plot of those numbers."""
    proc = run_usp("train", "model=moe_tiny", "model.n_layers=4", "model.tie_embeddings=false", *FAST,
                   "cluster.procs_per_node=2", "parallelism.pp=2", "parallelism.dp_replicate=1",
                   "train.micro_batch=4", f"train.runs_dir={tmp_path}", "train.name=moe")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(tmp_path / "moe" / "metrics.jsonl")
    plan = yaml.safe_load((tmp_path / "moe" / "plan.yaml").read_text())
    assignments = plan["batch"]["global_batch"] * plan["batch"]["seq_len"] * 2  # top-2
    for record in metrics:
        load = record["expert_load"]
        assert sorted(load) == ["0", "1", "2", "3"]
        for layer in load.values():
            assert layer["tokens_mean"] * 4 == assignments  # every token of the global batch, counted once
            assert layer["tokens_min"] <= layer["tokens_mean"] <= layer["tokens_max"]
            assert layer["imbalance"] == pytest.approx(layer["tokens_max"] / layer["tokens_mean"])
        worst = max(load, key=lambda k: load[k]["imbalance"])
        assert f"step {record['step']} moe load: imbalance max/mean {load[worst]['imbalance']:.2f} in layer {worst}" \
            in proc.stdout
    plot = write_report([str(tmp_path / "moe")]).plot("expert_load")
    assert plot is not None and plot.path.stat().st_size > 5000
    assert plot.data["layer 3"]["y"] == [r["expert_load"]["3"]["imbalance"] for r in metrics]
    assert plot.data["layer 0"]["max"] == [r["expert_load"]["0"]["tokens_max"] for r in metrics]
