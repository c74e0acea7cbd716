"""The rule table (usp/plan/rules.py) and its three callers: build_plan / checked_plan, `usp plan`
(every failure listed) and the layout search (never proposes what `usp train` refuses; for every catalogue
model: tests/e2e/test_rules.py). Torch-free."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import usp_cli
from usp.config.compose import compose_config
from usp.errors import PlanError
from usp.plan import rules
from usp.plan.plan import build_plan, checked_plan, engine_support_errors, plan_with_failures
from usp.plan.search import search_config

REPO = Path(__file__).resolve().parents[2]
MODELS = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
# a cluster each catalogue model fits on (the search finds at least one layout)
CLUSTERS = {
    "tiny": ["cluster=local_cpu", "cluster.procs_per_node=4"],
    "moe_tiny": ["cluster=local_cpu", "cluster.procs_per_node=4"],
    "llama3_2_1b": ["cluster=slurm_h100"],
    "llama3_2_3b": ["cluster=slurm_h100"],
    "llama3_1_8b": ["cluster=slurm_h100", "cluster.nodes=2"],
    "llama3_1_70b": ["cluster=slurm_h100", "cluster.nodes=8"],
    "llama3_1_405b": ["cluster=slurm_h100", "cluster.nodes=32", "train.global_batch=64"],
    "mixtral_8x7b": ["cluster=slurm_h100", "cluster.nodes=8"],
    "qwen3_0_6b": ["cluster=slurm_h100"],
    "qwen3_8b": ["cluster=slurm_h100", "cluster.nodes=2"],
    "qwen3_30b_a3b": ["cluster=slurm_h100", "cluster.nodes=4"],
    "qwen3_235b_a22b": ["cluster=slurm_h100", "cluster.nodes=32", "train.global_batch=64"],
    "deepseek_v3_tiny": ["cluster=local_cpu", "cluster.procs_per_node=4"],
    "deepseek_v3_671b": ["cluster=slurm_h100", "cluster.nodes=64", "train.global_batch=128"],
}


pytestmark = pytest.mark.usefixtures("fresh_cache")  # planning computes the dataset's path from it


def test_every_catalogue_model_has_a_cluster():
    assert set(MODELS) == set(CLUSTERS) and "moe_tiny" in MODELS


def test_moe_search_proposes_expert_parallel_only_as_the_engine_runs_it():
    cfg, _ = compose_config(None, ["model=moe_tiny", "cluster=local_cpu", "cluster.procs_per_node=4",
                                   "checkpoint.enabled=false"])
    top = search_config(cfg, top_k=50).top
    assert any(c.layout.ep > 1 for c in top)
    # EP ranks are sharded data-parallel ranks (dp_shard x cp), as torchtitan
    assert all((c.layout.dp_shard * c.layout.cp) % c.layout.ep == 0 for c in top if c.layout.ep > 1)


def test_the_table_is_well_formed():
    names = [r.name for r in rules.RULES]
    assert len(names) == len(set(names)) and {r.kind for r in rules.RULES} == set(rules.KINDS)
    assert all((r.broken is None) != (r.check is None) for r in rules.RULES)
    assert sum("expert" in r.name for r in rules.RULES) == 1  # one EP rule, to change in one place


def _plan(*overrides):
    cfg, choices = compose_config(None, list(overrides))
    return plan_with_failures(cfg, choices)


def test_plan_lists_every_failure_plan_and_engine_kinds():
    # seq_len 102 doesn't split into 2 x cp = 4 chunks; 0 virtual stages; ep not within dp_shard x cp (engine kind)
    plan, errors = _plan("cluster.procs_per_node=4", "parallelism.tp=2", "parallelism.cp=2", "train.seq_len=102",
                         "parallelism.pp_virtual_stages=0", "model.n_experts=4", "parallelism.ep=4")
    assert plan is None
    assert [e.key for e in errors] == ["train.seq_len", "parallelism.pp_virtual_stages", "parallelism.ep"]
    plan, errors = _plan("cluster.procs_per_node=4", "parallelism.tp=3")  # a degree error: before the rules
    assert plan is None and [e.key for e in errors] == ["parallelism"]


def test_zero1_composes_with_tp_and_pp_not_with_fsdp():
    for extra in (["parallelism.tp=2"], ["parallelism.pp=2", "model.tie_embeddings=false"]):
        plan, errors = _plan("cluster.procs_per_node=4", "parallelism.dp_replicate=2", "parallelism.zero1=true", *extra)
        assert plan is not None and errors == [], extra
        assert plan.memory.dp_kind == "zero1_fsdp" and plan.memory.zero_stage == 2 and plan.memory.shard_degree == 2
    plan, errors = _plan("cluster.procs_per_node=4", "parallelism.dp_shard=2", "parallelism.zero1=true")
    assert [e.key for e in errors] == ["parallelism.zero1"]


def test_plan_builds_and_lists_engine_failures():
    plan, errors = _plan("model=moe_tiny", "cluster.procs_per_node=4", "parallelism.ep=2", "parallelism.tp=2")
    assert plan is not None  # ep=2 needs dp_shard x cp >= 2; dp_replicate=2 doesn't count
    assert [e.key for e in errors] == ["parallelism.ep"]
    assert "parallelism.dp_shard=2 parallelism.dp_replicate=1" in errors[0].fix
    assert [str(e) for e in errors] == [str(e) for e in engine_support_errors(plan)]
    cfg, choices = compose_config(None, ["model=moe_tiny", "cluster.procs_per_node=4", "parallelism.ep=2",
                                         "parallelism.tp=2"])
    with pytest.raises(PlanError) as err:
        checked_plan(cfg, choices)
    assert err.value.key == "parallelism.ep"
    assert build_plan(cfg, choices).degrees["tp"] == 2  # the plan itself is fine (estimates)


def test_usp_plan_cli_lists_all_failures(tmp_path):
    r = usp_cli("plan", "cluster.procs_per_node=3", "parallelism.tp=3", "model.n_experts=4", "parallelism.ep=2",
                cwd=tmp_path, columns=250)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "model.n_heads=4: 4 heads can't be split over parallelism.tp=3" in r.stderr
    assert "parallelism.ep=2: expert parallelism takes its ranks from the sharded data-parallel ranks" in r.stderr
    assert r.stderr.count("fix:") == 2 and "Traceback" not in r.stderr
    r = usp_cli("plan", "model=moe_tiny", "cluster.procs_per_node=4", "parallelism.ep=2", "parallelism.tp=2",
                cwd=tmp_path, columns=250)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("usp train would refuse:") == 1 and "memory per device" in r.stdout


def test_no_import_cycles_in_usp_plan():
    """Between the files of usp/plan, function-level (lazy) imports included."""
    mods = {f"usp.plan.{p.stem}": p for p in (REPO / "usp" / "plan").glob("*.py")}
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "usp.plan":
                graph[m] |= {f"usp.plan.{a.name}" for a in node.names} & mods.keys()
            elif isinstance(node, ast.ImportFrom) and node.module in mods:
                graph[m].add(node.module)
            elif isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names} & mods.keys()
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in graph[m]:
            assert state.get(n) != 1, f"import cycle: {' -> '.join([*path, n])}"
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_moe_with_tp_plans_with_a_warning_not_a_refusal():
    """MoE x TP trains (MoE layers replicated over tp, no expert TP): a warning names the cost."""
    plan, errors = _plan("model=moe_tiny", "cluster.procs_per_node=4", "parallelism.dp_shard=2", "parallelism.ep=2",
                         "parallelism.tp=2", "checkpoint.enabled=false")
    assert plan is not None and errors == []
    assert any("parallelism.tp=2: MoE layers are not tensor-parallel" in w for w in plan.warnings)


def test_rope_types_other_than_default_llama3_and_yarn_are_refused_by_name():
    """model.rope_type: default, llama3 and yarn plan; the others transformers knows are refused by name;
    llama3 needs its four values, yarn its factor and original context, each value checked (yarn's optional
    ones when set); a scaling value the type doesn't read is a warning naming the type that does."""
    for rope_type in ("linear", "dynamic", "longrope"):
        plan, errors = _plan(f"model.rope_type={rope_type}", "model.rope_factor=4")
        assert plan is None and errors[0].key == "model.rope_type" and errors[0].value == rope_type
        assert "default, llama3, yarn" in str(errors[0]) and "model.rope_type=default" in errors[0].fix
    llama3 = ["model.rope_type=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=1",
              "model.rope_high_freq_factor=4", "model.rope_original_max_positions=8192"]
    plan, errors = _plan(*llama3)
    assert plan is not None and errors == [] and plan.config.model.rope_type == "llama3"
    for bad, key in [("model.rope_factor=null", "model.rope_factor"), ("model.rope_factor=0.5", "model.rope_factor"),
                     ("model.rope_low_freq_factor=0", "model.rope_low_freq_factor"),
                     ("model.rope_high_freq_factor=1", "model.rope_high_freq_factor"),
                     ("model.rope_original_max_positions=null", "model.rope_original_max_positions")]:
        plan, errors = _plan(*llama3, bad)
        assert plan is None and [e.key for e in errors] == [key], (bad, errors)
    yarn = ["model.rope_type=yarn", "model.rope_factor=40", "model.rope_original_max_positions=4096"]
    plan, errors = _plan(*yarn, "model.rope_mscale=1", "model.rope_mscale_all_dim=1")
    assert plan is not None and errors == [] and plan.config.model.rope_mscale_all_dim == 1.0
    for bad, key in [("model.rope_factor=null", "model.rope_factor"), ("model.rope_factor=0.5", "model.rope_factor"),
                     ("model.rope_original_max_positions=null", "model.rope_original_max_positions"),
                     ("model.rope_beta_fast=0", "model.rope_beta_fast"),
                     ("model.rope_beta_slow=64", "model.rope_beta_slow"),
                     ("model.rope_mscale=-1", "model.rope_mscale"),
                     ("model.rope_mscale_all_dim=-0.5", "model.rope_mscale_all_dim"),
                     ("model.rope_attention_factor=0", "model.rope_attention_factor")]:
        plan, errors = _plan(*yarn, bad)
        assert plan is None and [e.key for e in errors] == [key], (bad, errors)
        assert "model.rope_type=yarn needs" in str(errors[0]) and errors[0].fix.startswith(key + "="), errors[0]
    plan, errors = _plan("model.rope_factor=8")
    assert plan is not None and errors == []
    assert any(w.startswith("model.rope_factor=8.0: model.rope_type=default") for w in plan.warnings), plan.warnings
    plan, errors = _plan(*yarn, "model.rope_low_freq_factor=1")
    assert plan is not None and errors == []
    assert any(w.startswith("model.rope_low_freq_factor=1.0: model.rope_type=yarn doesn't read it")
               for w in plan.warnings), plan.warnings


def test_head_dim_is_an_option_with_its_own_rule():
    """model.head_dim: null (dim / n_heads) or a positive even number, refused naming the key and the fix;
    set, model.dim need not divide by model.n_heads (Qwen3's heads are 128 wide whatever dim / heads is)."""
    for value in (7, 0, -2):
        plan, errors = _plan(f"model.head_dim={value}")
        assert plan is None and [e.key for e in errors] == ["model.head_dim"], (value, errors)
        assert "model.head_dim=null" in errors[0].fix and "even" in str(errors[0])
    plan, errors = _plan("model.dim=120", "model.n_heads=7", "model.n_kv_heads=1")  # 120 / 7: no head width
    assert plan is None and [e.key for e in errors] == ["model.n_heads"] and "model.head_dim" in errors[0].fix
    plan, errors = _plan("model.dim=120", "model.n_heads=7", "model.n_kv_heads=1", "model.head_dim=32",
                         "model.qk_norm=true")
    assert plan is not None and errors == [], errors
    attention = 2 * 120 * 7 * 32 + 2 * 120 * 1 * 32  # wq, wo: dim x n_heads x head_dim; wk, wv: dim x kv x head_dim
    assert plan.model.params == plan.model.vocab_size * 120 + 2 * (attention + 3 * 120 * 384 + 2 * 120 + 2 * 32) + 120


@pytest.mark.parametrize("split", ["cp", "pp"])
def test_multi_token_prediction_is_refused_where_the_sequence_or_the_model_is_split(split):
    """model.mtp_depth=1 needs each rank's whole sequence and the embedding with the head: under cp or pp it is
    refused naming that degree; over data, tensor and expert parallelism it plans."""
    base = ["model=deepseek_v3_tiny", "model.mtp_depth=1", "cluster=local_cpu", "cluster.procs_per_node=2",
            "parallelism.dp_replicate=1"]
    _, errors = _plan(*base, f"parallelism.{split}=2")  # an engine rule: the plan is made, and refused
    assert [e.key for e in errors] == [f"parallelism.{split}"], errors
    assert "model.mtp_depth=0" in str(errors[0])
    plan, errors = _plan(*base, "parallelism.dp_shard=2", "parallelism.ep=2")
    assert plan is not None and errors == [], errors
    plan, errors = _plan(*base, "parallelism.tp=2")
    assert plan is not None and errors == [], errors
    _, errors = _plan(*base, "parallelism.dp_shard=2", "model.mtp_depth=2")
    assert [e.key for e in errors] == ["model.mtp_depth"], errors
