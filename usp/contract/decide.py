"""The rules behind the engine's choices, each once: the planner calls them (its memory and time
model, and `decisions`, usp/plan/plan.py) and records the outcome in the plan (RunPlan.decisions);
the engine reads that record and never calls these (tests/unit/test_architecture.py). Pure
Python, from plain values: a plan.yaml of the previous format is brought up to date with them
(usp/contract/plan_file.py)."""
from __future__ import annotations

from pathlib import Path

from usp.contract.config_schema import UspConfig
from usp.contract.dims import FSDP_KINDS, data_parallel_kind
from usp.contract.schedule import OptimSettings

COMPILE_CHOICES = ("auto", "true", "false")  # train.compile
ATTENTION_CHOICES = ("sdpa", "flash_attn")  # model.attention (usp/engine/accel.py installs them)


def uses_bf16(dtype: str, device: str) -> bool:
    """train.dtype=auto means bf16 on an accelerator, fp32 on CPU."""
    return dtype == "bf16" or (dtype == "auto" and device != "cpu")


def compile_choice(value) -> str | None:
    """train.compile as one of COMPILE_CHOICES ("auto", "true", "false"), or None for anything else
    (YAML and the command line give booleans; a string works too)."""
    text = str(value).lower()
    return text if text in COMPILE_CHOICES else None


def uses_compile(value, device: str) -> bool:
    """train.compile: per-block torch.compile, or eager. auto is on for CUDA, where it measured faster
    (Llama-3.2 1B on an H200: 49.0 % MFU compiled, 40.8 % eager, docs/benchmarks.md), and off elsewhere:
    on CPU inductor's C++ build costs more than a short run gains, XPU was never measured."""
    choice = compile_choice(value)
    return choice == "true" or (choice == "auto" and device == "cuda")


def compiles_loss(compiled: bool, tp: int) -> bool:
    """The loss is compiled with the blocks, unless TP shards the vocabulary (loss_parallel's cross
    entropy runs on DTensors eagerly; usp/engine/loss.py)."""
    return compiled and tp == 1


def autocast_weight_cache(recompute: str) -> bool:
    """Does the trainer's autocast keep its cache of bf16 weight copies (each weight cast once per
    forward, the copy held until the context exits)? Only without recompute: a recomputed layer
    casts again anyway, and a cache would hold every layer's copy through the loss (a pipeline's
    context: the whole step). Without recompute each linear saves its copy for backward anyway,
    and a pipeline's in-flight micro batches share the cached one."""
    return recompute == "none"


def uses_deterministic(configured: bool | None, device: str) -> bool:
    """train.deterministic, or by default: on for CPU (exact parity, resume), off on an accelerator
    (its deterministic kernels are slower). The engine sets the flag, the launcher its environment."""
    return device == "cpu" if configured is None else bool(configured)


def bf16_by_fsdp_policy(dp_kind: str, pp: int, ep: int) -> bool:
    """Under bf16, does FSDP2's MixedPrecisionPolicy compute in bf16 (parameters gathered in bf16,
    gradients reduced in fp32) rather than the trainer's autocast? FSDP/HSDP layouts without pipeline
    or expert parallelism, as torchtitan: stage boundaries and expert all-to-alls expect the fp32
    parameters' dtype."""
    return dp_kind in FSDP_KINDS and pp == 1 and ep == 1


def padded_vocab(vocab: int, tp: int) -> int:
    """The embedding's (and LM head's) rows: the vocabulary rounded up to a multiple of tp, so TP's
    vocabulary shards are even; the padded rows are masked out of the loss."""
    return -(-vocab // tp) * tp


def engine_choices(config: UspConfig, degrees: dict[str, int], device: str, vocab: int, run_dir: str) -> dict:
    """What the engine does with a resolved config on `degrees` and `device`, the vocabulary `vocab`, in
    `run_dir`: RunPlan.decisions' fields (usp/contract/run_plan.py)."""
    train, model = config.train, config.model
    kind = data_parallel_kind(degrees, bool(config.parallelism.zero1))
    bf16 = uses_bf16(str(train.dtype), device)
    by_fsdp = bf16 and bf16_by_fsdp_policy(kind, int(degrees["pp"]), int(config.parallelism.ep))
    compiled = uses_compile(train.compile, device)
    recompute = str(train.recompute)
    return {"dp_kind": kind, "bf16": bf16, "fsdp_mixed_precision": by_fsdp, "autocast": bf16 and not by_fsdp,
            "autocast_weight_cache": autocast_weight_cache(recompute), "compile": compiled,
            "compiled_loss": compiles_loss(compiled, int(degrees["tp"])), "fp8": str(train.fp8),
            "deterministic": uses_deterministic(train.deterministic, device), "recompute": recompute,
            "attention": str(model.attention), "moe": int(model.n_experts) > 0,
            "embedding_rows": padded_vocab(int(vocab), int(degrees["tp"])),
            "optimizer": OptimSettings.from_config(config.optimizer, config.train.steps),
            "checkpoint_dir": str(Path(config.checkpoint.dir or Path(run_dir) / "checkpoints").expanduser()),
            "tokenizer": str(config.data.tokenizer)}


def fault_tolerance_plan(config: UspConfig, degrees: dict[str, int], nodes: int, procs_per_node: int) -> dict | None:
    """RunPlan.fault_tolerance's fields (None for fault_tolerance=none): the dp_replicate ranks become
    replica groups, each a job of its own with the rest of the layout (the rules have checked that the
    groups fill whole nodes, or share one node evenly)."""
    ft = config.fault_tolerance
    if str(ft.kind) != "torchft":
        return None
    groups = int(degrees["dp_replicate"])
    group = {**degrees, "dp_replicate": 1}
    group_world = nodes * procs_per_node // groups
    group_nodes = nodes // groups if nodes >= groups else 1
    return {"kind": "torchft", "replica_groups": groups, "min_replicas": int(ft.min_replicas),
            "group_world_size": group_world, "group_nodes": group_nodes,
            "group_procs_per_node": group_world // group_nodes, "group_degrees": group,
            "group_dp_kind": data_parallel_kind(group, bool(config.parallelism.zero1)),
            "timeout_s": int(ft.timeout_s), "heartbeat_timeout_s": float(ft.heartbeat_timeout_s),
            "quorum_timeout_s": int(ft.quorum_timeout_s), "join_timeout_s": float(ft.join_timeout_s),
            "start_timeout_s": int(ft.start_timeout_s), "max_group_restarts": int(ft.max_group_restarts),
            "lighthouse_port": int(ft.lighthouse_port)}
