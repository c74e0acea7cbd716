"""train.compile=auto and train.fp8 before launch (torch-free): the one place compile is resolved, the
plan-time rules for FP8 (where it can't run: CPU, a GPU without FP8 units, rowwise scales over TP; what
this engine doesn't train yet), and what the planner's memory and time make of both."""
from __future__ import annotations

from functools import partial

import pytest

from tests.helpers import plan_for
from usp.config.compose import compose_config
from usp.contract.decide import compile_choice, uses_compile
from usp.errors import PlanError
from usp.perf.memory import fp8_layer_params
from usp.perf.specs import GIB, Arch, Layout
from usp.plan.plan import checked_plan, plan_with_failures

H100_ONE = ("cluster=slurm_h100", "cluster.procs_per_node=1", "model=llama3_2_1b", "train.seq_len=2048",
            "train.global_batch=8", "train.micro_batch=8")
FSDP8 = ("cluster=slurm_h100", "model=llama3_1_8b", "parallelism.dp_replicate=1", "parallelism.dp_shard=8",
         "train.seq_len=2048", "train.global_batch=8")


pytestmark = pytest.mark.usefixtures("fresh_cache")  # planning computes the dataset's path from it
plan_for = partial(plan_for, training=False)  # as `usp plan` plans: the data pipeline's limits are warnings


def failures(*overrides: str):
    cfg, choices = compose_config(None, list(overrides))
    return plan_with_failures(cfg, choices)


# --- train.compile=auto --------------------------------------------------------------------------------

@pytest.mark.parametrize("value,device,on", [
    ("auto", "cuda", True), ("auto", "cpu", False), ("auto", "xpu", False), (True, "cpu", True),
    (False, "cuda", False), ("true", "cpu", True), ("False", "cuda", False),  # a YAML string, an old plan's bool
])
def test_compile_auto_is_on_for_cuda_only(value, device, on):
    assert uses_compile(value, device) is on


def test_zero_bubble_schedules_run_eager_and_refuse_compile_true():
    """torch.distributed.pipelining refuses compiled stage modules under interleaved_zb and zbv (found by
    `usp plan --build-check` of a Qwen3-235B zbv layout on CUDA): auto plans them eager, with the eager
    figures; true is refused naming the key; other schedules keep compile."""
    pp = ("cluster=local_gpu", "cluster.procs_per_node=2", "parallelism.pp=2", "parallelism.pp_virtual_stages=2",
          "model.n_layers=4", "train.global_batch=16", "train.micro_batch=2")
    zbv = plan_for(*pp, "parallelism.pp_schedule=zbv")
    interleaved = plan_for(*pp, "parallelism.pp_schedule=interleaved_1f1b")
    assert zbv.decisions.compile is False and interleaved.decisions.compile is True
    assert zbv.decisions.compiled_loss is False
    eager = plan_for(*pp, "parallelism.pp_schedule=interleaved_1f1b", "train.compile=false")
    assert zbv.memory.stages[0].activation_per_layer == eager.memory.stages[0].activation_per_layer
    assert uses_compile("auto", "cuda", "zbv", 1) is True  # no pipeline: the schedule is not used
    with pytest.raises(PlanError) as err:
        plan_for(*pp, "parallelism.pp_schedule=zbv", "train.compile=true")
    assert err.value.key == "train.compile" and "parallelism.pp_schedule=interleaved_1f1b" in err.value.fix


def test_compile_defaults_to_auto_and_a_bad_value_is_refused_naming_the_key():
    cfg, _ = compose_config(None, [])
    assert cfg.train.compile == "auto" and compile_choice(cfg.train.compile) == "auto"
    auto, eager = (plan_for("cluster=local_gpu", *c).memory.stages[0] for c in ((), ("train.compile=false",)))
    assert auto.activation_per_layer < eager.activation_per_layer  # compiled on CUDA: the compiled block's count
    with pytest.raises(PlanError) as err:
        plan_for("train.compile=maybe")
    assert (err.value.key, err.value.value) == ("train.compile", "maybe") and "train.compile=auto" in err.value.fix


def test_eager_overhead_is_the_measured_compile_gain():
    """conf/cluster/h200.yaml: eager_overhead 0.2257 x the compiled micro batches' compute (the H200 run, 1B,
    both with the eager loss: 58,946 vs 49,072 tokens/s, the optimizer step and the fixed cost unchanged); one
    GPU has no communication, so the eager compute is exactly 1.2257 x the compiled one, and the planner
    predicts the measured ratio."""
    one = ("cluster=h200", "cluster.procs_per_node=1", *H100_ONE[2:])
    eager, compiled = (plan_for(*one, f"train.compile={c}").timing for c in ("false", "true"))
    assert eager.compute_s == pytest.approx(1.2257 * compiled.compute_s, rel=1e-9)
    assert eager.eager_s == pytest.approx(0.2257 * compiled.micro_batch_s, rel=1e-9) and compiled.eager_s == 0
    assert eager.step_s - eager.compute_s == pytest.approx(compiled.step_s - compiled.compute_s, rel=1e-9)
    assert compiled.mfu / eager.mfu == pytest.approx(58_946 / 49_072, rel=1e-3)


def test_eager_blocks_and_the_eager_loss_follow_the_h100_rows():
    """conf/cluster/slurm_h100.yaml, fitted to the H100 session (docs/benchmarks.md): an eager step takes
    0.3314 x the compiled micro batches' compute longer + 7.271 ps per logit for the eager loss. The planner
    then predicts each measured compiled / eager ratio, though the loss's share differs: 1B 8 x 1 1.343
    (59,902 / 44,586 tokens/s), 3B 2 x 4 1.294 (21,126 / 16,327). Under TP the loss stays eager
    (vocab-parallel) beside compiled blocks."""
    logits = 8 * 2048 * 128256
    eager, compiled = (plan_for(*H100_ONE, f"train.compile={c}").timing for c in ("false", "true"))
    assert eager.step_s == pytest.approx(compiled.step_s + 0.3314 * compiled.compute_s + 7.271e-12 * logits,
                                         rel=1e-9)
    assert compiled.tokens_per_s / eager.tokens_per_s == pytest.approx(59_902 / 44_586, rel=0.01)
    three = (*H100_ONE[:2], "model=llama3_2_3b", "train.seq_len=2048", "train.global_batch=8", "train.micro_batch=2")
    eager, compiled = (plan_for(*three, f"train.compile={c}").timing for c in ("false", "true"))
    assert compiled.tokens_per_s / eager.tokens_per_s == pytest.approx(21_126 / 16_327, rel=0.01)
    tp = ("cluster=slurm_h100", "cluster.procs_per_node=2", "parallelism.dp_replicate=1", "parallelism.tp=2",
          *H100_ONE[2:])
    free = plan_for(*tp, "cluster.timing.eager_loss_ps_per_logit=0").timing
    assert plan_for(*tp).timing.step_s == pytest.approx(free.step_s + 7.271e-12 * logits / 2, rel=1e-9)


def test_a_recipe_with_its_own_kernels_ignores_train_compile():
    """planner.profile=nanotron predicts nanotron's fused kernels: no eager overhead, no compiled activations."""
    one = ("cluster=h200", "cluster.procs_per_node=1", "planner.profile=nanotron", *H100_ONE[2:])
    eager, compiled = (plan_for(*one, f"train.compile={c}", force=True) for c in ("false", "true"))
    assert eager.timing.step_s == compiled.timing.step_s and eager.memory.peak_gib == compiled.memory.peak_gib


# --- FP8: the rules ------------------------------------------------------------------------------------

def test_fp8_on_cpu_is_refused_before_launch():
    with pytest.raises(PlanError) as err:
        plan_for("train.fp8=tensorwise")
    e = err.value
    assert (e.key, e.value) == ("train.fp8", "tensorwise") and "cluster.device=cpu" in str(e)
    assert "train.fp8=off" in e.fix and "cluster=slurm_h100" in e.fix


def test_fp8_on_a_gpu_without_fp8_units_is_refused():
    """A100 (Ampere, compute capability 8.0) has no FP8 tensor cores; H100, H200 and MI300X do."""
    with pytest.raises(PlanError) as err:
        plan_for("cluster=a100_80gb", "train.fp8=rowwise")
    e = err.value
    assert (e.key, e.value) == ("train.fp8", "rowwise") and "A100" in str(e) and "peak_tflops_fp8=0" in str(e)
    for cluster in ("slurm_h100", "h200", "mi300x", "local_gpu"):
        plan = plan_for(f"cluster={cluster}", "train.fp8=tensorwise")
        assert plan.timing.assumptions and any("train.fp8=tensorwise" in a for a in plan.timing.assumptions)


def test_fp8_recipe_names_are_checked():
    with pytest.raises(PlanError) as err:
        plan_for("cluster=slurm_h100", "train.fp8=blockwise")
    assert (err.value.key, err.value.value) == ("train.fp8", "blockwise") and "tensorwise" in str(err.value)


def test_rowwise_fp8_over_tensor_parallel_is_a_layout_torchao_cant_shard():
    """torchao's Float8ColwiseParallel / Float8RowwiseParallel implement per-tensor scales only: rowwise with
    tp > 1 can't work (plan kind); tensorwise could, but this engine doesn't install those styles (engine kind:
    the plan describes it, usp train refuses it)."""
    plan, errors = failures("cluster=slurm_h100", "parallelism.tp=2", "parallelism.dp_replicate=4",
                            "train.fp8=rowwise")
    assert plan is None and [e.key for e in errors][:1] == ["train.fp8"] and "scale per tensor" in str(errors[0])
    assert "train.fp8=tensorwise" in errors[0].fix
    plan, errors = failures("cluster=slurm_h100", "parallelism.tp=2", "parallelism.dp_replicate=4",
                            "train.fp8=tensorwise")
    assert plan is not None and [(e.key, e.value) for e in errors] == [("parallelism.tp", 2)]
    cfg, choices = compose_config(None, ["cluster=slurm_h100", "parallelism.tp=2", "parallelism.dp_replicate=4",
                                         "train.fp8=tensorwise"])
    with pytest.raises(PlanError) as err:
        checked_plan(cfg, choices)
    assert err.value.key == "parallelism.tp" and "parallelism.dp_shard" in err.value.fix


def test_fp8_composes_with_fsdp_and_warns_without_compile():
    plan = plan_for(*FSDP8, "train.fp8=rowwise")
    assert plan.memory.dp_kind == "fsdp" and not any("train.compile" in w for w in plan.warnings)
    eager = plan_for(*FSDP8, "train.fp8=rowwise", "train.compile=false")
    assert any(w.startswith("train.compile=False") and "FP8 without compile" in w for w in eager.warnings)
    plan, errors = failures("cluster=slurm_h100", "model=moe_tiny", "train.fp8=tensorwise")
    assert [e.key for e in errors] == ["train.fp8"] and "MoE" in str(errors[0])


# --- FP8: memory and time --------------------------------------------------------------------------------

def test_fp8_copies_replace_autocast_copies_and_count_their_scales():
    """Eager, no recompute, autocast caches a bf16 copy of every weight; FP8 linears cast to FP8 themselves:
    only the LM head's bf16 copy stays, and a layer's backward holds its FP8 weights (1 byte) + fp32 scales."""
    a = Arch.from_model(compose_config(None, ["model=llama3_2_1b"])[0].model)
    eager = ("train.compile=false", "train.recompute=none")
    bf16 = plan_for(*H100_ONE, *eager, force=True).memory.stages[0]
    plans = {r: plan_for(*H100_ONE, *eager, f"train.fp8={r}", force=True).memory.stages[0]
             for r in ("tensorwise", "rowwise")}
    head = 2 * a.vocab_size * a.dim
    assert bf16.copies == pytest.approx(2 * a.n_layers * a.layer_params + head, rel=1e-3)
    assert all(p.copies == pytest.approx(head) for p in plans.values()) and plans["rowwise"].total < bf16.total
    layer = fp8_layer_params(a, Layout())
    assert layer == a.attn_params + a.dense_mlp_params
    rows_and_cols = 6 * a.dim + 2 * a.kv_dim + 3 * (a.dim + a.ffn_dim)  # wq, wo: 2h; wk, wv: h + kv; SwiGLU: h + f
    from usp.perf.memory import _fp8_copies
    from usp.perf.specs import Precision

    assert _fp8_copies(a, Layout(), Precision.resolve("bf16", "cuda", True, fp8="rowwise")) == layer + 4 * rows_and_cols
    assert _fp8_copies(a, Layout(), Precision.resolve("bf16", "cuda", True, fp8="tensorwise")) == layer + 4 * 7
    assert _fp8_copies(a, Layout(), Precision.resolve("bf16", "cuda", True)) == 0


def test_fsdp_gathers_fp8_weights_as_without_fp8():
    """FSDP gathers the converted weights in bf16 and each Float8Linear casts them (torchao's FP8
    all-gather is not used: usp/engine/parallel/fp8.py): the same gathers, the same gathered memory."""
    plans = {r: plan_for(*FSDP8, f"train.fp8={r}") for r in ("off", "tensorwise", "rowwise")}
    gather = {r: next(c for c in p.timing.comm if c.name == "FSDP all-gather (forward)").bytes_per_step
              for r, p in plans.items()}
    assert gather["tensorwise"] == gather["rowwise"] == gather["off"] > 0
    assert len({p.memory.stages[0].gathered for p in plans.values()}) == 1


def test_fp8_time_uses_the_fp8_peak_times_its_efficiency():
    """Converted matmuls at peak_tflops_fp8 x gemm_efficiency x fp8_efficiency (with their own half-rate K),
    plus the casts through HBM (the profile's fp8_cast_bytes per element); at fp8_efficiency = bf16 peak / FP8
    peak and the bf16 K they run at the bf16 rate: the matmuls take the bf16 time, the casts come on top. MFU
    stays against the bf16 peak. usp's fp8_cast_bytes is fitted to the H100 session: Llama-3.2 3B, 2 x 4, FP8
    tensorwise at 1.056x bf16."""
    bf16 = plan_for(*H100_ONE).timing
    fp8 = plan_for(*H100_ONE, "train.fp8=tensorwise", "cluster.timing.fp8_efficiency=1.0").timing
    same = plan_for(*H100_ONE, "train.fp8=tensorwise", f"cluster.timing.fp8_efficiency={989 / 1979}",
                    "cluster.timing.fp8_half_k=200").timing
    assert 1.0 < bf16.step_s / fp8.step_s < 2.0 and bf16.gemm_s / fp8.gemm_s > 1.5
    assert same.gemm_s == pytest.approx(bf16.gemm_s, rel=1e-9)  # the LM head stays bf16 either way
    assert same.elementwise_s > bf16.elementwise_s and same.step_s > bf16.step_s  # the casts
    assert fp8.peak_tflops == bf16.peak_tflops == 989 and fp8.model_flops_per_token == bf16.model_flops_per_token
    assert plan_for(*H100_ONE, "train.fp8=tensorwise").memory.peak_gib * GIB > 0
    three = (*H100_ONE[:2], "model=llama3_2_3b", "train.seq_len=2048", "train.global_batch=8", "train.micro_batch=2")
    speedup = plan_for(*three, "train.fp8=tensorwise").timing.tokens_per_s / plan_for(*three).timing.tokens_per_s
    assert speedup == pytest.approx(22_310 / 21_126, rel=2e-3)  # the measured speedup
