"""The time model against measured runs (calibration/, usp/perf/calibration/published.py) and `usp calibrate`.
Pure Python.

- the committed constants (conf/cluster/*.yaml, usp/perf/stack_profile.py; scripts/fit_time_model.py) on the
  Ultra-Scale Playbook's held-out half (fitted on its even rows, scored on the odd ones), on llm-foundry's and
  torchtitan's tables they were fitted on (residuals), and on the published runs they were not fitted on
  (per stack and per scale);
- hardware and stack constants apart: a fit of one stack's runs on one cluster cannot move another's;
- the model's terms: the pipeline stall, the stage a cost-balanced split gives, the loss per logit, the
  collectives' algorithms, the overlaps each stack has or lacks;
- `usp calibrate` on a runs CSV of several stacks, and `usp plan`'s band and calibration notes.
The figures are printed (pytest -s) so the tables in docs/planner.md can be checked."""
from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tests.helpers import usp_cli
from usp.perf.calibration import published as P
from usp.perf.calibration.calibrate import Param, Problem, fit
from usp.perf.calibration.measured_runs import BF16, cluster_group, cluster_hardware
from usp.perf.specs import Arch, Hardware, Layout
from usp.perf.stack_profile import PROFILES
from usp.perf.timing import collective_s, evaluate, mfu, pipeline_stall_s, time_shape, timing_plan

ROOT = Path(__file__).resolve().parents[2]
FITTED = ROOT / "conf" / "cluster" / "h100_playbook.yaml"
SWEEP = P.PLAYBOOK


def _hw(path: Path) -> Hardware:
    return Hardware.from_cluster(cluster_group(yaml.safe_load(path.read_text()), path))


def _line(name: str, s) -> str:
    nodes = {n: round(v, 2) for n, v in s.ratio_by_nodes.items()} if len(s.ratio_by_nodes) <= 8 else "-"
    return (f"{name}: n {len(s.measured)}, MFU |error| median {s.abs_err_p50:.2f} points, median |rel| "
            f"{s.rel_err_p50:.1%}, within 15 % {s.within_15:.0%}, max {s.rel_err_max:.1%}, by nodes {nodes}, "
            f"top 3 {s.top3_share:.0%} of {s.cells}, Spearman {s.spearman_p50:.2f}")


@pytest.fixture(scope="module")
def held_out():
    return P.predict(P.playbook("odd"))


def test_the_playbook_held_out_half(held_out):
    """Fitted on the sweep's even rows (scripts/fit_time_model.py stage A), scored on the odd ones: the
    Done-when bars of issue #38 (docs/planner.md "Time on real runs")."""
    s = held_out.scored
    print("\n" + _line("playbook held out (odd rows)", s))
    print(_line("playbook fit half (even rows)", P.predict(P.playbook("even")).scored))
    assert len(held_out.runs) == 509  # the odd rows' ok runs with a non-zero MFU
    assert s.abs_err_p50 <= 3.0
    assert set(s.ratio_by_nodes) == {1, 2, 4, 8, 16, 32, 64}
    for nodes, ratio in s.ratio_by_nodes.items():
        assert 0.8 <= ratio <= 1.25, (nodes, ratio)
    assert s.spearman_p50 >= 0.7
    assert s.cells == 14 and s.top3_share >= 10 / 14  # 10 of 14 (issue #38 asks 75 %: docs/planner.md, misses)


def test_the_playbook_sizes_never_fitted():
    """The same sweep's 3.57B and 80B (calibration/playbook_h100/playbook_sweep_heldout_models.csv): no row of
    them was fitted. The 3.57B (a shape between the fitted two) keeps the held-out bars in median error; the
    80B is the model's weak spot (docs/planner.md): 3.05 points, 4.03 once the pipeline stall's memory input
    stopped counting usp's compiled-block terms for nanotron (a memory over-estimate that had stalled runs slow
    for another reason), 2.67 with the wait per blocking send/recv that grows with the TP degree (that reason:
    its pipelined tp 16-32 layouts had been predicted at 2.0-2.5x their measured MFU)."""
    by_model = P.predict(P.playbook_other_sizes()).by(lambda r: r.model)
    for name, sc in by_model.items():
        print(_line(f"playbook {name} (never fitted)", sc.scored))
    small, large = by_model["3.57B"].scored, by_model["80B"].scored
    assert len(by_model["3.57B"].runs) == 588 and small.abs_err_p50 <= 3.0 and small.spearman_p50 >= 0.6
    assert len(by_model["80B"].runs) == 138 and large.abs_err_p50 <= 3.0


def test_residuals_on_the_tables_the_constants_were_fitted_on():
    """llm-foundry's bf16 tables (Hopper's and Ampere's GPU constants, llm-foundry's stack constants: stage A)
    and torchtitan's 2024-12 tables (its stack constants and the 500 W part's clock: stage C) are fits, not
    tests: their residuals say how well the model can describe each stack at all."""
    lf = P.predict([r for r in P.llmfoundry() if r.precision == "bf16"]).by(lambda r: r.cluster)
    for name, sc in lf.items():
        print(_line(f"llm-foundry bf16 on {name}", sc.scored))
    assert {name: len(sc.runs) for name, sc in lf.items()} == {"a100_40gb": 78, "a100_80gb": 61, "slurm_h100": 70}
    assert all(sc.scored.rel_err_p50 <= 0.12 for sc in lf.values())
    tt = P.predict(P.torchtitan()).scored
    print(_line("torchtitan 2024-12", tt))
    assert len(tt.measured) == 10 and tt.rel_err_p50 <= 0.05 and tt.rel_err_max <= 0.15


# The published runs beyond 15 % today (docs/planner.md "Time on real runs: published runs at 48-16,384 GPUs"):
# torchtitan's 8B at 131k-262k tokens with CP 4-8 over-predicted, Megatron's 177B at 4,608 GPUs
# under-predicted. A run not named here that leaves the 15 % band is a regression.
MISSES_EVAL = {"tt_8b_cp4_s131072", "tt_8b_cp8_s262144", "mlm_h100_177B_strong_4608"}


def _published(use: str):
    return P.predict([r for r in P.published() if r.use == use])


def _misses(sc, beyond: float = 0.15) -> set[str]:
    return {r.run_id for r, p in zip(sc.runs, sc.predicted) if abs(p / r.mfu - 1) > beyond}


def test_the_published_runs_none_was_fitted_on():
    """calibration/published_runs.csv's bf16 runs marked eval (none fitted: the stacks' fitted runs are marked
    fit), each on its catalogue cluster group with its stack's profile, by stack and by scale. Issue #38's
    targets: median |error| <= 10 % (met: 6.2 %), >= 80 % within 15 % (met: 20 of 23, 87 %), max <= 25 %
    (met: 22.8 %). The bounds are the figures achieved with a small margin, so a regression fails."""
    ev = _published("eval")
    s = ev.scored
    print("\n" + _line("published eval (bf16)", s))
    for name, sc in ev.by(lambda r: r.profile).items():
        print(_line(f"  {name}", sc.scored))
    for name, sc in ev.by(lambda r: P.scale(r.layout.world)).items():
        print(_line(f"  {name} GPUs", sc.scored))
    assert len(ev.runs) == 23 and {r.profile for r in ev.runs} == {"megatron", "megatron_legacy", "meta_llama3",
                                                                     "torchtitan"}
    assert max(r.layout.world for r in ev.runs) == 16384
    assert s.rel_err_p50 <= 0.07 and s.within_15 >= 20 / 23 and s.rel_err_max <= 0.24
    assert _misses(ev) <= MISSES_EVAL, _misses(ev) - MISSES_EVAL
    by_stack = {k: v.scored for k, v in ev.by(lambda r: r.profile).items()}
    # legacy Megatron borrows nanotron's host costs, which fell when nanotron's TP wait (pipeline_stall_s) took
    # the pipeline's TP-dependent time: MegaScale's 12,288-GPU run -5.5 % -> -6.4 %
    assert by_stack["megatron"].rel_err_p50 <= 0.06 and by_stack["megatron_legacy"].rel_err_max <= 0.07
    assert by_stack["meta_llama3"].rel_err_max <= 0.14 and by_stack["torchtitan"].rel_err_p50 <= 0.14
    big = ev.by(lambda r: P.scale(r.layout.world))[">2048"]
    assert len(big.runs) == 7 and big.scored.rel_err_p50 <= 0.07 and big.scored.within_15 >= 6 / 7  # 6.4 %
    # Llama 3 405B on 16,384 H100 (its published layout: tp8 pp16 v8 dp128, seq 8,192): 40.4 % published
    llama = next(p for r, p in zip(ev.runs, ev.predicted) if r.run_id == "llama3_405b_16384_cp1")
    assert 0.43 <= llama <= 0.47


def test_the_published_fp8_and_low_confidence_runs():
    """Scored apart from the bf16 set: the FP8 runs (NeMo / Megatron-Bridge Llama 3 8B-405B on 8-1,024 H100,
    torchtitan float8 tensorwise and rowwise) and the low-confidence rows (Megatron's 2021 A100 table with an
    inferred tp / pp, Llama 3's CP16 row whose FLOP convention at 131k tokens is unstated). Figures achieved,
    with a small margin: FP8 is the model's weak spot (rowwise scaling's cost is not modelled)."""
    fp8, low = _published("eval_fp8"), _published("eval_lowconf")
    print("\n" + _line("published eval_fp8", fp8.scored))
    for name, sc in fp8.by(lambda r: r.profile).items():
        print(_line(f"  {name}", sc.scored))
    print(_line("published eval_lowconf", low.scored))
    print(_line("published fit (fitted on)", _published("fit").scored))
    assert len(fp8.runs) == 18 and len(low.runs) == 11
    assert fp8.scored.rel_err_p50 <= 0.19 and fp8.scored.within_15 >= 7 / 18 and fp8.scored.rel_err_max <= 0.72
    nemo = fp8.by(lambda r: r.profile)["megatron"].scored
    assert nemo.rel_err_p50 <= 0.17 and nemo.rel_err_max <= 0.21
    rowwise = {r.run_id for r in fp8.runs if "rowwise" in r.run_id}
    assert _misses(fp8, 0.25) <= rowwise  # only rowwise scaling beyond 25 %
    assert low.scored.rel_err_p50 <= 0.13 and low.scored.rel_err_max <= 0.5
    # the 2021 table's 1.7B and 7.5B (32 and 128 A100, tp / pp inferred): -22 / -25 % before nanotron's TP wait
    # lowered the host costs legacy Megatron borrows, -27 / -28 % after
    assert _misses(low, 0.25) == {"llama3_405b_16384_cp16", "mlm_a100_1.7B", "mlm_a100_7.5B"}


def test_the_normalised_runs_csvs_are_the_scripts_output():
    """calibration/at_scale/{llmfoundry,torchtitan}_runs.csv are scripts/calibration_runs.py's output from the
    verbatim tables beside them."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "calibration_runs.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_stack_fit_moves_only_its_runs_and_a_cluster_fit_only_its_clusters():
    """Hardware constants and stack constants apart: fitting llm-foundry's element-wise factor on its H100 runs
    leaves every nanotron prediction as it was; fitting slurm_h100's GPU efficiency leaves the A100 runs'."""
    runs = [*P.playbook("even")[:60], *(r for r in P.llmfoundry() if r.precision == "bf16")]
    problem = Problem(runs)
    before = problem.predict()
    for param in (Param("llmfoundry.elementwise_factor", "elementwise_factor", 0.5, 8.0, profile="llmfoundry"),
                  Param("gemm_efficiency", "gemm_efficiency", 0.3, 1.0, clusters=("slurm_h100",))):
        values = {param.name: 0.5 if param.profile else 0.4}
        after = problem.predict([param], values)
        moved = [(r.profile if param.profile else r.cluster) for r, a, b in zip(problem.runs, after, before) if a != b]
        assert moved and set(moved) == {param.profile or "slurm_h100"}, param.name


def test_fitting_recovers_constants_the_runs_were_made_with():
    """usp calibrate's search (Levenberg-Marquardt on the soft-L1 residuals, each constant within its range)
    finds the constants a set of runs was generated with, from a start far from them."""
    runs = list(P.llmfoundry())[:60]
    problem = Problem(runs)
    truth = {"llmfoundry.elementwise_factor": 2.0, "llmfoundry.attention_efficiency": 0.7}
    params = [Param("llmfoundry.elementwise_factor", "elementwise_factor", 0.5, 8.0, profile="llmfoundry"),
              Param("llmfoundry.attention_efficiency", "attention_efficiency", 0.2, 1.0, profile="llmfoundry")]
    made = problem.predict(params, truth)
    synthetic = Problem([replace(r, mfu=m) for r, m in zip(problem.runs, made)])
    result = fit(synthetic, params, values={"llmfoundry.elementwise_factor": 6.0,
                                            "llmfoundry.attention_efficiency": 0.3})
    for name, value in truth.items():
        assert result.values[name] == pytest.approx(value, rel=0.02), name
    assert result.fit.rel_err_max < 1e-3


def test_pipeline_stall_grows_with_nodes_and_memory_and_is_not_stretched_by_the_bubble():
    """nanotron's stall per blocking pipeline send/recv: none on few nodes with memory to spare, near
    p2p_stall_ms on 64 nodes or with the fullest stage nearly full, + a wait growing with the TP degree
    (p2p_tp_ms at tp 8); none for a stack without them; added once per blocking op, not multiplied by the
    bubble."""
    k = PROFILES["nanotron"].time
    assert pipeline_stall_s(k, 4, 0.5) < 0.01 * 1e-3 * k.p2p_stall_ms
    tp_only = replace(k, p2p_stall_ms=0.0)
    assert pipeline_stall_s(tp_only, 64, 0.99, 8) == pytest.approx(1e-3 * k.p2p_tp_ms)
    assert pipeline_stall_s(tp_only, 4, 0.5, 32) > 16 * 1e-3 * k.p2p_tp_ms  # ~ tp^2.2
    assert pipeline_stall_s(tp_only, 4, 0.5, 2) < 0.1 * 1e-3 * k.p2p_tp_ms
    assert pipeline_stall_s(k, 64, 0.5) > 0.9 * 1e-3 * k.p2p_stall_ms
    assert pipeline_stall_s(k, 4, 0.97) > 0.9 * 1e-3 * k.p2p_stall_ms
    assert pipeline_stall_s(k, 16, 0.5) < pipeline_stall_s(k, 32, 0.5) < pipeline_stall_s(k, 64, 0.5)
    assert pipeline_stall_s(PROFILES["megatron"].time, 64, 0.99) == 0.0
    # 8.86B, 64 nodes, dp8 tp4 pp16, micro batch 2 x 16: every stage blocks on 4 sends/recvs per micro batch
    run = next(r for r in P.playbook() if r.ok and r.nodes == 64 and r.model == "8.86B"
               and (r.layout.tp, r.layout.pp) == (4, 16))
    h = _hw(FITTED).with_nodes(64)
    shape = time_shape(run.arch, run.layout, run.seq_len, run.global_batch, h, BF16, PROFILES["nanotron"])
    t = evaluate(shape, h, k)
    stall = 4 * run.layout.grad_accum * pipeline_stall_s(k, 64, shape.memory_fraction, run.layout.tp)
    assert t.stall_s == pytest.approx(stall)
    assert t.step_s == pytest.approx((run.layout.grad_accum * t.mb_s + t.path_s) * (1 + shape.bubble) + stall
                                     + t.dp_s + t.fixed_s)
    assert 100 * mfu(shape, t.step_s) == pytest.approx(100 * run.mfu, abs=1.0)  # measured 0.5 %, stall-bound


def test_nanotron_is_timed_as_a_cost_balanced_split_and_its_loss_costs_per_logit():
    """The nanotron profile's busiest stage is the one a split balanced by cost gives (whole layers; the LM
    head and the loss in the balance: the fit's choice, docs/planner.md), usp's the engine's own stages; the
    loss costs loss_bytes_per_logit per logit (tokens x vocabulary/tp) through HBM on the head's stage."""
    hw = _hw(FITTED)
    nano = PROFILES["nanotron"]
    runs = [r for r in P.playbook() if r.ok]
    run = next(r for r in runs if r.model == "1.34B" and (r.layout.tp, r.layout.pp) == (1, 2) and r.nodes == 1)
    shape = time_shape(run.arch, run.layout, run.seq_len, run.global_batch, hw, BF16, nano)
    mb = evaluate(shape, hw, nano.time).mb
    assert shape.balanced and shape.stage_layers == (11, 5)  # nanotron's own split, as the memory model has it
    assert mb.layers < 16 and not mb.on_head  # a stage of whole layers, no more than half the work
    usp_shape = time_shape(run.arch, run.layout, run.seq_len, run.global_batch, hw, BF16, PROFILES["usp"])
    assert usp_shape.stage_layers == (8, 8) and not usp_shape.balanced
    one = next(r for r in runs if r.model == "1.34B" and (r.layout.tp, r.layout.pp) == (1, 1) and r.nodes == 1)
    two = next(r for r in runs if r.model == "1.34B" and (r.layout.tp, r.layout.pp) == (2, 1) and r.nodes == 1)
    s1, s2 = (time_shape(r.arch, r.layout, r.seq_len, r.global_batch, hw, BF16, nano) for r in (one, two))
    assert s1.logits_mb == one.layout.micro_batch * one.seq_len * 131072
    assert s2.logits_mb == two.layout.micro_batch * two.seq_len * 131072 / 2
    t1 = evaluate(s1, hw, nano.time)
    assert t1.mb.loss == pytest.approx(nano.time.loss_bytes_per_logit * s1.logits_mb / (1e9 * hw.hbm_gbps))
    free = evaluate(s1, hw, replace(nano.time, loss_bytes_per_logit=0.0))
    assert t1.step_s > free.step_s + one.layout.grad_accum * t1.mb.loss * 0.99  # + the windows it widens


def test_the_calibration_objective_counts_a_cell_whose_measured_best_leaves_the_predicted_top_3(monkeypatch):
    """The fit's ranking residual: RANK_WEIGHT x ln(3rd-best prediction / the measured best's prediction), 0 when
    the measured best is among the top 3 predicted (1.34B on 1 node), > 0 when not (8.86B on 64 nodes)."""
    import usp.perf.calibration.calibrate as cal

    runs = [r for r in P.playbook("odd") if r.ok]
    for model, nodes, missed in (("1.34B", 1, False), ("8.86B", 64, True)):
        problem = Problem([r for r in runs if r.model == model and r.nodes == nodes])
        predicted = problem.predict()
        best = max(predicted[i] for i, r in enumerate(problem.runs) if r.mfu == max(x.mfu for x in problem.runs))
        shortfall = max(0.0, math.log(sorted(predicted, reverse=True)[2] / best))
        residuals = problem.residuals([], {})
        assert len(residuals) == len(problem.runs) + 1
        assert residuals[-1] == pytest.approx(cal.RANK_WEIGHT * shortfall, abs=1e-12) and (shortfall > 0) == missed
        monkeypatch.setattr(cal, "RANK_WEIGHT", 0.0)
        assert problem.residuals([], {})[-1] == 0.0
        monkeypatch.undo()


def test_collectives_by_algorithm_and_topology():
    """Ring all-reduce: 2(n-1) latency steps, 2(n-1)/n of the bytes; tree: 2 ceil(log2 n) steps, 2 S (NVIDIA/
    nccl#457); auto takes the faster (tree for small messages over many ranks, ring for large); in-network
    reduction moves S once. Across nodes a group's ranks per node each drive their own NIC (rails)."""
    hw = cluster_hardware("slurm_h100")
    c = hw.timing
    nvl, nic = c.nvlink_efficiency * hw.intra_node_gbps * 1e9, c.nic_efficiency * hw.inter_node_gbps * 1e9
    ring = replace(hw, timing=replace(c, all_reduce="ring"))
    tree = replace(hw, timing=replace(c, all_reduce="tree"))
    n, big, small = 256, 4e9, 1e6
    bw = min(nvl, 8 * nic)
    assert collective_s("all_reduce", n, 8, True, big, ring)[0] == pytest.approx(
        2 * (n - 1) * 8e-6 + 2 * (n - 1) / n * big / bw)
    assert collective_s("all_reduce", n, 8, True, big, tree)[0] == pytest.approx(2 * 8 * 8e-6 + 2 * big / bw)
    for size in (big, small):
        by = [collective_s("all_reduce", n, 8, True, size, h)[0] for h in (hw, ring, tree)]
        assert by[0] == min(by[1:])
    auto_small, ring_small = (collective_s("all_reduce", n, 8, True, small, h)[2] for h in (hw, ring))
    assert auto_small < ring_small  # a small message over 256 ranks: the tree's log-depth latency
    sharp = replace(hw, timing=replace(c, in_network_reduction=True, all_reduce="tree"))
    assert collective_s("all_reduce", n, 8, True, big, sharp)[0] == pytest.approx(2 * 8 * 8e-6 + big / bw)
    one_per_node = collective_s("reduce_scatter", 48, 1, True, big, hw)
    assert one_per_node[1] == pytest.approx(nic / 1e9)  # tp8: each DP group has one rank per node, one rail
    assert collective_s("all_gather", 8, 8, False, big, hw)[1] == pytest.approx(nvl / 1e9)


GPT_32B = Arch("gpt32b", 7168, 48, 56, 56, 28672, 131072, False, gated=False)  # Megatron's H100 table row


def _plan(profile: str, layout: Layout, nodes: int = 48, batch: int = 192, arch: Arch = GPT_32B):
    hw = cluster_hardware("slurm_h100").with_nodes(nodes)
    prof = PROFILES[profile]
    from usp.perf.calibration.calibrate import run_precision
    from usp.perf.calibration.measured_runs import MeasuredRun

    prec = run_precision(MeasuredRun("m", arch, layout, nodes, 4096, batch, True, None, None), prof)
    return timing_plan(arch, layout, 4096, batch, hw, prec, prof)


def test_each_stack_overlaps_what_it_documents():
    """Megatron's distributed optimizer: fp32 reduce-scatter behind the last micro batch's backward and bf16
    all-gather behind the first forward, TE's TP overlap; the legacy code overlaps none of them; nanotron's
    ZeRO-1 blocks; usp exposes TP; torchtitan's async TP hides its share."""
    lay = Layout(tp=8, dp_replicate=48, zero1=True, micro_batch=1, grad_accum=4)
    mega, legacy, nano = (_plan(p, lay) for p in ("megatron", "megatron_legacy", "nanotron"))
    rs = next(c for c in mega.comm if "reduce-scatter" in c.name and "ZeRO-1" in c.name)
    ag = next(c for c in mega.comm if "all-gather" in c.name and "ZeRO-1" in c.name)
    assert rs.bytes_per_step == pytest.approx(2 * ag.bytes_per_step)  # fp32 gradients, bf16 parameters
    assert rs.hidden > 0 and ag.hidden > 0 and rs.window_s > ag.window_s  # a backward, a forward
    assert all(c.hidden == 0 for c in legacy.comm) and legacy.step_s > mega.step_s
    tp = next(c for c in mega.comm if c.name.startswith("TP all-gather"))
    assert tp.hidden == pytest.approx(0.9 * tp.seconds) and tp.overlap == 0.9
    blocking = [c for c in nano.comm if "ZeRO-1" in c.name]
    assert blocking and all(c.hidden == 0 and c.exposed_s == c.seconds for c in blocking)
    assert any("does not overlap" in a for a in nano.assumptions)
    tt = (replace(lay, zero1=False, dp_replicate=1, dp_shard=48), "torchtitan")
    vanilla, asynchronous = _plan(tt[1], tt[0]), _plan(tt[1], replace(tt[0], async_tp=True))
    exposed = [sum(c.exposed_s for c in p.comm if c.dims == "tp") for p in (vanilla, asynchronous)]
    assert exposed[1] == pytest.approx((1 - PROFILES["torchtitan"].time.async_tp_overlap) * exposed[0])


def test_torchtitan_context_parallel_moves_every_heads_kv_as_its_code_does():
    """torchtitan (2024-12, and its default since) repeats K/V to every query head before SDPA and runs torch's
    context_parallel with the all-gather rotation: one bf16 gather of every head's K/V per forward pass (again
    when recomputed) and one in the backward, and the fp32 dK/dV rotated cp times; a ring of the KV heads
    (Megatron's) moves 3(cp-1) bf16 blocks of the KV heads only. Both hide behind the layer's attention."""
    arch = Arch("llama3_8b", 4096, 32, 32, 8, 14336, 128256, False)
    lay = Layout(cp=8, dp_shard=1, micro_batch=1, recompute="full")
    torch_cp = [c for c in _plan("torchtitan", lay, nodes=1, batch=1, arch=arch).comm if c.dims == "cp"]
    ring = [c for c in _plan("megatron", lay, nodes=1, batch=1, arch=arch).comm if c.dims == "cp"]
    tokens = 4096 / 8
    gather, dkv = torch_cp
    # layers x passes x K and V x what a rank receives of the gather (7 of 8 blocks)
    assert gather.bytes_per_step == pytest.approx(32 * 3 * 2 * tokens * 4096 * 2 * 7)
    assert dkv.bytes_per_step == pytest.approx(32 * 8 * 2 * tokens * 4096 * 4)
    assert ring[0].bytes_per_step == pytest.approx(32 * 3 * 7 * 2 * tokens * 1024 * 2)
    assert all(c.hidden > 0 for c in torch_cp + ring)


def test_recompute_re_runs_the_tp_collectives_its_checkpoint_does_not_keep():
    """Per layer, 2 all-gathers and 2 reduce-scatters forward, as many backward, and what the recompute runs
    again (counted on usp's TP block on gloo: docs/planner.md): torch's checkpoint replays the block, takes
    the saved ops' outputs from its cache and stops once the backward's tensors exist, so the block's last
    reduce-scatter never re-runs. usp's selective (matmuls, attention kept) re-runs as much as full; torchtitan's
    per-op policy (reduce_scatter_tensor kept) the all-gathers; Megatron's core-attention recompute nothing,
    its full recompute the whole layer."""
    lay = Layout(tp=8, dp_shard=48, micro_batch=1, grad_accum=2, recompute="selective")

    def calls(profile: str, layout: Layout = lay) -> tuple[float, float]:
        plan = _plan(profile, layout)
        ag, rs = (next(c.bytes_per_step for c in plan.comm if c.name.startswith(f"TP {kind}"))
                  for kind in ("all-gather", "reduce-scatter"))
        return ag / one, rs / one

    one = 1.0
    one = calls("megatron")[0] / 4  # forward + backward: 4 all-gathers per layer
    assert calls("megatron") == pytest.approx((4, 4))
    assert calls("torchtitan") == pytest.approx((6, 4))
    assert calls("usp") == pytest.approx((6, 5))
    full = replace(lay, recompute="full")
    assert calls("usp", full) == pytest.approx((6, 5)) and calls("torchtitan", full) == pytest.approx((6, 5))
    assert calls("megatron", full) == pytest.approx((6, 6))


def test_three_gemms_per_linear_and_the_weight_gradient_reduces_over_the_tokens():
    """A linear of in x out over T tokens runs three GEMMs: forward (K = in), input gradient (K = out), weight
    gradient (K = T): the planner's matmul time is their sum at the cluster's K-saturated efficiency."""
    from usp.perf.timing import gemm_s, linears

    arch = Arch("one", 4096, 1, 32, 8, 14336, 128256, False)
    lay = Layout(micro_batch=1)
    hw = cluster_hardware("slurm_h100")
    c, peak, tokens = hw.timing, 989e12, 4096
    expect = sum(gemm_s(tokens, n, k, peak, c.gemm_efficiency, c.gemm_half_k, 1e-6 * c.gemm_fixed_us)
                 + gemm_s(tokens, k, n, peak, c.gemm_efficiency, c.gemm_half_k, 1e-6 * c.gemm_fixed_us)
                 + gemm_s(n, k, tokens, peak, c.gemm_efficiency, c.gemm_half_k, 1e-6 * c.gemm_fixed_us)
                 for _, k, n in linears(arch, lay, fused=False))
    t = timing_plan(arch, lay, 4096, 1, hw, BF16, PROFILES["usp"])
    head = sum(gemm_s(m, n, k, peak, c.gemm_efficiency, c.gemm_half_k, 1e-6 * c.gemm_fixed_us)
               for m, n, k in ((tokens, 128256, 4096), (tokens, 4096, 128256), (128256, 4096, tokens)))
    assert t.gemm_s == pytest.approx(expect + head, rel=1e-9)
    assert len(linears(arch, lay, fused=False)) == 7 and len(linears(arch, lay, fused=True)) == 4


def test_calibrate_command_fits_a_cluster_and_a_stack_from_a_runs_csv_of_several_stacks(tmp_path):
    """`usp calibrate calibration/published_runs.csv --cluster slurm_h100 --profile megatron --fit network,stack`:
    rows name their own cluster group and profile; only the slurm_h100 runs move its latencies, only the
    megatron runs the stack's constants; the group is written with what was fitted and the residuals, the
    stack's constants as a profile file `usp plan` takes."""
    out = tmp_path / "mine.yaml"
    r = usp_cli("calibrate", str(P.PUBLISHED), "--cluster", "slurm_h100", "--profile", "megatron", "--out",
                str(out), cwd=tmp_path, columns=300)
    assert r.returncode == 0, r.stderr
    assert "MFU |error| median" in r.stdout and "cluster group written to" in r.stdout
    written = yaml.safe_load(out.read_text())
    cal = written["timing"]["calibrated"]
    usable = [x for x in P.published() if x.mfu]
    assert cal["runs"] == len(usable) and set(cal["stacks"]) >= {"megatron", "torchtitan", "meta_llama3"}
    assert set(cal["fitted"]) >= {"intra_latency_us", "inter_latency_us", "megatron.layer_us"}
    assert written["name"] == "slurm_h100" and "# NVIDIA H100 SXM nodes" in out.read_text()  # the rest kept
    stack = tmp_path / "mine.megatron.yaml"
    assert yaml.safe_load(stack.read_text())["base"] == "megatron"
    plan = usp_cli("plan", f"cluster={out}", f"planner.profile={stack}", "model=llama3_1_8b", "parallelism.tp=8",
                   "parallelism.dp_replicate=1", "train.seq_len=4096", "train.micro_batch=1", "train.recompute=full",
                   cwd=tmp_path, columns=300)
    assert plan.returncode == 0, plan.stderr
    said = " ".join(plan.stdout.split())
    assert f"profile {stack}'s time constants: published_runs.csv: " in said and "elementwise_factor" in said
    assert "calibrated on" in said and "MFU band" in said
    bad = usp_cli("calibrate", str(tmp_path / "missing.csv"), "--cluster", "slurm_h100", cwd=tmp_path)
    assert bad.returncode == 2 and "not found" in bad.stderr
    bad = usp_cli("calibrate", str(P.PUBLISHED), "--cluster", "slurm_h100", "--fit", "everything", cwd=tmp_path)
    assert bad.returncode == 2 and "--fit" in bad.stderr


def test_plan_shows_band_and_what_was_never_measured(tmp_path):
    fitted = tmp_path / "fitted.yaml"
    r = usp_cli("calibrate", str(SWEEP), "--cluster", "h100_playbook", "--profile", "nanotron", "--fit", "network",
                "--out", str(fitted), cwd=tmp_path, columns=300)
    assert r.returncode == 0, r.stderr
    base = ["model=llama3_2_1b", "model.dim=2048", "model.n_layers=16", "model.n_heads=32", "model.n_kv_heads=32",
            "model.ffn_dim=8192", "model.vocab_size=131072", "train.seq_len=4096", "train.dtype=bf16",
            "train.global_batch=256", "planner.profile=nanotron", f"cluster={fitted}"]
    r = usp_cli("plan", *base, "cluster.nodes=2", "parallelism.dp_replicate=8", "parallelism.tp=2",
                "train.micro_batch=4", cwd=tmp_path, columns=300)
    assert r.returncode == 0, r.stderr
    assert "MFU band" in r.stdout and "calibrated on 1018 runs" in r.stdout
    assert "never measured" not in r.stdout
    r = usp_cli("plan", *base, "cluster.nodes=3", "parallelism.dp_replicate=12", "parallelism.tp=2",
                "train.global_batch=288", "train.micro_batch=4", "train.recompute=full", cwd=tmp_path, columns=300)
    assert r.returncode == 0, r.stderr
    assert "3 node(s) never measured (between" in r.stdout and "recompute:full" in r.stdout
    r = usp_cli("plan", "model=tiny", cwd=tmp_path)
    assert "never calibrated" in r.stdout
