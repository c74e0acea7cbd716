"""The parallelism presets (conf/parallelism/) and the large-model recipes (recipes/): each composes,
plans through the same rules `usp train` asks (checked_plan: no refusal of either kind) with the
degrees and data-parallel flavour its comment promises, and the recipes dry-run submit to Slurm."""
from __future__ import annotations

import re

import pytest

from tests.helpers import usp_cli
from usp.config.compose import compose_config
from usp.config.paths import group_options, recipe_names
from usp.contract.dims import data_parallel_kind
from usp.plan.plan import checked_plan

# preset -> (the model and nodes of 8 x H100 it is checked on, the degrees it must produce, its DP flavour)
H100 = ["cluster=slurm_h100", "train.seq_len=4096", "train.global_batch=256", "train.micro_batch=1",
        "train.recompute=full"]
PRESETS = {
    "ddp": ("llama3_2_1b", 2, {"dp_replicate": 16}, "ddp"),
    "zero1": ("llama3_2_1b", 2, {"dp_replicate": 16}, "zero1"),
    "fsdp": ("llama3_1_8b", 2, {"dp_shard": 16}, "fsdp"),
    "hsdp": ("llama3_1_8b", 2, {"dp_replicate": 2, "dp_shard": 8}, "hsdp"),
    "tp_sp": ("llama3_1_8b", 2, {"dp_replicate": 2, "tp": 8}, "replicate"),
    "3d": ("llama3_1_70b", 8, {"dp_shard": 2, "tp": 8, "pp": 4}, "fsdp"),
    "dp_tp_pp_zero1": ("llama3_1_70b", 8, {"dp_replicate": 2, "tp": 8, "pp": 4}, "zero1_fsdp"),
}
RECIPES = {"llama3_1_8b": 4, "llama3_1_70b": 8, "llama3_1_405b": 64, "mixtral_8x7b": 8, "qwen3_8b": 4,
           "qwen3_30b_a3b": 8, "qwen3_235b_a22b": 32}


def test_every_preset_is_checked_here():
    assert sorted(group_options("parallelism")) == sorted(PRESETS)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_plans_with_its_layout(preset):
    model, nodes, degrees, kind = PRESETS[preset]
    cfg, choices = compose_config(None, [f"parallelism={preset}", f"model={model}", f"cluster.nodes={nodes}", *H100])
    plan = checked_plan(cfg, choices)
    expected = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, **degrees}
    assert plan.degrees == expected
    assert data_parallel_kind(plan.degrees, bool(cfg.parallelism.zero1)) == kind
    assert bool(cfg.parallelism.zero1) == ("zero1" in preset)


def test_node_sized_presets_follow_the_cluster():
    """tp / dp_shard = cluster.procs_per_node: the group stays on one node's fast link."""
    cfg, _ = compose_config(None, ["parallelism=tp_sp", "cluster=local_cpu2"])
    assert cfg.parallelism.tp == 2
    cfg, _ = compose_config(None, ["parallelism=hsdp", "cluster=slurm_h100", "cluster.procs_per_node=4"])
    assert cfg.parallelism.dp_shard == 4


def test_every_large_recipe_is_checked_here():
    assert set(RECIPES) <= set(recipe_names())


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_plans_and_dry_run_submits(recipe, tmp_path):
    cfg, choices = compose_config(recipe, [])
    plan = checked_plan(cfg, choices)  # fits in memory, and no rule of either kind refuses it
    assert plan.nodes == RECIPES[recipe] and plan.device == "cuda" and cfg.cluster.launcher == "slurm"
    assert plan.batch.seq_len >= 4096
    r = usp_cli("submit", "--dry-run", f"conf={recipe}", f"train.runs_dir={tmp_path}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    script = (tmp_path / recipe / "job.sbatch").read_text()
    assert re.search(rf"^#SBATCH --nodes={RECIPES[recipe]}$", script, re.M), script[:800]
    # every recipe checkpoints (Mixtral's expert-parallel run included: experts saved whole)
    assert plan.config.checkpoint.enabled and re.search(r"checkpoints\s*│ every \d+ steps", r.stdout), r.stdout
