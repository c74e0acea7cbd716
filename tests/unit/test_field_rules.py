"""Every schema field's values are checked at plan time (issue 31, item 3): a rule per field that can be
wrong (usp/plan/rules.py FIELD_RULES, and the layout rules), choices typed as Enums where the schema owns
them, and a registry for the rest (checked elsewhere before launch, or free). Torch-free; the engine's
second line: tests/engine/test_messages.py."""
from __future__ import annotations

import importlib

import pytest
import yaml

from tests.helpers import plan_for, usp_cli
from usp.config.compose import compose_config
from usp.config.schema import schema_keys
from usp.errors import ConfigError, PlanError
from usp.plan import rules
from usp.plan.plan import plan_with_failures

pytestmark = pytest.mark.usefixtures("fresh_cache")  # planning computes the dataset's path from it


def test_every_schema_field_has_a_rule_or_is_marked_free():
    checks = rules.field_checks()
    assert set(checks) == set(schema_keys()) and len(checks) > 150
    unchecked = [key for key, how in checks.items() if not how]
    assert unchecked == [], f"add a rule (usp/plan/rules.py FIELD_RULES) or a FREE_FIELDS entry for {unchecked}"
    for key, where in rules.CHECKED_ELSEWHERE.items():  # the registry names real keys and real functions
        module, _, name = where.rpartition(".")
        assert key in checks and callable(getattr(importlib.import_module(module), name)), (key, where)
    assert set(rules.FREE_FIELDS) <= set(checks)
    assert not set(rules.FREE_FIELDS) & set(rules.CHECKED_ELSEWHERE)
    names = [r.name for r in rules.FIELD_RULES]
    assert len(names) == len(set(names))


def _errors(*overrides: str) -> list[PlanError]:
    cfg, choices = compose_config(None, list(overrides))
    plan, errors = plan_with_failures(cfg, choices)
    assert plan is None
    return errors


BAD = [  # (overrides, the key named, words of the message); the issue's examples first
    (["train.seed=-1"], "train.seed", "at least 0"),
    (["cluster.threads_per_proc=-1"], "cluster.threads_per_proc", "at least 0"),
    (["checkpoint.resume=/no/such/step_3"], "checkpoint.resume", "no such checkpoint directory"),
    (["model=moe_tiny", "model.top_k=9"], "model.top_k", "more experts than model.n_experts=4"),
    (["model.family=gpt2"], "model.family", "unknown model family"),
    (["model.vocab_size=0"], "model.vocab_size", "-1 (take it from the tokenizer)"),
    (["model.norm_eps=0"], "model.norm_eps", "> 0"),
    (["parallelism.ddp_bucket_mb=0"], "parallelism.ddp_bucket_mb", "at least 1"),
    (["cluster.backend=nccl"], "cluster.backend", "nccl runs on cuda devices"),
    (["cluster.backend=smoke_signals"], "cluster.backend", "unknown backend"),
    (["cluster.device_memory_gb=-1"], "cluster.device_memory_gb", "> 0"),
    (["cluster.timing.gemm_efficiency=2"], "cluster.timing.gemm_efficiency", "in (0, 1]"),
    (["cluster.timing.inter_latency_us=-1"], "cluster.timing.inter_latency_us", ">= 0"),
    (["cluster.timing.all_reduce=star"], "cluster.timing.all_reduce", "unknown all-reduce algorithm"),
    (["cluster.hbm_gbps=0"], "cluster.hbm_gbps", "> 0"),
    (["cluster.timeout_s=0"], "cluster.timeout_s", "at least 1"),
    (["cluster=local_slurm", "cluster.slurm.time=tomorrow"], "cluster.slurm.time", "not a Slurm time limit"),
    (["cluster=local_slurm", "cluster.slurm.rdzv_port=70000"], "cluster.slurm.rdzv_port", "not a TCP port"),
    (["data.val_fraction=1.5"], "data.val_fraction", "in (0, 1)"),
    (["data.source=ftp"], "data.source", "unknown data source"),
    (["data.vocab_size=100"], "data.vocab_size", "more than the 256 byte tokens"),
    (["data.workers=-2"], "data.workers", "at least 0"),
    (["data.text_check=lenient"], "data.text_check", "unknown text check"),
    (["model=moe_tiny", "model.router_bias_update_rate=-0.1"], "model.router_bias_update_rate", ">= 0"),
    (["train.eval_batches=0"], "train.eval_batches", "at least 1"),
    (["train.log_interval=0"], "train.log_interval", "at least 1"),
    (["train.sample_prompt=''"], "train.sample_prompt", "needs at least one character"),
    (["train.tokens=-5"], "train.tokens", "> 0"),
    (["train.hang_timeout_s=-1"], "train.hang_timeout_s", ">= 0 (seconds without step progress; 0 = off"),
    (["train.hang_factor=1"], "train.hang_factor", "> 1 (the hang window in predicted step times"),
    (["train.hang_timeout_s=400"], "train.hang_timeout_s", "more than half of the collective timeout "
                                                           "cluster.timeout_s=600"),
    (["checkpoint.keep_last=-1"], "checkpoint.keep_last", "at least 0"),
    (["logging.wandb_init_timeout_s=0"], "logging.wandb_init_timeout_s", "> 0"),
]


@pytest.mark.parametrize("overrides,key,words", BAD)
def test_a_bad_value_is_refused_naming_key_value_and_fix(overrides, key, words):
    errors = _errors(*overrides)
    assert errors[0].key == key and words in str(errors[0]), str(errors[0])
    assert errors[0].fix and "=" in errors[0].fix  # a fix the user can type
    assert errors[0].value == yaml.safe_load(overrides[-1].split("=", 1)[1].replace("''", '""')) \
        or key == "model.vocab_size" and errors[0].value == 0


def test_every_failing_value_is_listed_and_good_ones_plan():
    errors = _errors("train.seed=-1", "cluster.threads_per_proc=-1", "checkpoint.resume=/nowhere")
    assert [e.key for e in errors] == ["cluster.threads_per_proc", "train.seed", "checkpoint.resume"]
    for ok in (["train.seed=0"], ["cluster.threads_per_proc=1"], ["checkpoint.resume=never"],
               ["checkpoint.enabled=false", "checkpoint.resume=/nowhere"], ["model=moe_tiny", "model.top_k=4"]):
        assert plan_for(*ok).world_size == 1, ok


def test_a_resumed_checkpoint_must_be_a_complete_one(tmp_path):
    step = tmp_path / "checkpoints" / "step_4"
    step.mkdir(parents=True)
    assert "not a complete checkpoint: no manifest.json" in str(_errors(f"checkpoint.resume={step}")[0])
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert "not a checkpoint directory" in str(_errors(f"checkpoint.resume={other}")[0])


@pytest.mark.parametrize("override,choices", [
    ("train.nan_policy=ignore", "stop, skip"), ("checkpoint.async_mode=maybe", "none, async"),
    ("logging.console=loud", "auto, rich, plain, quiet"), ("cluster.launcher=pbs", "local, slurm"),
    ("parallelism.ddp_comm_hook=int8", "none, bf16, fp16, powersgd"),
    ("cluster.slurm.gpu_request=all", "gpus_per_node, gres, none"), ("logging.wandb_mode=maybe", "offline"),
])
def test_a_choice_outside_its_enum_is_refused_when_composing(override, choices):
    with pytest.raises(ConfigError) as err:
        compose_config(None, [override])
    key, value = override.split("=")
    assert err.value.key == key and err.value.value == value and choices in str(err.value), str(err.value)
    assert err.value.fix.startswith(f"{key}=")


def test_enum_values_reach_plan_yaml_as_strings():
    plan = plan_for("train.nan_policy=skip", "checkpoint.async_mode=async", "logging.console=plain")
    text = yaml.safe_dump(plan.to_dict())  # plan.yaml holds plain strings: safe_dump refuses an Enum
    assert "nan_policy: skip" in text and "async_mode: async" in text
    assert type(plan.to_dict()["config"]["train"]["nan_policy"]) is str
    assert plan.config.train.nan_policy == "skip"  # typed (a StrEnum) in the RunPlan, equal to its string


def test_a_plain_dict_is_checked_too_enum_values_included():
    """A partial dict (the Slurm settings a saved plan holds, usp/launch/slurm_script.py) checks only
    what it holds."""
    found = rules.field_failures({"train": {"nan_policy": "ignore", "seed": -3}, "checkpoint": {"async_mode": "x"}})
    assert [(e.key, e.value) for e in found] == [("train.seed", -3), ("train.nan_policy", "ignore"),
                                                 ("checkpoint.async_mode", "x")]
    assert rules.field_failures({"train": {"seed": 7}}) == []


def test_usp_plan_lists_the_issues_examples_without_a_traceback(tmp_path):
    r = usp_cli("plan", "train.seed=-1", "cluster.threads_per_proc=-1", "checkpoint.resume=/nowhere/step_1",
                cwd=tmp_path, columns=250)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    for says in ("train.seed=-1: must be at least 0", "cluster.threads_per_proc=-1: must be at least 0",
                 "checkpoint.resume='/nowhere/step_1': no such checkpoint directory"):
        assert says in r.stderr, r.stderr
    assert r.stderr.count("fix:") == 3
    for override in ("train.nan_policy=ignore", "checkpoint.async_mode=maybe"):
        r = usp_cli("plan", override, cwd=tmp_path, columns=250)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "fix:" in r.stderr, r.stderr
