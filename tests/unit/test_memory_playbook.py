"""The planner's memory model on real H100 runs (calibration/playbook_h100: the Ultra-Scale
Playbook's nanotron sweep, 1,027 ok runs of a 1.34B and an 8.86B Llama on 1-64 nodes): the
`nanotron` profile's predicted peak memory of pp rank 0 against the measured one (mem_gb: peak
allocated memory on rank 0). The rows become layouts once (usp.perf.calibration.measured_runs, also behind
`usp calibrate`); usp.perf.calibration.memory_check scores them (also behind scripts/bench/calibration_sweep.py).
Pure Python, no torch; docs/planner.md has the numbers."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.helpers import usp_cli
from usp.perf.calibration.measured_runs import BF16, SEQ_LEN, h100_nodes, read_sweep_csv
from usp.perf.calibration.memory_check import accuracy, check_memory, fit_constants
from usp.perf.calibration.published import PLAYBOOK_OTHER_SIZES
from usp.perf.memory import activation_values, memory_plan, stage_memory, zero_sharding
from usp.perf.pipeline_split import matmul_threshold_split
from usp.perf.specs import Layout
from usp.perf.stack_profile import PROFILES
from usp.perf.timing import time_shape

NANOTRON = PROFILES["nanotron"]


@pytest.fixture(scope="module")
def runs():
    return read_sweep_csv()


def _line(name: str, acc: dict) -> str:
    return (f"{name}: {acc['ok_runs']} ok runs, median |error| {acc['median_abs_error']:.1%}, "
            f"{acc['within_10pct']:.0%} within 10 %, {acc['ok_predicted_oom']} predicted OOM; "
            f"{acc['failed_predicted_fit']} of {acc['failed_runs']} failed runs predicted to fit")


def test_nanotron_profile_predicts_the_playbook_runs(runs):
    checks = check_memory(runs, NANOTRON)
    acc = accuracy(checks)
    print("\n" + _line("nanotron profile, all", acc))
    for model in ("1.34B", "8.86B"):
        print(_line(f"  {model}", accuracy([c for c in checks if c.run.model == model])))
    assert acc["ok_runs"] == 1027 and acc["ok_unplaced"] == 0
    # issue 17's bars: median |error| <= 8 % (5.5 % today) and >= 70 % of the ok runs within 10 % (70.5 %: 724 runs;
    # 69.0 % before the bf16 gradients were freed per micro batch at tp = 1, docs/planner.md)
    assert acc["median_abs_error"] <= 0.08 and acc["within_10pct"] >= 0.70
    # issue 16: no ZeRO-1 run with TP or PP that ran is predicted out of memory (3 were: 8.86B pp 2-8 at tp 1). The
    # 3 left are ZeRO-0 rows with huge micro batches at tp 32 measured far below any count (8.86B mbs 64: 25.6 GiB)
    assert acc["ok_zero1_tp_pp_predicted_oom"] == 0 and acc["ok_predicted_oom"] <= 3
    # usp's own recipe on the same layouts is another engine: far off, and that is the point of a profile
    assert accuracy(check_memory(runs, PROFILES["usp"]))["median_abs_error"] > 0.2


def test_constants_fitted_on_one_model_hold_on_the_other(runs):
    """The three fitted constants (activation_scale, sp_full_buffers, accum_bytes_per_token_h) chosen on one
    model's runs, checked on the other model's: the fit must not be a lookup of these rows, and the
    gradient-accumulation term comes out the same on both models (it scales with h, not per model)."""
    chosen = []
    for fit_on, held_out in (("1.34B", "8.86B"), ("8.86B", "1.34B")):
        fitted, fit_acc = fit_constants([r for r in runs if r.model == fit_on], NANOTRON,
                                        scales=(1.0, 1.1), buffers=(2, 3, 4), accum=(0.0, 100.0))
        held = accuracy(check_memory([r for r in runs if r.model == held_out], fitted))
        print(f"\nfit on {fit_on} (activation_scale {fitted.activation_scale}, sp_full_buffers "
              f"{fitted.sp_full_buffers}, accum_bytes_per_token_h {fitted.accum_bytes_per_token_h}): "
              + _line("fit", fit_acc) + "\n  " + _line(f"held out {held_out}", held))
        assert held["median_abs_error"] <= 0.08 and held["ok_predicted_oom"] <= 3
        assert held["ok_zero1_tp_pp_predicted_oom"] == 0
        chosen.append(fitted.accum_bytes_per_token_h)
    assert chosen == [100.0, 100.0]


def test_gradient_accumulation_term_only_where_measured():
    """The measured extra of a rank holding the whole model that accumulates gradients: 100 bytes per
    token per hidden unit, not divided by tp, absent at gas = 1, at pp > 1 and in usp's profile."""
    run = next(r for r in read_sweep_csv() if r.model == "8.86B")
    h = run.arch.dim

    def activations(profile, **kw):
        return stage_memory(run.arch, Layout(**kw), SEQ_LEN, h100_nodes(4), BF16, 0, profile).activations

    for t in (1, 8):
        extra = activations(NANOTRON, tp=t, micro_batch=2, grad_accum=4) - activations(NANOTRON, tp=t, micro_batch=2)
        assert extra == pytest.approx(100 * SEQ_LEN * 2 * h)
    without = replace(NANOTRON, accum_bytes_per_token_h=0.0)
    assert activations(NANOTRON, pp=2, micro_batch=2, grad_accum=4) == activations(without, pp=2, micro_batch=2,
                                                                                   grad_accum=4)  # not measured
    usp = PROFILES["usp"]
    assert activations(usp, tp=8, micro_batch=2, grad_accum=4) == activations(usp, tp=8, micro_batch=2)
    said = [memory_plan(run.arch, Layout(tp=8, grad_accum=4), SEQ_LEN, h100_nodes(1), BF16, p).assumptions
            for p in (NANOTRON, usp)]
    assert any("gradient accumulation on the whole model: + 100 bytes" in a for a in said[0])
    assert not any("gradient accumulation on the whole model" in a for a in said[1])


def test_nanotron_split_and_zero1_are_the_recipe_s():
    """nanotron's layer split counts the LM head as V·h of matmul (the 1.34B's first of 4 ranks gets 6
    layers, the last only the head); its ZeRO-1 with TP/PP shards the optimizer states only."""
    run = next(r for r in read_sweep_csv() if r.model == "1.34B")
    assert matmul_threshold_split(run.arch, 2) == (11, 5)
    assert matmul_threshold_split(run.arch, 4) == (6, 5, 5, 0)
    lay = Layout(pp=2, dp_replicate=4, tp=2, zero1=True, micro_batch=1, grad_accum=8)
    assert zero_sharding(lay, NANOTRON) == (1, 4) and zero_sharding(lay, PROFILES["usp"]) == (2, 4)
    st = stage_memory(run.arch, lay, SEQ_LEN, h100_nodes(1), BF16, 0, NANOTRON)
    assert st.layers == 11 and st.parameters == 2 * st.params and st.optimizer == pytest.approx(12 * st.params / 4)
    assert st.gradients == (2 + 4) * st.params  # bf16 gradients + the fp32 accumulation buffer, unsharded
    assert st.comm_buffers == 0 and st.overhead == 0  # no DDP under ZeRO-1; peak allocated memory


def test_nanotron_layer_keeps_sharded_norm_outputs_and_a_packed_kv():
    """A dense layer as nanotron keeps it, per token: norm inputs and outputs h/t each (fused norm,
    sequence-sharded), q/k/v (h + 2kv)/t + the packed K/V 2kv/t + the attention output h/t, the MLP
    4f/t: (10h + 4f)/t with MHA; usp's engine keeps x·rstd too and the norm outputs all-gathered."""
    arch = next(r for r in read_sweep_csv() if r.model == "8.86B").arch
    h, f = arch.dim, arch.ffn_dim
    for t in (1, 4):
        lay = Layout(tp=t)
        assert activation_values(arch, lay, NANOTRON)[0] == pytest.approx((10 * h + 4 * f) / t)
        assert activation_values(arch, lay, PROFILES["usp"])[0] == pytest.approx((8 * h + 4 * f) / t + 2 * h)


def test_usp_plan_predicts_as_the_profile_says(tmp_path):
    args = ("plan", "model=llama3_1_8b", "cluster=slurm_h100", "cluster.nodes=2", "parallelism.tp=4",
            "parallelism.dp_replicate=4", "parallelism.zero1=true", "train.seq_len=4096")
    usp, nano = (usp_cli(*args, *extra, cwd=tmp_path) for extra in ((), ("planner.profile=nanotron",)))
    assert usp.returncode == nano.returncode == 0, usp.stderr + nano.stderr
    assert "profile nanotron" in nano.stdout and "fp32 gradient-accumulation buffer" in nano.stdout
    assert "profile usp" in usp.stdout and "fp32 gradient-accumulation" not in usp.stdout


def test_train_compile_moves_usp_memory_only():
    """train.compile's memory terms (what a compiled block saves, the compiled loss, a cast per in-flight micro
    batch) are usp's blocks under torch.compile. nanotron runs its own fused kernels whatever the flag
    (Profile.follows_compile False): the playbook's rows say compile=true by default, and its 80B at pp 16 tp 4
    (63.1 GiB measured) was predicted at 78 GiB through usp's compiled terms, which fired the pipeline stall."""
    run = next(r for r in read_sweep_csv(PLAYBOOK_OTHER_SIZES) if r.model == "80B" and r.ok and r.mem_gib
               and (r.layout.pp, r.layout.tp, r.nodes) == (16, 4, 8))
    compiled = replace(BF16, compiled=True)
    hw = h100_nodes(run.nodes)

    def gib(profile, prec):
        return memory_plan(run.arch, run.layout, run.seq_len, hw, prec, profile).peak_gib

    assert gib(NANOTRON, compiled) == gib(NANOTRON, BF16)
    assert gib(NANOTRON, compiled) == pytest.approx(run.mem_gib, rel=0.15)  # 72.2 GiB for 63.1 measured
    assert gib(PROFILES["usp"], compiled) != gib(PROFILES["usp"], BF16)
    # the time model's memory input (the stall's trigger) reads the same peak
    shape = time_shape(run.arch, run.layout, run.seq_len, run.global_batch, hw, compiled, NANOTRON)
    assert shape.memory_fraction == pytest.approx(gib(NANOTRON, BF16) / hw.memory_gib, rel=0.02)


def test_zero1_pipeline_runs_fit_because_bf16_gradients_live_one_micro_batch(runs):
    """The three 8.86B ZeRO-1 pipeline runs once predicted out of memory (pp rank 0: 80-85 GiB, measured 72-77):
    nanotron adds each micro batch's bf16 gradients into its fp32 buffer and frees them, so at the start of a
    backward pp rank 0 holds 1F1B's p micro batches in flight and no bf16 gradient (and the backward transients of
    that one micro batch only). Under TP the sweep's peaks keep the all-at-once count; usp's profile never frees."""
    picked = {(2, 4, 1, 64), (4, 8, 2, 16), (8, 4, 2, 32)}
    found = [r for r in runs if r.ok and r.model == "8.86B" and r.layout.zero1 and r.layout.tp == 1
             and (r.layout.pp, r.layout.dp, r.layout.micro_batch, r.layout.grad_accum) in picked]
    assert len(found) == 3
    all_at_once = replace(NANOTRON, grads_freed_max_tp=0)
    for run, check, before in zip(found, check_memory(found, NANOTRON), check_memory(found, all_at_once)):
        assert check.fits and abs(check.error) <= 0.05 and not before.fits
        st = stage_memory(run.arch, run.layout, SEQ_LEN, h100_nodes(run.nodes), BF16, 0, NANOTRON)
        assert st.peak_phase == "start of a micro batch's backward" and st.in_flight == run.layout.pp
        assert st.gradients == pytest.approx(4 * st.params)  # the fp32 accumulation buffer only
        one = st.activation_per_layer * st.layers  # transients of one micro batch: kept x 1.1 on it alone
        stage_output = SEQ_LEN * run.layout.micro_batch * run.arch.dim * 2
        assert st.activations == pytest.approx((one / 1.1 + stage_output) * st.in_flight + one * 0.1 / 1.1)
    tp2 = Layout(pp=2, dp_replicate=4, tp=2, zero1=True, micro_batch=1, grad_accum=64)
    arch = found[0].arch
    assert stage_memory(arch, tp2, SEQ_LEN, h100_nodes(2), BF16, 0, NANOTRON).peak_phase == "backward"
    assert stage_memory(arch, found[0].layout, SEQ_LEN, h100_nodes(1), BF16, 0, PROFILES["usp"]).peak_phase \
        in ("loss backward", "layer backward")
