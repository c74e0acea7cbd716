"""RunPlan: everything that can be known before a device is touched, derived once from the composed
config by the planner (usp/plan/plan.py) and written to <run_dir>/plan.yaml, the engine's only input.
Typed both ways: plan.yaml is written from these dataclasses and read back into them
(usp/contract/plan_file.py). Every choice the engine acts on is recorded here (`decisions`), so the
engine reads it instead of deciding again."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from usp.contract.config_schema import UspConfig
from usp.contract.dims import ParallelDims, RankInfo
from usp.contract.predictions import GoodputPlan, MemoryPlan, TimingPlan
from usp.contract.schedule import OptimSettings
from usp.contract.typed import plain

# 2: `decisions` recorded; plan.yaml is read back typed. 3: cluster.timing holds the GPU and network constants
# of the time model that splits them from the stack's. Versions 1 (usp before 2026-12) and 2 are brought up to
# date when read (usp/contract/plan_file.py).
PLAN_VERSION = 3


@dataclass(frozen=True)
class BatchPlan:
    seq_len: int
    micro_batch: int  # sequences per forward/backward on one rank
    grad_accum: int  # micro batches per optimizer step on one rank
    dp: int  # data-parallel degree (dp_replicate x dp_shard)
    global_batch: int  # sequences per optimizer step, whole job

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch * self.seq_len


@dataclass
class ModelPlan:
    name: str
    params: int
    vocab_size: int  # the embedding's rows: the tokenizer's (or model.vocab_size), padded to a multiple of tp
    flops_per_token: float  # training FLOPs per token: 6N + 12 L h s (usp.perf.specs.Arch.flops_per_token)
    flops_per_step: float


@dataclass
class PipelinePlan:
    """The stage split and schedule when parallelism.pp > 1 (the rules have passed)."""

    schedule: str
    virtual_stages: int
    n_microbatches: int
    stage_layers: list[list[int]]  # the layers of each stage, first to last
    rank_stages: list[list[int]]  # the stages each pp rank holds

    @property
    def last_stage_rank(self) -> int:
        """The pp rank holding the last stage (the one that computes the loss)."""
        last = len(self.stage_layers) - 1
        return next(rank for rank, stages in enumerate(self.rank_stages) if last in stages)


@dataclass
class HangWindow:
    """When a rank counts as hung (docs/hangs.md): the seconds each phase of the loop may go without
    progress, resolved once by the planner (usp/contract/decide.py hang_window) from
    train.hang_timeout_s / train.hang_factor and the predicted step time."""

    step_s: float  # one training step: the window
    first_step_s: float  # the first step of a launch (compile, warm-up, lazy initialisation)
    eval_s: float  # an evaluation (train.eval_batches forward passes of a global batch)
    checkpoint_s: float  # a checkpoint save
    grace_s: float  # after a detection: the stall may clear (stop with a checkpoint), else the live ranks exit
    poll_s: float  # how often each rank's watchdog thread looks
    source: str  # how step_s was set (the plan's text, the rank logs)


@dataclass
class Decisions:
    """What the engine does, decided once by the planner (usp/contract/decide.py's rules)."""

    dp_kind: str  # none | ddp | zero1 | fsdp | hsdp | replicate | zero1_fsdp (usp/contract/dims.py)
    bf16: bool  # the matmuls compute in bf16 (train.dtype)
    fsdp_mixed_precision: bool  # bf16 through FSDP2's MixedPrecisionPolicy (gathers bf16, reduces fp32)
    autocast: bool  # bf16 through torch.autocast around forward and loss instead
    autocast_weight_cache: bool  # autocast keeps its bf16 weight copies for the forward (no recompute)
    compile: bool  # per-block torch.compile (train.compile resolved for the device)
    compiled_loss: bool  # the loss compiled too (not under TP)
    fp8: str  # off | tensorwise | rowwise (torchao.float8 recipe of the blocks' linears)
    deterministic: bool  # torch.use_deterministic_algorithms
    recompute: str  # none | selective | full
    attention: str  # sdpa | flash_attn
    moe: bool  # the model has routed experts
    embedding_rows: int  # the vocabulary padded to a multiple of tp (the padded rows are masked out of the loss)
    optimizer: OptimSettings  # the optimizer and its learning-rate schedule, train.steps included
    checkpoint_dir: str  # where checkpoints go (checkpoint.dir, or <run_dir>/checkpoints), absolute
    tokenizer: str  # data.tokenizer: bpe | bytes | hf | tiktoken (the dataset is dataset_dir)
    # What each rank times to find stragglers (usp/engine/observe/stragglers.py): "runnable" (CPU: its
    # threads' time on or waiting for a CPU), "data+optimizer" or "data" (accelerators); "": one process.
    straggler_measure: str = ""
    hang: HangWindow | None = None  # None: no hang watchdog (one process, train.hang_timeout_s=0, an older plan)


@dataclass
class FaultTolerancePlan:
    """fault_tolerance=torchft, decided by the planner (usp/contract/decide.py: fault_tolerance_plan). The
    plan's dp_replicate ranks are `replica_groups` groups, each launched (and restarted) on its own as a
    job of `group_world_size` ranks with the layout `group_degrees` (dp_replicate 1); torchft averages
    their gradients every step over the groups that are alive. A plan without it (None) restarts whole
    on a loss: the planner's goodput compares the two from this field."""

    kind: str  # torchft
    replica_groups: int  # the plan's dp_replicate
    min_replicas: int  # replica groups a step needs to commit
    group_world_size: int  # ranks of one replica group
    group_nodes: int  # nodes of one group (1 when the groups share one node)
    group_procs_per_node: int
    group_degrees: dict[str, int]  # one group's mesh: the plan's degrees with dp_replicate 1
    group_dp_kind: str  # how a group reduces its gradients inside itself (usp/contract/dims.py)
    timeout_s: int  # fault_tolerance.*, as configured
    heartbeat_timeout_s: float
    quorum_timeout_s: int
    join_timeout_s: float
    start_timeout_s: int
    max_group_restarts: int
    lighthouse_port: int


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
    degrees: dict[str, int]  # the mesh dims' degrees (ParallelDims.mesh)
    mesh_dims: list[str]
    mesh_shape: list[int]
    batch: BatchPlan
    model: ModelPlan
    dataset_dir: str
    choices: dict[str, str | None]
    config: UspConfig  # the resolved config this plan was derived from
    decisions: Decisions
    warnings: list[str] = field(default_factory=list)
    data_meta: dict = field(default_factory=dict)  # filled in once the dataset is prepared
    pipeline: PipelinePlan | None = None  # stage split and schedule when parallelism.pp > 1
    memory: MemoryPlan | None = None  # predicted memory per rank and stage (usp/perf/memory.py)
    timing: TimingPlan | None = None  # predicted step time, tokens/s, MFU (usp/perf/timing.py)
    goodput: GoodputPlan | None = None  # failures, checkpoint costs, the interval (usp/perf/goodput.py)
    fault_tolerance: FaultTolerancePlan | None = None  # fault_tolerance=torchft: the replica groups
    version: int = PLAN_VERSION

    @property
    def parallel(self) -> ParallelDims:
        return ParallelDims.of(self.degrees, self.config.parallelism.ep)

    @cached_property
    def ranks(self) -> list[RankInfo]:
        """The rank table (which node, which mesh coordinates), derived from the degrees: not written
        to plan.yaml, which every rank of a 16,384-GPU job reads at start-up."""
        return self.parallel.rank_table(self.procs_per_node)

    def to_dict(self) -> dict:
        """plan.yaml's content: plain values (the batch's token count added for the reader)."""
        out = plain(self)
        out["batch"]["global_batch_tokens"] = self.batch.global_batch_tokens
        return out
