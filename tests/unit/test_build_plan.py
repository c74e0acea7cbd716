"""The planner knows the build (issue 27, item 5): the optimizer the config names is counted, the
build's and the load's transient is planned per rank (`usp plan` shows it), a layout whose build
wouldn't fit is refused (or planned anyway under --force), and each rank's parameter count follows
FSDP2's padded dim-0 shards. The engine's real (meta) build is checked against these figures in
tests/e2e/test_build_check.py. No torch here."""
from __future__ import annotations

import json
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.helpers import plan_for, usp_cli
from usp.contract.dims import shard_index
from usp.contract.hf_shape import hf_config
from usp.errors import PlanError
from usp.perf.memory import (
    DTENSOR_TRANSIENT,
    _held,
    build_memory,
    build_peak,
    local_bytes,
    peak_bytes,
    sharded_params,
)
from usp.perf.specs import GIB, Arch, Hardware, Layout, Precision, optimizer_states
from usp.perf.stack_profile import PROFILES
from usp.plan.hf_config import checkpoint_value_bytes
from usp.plan.planner_inputs import planned_local_bytes
from usp.plan.rules import Settings
from usp.plan.search import enumerate_layouts, search

pytestmark = pytest.mark.usefixtures("fresh_cache")
plan_for = partial(plan_for, training=False)  # as `usp plan` plans
USP = PROFILES["usp"]
CPU8 = Hardware("cpu", "cpu", 24.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1, 8)
HALF_B = ["model=tiny", "model.dim=1024", "model.n_layers=32", "model.n_heads=16", "model.n_kv_heads=8",
          "model.ffn_dim=4096", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=1",
          "cluster.procs_per_node=8", "parallelism.dp_shard=8"]
DENSE = Arch("dense", 1024, 32, 16, 8, 4096, 4096, True)
MIXTRAL = Arch("mixtral", 4096, 32, 32, 8, 14336, 32000, False, n_experts=8, top_k=2)


# --- the optimizer the config names ------------------------------------------------------------------

@pytest.mark.parametrize("name, momentum, states", [("adamw", 0.9, 2), ("adam", 0.9, 2), ("sgd", 0.9, 1),
                                                    ("sgd", 0.0, 0)])
def test_optimizer_states_follow_torch(name, momentum, states):
    """AdamW and Adam keep exp_avg and exp_avg_sq, SGD its momentum buffer, none without momentum;
    4 bytes each for fp32 parameters, + the fp32 master copy where a recipe stores bf16 parameters."""
    assert optimizer_states(name, momentum) == states
    assert Precision.resolve("auto", "cpu", optimizer=name, momentum=momentum).optim == 4 * states
    assert Precision.resolve("bf16", "cuda", True, optimizer=name, momentum=momentum).optim == 4 * states
    assert Precision.resolve("bf16", "cuda", False, optimizer=name, momentum=momentum).optim == 4 + 4 * states


@pytest.mark.parametrize("optimizer, per_param", [("optimizer=sgd", 4), ("optimizer=adamw", 8),
                                                  ("optimizer.name=sgd optimizer.momentum=0", 0)])
def test_the_plan_counts_the_named_optimizer(optimizer, per_param):
    """issue 27's 0.5 B run: SGD with momentum keeps 4 B per parameter, AdamW 8, SGD without momentum
    none (it used to be planned at AdamW's 8 whatever the optimizer), and the plan says which."""
    plan = plan_for(*HALF_B, *optimizer.split())
    st = plan.memory.stages[0]
    assert st.optimizer == per_param * st.local.params
    said = next(a for a in plan.memory.assumptions if "optimizer state" in a)
    assert f"{per_param} B/param of optimizer state" in said
    assert {4: "SGD's momentum", 8: "AdamW's m + v", 0: "SGD without momentum: no state"}[per_param] in said


def test_sgd_plans_less_than_adamw_by_the_states():
    sgd, adamw = plan_for(*HALF_B, "optimizer=sgd").memory.peak, plan_for(*HALF_B, "optimizer=adamw").memory.peak
    assert adamw.optimizer - sgd.optimizer == 4 * sgd.local.params
    assert sgd.total < adamw.total


# --- each rank's parameters, exactly --------------------------------------------------------------------

@pytest.mark.parametrize("arch, layout", [
    (DENSE, Layout(dp_shard=8)), (DENSE, Layout(pp=2, tp=2, dp_shard=2)), (DENSE, Layout(tp=2, dp_shard=4)),
    (MIXTRAL, Layout(pp=4, dp_shard=16, ep=8)), (Arch("odd", 192, 3, 6, 3, 500, 1000, False), Layout(tp=3, pp=3))])
def test_the_stage_parameters_are_the_sum_of_its_tensors(arch, layout):
    """The parameters a rank holds, counted tensor by tensor after TP / EP (what FSDP2 cuts), add up
    to the stage's count; with tp dividing every dimension they are the stage's parameters exactly."""
    for r in range(layout.pp):
        h = _held(arch, layout, r, USP)
        total = sum(rows * cols * count for rows, cols, count, _ in h.tensors)
        if arch.name == "odd":  # 500 / 3: DTensor's first rank holds ceil(500 / 3) rows
            assert total > h.params
        else:
            assert total == h.params


def test_fsdp2_pads_every_shard_to_the_first_ranks_rows():
    """One local expert over 2 FSDP2 ranks (Mixtral's recipe: 8 experts, ep 8, dp_shard 16): both
    ranks store the whole expert (the second as padding), not half of it; the optimizer keeps states
    for the real rows only, so the second rank's are the dense part's."""
    lay = Layout(pp=4, dp_shard=16, ep=8)
    h = _held(MIXTRAL, lay, 0, USP)
    padded = sharded_params(MIXTRAL, lay, h, 16)
    assert h.experts + h.dense / 16 <= padded < h.experts + 1.01 * h.dense / 16  # the router's 8 rows: 1 each
    prec = Precision.resolve("bf16", "cuda", True)
    first, second = local_bytes(MIXTRAL, lay, prec, 0, index=0), local_bytes(MIXTRAL, lay, prec, 0, index=8)
    assert first.parameters == second.parameters == 4 * padded
    assert first.optimizer == 8 * padded
    assert second.optimizer < 8 * 1.01 * h.dense / 16  # index 8 // ep 8 = 1: the expert's padding, no states


def test_a_ranks_place_in_its_shard_group():
    deg = {"pp": 2, "dp_replicate": 1, "dp_shard": 4, "cp": 2, "tp": 1}
    assert shard_index(deg, {"pp": 1, "dp_replicate": 0, "dp_shard": 3, "cp": 1, "tp": 0}) == 7
    rep = {"pp": 1, "dp_replicate": 4, "dp_shard": 1, "cp": 1, "tp": 2}
    assert shard_index(rep, {"pp": 0, "dp_replicate": 2, "dp_shard": 0, "cp": 0, "tp": 1}, zero1=True) == 2
    assert shard_index(rep, {"pp": 0, "dp_replicate": 2, "dp_shard": 0, "cp": 0, "tp": 1}) == 0  # replicated


def test_planned_local_bytes_per_rank_of_a_plan():
    plan = plan_for(*HALF_B, "optimizer=sgd")
    planned = planned_local_bytes(plan, [0, 7])
    assert planned[0] == planned[7] == plan.memory.stages[0].local
    assert planned[0].parameters == 4 * (DENSE.total_params / 8)


# --- the build and the load --------------------------------------------------------------------------------

def test_the_build_holds_the_shards_and_the_largest_parameter_whole():
    """FSDP over 8: the rank's eighth of the model + the 4096 x 1024 embedding's whole fp32 value, with
    the copy distribute_tensor makes while cutting it; a single process copies each value in place."""
    fsdp = build_memory(DENSE, Layout(dp_shard=8), CPU8, 0)
    assert fsdp.parameters == 4 * DENSE.total_params / 8
    assert (fsdp.largest, fsdp.largest_params) == ("tok_embeddings.weight", 4096 * 1024)
    assert fsdp.transient == DTENSOR_TRANSIENT * 4 * 4096 * 1024 and fsdp.read_buffer == 0
    single = build_memory(DENSE, Layout(), CPU8, 0)
    assert single.parameters == 4 * DENSE.total_params and single.transient == 4 * 4096 * 1024
    assert fsdp.total == fsdp.parameters + fsdp.transient + fsdp.overhead


def test_each_pipeline_stage_builds_its_own_largest_parameter():
    untied = Arch("untied", 1024, 8, 16, 8, 8192, 4096, False)
    lay = Layout(pp=2, dp_shard=4)
    first, last = build_memory(untied, lay, CPU8, 0), build_memory(untied, lay, CPU8, 1)
    assert first.largest == "layers.<i>.feed_forward.w1.weight" and first.largest_params == 8192 * 1024
    assert last.largest == "layers.<i>.feed_forward.w1.weight"
    moe = build_memory(MIXTRAL, Layout(pp=4, dp_shard=16, ep=8), CPU8, 1)
    assert moe.largest.endswith("experts.w1") and moe.largest_params == 8 * 14336 * 4096  # drawn whole under EP


def test_the_load_reads_only_the_ranks_part():
    """model.init_from replaces the init: each rank reads only its part of each parameter (bf16: 2
    bytes a value), no whole fp32 value; stacked experts are read expert by expert, then stacked."""
    lay = Layout(dp_shard=8)
    loaded = build_memory(DENSE, lay, CPU8, 0, load_bytes=2)
    assert loaded.read_buffer == loaded.transient == 2 * 4096 * 1024 / 8  # the embedding's eighth
    assert loaded.transient < build_memory(DENSE, lay, CPU8, 0).transient
    moe = build_memory(MIXTRAL, Layout(pp=4, dp_shard=16, ep=8), CPU8, 1, load_bytes=2)
    assert moe.read_buffer == 2 * 2 * 14336 * 4096  # one local expert (padded over 2 ranks), read then stacked
    assert checkpoint_value_bytes({"torch_dtype": "bfloat16"}) == 2
    assert checkpoint_value_bytes({"dtype": "float32"}) == checkpoint_value_bytes({}) == 4


def test_a_padded_vocabulary_draws_the_embeddings_whole_init_under_the_load():
    """TP pads the vocabulary: the rows the checkpoint lacks keep the model's own init, drawn whole in fp32."""
    arch = Arch("odd_vocab", 1024, 4, 16, 8, 4096, 4099, True)
    b = build_memory(arch, Layout(tp=2, dp_shard=4), CPU8, 0, load_bytes=2)
    assert b.transient == 4 * 4100 * 1024 > b.read_buffer


def test_a_plan_with_init_from_counts_the_checkpoints_dtype(tmp_path):
    base = ["data.tokenizer=bytes", "model.vocab_size=512", "parallelism.dp_shard=2", "cluster.procs_per_node=2"]
    plain = plan_for(*base)
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(hf_config(plain.config.model, 512, 128, "bfloat16")))
    save_file({"model.norm.weight": np.ones(128, np.float32)}, str(ckpt / "model.safetensors"))  # headers read
    loaded = plan_for(*base, f"model.init_from={ckpt}")
    b = loaded.memory.stages[0].build
    assert b.read_buffer == b.transient == 2 * 512 * 128 / 2  # bf16, the embedding's half on each of 2 ranks
    assert any("model.init_from reads it (2 B/value)" in a for a in loaded.memory.assumptions)


def test_usp_plan_shows_the_build_next_to_training(tmp_path):
    out = usp_cli("plan", *HALF_B, "optimizer=sgd", cwd=tmp_path).stdout
    assert "at build: total" in out and "largest parameter" in out and "tok_embeddings.weight" in out
    assert "at build 0." in out and ": fits" in out
    assert "4 B/param of optimizer state (SGD's momentum)" in out


# A big vocabulary on a tiny model over tp 4 x dp_shard 2: each rank's eighth is small, but every rank
# makes the 262144 x 128 embedding whole (with distribute_tensor's copy: 256 MiB) while it builds.
BIG_VOCAB = ["model=tiny", "model.vocab_size=262144", "data.tokenizer=bytes", "cluster.procs_per_node=8",
             "parallelism.tp=4", "parallelism.dp_shard=2", "optimizer.name=sgd", "optimizer.momentum=0",
             "train.seq_len=16", "train.global_batch=8", "train.micro_batch=1"]


def _between_training_and_build() -> float:
    plan = plan_for(*BIG_VOCAB)
    train, build = plan.memory.peak_gib, plan.memory.build_peak_gib
    assert build > train, (build, train)  # this layout's build needs more than its training
    return (train + build) / 2


def test_a_build_that_does_not_fit_is_refused_with_key_value_fix():
    capacity = _between_training_and_build()
    with pytest.raises(PlanError) as err:
        plan_for(*BIG_VOCAB, f"cluster.device_memory_gb={capacity}")
    e = err.value
    assert e.key == "parallelism" and e.value == "fsdp2-tp4"
    assert all(w in str(e) for w in ("while the model is built", "tok_embeddings.weight", "cluster.device_memory_gb"))
    assert "more than" in e.fix  # the whole embedding is made on every rank: sharding more can't help
    forced = plan_for(*BIG_VOCAB, f"cluster.device_memory_gb={capacity}", force=True)
    assert not forced.memory.build_fits and any("while the model is built" in w for w in forced.warnings)


def test_the_search_never_proposes_a_layout_whose_build_does_not_fit():
    """A 1 M-token vocabulary on a small model, 8 GPUs: at 19 GiB some layouts train within the memory but
    can't build (every rank makes the 2 G-value embedding whole, 15 GiB with distribute_tensor's copy,
    next to its parameters); the search proposes none of them. At 24 GiB every proposal builds."""
    arch = Arch("big_vocab", 2048, 8, 16, 8, 8192, 1_000_000, False)
    prec = Precision.resolve("bf16", "cuda", True)
    for cap in (19.0, 24.0):
        hw = Hardware("cuda", "gpu", cap, 989.0, 67.0, 450.0, 50.0, 0.0, 1, 8)
        trains_only = [lay for lay, local in enumerate_layouts(arch, hw, 1024, 64, ("none",), Settings(seq_len=1024))
                       if peak_bytes(arch, replace(lay, grad_accum=local), 1024, hw, prec, USP)[0] <= cap * GIB
                       < build_peak(arch, lay, hw).total]
        found = search(arch, hw, prec, 1024, 64, top_k=20)
        assert all(build_peak(arch, c.layout, hw).total <= cap * GIB for c in found.top)
        assert (cap, bool(trains_only), bool(found.top)) in ((19.0, True, False), (24.0, False, True))
