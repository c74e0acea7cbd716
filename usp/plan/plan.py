"""RunPlan: everything that can be known before a device is touched, derived once from the
composed config. Written to <run_dir>/plan.yaml, the only file the engine reads."""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from usp.errors import PlanError
from usp.plan.batch import BatchPlan
from usp.plan.layout import MESH_DIMS, RankInfo, data_parallel_kind, layout_tag, rank_table, resolve_degrees
from usp.plan.pipeline_plan import plan_pipeline
from usp.plan.specs import ATTENTION_CHOICES

if TYPE_CHECKING:
    from usp.plan.memory import MemoryPlan
    from usp.plan.timing import TimingPlan

PLAN_VERSION = 1


@dataclass
class ModelPlan:
    name: str
    params: int
    vocab_size: int
    flops_per_token: float  # training FLOPs per token: 6N + 12 L h s (see usp/plan/model_math.py)
    flops_per_step: float


@dataclass
class RunPlan:
    name: str
    run_dir: str
    world_size: int
    nodes: int
    procs_per_node: int
    device: str
    backend: str
    threads_per_proc: int
    degrees: dict[str, int]
    mesh_dims: list[str]
    mesh_shape: list[int]
    batch: BatchPlan
    model: ModelPlan
    dataset_dir: str
    ranks: list[RankInfo]
    choices: dict[str, str | None]
    config: dict  # the resolved config this plan was derived from
    warnings: list[str] = field(default_factory=list)
    data_meta: dict = field(default_factory=dict)  # filled in once the dataset is prepared
    pipeline: dict | None = None  # stage split and schedule when parallelism.pp > 1
    memory: MemoryPlan | None = None  # predicted memory per rank and stage (usp/plan/memory.py)
    timing: TimingPlan | None = None  # predicted step time, tokens/s, MFU (usp/plan/timing.py)
    version: int = PLAN_VERSION

    def to_dict(self) -> dict:
        out = asdict(self)
        out["batch"]["global_batch_tokens"] = self.batch.global_batch_tokens
        return out


LAUNCHERS = ("local", "slurm")


def build_plan(cfg, choices: dict | None = None, cpu_count: int | None = None, *, force: bool = False,
               strict: bool = False, training: bool = True) -> RunPlan:
    """Derive the run plan from a composed config (DictConfig or an object with the same fields).
    force: a predicted OOM is a warning, not an error. strict: a TP group across nodes is an error.
    training=False (`usp plan`, `usp estimate`): limits of the data pipeline are warnings."""
    from omegaconf import OmegaConf

    from usp.data.prepare import dataset_dir
    from usp.plan.model_math import count_params_cfg, flops_per_token_cfg
    from usp.plan.validate import analyse, derive_batch

    cluster, train, model = cfg.cluster, cfg.train, cfg.model
    nodes, per_node = int(cluster.nodes), int(cluster.procs_per_node)
    for key, value in (("cluster.nodes", nodes), ("cluster.procs_per_node", per_node)):
        if value < 1:
            raise PlanError("must be at least 1", key=key, value=value, fix=f"{key}=1")
    if cluster.launcher not in LAUNCHERS:
        raise PlanError(f"unknown launcher; choose one of {', '.join(LAUNCHERS)}", key="cluster.launcher",
                        value=cluster.launcher, fix="cluster.launcher=local, or cluster=local_slurm")
    world = nodes * per_node
    degrees = resolve_degrees(cfg.parallelism, world)
    batch = derive_batch(train, degrees)

    data_vocab = _data_vocab(cfg.data)
    vocab = int(model.vocab_size) if int(model.vocab_size) > 0 else data_vocab
    shape = SimpleNamespace(**{**{k: model[k] for k in model}, "vocab_size": vocab})
    if training and data_vocab > 65535:  # token ids come from the data's tokenizer
        raise PlanError("token files are uint16: the tokenizer's vocabulary must be below 65536",
                        key="data.vocab_size", value=data_vocab, fix="data.vocab_size=32000 (or less)")
    _check_model(shape, degrees, batch, training)
    per_token = float(flops_per_token_cfg(shape, batch.seq_len))
    pipeline = plan_pipeline(cfg.parallelism, shape, degrees, batch.grad_accum)

    threads = _threads_per_proc(cluster, per_node, cpu_count)
    name = train.name or f"{model.name}-{layout_tag(degrees)}"
    run_dir = Path(train.runs_dir).expanduser().resolve() / name
    plan = RunPlan(
        name=name, run_dir=str(run_dir), world_size=world, nodes=nodes, procs_per_node=per_node,
        device=cluster.device, backend=_backend(cluster), threads_per_proc=threads,
        degrees=degrees, mesh_dims=list(MESH_DIMS), mesh_shape=[degrees[d] for d in MESH_DIMS],
        batch=batch,
        model=ModelPlan(model.name, count_params_cfg(shape), vocab, per_token, per_token * batch.global_batch_tokens),
        dataset_dir=str(dataset_dir(cfg.data)), ranks=rank_table(degrees, per_node),
        choices=dict(choices or {}), config=OmegaConf.to_container(cfg, resolve=True),
        warnings=_warnings(cfg, degrees, batch), pipeline=pipeline,
    )
    analyse(plan, cfg, force=force, strict=strict, training=training)
    return plan


def _data_vocab(data) -> int:
    return 256 if data.tokenizer == "bytes" and data.source != "token_files" else int(data.vocab_size)


def _backend(cluster) -> str:
    if cluster.backend != "auto":
        return cluster.backend
    return {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}.get(cluster.device, "gloo")


def _check_model(m, degrees: dict[str, int], batch: BatchPlan, training: bool = True) -> None:
    for key in ("dim", "n_layers", "n_heads", "ffn_dim"):
        if int(getattr(m, key)) < 1:
            raise PlanError("must be at least 1", key=f"model.{key}", value=getattr(m, key),
                            fix=f"model.{key}=<a positive integer>")
    if m.n_kv_heads is not None and m.n_kv_heads < 1:
        raise PlanError("must be at least 1, or null for as many as model.n_heads", key="model.n_kv_heads",
                        value=m.n_kv_heads, fix="model.n_kv_heads=null")
    kv = m.n_kv_heads or m.n_heads
    if m.dim % m.n_heads:
        raise PlanError(f"model.dim={m.dim} is not divisible by the number of heads", key="model.n_heads",
                        value=m.n_heads, fix="pick n_heads that divides model.dim")
    if m.n_heads % kv:
        raise PlanError(f"model.n_heads={m.n_heads} is not a multiple of the KV heads", key="model.n_kv_heads",
                        value=kv, fix="n_kv_heads must divide n_heads")
    if (m.dim // m.n_heads) % 2:
        raise PlanError(f"head dim {m.dim // m.n_heads} is odd; RoPE rotates pairs of channels",
                        key="model.n_heads", value=m.n_heads, fix="make model.dim / model.n_heads even")
    tp, pp, cp = degrees["tp"], degrees["pp"], degrees["cp"]
    for key, heads in (("model.n_heads", m.n_heads), ("model.n_kv_heads", kv)):
        if heads % tp:
            raise PlanError(f"{heads} heads can't be split over parallelism.tp={tp}", key=key, value=heads,
                            fix=f"parallelism.tp in {_divisors(heads)}")
    if m.n_layers < pp:
        raise PlanError(f"{m.n_layers} layers can't fill parallelism.pp={pp} pipeline stages", key="parallelism.pp",
                        value=pp, fix=f"parallelism.pp <= {m.n_layers}")
    if cp > 1 and batch.seq_len % (2 * cp):
        raise PlanError(f"zigzag context parallelism splits the sequence into 2 x cp = {2 * cp} chunks",
                        key="train.seq_len", value=batch.seq_len,
                        fix=f"train.seq_len={math.ceil(batch.seq_len / (2 * cp)) * 2 * cp}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _warnings(cfg, degrees: dict[str, int], batch: BatchPlan) -> list[str]:
    out = []
    if degrees["tp"] > int(cfg.cluster.procs_per_node):
        out.append(f"parallelism.tp={degrees['tp']} spans nodes (procs_per_node={cfg.cluster.procs_per_node}): "
                   "TP all-reduces would cross the inter-node link")
    return out


def checked_plan(cfg, choices: dict | None = None) -> RunPlan:
    """The plan `usp train` runs: build_plan, and the first layout the engine can't train refused."""
    plan = build_plan(cfg, choices)
    errors = engine_support_errors(plan)
    if errors:
        raise errors[0]
    return plan


def _threads_per_proc(cluster, per_node: int, cpu_count: int | None) -> int:
    """cluster.threads_per_proc, else the node's CPUs split over its processes: on Slurm the nodes'
    (cluster.slurm.cpus_per_task; this login machine's count says nothing about them), else this one's."""
    if int(cluster.threads_per_proc):
        return int(cluster.threads_per_proc)
    if cluster.launcher != "slurm":
        return max(1, (cpu_count or os.cpu_count() or 1) // per_node)
    if not int(cluster.slurm.cpus_per_task):
        raise PlanError("a Slurm job needs the nodes' CPU count: cluster.slurm.cpus_per_task and "
                        "cluster.threads_per_proc are both 0", key="cluster.slurm.cpus_per_task", value=0,
                        fix=f"cluster.slurm.cpus_per_task=<CPUs per node> (split over {per_node} processes), "
                            "or cluster.threads_per_proc=<threads per process>")
    return max(1, int(cluster.slurm.cpus_per_task) // per_node)


def engine_support_errors(plan: RunPlan) -> list[PlanError]:
    """Layouts the engine cannot train (the plan may still describe them for estimates)."""
    deg, par, model = plan.degrees, plan.config["parallelism"], plan.config["model"]
    ep, experts, kind = int(par["ep"]), int(model.get("n_experts", 0)), data_parallel_kind(deg, bool(par["zero1"]))
    rules = [
        (ep > 1 and experts == 0, "parallelism.ep", ep, "expert parallelism needs a MoE model", "model=moe_tiny"),
        (ep > 1 and experts % ep != 0, "parallelism.ep", ep, f"{experts} experts can't be split over ep={ep}",
         "parallelism.ep that divides model.n_experts"),
        (ep > 1 and deg["dp_replicate"] % ep != 0, "parallelism.ep", ep,
         f"expert parallelism is carved out of dp_replicate={deg['dp_replicate']}, which ep must divide",
         f"parallelism.dp_replicate={ep} (or a multiple)"),
        (ep > 1 and max(deg["dp_shard"], deg["cp"], deg["tp"], deg["pp"]) > 1, "parallelism.ep", ep,
         "expert parallelism composes with dp_replicate only in this version (not FSDP, CP, TP or PP)",
         "parallelism.dp_shard=1 parallelism.cp=1 parallelism.tp=1 parallelism.pp=1"),
        (experts > 0 and deg["tp"] > 1, "parallelism.tp", deg["tp"], "tensor parallelism of MoE layers is not "
         "implemented", "parallelism.tp=1 (use parallelism.ep for the experts)"),
        (experts > 0 and deg["pp"] > 1, "parallelism.pp", deg["pp"], "pipeline parallelism of MoE models is not "
         "implemented (the load-balancing loss spans stages)", "parallelism.pp=1"),
        (deg["cp"] > 1 and deg["pp"] > 1, "parallelism.cp", deg["cp"], "context parallelism inside a pipeline "
         "is not implemented", "parallelism.cp=1 or parallelism.pp=1"),
        (par["pp_schedule"] in ("interleaved_zb", "zbv") and deg["pp"] > 1 and kind in ("fsdp", "hsdp")
         and bool(par["reshard_after_forward"]), "parallelism.reshard_after_forward", True,
         "ZeRO-3 reshards parameters before a zero-bubble schedule's deferred weight-gradient pass, which then "
         "computes wrong gradients (measured: 8.7% loss error after 5 steps)",
         "parallelism.reshard_after_forward=false (ZeRO-2), or pp_schedule=1f1b / interleaved_1f1b"),
        (bool(par["zero1"]) and kind != "zero1", "parallelism.zero1", True, f"ZeRO-1 applies to plain DDP; this "
         f"layout uses {kind}", "parallelism.zero1=false (FSDP already shards the optimizer states)"),
        (par["ddp_comm_hook"] != "none" and kind != "ddp", "parallelism.ddp_comm_hook", par["ddp_comm_hook"],
         f"communication hooks apply to plain DDP; this layout uses {kind}", "parallelism.ddp_comm_hook=none"),
        (par["ddp_comm_hook"] == "bf16" and plan.device not in ("cuda", "xpu"), "parallelism.ddp_comm_hook", "bf16",
         "PyTorch's bf16 compression hook needs NCCL (CUDA) or XCCL (XPU), not gloo",
         "parallelism.ddp_comm_hook=fp16 or powersgd on CPU"),
        (model.get("attention") == "flash_attn" and plan.device != "cuda", "model.attention", "flash_attn",
         "flash-attn runs on CUDA only", "model.attention=sdpa"),
        (model.get("attention", "sdpa") not in ATTENTION_CHOICES, "model.attention", model.get("attention"),
         "unknown attention kernel", "model.attention=sdpa (or flash_attn on CUDA)"),
        (model.get("attention") == "flash_attn" and plan.config["train"]["dtype"] == "fp32", "train.dtype", "fp32",
         "flash-attn computes in bf16/fp16 only", "train.dtype=auto (bf16 on GPU), or model.attention=sdpa"),
        (model.get("attention") == "flash_attn" and deg["cp"] > 1, "model.attention", "flash_attn",
         "context parallelism brings its own (ring) attention", "model.attention=sdpa"),
        (ep > 1 and plan.config["checkpoint"]["enabled"], "checkpoint.enabled", True,
         "checkpoints of expert-parallel runs are not supported yet (expert weights differ per rank)",
         "checkpoint.enabled=false"),
        (plan.nodes > 1 and plan.config["cluster"]["launcher"] == "local", "cluster.nodes", plan.nodes,
         "the local launcher runs on one machine", "cluster.nodes=1, or a Slurm cluster group"),
    ]
    return [PlanError(why, key=key, value=value, fix=fix) for bad, key, value, why, fix in rules if bad]
