"""The run plan: degrees, rank table, batch math, model checks, plan.yaml, and `usp plan`.
Pure Python planning on real composed configs; `usp` runs as a real process."""
from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers import plan_for, usp_cli
from usp.config.compose import compose_config
from usp.contract.config_schema import ParallelismConfig, TrainConfig
from usp.contract.dims import MESH_DIMS, ParallelDims, RankInfo, rank_table
from usp.contract.plan_file import read_plan, write_plan
from usp.contract.run_plan import PLAN_VERSION
from usp.errors import PlanError, UspError
from usp.perf.specs import Arch
from usp.plan.batch import plan_batch
from usp.plan.plan import build_plan, engine_support_errors
from usp.run.files import write_text_atomic

TINY_PARAMS = 950_912  # tiny model, vocab 4096 (README: "~0.95 M parameters")


pytestmark = pytest.mark.usefixtures("fresh_cache")  # planning computes the dataset's path from it


def plan_error(*overrides: str) -> PlanError:
    with pytest.raises(PlanError) as info:
        plan_for(*overrides)
    assert isinstance(info.value, UspError) and info.value.fix
    return info.value


# --- ParallelDims.resolve -------------------------------------------------------------------------

@pytest.mark.parametrize("par,world,expected", [
    ({}, 1, dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1)),
    ({}, 4, dict(pp=1, dp_replicate=4, dp_shard=1, cp=1, tp=1)),
    (dict(tp=2), 8, dict(pp=1, dp_replicate=4, dp_shard=1, cp=1, tp=2)),
    (dict(tp=2, pp=2), 8, dict(pp=2, dp_replicate=2, dp_shard=1, cp=1, tp=2)),
    (dict(tp=8), 8, dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=8)),
    (dict(dp=4, tp=2), 8, dict(pp=1, dp_replicate=4, dp_shard=1, cp=1, tp=2)),  # dp shorthand
    (dict(dp=2, dp_replicate=2), 2, dict(pp=1, dp_replicate=2, dp_shard=1, cp=1, tp=1)),  # consistent
    (dict(dp=2, dp_shard=-1), 8, dict(pp=1, dp_replicate=2, dp_shard=4, cp=1, tp=1)),
    (dict(dp_replicate=2, dp_shard=-1), 8, dict(pp=1, dp_replicate=2, dp_shard=4, cp=1, tp=1)),
    (dict(dp_replicate=1, cp=-1), 4, dict(pp=1, dp_replicate=1, dp_shard=1, cp=4, tp=1)),
    (dict(dp_replicate=2, pp=-1, tp=2), 16, dict(pp=4, dp_replicate=2, dp_shard=1, cp=1, tp=2)),
    (dict(dp_replicate=2, dp_shard=2, cp=2, tp=2, pp=2), 32, dict(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)),
])
def test_resolve_degrees(par, world, expected):
    degrees = ParallelDims.resolve(ParallelismConfig(**par), world).mesh
    assert degrees == expected
    assert list(degrees) == list(MESH_DIMS)
    assert math.prod(degrees.values()) == world


@pytest.mark.parametrize("par,world,key,words", [
    (dict(tp=-1), 8, "parallelism.tp", "only one degree"),  # dp_replicate is -1 too
    (dict(dp_replicate=-1, dp_shard=-1), 8, "parallelism.dp_shard", "only one degree"),
    (dict(tp=3), 8, "parallelism", "does not divide"),
    (dict(tp=16), 8, "parallelism", "does not divide"),
    (dict(dp_replicate=2), 8, "parallelism", "world size is 8"),
    (dict(dp_replicate=1, tp=2), 4, "parallelism", "world size is 4"),
    (dict(dp_replicate=1), 2, "parallelism", "world size is 2"),
    (dict(tp=0), 8, "parallelism.tp", "positive"),
    (dict(pp=-2), 8, "parallelism.pp", "positive"),
    (dict(dp_shard=0), 8, "parallelism.dp_shard", "positive"),
    (dict(dp=2, dp_replicate=4), 8, "parallelism.dp", "conflicts"),
])
def test_resolve_degrees_errors(par, world, key, words):
    with pytest.raises(PlanError) as info:
        ParallelDims.resolve(ParallelismConfig(**par), world)
    assert info.value.key == key
    assert words in str(info.value)
    assert info.value.fix


def test_resolve_degrees_no_minus_one_fix_names_world():
    with pytest.raises(PlanError) as info:
        ParallelDims.resolve(ParallelismConfig(dp_replicate=2), 8)
    assert "-1" in info.value.fix and "procs_per_node=2" in info.value.fix


# --- rank table ---------------------------------------------------------------------------------

def test_rank_table_two_nodes_tp2():
    degrees = ParallelDims.resolve(ParallelismConfig(tp=2), 8).mesh
    assert degrees["dp_replicate"] == 4
    table = rank_table(degrees, procs_per_node=4)
    assert [r.rank for r in table] == list(range(8))
    assert [r.node for r in table] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r.local_rank for r in table] == [0, 1, 2, 3, 0, 1, 2, 3]
    # tp innermost: ranks 0 and 1 differ only in tp
    r0, r1 = table[0].coords, table[1].coords
    assert r0["tp"] == 0 and r1["tp"] == 1
    assert {d: v for d, v in r0.items() if d != "tp"} == {d: v for d, v in r1.items() if d != "tp"}
    assert [r.coords["tp"] for r in table] == [0, 1] * 4
    assert [r.coords["dp_replicate"] for r in table] == [0, 0, 1, 1, 2, 2, 3, 3]
    # every TP group sits inside one node
    for dp in range(4):
        assert len({r.node for r in table if r.coords["dp_replicate"] == dp}) == 1


@pytest.mark.parametrize("degrees,per_node", [
    (dict(pp=1, dp_replicate=4, dp_shard=1, cp=1, tp=2), 4),
    (dict(pp=2, dp_replicate=2, dp_shard=1, cp=1, tp=2), 4),
    (dict(pp=2, dp_replicate=1, dp_shard=3, cp=2, tp=2), 8),
    (dict(pp=3, dp_replicate=2, dp_shard=2, cp=1, tp=1), 12),
])
def test_rank_table_covers_every_coordinate_once(degrees, per_node):
    table = rank_table(degrees, per_node)
    world = math.prod(degrees.values())
    assert len(table) == world
    coords = [tuple(r.coords[d] for d in MESH_DIMS) for r in table]
    assert list(table[0].coords) == list(MESH_DIMS)
    assert sorted(coords) == list(itertools.product(*(range(degrees[d]) for d in MESH_DIMS)))
    # row-major in MESH_DIMS order, i.e. the rank is the flat index of its coordinates
    assert coords == sorted(coords)
    # pp outermost: each pipeline stage is a contiguous block of ranks
    block = world // degrees["pp"]
    assert [r.coords["pp"] for r in table] == [i // block for i in range(world)]
    assert all(r.node == r.rank // per_node and r.local_rank == r.rank % per_node for r in table)


@pytest.mark.parametrize("degrees,tag", [
    (dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1), "single"),
    (dict(pp=1, dp_replicate=2, dp_shard=1, cp=1, tp=1), "dp2"),
    (dict(pp=1, dp_replicate=2, dp_shard=1, cp=1, tp=2), "dp2-tp2"),
    (dict(pp=2, dp_replicate=1, dp_shard=4, cp=2, tp=1), "pp2-fsdp4-cp2"),
])
def test_layout_label(degrees, tag):
    assert ParallelDims.of(degrees).label() == tag
    assert ParallelDims.of(degrees, ep=2).label() == ("ep2" if tag == "single" else f"{tag}-ep2")
    assert ParallelDims.of(degrees, ep=2).label(with_ep=False) == tag  # run names: as earlier usp versions


# --- batch math -------------------------------------------------------------------------------------

def train(**kw) -> TrainConfig:
    return TrainConfig(**kw)


@pytest.mark.parametrize("kw,dp,accum,global_batch", [
    (dict(global_batch=16, micro_batch=16), 1, 1, 16),
    (dict(global_batch=16, micro_batch=4), 2, 2, 16),
    (dict(global_batch=64, micro_batch=2), 4, 8, 64),
    (dict(global_batch=16, micro_batch=4, grad_accum=2), 2, 2, 16),  # explicit and consistent
    (dict(global_batch_tokens=4096, seq_len=128, micro_batch=8), 2, 2, 32),
    (dict(global_batch=999, global_batch_tokens=1024, seq_len=256, micro_batch=1), 4, 1, 4),  # tokens win
])
def test_plan_batch(kw, dp, accum, global_batch):
    b = plan_batch(train(**kw), dp)
    assert (b.grad_accum, b.global_batch, b.dp) == (accum, global_batch, dp)
    assert b.micro_batch * b.grad_accum * b.dp == b.global_batch
    assert b.global_batch_tokens == b.global_batch * b.seq_len


@pytest.mark.parametrize("global_batch,micro,dp", [(20, 4, 2), (16, 16, 2), (100, 3, 3), (7, 2, 1), (30, 4, 4)])
def test_plan_batch_non_divisible_suggests_working_values(global_batch, micro, dp):
    with pytest.raises(PlanError) as info:
        plan_batch(train(global_batch=global_batch, micro_batch=micro), dp)
    err = info.value
    assert err.key == "train.global_batch" and err.value == global_batch
    found = re.search(r"train\.global_batch=(\d+) or (\d+)", err.fix)
    assert found, err.fix
    for suggested in map(int, found.groups()):
        assert suggested > 0 and suggested % (micro * dp) == 0
        assert plan_batch(train(global_batch=suggested, micro_batch=micro), dp).global_batch == suggested


def test_plan_batch_tokens_not_multiple_of_seq_len():
    with pytest.raises(PlanError) as info:
        plan_batch(train(global_batch_tokens=1000, seq_len=128, micro_batch=1), 1)
    assert info.value.key == "train.global_batch_tokens" and info.value.value == 1000
    suggested = int(re.search(r"train\.global_batch_tokens=(\d+)", info.value.fix).group(1))
    assert suggested > 0 and suggested % 128 == 0


def test_plan_batch_inconsistent_grad_accum():
    with pytest.raises(PlanError) as info:
        plan_batch(train(global_batch=16, micro_batch=4, grad_accum=3), 2)
    assert info.value.key == "train.grad_accum" and info.value.value == 3
    assert "grad_accum=-1" in info.value.fix


@pytest.mark.parametrize("accum", [0, -2])
def test_plan_batch_bad_grad_accum(accum):
    with pytest.raises(PlanError) as info:
        plan_batch(train(global_batch=16, micro_batch=4, grad_accum=accum), 1)
    assert info.value.key == "train.grad_accum"


@pytest.mark.parametrize("kw,key", [
    (dict(micro_batch=0), "train.micro_batch"),
    (dict(micro_batch=-4), "train.micro_batch"),
    (dict(seq_len=1), "train.seq_len"),
    (dict(seq_len=0), "train.seq_len"),
])
def test_plan_batch_bad_sizes(kw, key):
    with pytest.raises(PlanError) as info:
        plan_batch(train(**kw), 1)
    assert info.value.key == key and info.value.fix


@pytest.mark.parametrize("kw", [dict(global_batch=0), dict(global_batch=-16), dict(global_batch_tokens=0)])
def test_plan_batch_rejects_empty_global_batch(kw):
    with pytest.raises(PlanError) as info:
        plan_batch(train(**kw), 1)
    assert info.value.key.startswith("train.global_batch") and info.value.fix


@pytest.mark.parametrize("global_batch,dp,accum,micro", [(16, 1, -1, 16), (16, 2, -1, 8), (32, 2, 4, 4), (8, 8, -1, 1)])
def test_plan_batch_derives_the_micro_batch(global_batch, dp, accum, micro):
    batch = plan_batch(train(global_batch=global_batch, micro_batch=-1, grad_accum=accum), dp)
    assert batch.micro_batch == micro and batch.micro_batch * batch.grad_accum * dp == global_batch


def test_plan_batch_micro_batch_cannot_be_derived_below_one():
    with pytest.raises(PlanError) as info:
        plan_batch(train(global_batch=4, micro_batch=-1), 8)
    assert info.value.key == "train.global_batch" and "8" in info.value.fix


# --- build_plan ---------------------------------------------------------------------------------------

def test_default_plan(tmp_path):
    plan = plan_for(runs_dir=tmp_path)
    assert plan.name == "tiny-single"
    assert plan.run_dir == str(tmp_path.resolve() / "tiny-single")
    assert plan.world_size == 1 and plan.nodes == 1 and plan.procs_per_node == 1
    assert plan.device == "cpu" and plan.backend == "gloo"
    assert plan.model.params == TINY_PARAMS and plan.model.vocab_size == 4096
    assert plan.batch.global_batch == 16 and plan.batch.grad_accum == 1
    assert plan.mesh_dims == list(MESH_DIMS) and plan.mesh_shape == [1] * 5
    assert plan.choices["model"] == "tiny" and plan.config.train.steps == 150
    assert plan.warnings == [] and engine_support_errors(plan) == []


def test_params_and_flops_match_the_closed_form(tmp_path):
    cfg, choices = compose_config(None, ["train.seq_len=64", "train.global_batch=32", "train.micro_batch=8"])
    plan = build_plan(cfg, choices)
    a = Arch.from_model(cfg.model, 4096)
    assert plan.model.params == a.total_params == TINY_PARAMS
    h, n, f, v = a.dim, a.n_layers, a.ffn_dim, a.vocab_size  # 6·N + 12·L·h·s, N = block matmuls + LM head
    assert plan.model.flops_per_token == a.flops_per_token(64) == 6 * (n * (2 * h * h + 2 * h * a.kv_dim + 3 * h * f)
                                                                      + v * h) + 12 * n * h * 64
    assert plan.batch.global_batch_tokens == 32 * 64
    assert plan.model.flops_per_step == plan.model.flops_per_token * 32 * 64


def test_vocab_from_tokenizer_or_model():
    assert plan_for("data.tokenizer=bytes").model.vocab_size == 256
    explicit = plan_for("model.vocab_size=5000")  # room to spare over the tokenizer's 4096
    assert explicit.model.vocab_size == 5000 and explicit.model.params > TINY_PARAMS
    assert plan_for("data.vocab_size=2048").model.vocab_size == 2048


def test_world_is_nodes_times_procs(tmp_path):
    plan = plan_for("cluster.nodes=2", "cluster.procs_per_node=4", "parallelism.tp=2", "train.micro_batch=4",
                    runs_dir=tmp_path)
    assert plan.world_size == 8 and plan.nodes == 2 and plan.procs_per_node == 4
    assert plan.degrees == dict(pp=1, dp_replicate=4, dp_shard=1, cp=1, tp=2)
    assert plan.mesh_shape == [1, 4, 1, 1, 2]
    assert len(plan.ranks) == 8 and plan.ranks[-1].node == 1 and plan.ranks[-1].local_rank == 3
    assert plan.batch.dp == 4 and plan.batch.grad_accum == 1
    assert plan.name == "tiny-dp4-tp2"
    assert plan.warnings == []  # tp=2 fits in a node of 4


def test_ddp_plan_name_and_run_dir(tmp_path):
    plan = plan_for("parallelism=ddp", "cluster=local_cpu2", "train.micro_batch=8", runs_dir=tmp_path)
    assert plan.name == "tiny-dp2" and plan.run_dir == str(tmp_path.resolve() / "tiny-dp2")
    assert plan.batch.dp == 2 and plan.world_size == 2
    assert plan.choices["parallelism"] == "ddp"
    assert engine_support_errors(plan) == []


def test_recipe_plan_uses_recipe_name(tmp_path):
    plan = plan_for(conf="tiny_ddp", runs_dir=tmp_path)
    assert plan.name == "tiny_ddp" and Path(plan.run_dir) == tmp_path.resolve() / "tiny_ddp"


def test_relative_runs_dir_resolves_against_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = plan_for("train.runs_dir=out/runs", "train.name=exp")
    assert plan.run_dir == str(tmp_path.resolve() / "out" / "runs" / "exp")
    assert not (tmp_path / "out").exists()  # planning creates nothing


def test_dataset_dir_under_cache(tmp_path):
    explicit = plan_for(f"data.cache_dir={tmp_path / 'cc'}")
    assert Path(explicit.dataset_dir).parent == (tmp_path / "cc").resolve() / "datasets"
    assert Path(explicit.dataset_dir).name.startswith("shakespeare-")
    from_env = plan_for()
    assert Path(from_env.dataset_dir).parent == (tmp_path / "cache").resolve() / "datasets"
    assert not (tmp_path / "cc").exists() and not (tmp_path / "cache").exists()  # only a path, nothing tokenized
    # a different tokenizer is a different dataset
    assert plan_for("data.vocab_size=2048").dataset_dir != from_env.dataset_dir


def test_divisors_are_every_divisor_ascending_and_fast_on_a_huge_batch():
    from usp.plan.rules import divisors

    for n in range(1, 400):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    # a global batch of 10^15: O(n) took hours (10^9 took 28 s in usp plan); O(sqrt n), a fraction of a second
    assert len(divisors(10**15)) == 16 * 16 and divisors(10**15)[-2] == 10**15 // 2


def test_threads_and_backend(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg, choices = compose_config(None, ["cluster=local_cpu2", "parallelism=ddp", "train.micro_batch=8"])
    assert build_plan(cfg, choices, cpu_count=8).threads_per_proc == 4
    assert build_plan(cfg, choices, cpu_count=1).threads_per_proc == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the environment's setting wins over the core count
    assert build_plan(cfg, choices, cpu_count=8).threads_per_proc == 3
    cfg, choices = compose_config(None, ["cluster.threads_per_proc=5"])  # and the config's over both
    assert build_plan(cfg, choices, cpu_count=64).threads_per_proc == 5
    with pytest.raises(PlanError) as err:  # more than the machine has: refused (100,000 segfaulted a run)
        build_plan(cfg, choices, cpu_count=4)
    assert err.value.key == "cluster.threads_per_proc" and "4 CPUs" in str(err.value)
    cfg, choices = compose_config(None, ["cluster=slurm_h100", "cluster.slurm.cpus_per_task=8",
                                         "cluster.threads_per_proc=9"])
    with pytest.raises(PlanError, match="cpus_per_task gives a task 8 CPUs"):
        build_plan(cfg, choices)
    assert plan_for("cluster=local_gpu").backend == "nccl"
    assert plan_for("cluster.backend=mpi").backend == "mpi"


@pytest.mark.parametrize("overrides,key,words", [
    (["cluster.procs_per_node=3", "parallelism.tp=3"], "model.n_heads", "can't be split"),
    (["model.n_kv_heads=2", "cluster.procs_per_node=4", "parallelism.tp=4"], "model.n_kv_heads", "can't be split"),
    (["model.n_kv_heads=3"], "model.n_kv_heads", "not a multiple"),
    (["cluster.procs_per_node=4", "parallelism.pp=4"], "parallelism.pp", "layers"),
    (["cluster.procs_per_node=3", "parallelism.cp=3"], "train.seq_len", "2 x cp = 6"),
    (["model.dim=120", "model.n_heads=8"], "model.n_heads", "odd"),
    (["model.dim=130"], "model.n_heads", "not divisible"),
    (["model.vocab_size=1000"], "model.vocab_size", "tokenizer's 4,096 ids"),
    (["cluster.nodes=0"], "cluster.nodes", "at least 1"),
    (["cluster.procs_per_node=0"], "cluster.procs_per_node", "at least 1"),
    (["parallelism.tp=2"], "parallelism", "does not divide"),
    (["cluster=local_cpu2", "parallelism=ddp", "train.micro_batch=16"], "train.global_batch", "not divisible"),
])
def test_plan_errors(overrides, key, words):
    err = plan_error(*overrides)
    assert err.key == key, str(err)
    assert words in str(err)


def test_heads_over_tp_fix_lists_divisors():
    err = plan_error("cluster.procs_per_node=3", "parallelism.tp=3")
    assert "[1, 2, 4]" in err.fix


def test_cp_seq_len_fix_works():
    err = plan_error("cluster.procs_per_node=3", "parallelism.cp=3")
    suggested = int(re.search(r"train\.seq_len=(\d+)", err.fix).group(1))
    assert suggested % 6 == 0
    plan = plan_for("cluster.procs_per_node=3", "parallelism.cp=3", f"train.seq_len={suggested}")
    assert plan.degrees["cp"] == 3 and plan.batch.seq_len == suggested


def test_warning_when_tp_spans_nodes():
    plan = plan_for("cluster.nodes=2", "cluster.procs_per_node=2", "parallelism.tp=4")
    assert plan.world_size == 4 and plan.degrees["tp"] == 4
    assert len(plan.warnings) == 1 and "parallelism.tp=4" in plan.warnings[0] and "nodes" in plan.warnings[0]
    # a TP group of 4 on 2+2 processes crosses nodes in the rank table too
    assert {r.node for r in plan.ranks} == {0, 1}


@pytest.mark.parametrize("override", ["model.n_heads=0", "model.n_kv_heads=0"])
def test_zero_heads_is_a_plan_error(override):
    plan_error(override)


def test_token_files_can_be_planned(tmp_path):
    for name in ("train.bin", "val.bin"):
        (tmp_path / name).write_bytes(b"\0\0" * 64)
    plan = plan_for("data=token_files", f"data.train_bin={tmp_path / 'train.bin'}",
                    f"data.val_bin={tmp_path / 'val.bin'}")
    assert plan.model.vocab_size == 50304


# --- engine support --------------------------------------------------------------------------------

PP4 = ["model.tie_embeddings=false", "model.n_layers=4", "cluster.procs_per_node=4", "parallelism.pp=2"]


@pytest.mark.parametrize("overrides,keys", [
    (["parallelism=ddp", "cluster=local_cpu2", "train.micro_batch=8"], []),
    (["cluster.procs_per_node=2", "parallelism.tp=2"], []),
    (["cluster.procs_per_node=2", "parallelism.dp_shard=2", "train.micro_batch=8"], []),
    (PP4 + ["parallelism.tp=2", "train.micro_batch=4"], []),
    (["parallelism.ep=2"], ["parallelism.ep"]),  # dense, and ep ∤ dp_shard 1: one EP rule
    (["model=moe_tiny", "cluster.procs_per_node=2", "parallelism.ep=2", "train.micro_batch=8"],
     ["parallelism.ep"]),  # ep from dp_replicate: no longer (EP ranks are FSDP ranks)
    (["model=moe_tiny", "cluster.procs_per_node=2", "parallelism.dp_shard=2", "parallelism.ep=2",
      "train.micro_batch=8"], []),  # expert-parallel checkpoints: parallel/expert.py global_expert_state
    (["model=moe_tiny", "cluster.procs_per_node=2", "parallelism.tp=2"], []),  # MoE x TP: the MoE runs replicated
    (["model=moe_tiny", "model.tie_embeddings=false", "cluster.procs_per_node=8", "parallelism.dp_shard=2",
      "parallelism.ep=2", "parallelism.tp=2", "parallelism.pp=2", "train.micro_batch=4"], []),
    (PP4 + ["parallelism.cp=2", "train.micro_batch=4"], []),  # context parallelism inside a pipeline
    (["cluster=local_cpu2", "parallelism.dp_shard=2", "parallelism.zero1=true"], ["parallelism.zero1"]),
    (["cluster=local_cpu2", "parallelism=ddp", "parallelism.ddp_comm_hook=bf16"], ["parallelism.ddp_comm_hook"]),
    (["cluster=local_cpu2", "parallelism=ddp", "parallelism.ddp_comm_hook=powersgd"], []),
    (PP4 + ["parallelism.dp_shard=2", "parallelism.dp_replicate=1", "train.micro_batch=2",
            "parallelism.pp_schedule=zbv", "parallelism.pp_virtual_stages=2"], []),  # zero-bubble with ZeRO-3
    (PP4 + ["parallelism.dp_shard=2", "parallelism.dp_replicate=1", "train.micro_batch=2",
            "parallelism.pp_schedule=zbv", "parallelism.pp_virtual_stages=2",
            "parallelism.reshard_after_forward=false"], []),
    (["cluster.nodes=2", "train.micro_batch=8"], ["cluster.node_rank and cluster.rdzv_endpoint"]),
    (["cluster.nodes=2", "train.micro_batch=8", "cluster.node_rank=1", "cluster.rdzv_endpoint=n0:29500"], []),
    (["cluster=local_slurm", "cluster.nodes=2", "cluster.procs_per_node=1", "train.micro_batch=8"], []),
])
def test_engine_support_errors(overrides, keys):
    errors = engine_support_errors(plan_for(*overrides))
    assert [e.key for e in errors] == keys
    assert all(isinstance(e, PlanError) and e.fix for e in errors)


def test_a_slurm_job_without_the_nodes_cpu_count_is_refused():
    """threads per rank would otherwise come from the login node's CPU count."""
    with pytest.raises(PlanError) as err:
        plan_for("cluster.launcher=slurm", "cluster.threads_per_proc=0", "cluster.slurm.cpus_per_task=0")
    assert err.value.key == "cluster.slurm.cpus_per_task" and "cpus_per_task=<CPUs per node>" in err.value.fix
    assert plan_for("cluster.launcher=slurm", "cluster.slurm.cpus_per_task=16").threads_per_proc == 16


# --- plan.yaml -------------------------------------------------------------------------------------

def test_plan_yaml_round_trip_and_atomic_write(tmp_path):
    plan = plan_for("parallelism=ddp", "cluster=local_cpu2", "train.micro_batch=8", "+cluster.env.A=b",
                    runs_dir=tmp_path)
    path = write_plan(plan)
    assert path == Path(plan.run_dir) / "plan.yaml"
    text = path.read_text()
    assert text.startswith("# ")
    loaded = read_plan(path)  # typed both ways: the same RunPlan back
    assert loaded == plan and loaded.to_dict() == plan.to_dict()
    assert yaml.safe_load(text)["batch"]["global_batch_tokens"] == plan.batch.global_batch_tokens
    assert loaded.ranks[1] == RankInfo(rank=1, node=0, local_rank=1,
                                       coords=dict(pp=0, dp_replicate=1, dp_shard=0, cp=0, tp=0))
    assert loaded.config.cluster.env == {"A": "b"}
    write_plan(plan)  # overwrite in place
    assert sorted(p.name for p in path.parent.iterdir()) == ["plan.yaml"]  # no leftover temp files


def test_write_plan_to_explicit_path(tmp_path):
    plan = plan_for(runs_dir=tmp_path / "runs")
    path = write_plan(plan, tmp_path / "deep" / "p.yaml")
    assert path == tmp_path / "deep" / "p.yaml" and read_plan(path).name == "tiny-single"
    assert not (tmp_path / "runs").exists()


def test_failed_write_keeps_previous_file(tmp_path):
    target = tmp_path / "plan.yaml"
    write_text_atomic(target, "# old\nname: a\n")
    with pytest.raises(TypeError):
        write_text_atomic(target, object())  # the write itself fails half way
    assert target.read_text() == "# old\nname: a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]


# --- CLI, real processes ------------------------------------------------------------------------------

def test_cli_plan_prints_rank_table_and_batch(tmp_path):
    out = usp_cli("plan", "parallelism=ddp", "cluster=local_cpu2", "train.micro_batch=8", f"train.runs_dir={tmp_path}",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "run plan: tiny-dp2" in out.stdout
    assert "global 16 seq x 128 = 2,048 tokens/step = micro 8 x grad-accum 1 x dp 2" in out.stdout
    assert "local rank" in out.stdout and "dp_replicate" in out.stdout
    rows = [line for line in out.stdout.splitlines() if re.match(r"^\W*\s+[01]\s+\W\s+0\s+\W\s+[01]\s+\W", line)]
    assert len(rows) == 2, out.stdout  # rank 0 and rank 1, both on node 0
    assert not (tmp_path / "tiny-dp2").exists()  # plan without --save writes nothing


def test_cli_plan_save_writes_plan_yaml(tmp_path):
    runs = tmp_path / "runs"
    out = usp_cli("plan", "--save", f"train.runs_dir={runs}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    path = runs / "tiny-single" / "plan.yaml"
    assert path.is_file() and "plan written to" in out.stdout and str(path) in out.stdout
    saved = read_plan(path)
    assert saved.name == "tiny-single" and saved.model.params == TINY_PARAMS
    assert saved.world_size == 1 and saved.version == PLAN_VERSION
    assert not (tmp_path / "cache").exists()


def test_cli_plan_error_is_one_clear_message(tmp_path):
    out = usp_cli("plan", "cluster.procs_per_node=3", "parallelism.tp=3", cwd=tmp_path)
    assert out.returncode == 2
    assert "model.n_heads" in out.stderr and "fix:" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_cli_zero_heads_no_traceback(tmp_path):
    out = usp_cli("plan", "model.n_heads=0", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_cli_plan_prints_the_pipeline_stage_split(tmp_path):
    out = usp_cli("plan", "cluster.procs_per_node=2", "parallelism.pp=2", "model.tie_embeddings=false",
                  "model.n_layers=4", "parallelism.pp_schedule=zbv", "parallelism.pp_virtual_stages=2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "pipeline: zbv, 4 stages" in out.stdout and "final norm + LM head" in out.stdout
