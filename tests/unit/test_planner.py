"""The planner: catalogue parameter counts, hardware figures, memory per rank against hand
computations (Ultra-Scale Playbook formulas, docs/planner.md), the time model, every validation
rule through the real `usp plan`. No torch, all fast."""
from __future__ import annotations

import re
from dataclasses import replace
from functools import cache, partial
from pathlib import Path

import pytest

from tests.helpers import plan_for, usp_cli
from usp.config.compose import compose_config
from usp.contract.dims import rank_table
from usp.errors import PlanError
from usp.perf.memory import FIXED_OVERHEAD_GIB, heap_top_kept, in_flight, memory_plan, stage_memory
from usp.perf.specs import GIB, Arch, Hardware, Layout, Precision, group_crosses_nodes
from usp.perf.stack_profile import PROFILES
from usp.perf.timing import timing_plan
from usp.plan.plan import build_plan

REPO = Path(__file__).resolve().parents[2]
BF16, FP32 = Precision("bf16", 2, 2, 12, 2), Precision("fp32", 4, 4, 8, 4)
USP = PROFILES["usp"]


pytestmark = pytest.mark.usefixtures("fresh_cache")  # planning computes the dataset's path from it


def cfg_for(*overrides: str):
    return compose_config(None, list(overrides))


plan_for = partial(plan_for, training=False)  # as `usp plan` plans: the data pipeline's limits are warnings


@cache  # Arch and Hardware are frozen: each is composed once (a compose costs ~0.1 s)
def arch(name: str) -> Arch:
    cfg, _ = cfg_for(f"model={name}")
    return Arch.from_model(cfg.model)


@cache
def h100(nodes: int = 1) -> Hardware:
    cfg, _ = cfg_for("cluster=slurm_h100", f"cluster.nodes={nodes}")
    return Hardware.from_cluster(cfg.cluster)


# --- catalogue -------------------------------------------------------------------------------------

PUBLISHED = {  # Meta's model cards: parameters, to 3 significant digits
    "llama3_2_1b": 1.24e9, "llama3_2_3b": 3.21e9, "llama3_1_8b": 8.03e9, "llama3_1_70b": 70.6e9,
    "llama3_1_405b": 405.9e9,
}
EXACT = {  # embedding + layers x (attention + SwiGLU + 2 norms) + final norm (+ untied head)
    "llama3_2_1b": 1_235_814_400, "llama3_2_3b": 3_212_749_824, "llama3_1_8b": 8_030_261_248,
    "llama3_1_70b": 70_553_706_496, "llama3_1_405b": 405_853_388_800,
}


def sig3(x: float) -> float:
    return float(f"{x:.3g}")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_catalogue_parameter_counts(name):
    cfg, _ = cfg_for(f"model={name}")
    n = Arch.from_model(cfg.model).total_params
    assert n == EXACT[name]
    assert sig3(n) == sig3(PUBLISHED[name])
    m = cfg.model
    assert m.vocab_size == 128256 and m.rope_theta == 500000.0
    assert m.tie_embeddings == name.startswith("llama3_2")
    # hand check of the 8B: 128256·4096 embedding and head, 32 x (2·4096² + 2·4096·1024 + 3·4096·14336 + 2·4096)
    if name == "llama3_1_8b":
        assert n == 2 * 128256 * 4096 + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 4096
    text = (REPO / "conf" / "model" / f"{name}.yaml").read_text()
    assert text.startswith("# ") and "Llama" in text.splitlines()[0]


CLUSTERS = {"slurm_h100": (80, 989, 8, "cuda"), "h200": (141, 989, 8, "cuda"), "a100_80gb": (80, 312, 8, "cuda"),
            "a100_40gb": (40, 312, 8, "cuda"), "h100_500w": (96, 989, 8, "cuda"),
            "mi300x": (192, 1307, 8, "cuda"), "supermuc_ng_p2": (128, 839, 4, "xpu")}


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_cluster_hardware(name):
    cfg, _ = cfg_for(f"cluster={name}")
    c = cfg.cluster
    memory, peak, per_node, device = CLUSTERS[name]
    assert (c.device_memory_gb, c.peak_tflops_bf16, c.procs_per_node, c.device) == (memory, peak, per_node, device)
    assert c.launcher == "slurm" and c.intra_node_gbps > c.inter_node_gbps > 0
    assert (REPO / "conf" / "cluster" / f"{name}.yaml").read_text().startswith("# ")


HARDWARE_FIGURES = ("device_memory_gb", "peak_tflops_bf16", "peak_tflops_fp32", "peak_tflops_fp8", "intra_node_gbps",
                    "inter_node_gbps", "hbm_gbps")


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "conf" / "cluster").glob("*.yaml")
                                        if p.stem != "h100_playbook"))  # fitted by usp calibrate: docs/planner.md
def test_hardware_doc_sources_every_figure_the_planner_uses(name):
    """docs/hardware.md is where each hardware figure comes from: every figure a cluster group gives the
    planner (as composed, not as its file spells it) is a value in that table."""
    rows = [line.split("|") for line in (REPO / "docs" / "hardware.md").read_text().splitlines()
            if line.startswith("| ")]
    values = {float(n) for row in rows for n in re.findall(r"\d+(?:\.\d+)?", row[2])}
    cluster = cfg_for(f"cluster={name}")[0].cluster
    figures = {f: getattr(cluster, f) for f in HARDWARE_FIGURES}
    missing = {f: v for f, v in figures.items() if v and v not in values}  # 0: none (no FP8 units)
    assert not missing, f"docs/hardware.md has no row for {name}'s {missing}"


def test_local_cpu_defaults_work():
    cfg, _ = cfg_for()
    hw = Hardware.from_cluster(cfg.cluster)
    assert hw.device == "cpu" and hw.memory_gib > 0 and hw.peak_tflops_fp32 > 0
    plan = plan_for()
    assert plan.memory.fits and plan.memory.dtype == "fp32" and plan.timing.mfu > 0
    assert plan.warnings == []


# --- memory: hand computations ----------------------------------------------------------------------

PSI_8B = EXACT["llama3_1_8b"]
H, V, L, S = 4096, 128256, 32, 4096
LAYER_8B = 2 * H * H + 2 * H * 1024 + 3 * H * 14336 + 2 * H  # 218,112,000
KV, FFN = 1024, 14336


def layer_values(t: int = 1) -> float:
    """Activation values kept per token per layer (docs/planner.md): per RMSNorm its input and x·rstd
    (2h/t) and its output, the projections' input (h, all-gathered under TP); q, k, v after RoPE
    (h + 2kv)/t; the SDPA output h/t; SwiGLU's w1, w3, silu, product 4f/t."""
    return (6 * H + 2 * KV + 4 * FFN) / t + 2 * H  # 8B: 92,160 (Megatron's GPT count: 17h = 69,632)


def final_norm_values(t: int = 1) -> float:
    return 2 * H / t + H  # the last stage's final norm: input, x·rstd, output (the head's input)


def mem8b(**kw) -> object:
    lay = Layout(**{"dp_replicate": 8, "micro_batch": 1, "grad_accum": 1, **kw})
    return stage_memory(arch("llama3_1_8b"), lay, S, h100(), BF16, 0, USP)


def overhead(subtotal: float, fixed_gib: float = FIXED_OVERHEAD_GIB["cuda"]) -> float:
    return fixed_gib * GIB + 0.05 * subtotal


def test_memory_ddp_mixed_precision():
    """DDP, bf16 mixed precision: 2Ψ + 2Ψ + 12Ψ, plus DDP's bucket copy of the gradients (2Ψ)."""
    st = mem8b()
    assert st.params == PSI_8B
    assert (st.parameters, st.optimizer, st.comm_buffers) == (2 * PSI_8B, 12 * PSI_8B, 2 * PSI_8B)
    acts = 2 * S * 1 * (layer_values() * L + final_norm_values())  # bf16 values, one micro batch in flight
    logits = 4 * S * 1 * V  # fp32 log-probabilities kept for backward
    assert st.activations == acts and st.gathered == 0
    # one micro batch per step: the gradients appear during the backward while each layer frees its
    # activations (a layer keeps 0.75e9 bytes, its gradient is 0.44e9), so beside every activation
    # there are only the head's and the top layer's (1.5e9); the loss backward's 2 more logits-sized
    # buffers (2 x 4·S·V = 4.2e9 bytes) outweigh them: the peak, with no gradient yet
    first = 2 * (V * H + H + LAYER_8B)
    assert st.peak_phase == "loss backward" and 2 * logits > first and st.gradients == 0
    assert st.logits == 3 * logits
    subtotal = 16 * PSI_8B + acts + 3 * logits
    assert st.total == pytest.approx(subtotal + overhead(subtotal))
    assert st.total / GIB == pytest.approx(156.83, abs=0.01)  # 168e9 bytes: 8B never fits 80 GiB with DDP
    accum = mem8b(grad_accum=4)  # earlier micro batches left every gradient: they meet every activation
    assert accum.gradients == 2 * PSI_8B and accum.peak_phase == "loss backward"


def test_memory_zero1_zero2_zero3():
    n = 8
    z1 = mem8b(zero1=True, grad_accum=2)  # ZeRO-1: 2Ψ + 2Ψ + 12Ψ/N (every gradient alive: accumulation)
    assert (z1.parameters, z1.gradients, z1.optimizer) == (2 * PSI_8B, 2 * PSI_8B, 12 * PSI_8B / n)
    # ZeRO-2: 2Ψ (all-gathered, kept from forward to backward) + 2Ψ/N (FSDP2's sharded parameters) + (2Ψ + 12Ψ)/N
    z2 = mem8b(dp_replicate=1, dp_shard=8, reshard_after_forward=False)
    assert (z2.parameters, z2.optimizer) == (2 * PSI_8B + 2 * PSI_8B / n, 12 * PSI_8B / n)
    assert z2.comm_buffers == 0 and z2.gathered == 0
    # its peak is the loss backward: 2 more fp32 logits-sized buffers (2 x 4·S·V = 4.2e9) outweigh the
    # sharded gradients (2Ψ/N = 2.0e9), which do not exist yet then (one micro batch per step)
    logits = 4 * S * V
    assert z2.peak_phase == "loss backward" and 2 * logits > 2 * PSI_8B / n
    assert z2.gradients == 0 and z2.logits == 3 * logits
    z3 = mem8b(dp_replicate=1, dp_shard=8)  # ZeRO-3: (2Ψ + 2Ψ + 12Ψ)/N + the unsharded units
    assert z3.parameters + z3.optimizer == pytest.approx(14 * PSI_8B / n)
    root = 2 * V * H + H  # embedding + head + final norm: FSDP2's root unit, unsharded during all of backward
    # the peak is a layer's backward: gathered units (5.5e9) + the sharded gradients that exist beside every
    # activation, the head's and the top layer's (one micro batch per step) > the loss backward's 4.2e9
    assert z3.peak_phase == "layer backward" and z3.logits == logits
    assert z3.gradients == pytest.approx(2 * (V * H + H + LAYER_8B) / n)
    assert z3.gathered == pytest.approx((2 + 2) * root + (2 * 2 + 2) * LAYER_8B)
    # with gradient accumulation the engine keeps unsharded gradients between micro batches
    z3_accum = mem8b(dp_replicate=1, dp_shard=8, micro_batch=1, grad_accum=4)
    assert z3_accum.gradients == 2 * PSI_8B and z3_accum.optimizer == 12 * PSI_8B / n


def test_memory_zero1_with_tp_pp_is_fsdp2_over_the_replicas():
    """zero1 with TP/PP is FSDP2 sharded over dp_replicate without resharding after forward: the
    ZeRO-2 terms of a dp_shard layout with the same degrees, sharded over N = dp_replicate."""
    n, t = 8, 4
    z1 = mem8b(tp=t, zero1=True)
    z2 = mem8b(dp_replicate=1, dp_shard=n, tp=t, reshard_after_forward=False)
    psi = z1.params  # after TP slicing
    assert z1.parameters == 2 * psi + 2 * psi / n and z1.optimizer == 12 * psi / n
    assert z1.comm_buffers == 0 and z1.gathered == 0
    assert (z1.parameters, z1.optimizer, z1.gradients, z1.total) == (z2.parameters, z2.optimizer, z2.gradients,
                                                                     z2.total)
    replicated = mem8b(tp=t)  # before: FSDP2 replication, states counted whole
    assert replicated.optimizer == 12 * psi and replicated.total - z1.total > 12 * psi * (1 - 1 / n)
    # gradients: sharded after the reduce-scatter, whole between micro batches under accumulation
    accum = mem8b(tp=t, zero1=True, grad_accum=4)
    assert accum.gradients == 2 * psi and accum.optimizer == 12 * psi / n
    pp = Layout(pp=4, dp_replicate=8, zero1=True, micro_batch=1, grad_accum=8)
    assert (pp.dp_kind, pp.zero_stage, pp.shard_degree) == ("zero1_fsdp", 2, 8)
    st = stage_memory(arch("llama3_1_8b"), pp, S, h100(4), BF16, 0, USP)
    assert st.optimizer == 12 * st.params / 8


def test_zero1_with_tp_communicates_like_fsdp_over_the_replicas():
    """A reduce-scatter of the gradients and a forward all-gather of the parameters over dp_replicate,
    instead of the replication's all-reduce: the same bytes, 2(n-1)/n Ψ."""
    a, n = arch("llama3_1_8b"), 16
    z1 = timing_plan(a, Layout(tp=8, dp_replicate=n, zero1=True, micro_batch=1, grad_accum=1), S, n, h100(16), BF16)
    rep = timing_plan(a, Layout(tp=8, dp_replicate=n, micro_batch=1, grad_accum=1), S, n, h100(16), BF16)
    dp = {c.name: c for c in z1.comm if c.dims == "dp_replicate"}
    assert set(dp) == {"FSDP all-gather (forward)", "FSDP gradient reduce-scatter"}
    (ar,) = [c for c in rep.comm if c.name.startswith("DP gradient")]
    assert sum(c.bytes_per_step for c in dp.values()) == pytest.approx(ar.bytes_per_step)
    assert all(c.crosses_nodes for c in dp.values())


def test_memory_hsdp_shards_within_dp_shard_x_cp():
    st = mem8b(dp_replicate=2, dp_shard=2, cp=2)
    assert st.optimizer == pytest.approx(12 * PSI_8B / 4)  # N = dp_shard x cp, replicated over dp_replicate


def test_memory_activations_tp_sp_cp_recompute():
    base = dict(dp_replicate=1, tp=8)
    st = mem8b(**base)
    # TP + sequence parallel: the norms, q/k/v, attention and MLP values divided by t, the two
    # all-gathered projection inputs (2h) not (DTensor keeps them gathered over the sequence)
    assert st.activation_per_layer == 2 * S * layer_values(8)
    assert st.activations == 2 * S * (layer_values(8) * L + final_norm_values(8))
    vocab_pad = 128256  # divisible by 8
    # the peak is the loss backward (one micro batch: only the head's and the top layer's gradients meet every
    # activation): the kept log-probabilities + loss_parallel's 3 buffers, vocab-parallel
    assert st.peak_phase == "loss backward" and st.logits == 4 * 4 * S * vocab_pad / 8
    # TP divides the layer weights by t; norms stay whole; vocab-parallel embedding and head
    assert st.params == L * ((LAYER_8B - 2 * H) / 8 + 2 * H) + 2 * V * H / 8 + H
    cp = mem8b(dp_replicate=1, cp=2)  # CP halves s; the ring keeps K, V expanded (GQA: 2h not 2kv) and its
    # output in fp32 (2 more bytes per value of h under bf16)
    assert cp.activation_per_layer == 2 * (S / 2) * (layer_values() + 2 * (H - KV)) + 2 * (S / 2) * H
    b2 = mem8b(micro_batch=2)
    assert b2.activations == 2 * mem8b().activations
    # full recompute: the layer input per layer (2 bytes x s·b·h/t) + the layer being recomputed (its full
    # set less its input), which with the gradients outweighs the loss backward's 3 vocab-parallel buffers
    full = mem8b(recompute="full", **base)
    assert full.peak_phase == "layer backward"
    assert full.activations == 2 * S * (H / 8 * L + final_norm_values(8)) + 2 * S * (layer_values(8) - H / 8)
    # selective (the engine's policy keeps the matmul and attention outputs): the input, q/k/v, SDPA
    # output, wo output (h: a partial sum over the whole sequence under TP), w1/w3 outputs, w2 output (h)
    sel = mem8b(recompute="selective", **base)
    kept = H / 8 + (H + 2 * KV) / 8 + H / 8 + H + 2 * FFN / 8 + H
    assert sel.activation_per_layer == 2 * S * kept
    assert sel.activations == 2 * S * (kept * L + final_norm_values(8)) + 2 * S * (layer_values(8) - kept)
    assert full.activations < sel.activations < st.activations


def test_memory_fp32_on_cpu():
    """Plain fp32 training: 4Ψ + 4Ψ + 8Ψ (+ 4Ψ buckets under DDP); activations twice the bf16 bytes."""
    a = arch("llama3_2_1b")
    cfg, _ = cfg_for("cluster=local_cpu2")
    hw = Hardware.from_cluster(cfg.cluster)
    lay = Layout(dp_replicate=2, micro_batch=1, grad_accum=1)
    st = stage_memory(a, lay, 512, hw, FP32, 0, USP)
    psi = EXACT["llama3_2_1b"]
    assert (st.parameters, st.gradients, st.optimizer, st.comm_buffers) == (4 * psi, 4 * psi, 8 * psi, 4 * psi)
    # fp32: 4 bytes per value; 1B: h 2048, kv 512 (8 KV heads x 64), f 8192: 8h + 2kv + 4f values per token
    assert st.activation_per_layer == 4 * 512 * (8 * 2048 + 2 * 512 + 4 * 8192)
    subtotal = 20 * psi + st.activations + st.logits
    heap_top = 2 * 32 * 2 ** 20  # DDP gathers no parameter: glibc's heap top kept (usp.perf.memory.heap_top_kept)
    assert st.total == pytest.approx(subtotal + overhead(subtotal, FIXED_OVERHEAD_GIB["cpu"]) + heap_top)
    fsdp = stage_memory(a, Layout(dp_shard=2, micro_batch=1, grad_accum=1), 512, hw, FP32, 0, USP)
    assert heap_top_kept(Layout(dp_shard=2)) == 0 and heap_top_kept(lay) == heap_top
    assert heap_top_kept(Layout(pp=2)) == 0  # a pipeline trains memory first (usp.contract.decide.cpu_memory_first)
    assert fsdp.total < st.total
    assert Precision.resolve("auto", "cpu") == FP32 and Precision.resolve("auto", "cuda") == BF16


@pytest.mark.parametrize("schedule,v,m,expected", [
    ("1f1b", 1, 8, [4, 3, 2, 1]),  # min(m, p - r)
    ("1f1b", 1, 2, [2, 2, 2, 1]),
    ("afab", 1, 8, [8, 8, 8, 8]),  # all forwards first: every micro batch
    ("interleaved_1f1b", 2, 8, [5.5, 4.5, 3.5, 2.5]),  # (2(p-1-r) + (v-1)p + 1) / v chunks (Megatron)
    ("zbv", 2, 8, [4, 4, 4, 4]),
])
def test_micro_batches_in_flight(schedule, v, m, expected):
    lay = Layout(pp=4, pp_schedule=schedule, pp_virtual_stages=v, grad_accum=m)
    assert [in_flight(lay, r) for r in range(4)] == expected


def test_pipeline_stages_hold_embedding_and_head():
    """70B on pp=4 (1f1b): stage 0 the embedding, stage 3 the head; every layer placed once;
    activations follow the in-flight count (4, 3, 2, 1 micro batches)."""
    a = arch("llama3_1_70b")
    lay = Layout(pp=4, tp=8, dp_replicate=1, micro_batch=1, grad_accum=8)
    mem = memory_plan(a, lay, S, h100(4), BF16, USP)
    st = mem.stages
    assert [s.holds_embedding for s in st] == [True, False, False, False]
    assert [s.holds_head for s in st] == [False, False, False, True]
    assert sum(s.layers for s in st) == 80
    layer = a.layer_params
    per_rank = (layer - 2 * 8192) / 8 + 2 * 8192
    emb = V * 8192 / 8
    assert st[0].params == int(st[0].layers * per_rank + emb)
    assert st[3].params == int(st[3].layers * per_rank + emb + 8192)
    assert st[0].layers < st[1].layers  # the split gives the embedding stage fewer layers
    assert [s.in_flight for s in st] == [4, 3, 2, 1]
    # 70B per layer: (6h + 2kv + 4f)/t + 2h values, h 8192, kv 1024, f 28672, t 8; + the stage output
    # (h/t) that torch.distributed.pipelining keeps per micro batch in flight; bf16
    per_layer = (6 * 8192 + 2 * 1024 + 4 * 28672) / 8 + 2 * 8192
    assert st[1].activations == 2 * S * (per_layer * st[1].layers + 8192 / 8) * 3
    # last stage, grad_accum 8: the peak is the loss backward (earlier micro batches' gradients exist
    # in both phases): log-probs kept (fp32) + the stage output (the logits, bf16) + 3 vocab-parallel buffers
    assert st[3].peak_phase == "loss backward"
    assert st[3].logits == (4 + 2 + 3 * 4) * S * V / 8 and st[0].logits == 0
    assert mem.peak_stage == max(range(4), key=lambda i: st[i].total)


def test_moe_experts_sliced_by_ep():
    cfg, _ = cfg_for("model=tiny", "model.n_experts=8", "model.top_k=2", "model.vocab_size=4096")
    a = Arch.from_model(cfg.model)
    one = stage_memory(a, Layout(dp_replicate=4, ep=1), 128, h100(), BF16, 0, USP)
    four = stage_memory(a, Layout(dp_replicate=4, ep=4), 128, h100(), BF16, 0, USP)
    experts = a.n_layers * a.expert_params
    assert one.params - four.params == pytest.approx(experts - experts / 4)


def test_moe_not_tp_sliced_and_experts_sharded_over_dp_shard_mod_ep():
    """No expert TP: tp leaves a MoE layer's router / experts whole; FSDP shards the experts over
    dp_shard x cp / ep ranks (ZeRO-3: params / 2 here), the dense part over dp_shard x cp."""
    cfg, _ = cfg_for("model=tiny", "model.n_experts=8", "model.top_k=2", "model.vocab_size=4096")
    a = Arch.from_model(cfg.model)
    all_experts = a.n_layers * a.expert_params
    tp_ep1 = stage_memory(a, Layout(dp_shard=4, tp=2, ep=1), 128, h100(), BF16, 0, USP)
    tp_ep4 = stage_memory(a, Layout(dp_shard=4, tp=2, ep=4), 128, h100(), BF16, 0, USP)
    assert tp_ep1.params - tp_ep4.params == pytest.approx(all_experts - all_experts / 4)  # not / tp
    experts = all_experts / 4  # on one EP rank, before FSDP
    fsdp8 = stage_memory(a, Layout(dp_shard=8, ep=4), 128, h100(), BF16, 0, USP)
    dense = fsdp8.params - experts
    assert fsdp8.parameters == pytest.approx(BF16.param * (dense / 8 + experts / 2))


def test_ep_all_to_all_link_is_the_ep_groups_own():
    """EP groups are ep·tp consecutive ranks (inside dp_shard x cp): on 8-GPU nodes ep 8 x tp 1
    stays on NVLink even when dp_shard x cp spans 8 nodes; ep 8 x tp 2 crosses."""
    cfg, _ = cfg_for("model=mixtral_8x7b")
    a, hw = Arch.from_model(cfg.model), h100(nodes=8)
    ep = {t: next(c for c in timing_plan(a, Layout(dp_shard=64 // t, tp=t, ep=8, micro_batch=1), 4096, 64, hw,
                                         BF16).comm if c.name.startswith("EP")) for t in (1, 2)}
    assert not ep[1].crosses_nodes and ep[2].crosses_nodes


def test_deepseeks_dense_first_blocks_are_timed_as_dense_blocks():
    """DeepSeek-V3's 3 dense first blocks (model.n_dense_layers) cost what a dense block costs in the time model:
    their matmuls are a dense model's layer's (a TP-sliced SwiGLU of ffn_dim, no router or experts), they send
    no EP all-to-all (calls per MoE layer of the stage holding them, each of a whole layer's tokens), and
    their parameters are a dense block's in the FSDP traffic; a MoE layer's work is unchanged."""
    from usp.perf.timing import _calls, _layer_times, _matmul_flops, _stages, micro_batches, time_shape

    cfg, _ = cfg_for("model=deepseek_v3_671b")
    a, hw = Arch.from_model(cfg.model), h100(nodes=16)
    all_moe = replace(a, n_dense_layers=0)
    lay = Layout(dp_shard=64, pp=2, ep=8, micro_batch=1, grad_accum=4)
    shape, moe_shape = (time_shape(x, lay, 4096, 256, hw, BF16, USP) for x in (a, all_moe))
    dense_model = time_shape(replace(a, n_experts=0), lay, 4096, 256, hw, BF16, USP)
    assert shape.stage_dense == (3, 0) and moe_shape.stage_dense == (0, 0)
    assert _matmul_flops(shape.dense_layer) == _matmul_flops(dense_model.layer) != _matmul_flops(shape.layer)
    assert _matmul_flops(shape.layer) == _matmul_flops(moe_shape.layer)
    layers, dense, _, busiest = _stages(a, lay, 4096, USP.pp_split)
    assert shape.matmul_flops_mb == pytest.approx((layers[busiest] - dense[busiest]) * _matmul_flops(shape.layer)
                                                  + dense[busiest] * _matmul_flops(shape.dense_layer)
                                                  + (shape.head_fwd.flops + shape.head_bwd.flops
                                                     if busiest in shape.head_ranks else 0.0))
    # the stage with the dense blocks (31 layers, 3 dense) and the head's (30): EP calls per MoE layer
    mbs = {mb.rank: mb for mb in micro_batches(shape, hw.timing, USP.time)}
    ep_term = next(ct for ct in shape.comms if ct.name.startswith("EP"))
    assert (mbs[0].layers, mbs[0].dense_layers, mbs[1].dense_layers) == (31, 3, 0)
    assert _calls(ep_term, mbs[0]) == ep_term.calls * 28 and _calls(ep_term, mbs[1]) == ep_term.calls * 30
    def gemm_s(work):  # one layer's matmul seconds under the constants
        return _layer_times(shape, work, hw.timing, USP.time).gemm

    assert mbs[0].gemm == pytest.approx(28 * gemm_s(shape.layer) + 3 * gemm_s(dense_model.layer))
    assert gemm_s(dense_model.layer) != pytest.approx(gemm_s(shape.layer), rel=1e-3)
    all_moe_mb = {mb.rank: mb for mb in micro_batches(moe_shape, hw.timing, USP.time)}
    assert mbs[1].gemm == pytest.approx(all_moe_mb[1].gemm) and all_moe_mb[0].dense_layers == 0
    plan = timing_plan(a, lay, 4096, 256, hw, BF16)  # the busiest stage (the head's) sends a whole layer's tokens
    ep = next(c for c in plan.comm if c.name.startswith("EP"))
    assert plan.efficiency_terms["busiest_pp_rank"] == 1 and ep.calls == 2 * 2 * lay.grad_accum * 30
    per_call = 4096 * a.top_k * a.dim * BF16.act * (lay.ep - 1) / lay.ep
    assert ep.bytes_per_step == pytest.approx(ep.calls * per_call)
    # stage 0's parameters: 3 dense blocks (attention + 3 x dim x ffn_dim, norms), not 3 MoE layers
    from usp.perf.timing import rank_params

    params, moe_params = rank_params(a, lay), rank_params(all_moe, lay)
    block = a.attn_params_over(1) + a.parts["dense_mlp"] + a.norm_params
    moe_layer = a.attn_params_over(1) + a.dense_mlp_params + a.router_params + a.norm_params + a.expert_params / 8
    assert moe_params[0] - params[0] == pytest.approx(3 * (moe_layer - block)) and params[1] == moe_params[1]


def test_mixtral_plans_with_ep_x_fsdp_x_tp_x_pp_on_h100():
    cfg, choices = compose_config(None, ["model=mixtral_8x7b", "cluster=slurm_h100", "cluster.nodes=16",
                                         "parallelism.ep=8", "parallelism.dp_shard=8", "parallelism.tp=4",
                                         "parallelism.pp=4", "train.global_batch=256", "train.seq_len=4096",
                                         "train.micro_batch=1", "train.recompute=full", "checkpoint.enabled=false"])
    from usp.plan.plan import checked_plan

    plan = checked_plan(cfg, choices)  # no plan or engine rule refuses it
    assert plan.memory.fits and plan.degrees["tp"] == 4 and plan.degrees["pp"] == 4
    assert any("EP all-to-all" in c.name and c.group == 8 for c in plan.timing.comm)


def test_measured_expert_imbalance_slows_ep_and_is_said():
    """model.expert_load_imbalance (the measured max/mean tokens per expert): the busiest EP rank
    receives and computes that much more; without EP nothing changes; the plan says which it assumed."""
    cfg, _ = cfg_for("model=mixtral_8x7b")
    hw, lay = h100(nodes=8), Layout(dp_shard=64, ep=8, micro_batch=1)
    even, skewed = (timing_plan(replace(Arch.from_model(cfg.model), expert_load_imbalance=i), lay, 4096, 64, hw, BF16)
                    for i in (1.0, 1.5))
    a2a = [next(c for c in t.comm if c.name.startswith("EP")) for t in (even, skewed)]
    assert a2a[1].bytes_per_step == pytest.approx(1.5 * a2a[0].bytes_per_step)
    assert skewed.micro_batch_s > even.micro_batch_s and skewed.mfu < even.mfu
    assert any("experts assumed balanced (model.expert_load_imbalance=1" in line for line in even.assumptions)
    assert any("x 1.5 on the busiest rank" in line for line in skewed.assumptions)
    no_ep = [timing_plan(replace(Arch.from_model(cfg.model), expert_load_imbalance=i), replace(lay, ep=1), 4096, 64,
                         hw, BF16) for i in (1.0, 1.5)]
    assert no_ep[0].step_s == no_ep[1].step_s and not any("imbalance" in line for line in no_ep[1].assumptions)
    with pytest.raises(PlanError, match="model.expert_load_imbalance=0.9"):
        build_plan(*compose_config(None, ["model=moe_tiny", "model.expert_load_imbalance=0.9"]))


# --- time -------------------------------------------------------------------------------------------

def test_flops_match_arch_and_hfu():
    cfg, _ = cfg_for("model=llama3_1_8b")
    a = Arch.from_model(cfg.model)
    lay = Layout(dp_replicate=8, micro_batch=1, grad_accum=4)
    t = timing_plan(a, lay, S, 32, h100(), BF16)
    assert t.model_flops_per_token == a.flops_per_token(S)
    assert t.model_flops_per_step == t.model_flops_per_token * 32 * S
    assert t.hfu == pytest.approx(t.mfu)
    full = timing_plan(a, replace(lay, recompute="full"), S, 32, h100(), BF16)
    # the blocks' forward again (8 vs 6 FLOPs per block weight per token); the LM head is not recomputed
    head = 6 * a.vocab_size * a.dim
    blocks = t.model_flops_per_token - head
    assert full.hfu == pytest.approx(full.mfu * (head + blocks * 4 / 3) / (head + blocks))
    assert full.mfu * 1.2 < full.hfu < full.mfu * 4 / 3  # an 8B model: the head is ~7 % of the FLOPs
    c = h100().timing
    # the matmuls' efficiency: the K-saturated share of the peak, less the fixed cost per kernel; MFU below it
    assert 0 < t.mfu < t.efficiency < c.gemm_efficiency
    assert t.gemm_s + t.attention_s + t.elementwise_s + t.loss_s + t.host_s + t.recompute_s + t.eager_s \
        == pytest.approx(t.micro_batch_s)
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_path_comm_s + t.bubble_s + t.exposed_dp_comm_s + t.fixed_s)
    assert t.tokens_per_s_per_device == pytest.approx(32 * S / t.step_s / 8)


def test_ddp_all_reduce_volume_and_overlap():
    a = arch("llama3_2_1b")
    lay = Layout(dp_replicate=16, micro_batch=1, grad_accum=1)
    t = timing_plan(a, lay, 2048, 16, h100(2), BF16)
    (ar,) = [c for c in t.comm if c.name.startswith("DP gradient")]
    assert ar.bytes_per_step == pytest.approx(2 * 15 / 16 * 2 * EXACT["llama3_2_1b"])  # 2(n-1)/n x 2Ψ
    # 16 ranks on 2 nodes: the inter-node link, each of a node's 8 GPUs of the group on its own NIC (NCCL's bus
    # bandwidth: the cluster's efficiencies of the NVLink and NIC figures)
    c = h100(2).timing
    assert ar.crosses_nodes and ar.gbps == pytest.approx(min(c.nvlink_efficiency * 450, 8 * c.nic_efficiency * 50))
    # usp's DDP hides the all-reduce behind the last micro batch's backward (its window), the rest is exposed
    assert ar.hidden == pytest.approx(min(ar.seconds, ar.window_s)) and ar.window_s > 0
    assert ar.exposed_s == pytest.approx(ar.seconds - ar.hidden)


def test_cp_inside_a_pipeline_time():
    """CP x PP: each pp rank's ring runs over its own layers; the pipeline sends the CP shard (s/c)."""
    a = arch("llama3_1_8b")
    lay = Layout(pp=2, cp=2, dp_replicate=2, micro_batch=1, grad_accum=4)
    t = timing_plan(a, lay, S, 8, h100(), BF16)
    (ring,) = [c for c in t.comm if c.dims == "cp"]
    (pp,) = [c for c in t.comm if c.dims == "pp"]
    # per layer and micro batch: c-1 K/V hops forward, c-1 backward, c dK/dV hops; fp32 blocks of all heads
    kv_block = 2 * (S / 2) * 1 * H * 4
    assert ring.calls == (1 + 1 + 2) * (L // 2) * 4
    assert ring.bytes_per_step == pytest.approx(ring.calls * kv_block)
    assert pp.bytes_per_step == pytest.approx(2 * 4 * (S / 2) * H * 2)  # activations + grads, bf16, s/c tokens
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_path_comm_s + t.bubble_s + t.exposed_dp_comm_s + t.fixed_s)


def test_cp_inside_a_pipeline_memory():
    """CP x PP: every stage keeps s/c tokens per micro batch in flight (1F1B: p - r on pp rank r)."""
    a = arch("llama3_1_8b")
    lay = Layout(pp=2, cp=2, dp_replicate=1, micro_batch=1, grad_accum=4)
    first, last = (stage_memory(a, lay, S, h100(), BF16, r, USP) for r in (0, 1))
    per_layer = 2 * (S / 2) * (layer_values() + 2 * (H - KV)) + 2 * (S / 2) * H  # the ring's K/V and fp32 output
    assert first.activation_per_layer == last.activation_per_layer == per_layer
    stage_output = 2 * (S / 2) * H  # the pipeline keeps each in-flight micro batch's output
    assert first.activations == pytest.approx((per_layer * first.layers + stage_output) * 2)
    assert last.logits >= 4 * (S / 2) * V and last.in_flight == 1


def test_zero_bubble_zero3_keeps_the_stage_unsharded():
    """ZeRO-3 with a zero-bubble schedule: the engine unshards a whole stage for its split backward."""
    a = arch("llama3_1_8b")
    zb = Layout(pp=2, dp_replicate=1, dp_shard=4, pp_schedule="zbv", pp_virtual_stages=2, micro_batch=1,
                grad_accum=4)
    st = stage_memory(a, zb, S, h100(), BF16, 0, USP)  # pp rank 0 of the V holds stages 0 and 3: embedding and head
    root = 2 * V * H + H
    assert st.gathered == pytest.approx((2 + 2) * root + (2 * st.layers + 2) * LAYER_8B)  # not 2 blocks' worth
    assert st.layers > 2  # 14 of 32: the split balances the embedding and the head


@pytest.mark.parametrize("schedule,v,expected", [("1f1b", 1, 3 / 8), ("afab", 1, 3 / 8),
                                                 ("interleaved_1f1b", 2, 3 / 16), ("zbv", 2, 0.0)])
def test_bubble(schedule, v, expected):
    lay = Layout(pp=4, tp=2, pp_schedule=schedule, pp_virtual_stages=v, micro_batch=1, grad_accum=8)
    t = timing_plan(arch("llama3_1_8b"), lay, S, 8, h100(), BF16)
    assert t.bubble_fraction == pytest.approx(expected)


def test_tp_comm_uses_the_link_it_crosses():
    a = arch("llama3_1_8b")
    inside = timing_plan(a, Layout(tp=8, dp_replicate=2, micro_batch=1, grad_accum=1), S, 2, h100(2), BF16)
    ag, rs = [c for c in inside.comm if c.dims == "tp"]  # all-gathers, reduce-scatters
    assert not ag.crosses_nodes and all(c.exposed_s == c.seconds for c in (ag, rs))  # TP is never overlapped
    # 4 collectives x 2 passes per layer
    assert ag.bytes_per_step + rs.bytes_per_step == pytest.approx(8 * 7 / 8 * S * H * 2 * L)


@pytest.mark.parametrize("degrees,per_node", [
    (dict(pp=1, dp_replicate=4, dp_shard=1, cp=1, tp=2), 4), (dict(pp=1, dp_replicate=3, dp_shard=1, cp=1, tp=2), 3),
    (dict(pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=2), 8), (dict(pp=2, dp_replicate=1, dp_shard=3, cp=2, tp=2), 4),
    (dict(pp=4, dp_replicate=2, dp_shard=1, cp=2, tp=1), 6),
])
def test_group_crosses_nodes_matches_the_rank_table(degrees, per_node):
    table = rank_table(degrees, per_node)
    for dims in (("tp",), ("cp",), ("pp",), ("dp_replicate",), ("dp_shard", "cp"), ("dp_replicate", "cp")):
        groups: dict = {}
        for r in table:
            key = tuple(v for d, v in r.coords.items() if d not in dims)
            groups.setdefault(key, set()).add(r.node)
        brute = any(len(nodes) > 1 for nodes in groups.values())
        assert group_crosses_nodes(degrees, per_node, dims) == brute, dims


def test_plan_carries_memory_and_timing(tmp_path):
    plan = plan_for("model=llama3_1_8b", "cluster=slurm_h100", "train.seq_len=4096", "train.global_batch=256",
                    "parallelism.dp_replicate=1", "parallelism.dp_shard=8", "train.micro_batch=1")
    # (micro batch 2 no longer fits 80 GiB without recompute: 92k activation values per token per layer)
    assert plan.memory.fits and plan.memory.zero_stage == 3 and len(plan.memory.stages) == 1
    # a plausibility range, not a measurement: usp's profile has no multi-GPU run (0.550 with the fit of 2026-12)
    assert 0.3 < plan.timing.mfu < 0.6
    data = plan.to_dict()
    assert data["memory"]["stages"][0]["total"] == plan.memory.stages[0].total
    assert data["timing"]["comm"][0]["name"].startswith("FSDP")
    from usp.contract.plan_file import read_plan, write_plan

    back = read_plan(write_plan(plan, tmp_path / "plan.yaml"))
    assert back == plan and back.to_dict() == data


def test_pipeline_batch_derivation_fills_the_pipeline():
    plan = plan_for("cluster.procs_per_node=4", "parallelism.pp=4", "model.n_layers=4", "model.tie_embeddings=false")
    assert plan.batch.grad_accum == 4 and plan.batch.micro_batch == 4


def test_tied_embeddings_under_pp_plan_with_the_head_copy(tmp_path):
    """llama3_2_1b (tied) with pp=2 is planned, not refused: the last stage holds the embedding's
    copy as its LM head (parameters, gradients, AdamW states), so both stages hold the same
    parameters; the embedding group's gradient all-reduce is a timed (exposed) term."""
    a = arch("llama3_2_1b")
    plan = plan_for("model=llama3_2_1b", "cluster=h200", "parallelism.pp=2")
    first, last = plan.memory.stages
    layer = a.layer_params
    assert first.params == 8 * layer + a.embed_params
    assert last.params == 8 * layer + a.embed_params + a.dim  # + final norm
    assert last.optimizer == first.optimizer + 8 * a.dim  # usp's bf16: fp32 parameters, 8 B/param of AdamW
    tied = [c for c in plan.timing.comm if c.name.startswith("tied embedding")]
    assert len(tied) == 1 and tied[0].bytes_per_step == 4 * a.embed_params and tied[0].exposed_s > 0  # fp32 grads
    zbv = plan_for("model=llama3_2_1b", "cluster=h200", "parallelism.pp=2", "parallelism.pp_schedule=zbv",
                   "parallelism.pp_virtual_stages=2")
    assert not [c for c in zbv.timing.comm if c.name.startswith("tied embedding")]  # one rank: summed locally
    out = usp_cli("plan", "model=llama3_2_1b", "cluster=h200", "parallelism.pp=2", cwd=tmp_path, columns=250)
    assert out.returncode == 0 and "tie_embeddings" not in out.stderr, out.stderr


# --- validation rules through the CLI -----------------------------------------------------------------

UNTIED4 = ["model.n_layers=4", "model.tie_embeddings=false"]
RULES = [
    # (overrides, key in the message, words)
    (["cluster.procs_per_node=8", "parallelism.tp=3"], "parallelism", "does not divide"),
    (["cluster.procs_per_node=8", "parallelism.tp=8"], "model.n_heads", "can't be split"),
    (["cluster.procs_per_node=2", "parallelism.pp=2", "parallelism.pp_schedule=interleaved_1f1b",
      "parallelism.pp_virtual_stages=4", *UNTIED4], "parallelism.pp_virtual_stages", "layers"),
    (["cluster.procs_per_node=4", "parallelism.pp=4", "train.micro_batch=8", *UNTIED4], "train.grad_accum",
     "stages"),
    (["cluster.procs_per_node=4", "parallelism.pp=4", "parallelism.pp_schedule=interleaved_1f1b",
      "parallelism.pp_virtual_stages=2", "train.micro_batch=8", "model.n_layers=8", "model.tie_embeddings=false"],
     "train.grad_accum", "micro batches"),
    (["cluster=local_cpu2", "parallelism=ddp", "train.micro_batch=16"], "train.global_batch", "not divisible"),
    (["cluster.procs_per_node=3", "parallelism.cp=3"], "train.seq_len", "2 x cp"),
    (["model=llama3_1_8b", "cluster=slurm_h100"], "parallelism", "out of memory"),
]


@pytest.mark.parametrize("overrides,key,words", RULES)
def test_rule_through_cli(tmp_path, overrides, key, words):
    r = usp_cli("plan", *overrides, cwd=tmp_path, columns=250)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert f"{key}=" in r.stderr and words in r.stderr and "fix:" in r.stderr, r.stderr


@pytest.mark.parametrize("overrides,words", [
    (["cluster.procs_per_node=3", "model.n_experts=4", "parallelism.ep=3", "train.global_batch=24"],
     ["4 experts (model.n_experts) can't be split over ep=3"]),
    (["cluster.procs_per_node=2", "model.n_experts=4", "parallelism.tp=2", "parallelism.ep=2"],
     ["dp_shard x cp = 1 x 1 = 1, which ep=2 must divide", "fix: parallelism.ep in [1]"]),
])
def test_expert_parallel_rule_through_cli(tmp_path, overrides, words):
    """The EP rule is of kind "engine": `usp plan` prints the plan and what `usp train` would refuse."""
    r = usp_cli("plan", *overrides, cwd=tmp_path, columns=250)
    out = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stderr
    assert "usp train would refuse: parallelism.ep=" in out and all(w in out for w in words), out


def test_tp_across_nodes_warns_and_strict_refuses(tmp_path):
    # 2 nodes x 3 processes, tp=2: the TP group of ranks 2 and 3 straddles the node boundary
    args = ["cluster.nodes=2", "cluster.procs_per_node=3", "parallelism.tp=2", "train.global_batch=24"]
    r = usp_cli("plan", *args, cwd=tmp_path, columns=250)
    assert r.returncode == 0, r.stderr
    assert "warning" in r.stdout and "spans nodes" in r.stdout
    r = usp_cli("plan", "--strict", *args, cwd=tmp_path, columns=250)
    assert r.returncode == 2 and "parallelism.tp=2" in r.stderr and "spans nodes" in r.stderr


def test_oom_error_names_stage_consumers_and_a_layout_that_fits(tmp_path):
    args = ["model=llama3_1_70b", "cluster=slurm_h100", "cluster.nodes=2", "parallelism.tp=8", "parallelism.pp=2",
            "train.seq_len=4096", "train.global_batch=16"]
    with pytest.raises(PlanError) as info:
        plan_for(*args)
    err = str(info.value)
    assert info.value.key == "parallelism" and "out of memory" in err
    assert re.search(r"pipeline stage \d \(ranks \d+-\d+\)", err)
    consumers = re.search(r"top consumers: (.*)", err).group(1)
    assert consumers.count("GiB") == 3
    suggested = re.search(r"a layout that fits: (.*?) \(predicted", info.value.fix).group(1).split()
    fitted = plan_for(*args, *suggested)  # the suggestion really fits
    assert fitted.memory.fits
    forced = plan_for(*args, force=True)  # --force: a warning instead
    assert not forced.memory.fits and any("out of memory" in w for w in forced.warnings)
    r = usp_cli("plan", "--force", *args, cwd=tmp_path, columns=250)
    assert r.returncode == 0 and "OUT OF MEMORY" in r.stdout


def test_a_tokenizer_vocab_over_the_model_vocab_is_refused():
    """Token ids come from the data's tokenizer (uint16 or uint32 files): any vocabulary the model's
    embedding holds trains; one larger than model.vocab_size is refused before launch."""
    cfg, choices = cfg_for("model=llama3_2_1b", "cluster=slurm_h100", "data.vocab_size=70000")
    assert build_plan(cfg, choices).model.vocab_size == 128256
    cfg, choices = cfg_for("model=llama3_2_1b", "cluster=slurm_h100", "data.vocab_size=200000")
    with pytest.raises(PlanError) as info:
        build_plan(cfg, choices)
    assert info.value.key == "model.vocab_size" and "200,000" in str(info.value)
    with pytest.raises(PlanError):  # `usp plan` refuses it too
        build_plan(cfg, choices, training=False)


# --- usp plan output (the import boundary: test_import_boundary.py) ----------------------------------

def test_usp_plan_shows_memory_and_time_tables(tmp_path):
    # full recompute: without it each of stage 0's 5.5 in-flight micro batches keeps its compiled blocks'
    # bf16 weight casts (20.8 GiB) and 70B on 4 x 8 H100s does not fit
    r = usp_cli("plan", "model=llama3_1_70b", "cluster=slurm_h100", "cluster.nodes=4", "parallelism.tp=8",
                "parallelism.pp=4", "parallelism.pp_schedule=interleaved_1f1b", "parallelism.pp_virtual_stages=2",
                "train.seq_len=4096", "train.global_batch=32", "train.micro_batch=1", "train.recompute=full",
                cwd=tmp_path, columns=250)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "memory per device" in out and "stage 0 (ranks 0-7)" in out and "stage 3 (ranks 24-31)" in out
    assert "optimizer states" in out and "framework overhead" in out and "micro batch(es) in flight" in out
    assert "time per step" in out and "MFU" in out and "pipeline bubble" in out and "TP all-gather" in out


@pytest.mark.parametrize("embed,head", [(0, 0), (500, 500), (1000, 1), (1, 1000), (262, 263)])
def test_uniform_split_equals_pipeline_split(embed, head):
    """The fast split for equal layers (what split_layers uses) is the exact dynamic program."""
    from usp.perf.pipeline_split import _balanced_counts, uniform_split

    cases = [(n, s) for n in range(2, 27) for s in range(2, min(n, 12) + 1)] + [(80, 32), (126, 63), (80, 80)]
    for n, stages in cases:
        expected = tuple(_balanced_counts([218] * n, stages, embed, head))
        assert uniform_split(n, stages, embed, head, 218) == expected, (n, stages)


H200_ONE = ("cluster=h200", "cluster.procs_per_node=1", "train.seq_len=2048", "train.global_batch=8")


def test_bf16_storage_follows_the_recipe():
    """usp keeps fp32 parameters and gradients and gives the matmuls bf16 copies (4 + 4 + 8 B and the
    copies); a Megatron/nanotron recipe stores bf16 parameters with fp32 masters (2 + 2 + 12)."""
    usp_prec = Precision.resolve("bf16", "cuda", PROFILES["usp"].fp32_params)
    nano = Precision.resolve("bf16", "cuda", PROFILES["nanotron"].fp32_params)
    assert (usp_prec.param, usp_prec.grad, usp_prec.optim, usp_prec.copy_bytes) == (4, 4, 8, 2)
    assert (nano.param, nano.grad, nano.optim, nano.copy_bytes) == (2, 2, 12, 0)
    assert Precision.resolve("auto", "cpu", True).copy_bytes == 0  # fp32: the matmuls read the parameters


def test_autocast_weight_copies_where_the_engine_holds_them():
    """Measured on an H200 (docs/benchmarks.md): Llama-3.1 8B, full recompute, micro batch 2, eager,
    ran out of memory at the loss forward, where autocast's cache held a bf16 copy of every weight.
    The engine now caches only without recompute, so a recomputed model holds one layer's copy during
    that layer's backward (and the LM head's until its backward); without recompute every layer keeps
    its copy for backward. That run's compiled peak, 128.7 GiB, had compiled blocks and the eager loss:
    under full recompute a compiled block keeps what an eager one does, so as memory goes that is the
    planner's train.compile=false plan (the engine now compiles the loss with the blocks:
    test_planner_follows_the_h100_session pins the engine as it is)."""
    a = arch("llama3_1_8b")
    head = 2 * a.vocab_size * a.dim
    full = plan_for("model=llama3_1_8b", *H200_ONE, "train.micro_batch=2", "train.recompute=full",
                    "train.compile=false").memory.stages[0]
    assert full.copies == pytest.approx(head) and full.peak_phase == "loss backward"
    assert (full.total - full.overhead) / GIB == pytest.approx(128.7, rel=0.03)  # the compiled run's peak
    every = 2 * (a.n_layers * a.layer_params + a.vocab_size * a.dim)  # not the embedding: a lookup, never cast
    none = plan_for("model=llama3_1_8b", *H200_ONE, "train.micro_batch=1", "train.recompute=none",
                    "train.compile=false", force=True).memory.stages[0]
    assert none.copies == pytest.approx(every, rel=1e-3)
    fsdp = plan_for("model=llama3_1_8b", "cluster=h200", "parallelism.dp_replicate=1", "parallelism.dp_shard=8",
                    "train.recompute=none").memory.stages[0]
    assert fsdp.copies == 0  # FSDP2's policy gathers bf16 parameters instead (the gathered term)
    nanotron = plan_for("model=llama3_1_8b", *H200_ONE, "train.micro_batch=1", "planner.profile=nanotron",
                        force=True).memory.stages[0]
    assert nanotron.copies == 0 and nanotron.optimizer == 12 * nanotron.params


def test_compiled_blocks_save_their_weight_casts():
    """A compiled block casts its fp32 weights to bf16 inside its graph and saves the casts for backward
    (read from its saved tensors on CPU: scripts/bench/compiled_saved.py), as autocast's cache does for an
    eager one: every layer's copy + the eager head's, one set per pipeline micro batch in flight (each call
    casts anew). FP8 blocks save their fp32 weights and cast to FP8 again: the head's copy only."""
    a = arch("llama3_2_1b")  # tied: the head casts the embedding
    head, layers = 2 * a.vocab_size * a.dim, 2 * a.n_layers * a.layer_params
    one = ("model=llama3_2_1b", *H200_ONE, "train.micro_batch=8")
    eager, compiled, default = (plan_for(*one, *c).memory.stages[0]
                                for c in (("train.compile=false",), ("train.compile=true",), ()))
    assert compiled.copies == pytest.approx(head + layers, rel=1e-3) == eager.copies
    assert compiled.total < eager.total and default.total == compiled.total  # compile=auto: on for CUDA
    fp8 = plan_for(*one, "train.fp8=tensorwise").memory.stages[0]
    assert fp8.copies == pytest.approx(head)
    pp = ("model=llama3_2_1b", "cluster=h200", "cluster.procs_per_node=2", "parallelism.dp_replicate=1",
          "parallelism.pp=2", "train.seq_len=2048", "train.global_batch=8", "train.micro_batch=1")
    eager, compiled = (plan_for(*pp, f"train.compile={c}").memory.stages[0] for c in ("false", "true"))
    assert compiled.in_flight == 2 and compiled.copies - eager.copies == pytest.approx(
        2 * compiled.layers * a.layer_params, rel=1e-3)  # the second micro batch's casts


def test_compiled_activations_are_what_the_compiled_block_keeps():
    """Without recompute a compiled dense block keeps its input in fp32 (the residual stream under
    autocast), the two norm outputs, q/k/v, the SDPA output, wo's output and SwiGLU's three tensors in
    bf16, per token 4h + 2·(5h + 2kv + 3f) bytes (inductor recomputes x·rstd, silu and x + attention(x));
    with train.fp8 it recomputes the linears' inputs (the norm outputs, w2's input) too:
    4h + 2·(3h + 2kv + 2f). Both read from the compiled block's saved tensors on CPU
    (scripts/bench/compiled_saved.py: 1B at 8 x 2048 tokens 80,040 bytes per token with RoPE's tables,
    the rstd and SDPA's log-sum-exp). With full recompute a compiled block keeps what an eager one
    keeps (its input)."""
    h, kv, f, tokens = 2048, 512, 8192, 8 * 2048  # Llama-3.2 1B, micro batch 8 x seq 2048
    one = ("model=llama3_2_1b", *H200_ONE, "train.micro_batch=8")
    compiled = plan_for(*one, "train.compile=true").memory.stages[0]
    assert compiled.activation_per_layer == tokens * (4 * h + 2 * (5 * h + 2 * kv + 3 * f))
    fp8 = plan_for(*one, "train.compile=true", "train.fp8=tensorwise").memory.stages[0]
    assert fp8.activation_per_layer == tokens * (4 * h + 2 * (3 * h + 2 * kv + 2 * f))
    full = [plan_for(*one, "train.recompute=full", f"train.compile={c}").memory.stages[0].activation_per_layer
            for c in ("false", "true")]
    assert full[0] == full[1] == tokens * 2 * h


# The H100 session (docs/benchmarks.md "GPU session", 2026-11-27, torch 2.11, runs 3 and 4): each row's
# case, model, micro batch x accumulation, train.compile, train.fp8 and the allocator's peak (GiB).
H100_ROWS = [
    ("1b compiled", "llama3_2_1b", 8, 1, "true", "off", 43.73),
    ("1b compiled accum 4", "llama3_2_1b", 8, 4, "true", "off", 48.33),
    ("1b eager", "llama3_2_1b", 8, 1, "false", "off", 67.38),
    ("largest compiled", "llama3_2_3b", 2, 4, "true", "off", 66.24),
    ("largest fp8 tensorwise compiled", "llama3_2_3b", 2, 4, "true", "tensorwise", 57.93),
    ("largest eager", "llama3_2_3b", 2, 4, "false", "off", 74.53),
    ("largest compiled accum 1", "llama3_2_3b", 2, 1, "true", "off", 54.27),
    ("largest compiled micro 1", "llama3_2_3b", 1, 4, "true", "off", 60.58),
]


@pytest.mark.parametrize("case,model,micro,accum,compiled,fp8,measured", H100_ROWS, ids=[r[0] for r in H100_ROWS])
def test_planner_follows_the_h100_session(case, model, micro, accum, compiled, fp8, measured):
    """The planner's tensor memory (its total without the overhead allowance) within 5 % of each row's
    measured peak, as the session planned it (cluster=local_gpu, 79.2 GiB, seq 2048, no recompute)."""
    st = plan_for(f"model={model}", "cluster=local_gpu", "cluster.device_memory_gb=79.2", "train.seq_len=2048",
                  "train.dtype=bf16", f"train.compile={compiled}", f"train.fp8={fp8}", f"train.micro_batch={micro}",
                  f"train.global_batch={micro * accum}", force=True).memory.peak  # its tensors, fit or not
    assert (st.total - st.overhead) / GIB == pytest.approx(measured, rel=0.05)
