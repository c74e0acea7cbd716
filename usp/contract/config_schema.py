"""The typed schema of a usp config: the dataclasses a composed config fills, and the resolved
config every plan carries (RunPlan.config, usp/contract/run_plan.py). usp/config/schema.py registers
it in Hydra's ConfigStore, so a misspelt key or a wrong type is an error at compose time rather than
a silent default; the engine reads the same types back from plan.yaml.

A closed set of choices that nothing below the config layer lists is an Enum here (StrEnum: its
members compare and print as their strings, and plan.yaml stores the strings), so omegaconf
refuses any other value at compose time. Choices that usp.perf or usp.data own (train.recompute,
train.fp8, data.tokenizer, ...) stay strings, checked by a rule in usp/plan/rules.py, which also
holds every range and cross-field rule (FIELD_RULES)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class CommHook(StrEnum):
    """parallelism.ddp_comm_hook: DDP gradient compression."""
    none = "none"
    bf16 = "bf16"
    fp16 = "fp16"
    powersgd = "powersgd"


class Launcher(StrEnum):
    local = "local"
    slurm = "slurm"


class GpuRequest(StrEnum):
    """cluster.slurm.gpu_request: how a Slurm job asks for GPUs."""
    gpus_per_node = "gpus_per_node"
    gres = "gres"
    none = "none"


class NanPolicy(StrEnum):
    stop = "stop"  # checkpoint the last good step, exit
    skip = "skip"  # drop the step


# checkpoint.async_mode; "async" is a keyword, so the functional form
AsyncMode = StrEnum("AsyncMode", [("none", "none"), ("async", "async")])  # type: ignore[misc]


class FaultToleranceKind(StrEnum):
    """fault_tolerance.kind: how a run survives a lost rank (docs/fault_tolerance.md)."""
    none = "none"  # a lost rank stops the job; it restarts whole from the last checkpoint
    torchft = "torchft"  # each replica group (dp_replicate) is its own job; the others train on


class ConsoleMode(StrEnum):
    auto = "auto"  # rich on a TTY, plain otherwise
    rich = "rich"
    plain = "plain"
    quiet = "quiet"


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class ModelConfig:
    name: str = "tiny"
    family: str = "llama"
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads (multi-head attention)
    head_dim: int | None = None  # None = dim / n_heads; q and the attention output are n_heads x head_dim (Qwen3)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3; parameters attention.q_norm/k_norm)
    ffn_dim: int = 384  # SwiGLU hidden size
    vocab_size: int = -1  # -1 = take it from the data group's tokenizer
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    # RoPE frequency scaling, transformers' rope_type: default (none) | llama3 (Llama 3.1 / 3.2: factor,
    # low/high_freq_factor, original_max_positions) | yarn (DeepSeek-V3, Qwen3's long context: factor,
    # original_max_positions and the optional beta_fast .. truncate), as in config.json's rope_scaling
    # (usp/models/layers.py rope_inv_freq; docs/hf_checkpoints.md "YaRN RoPE scaling")
    rope_type: str = "default"
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_positions: int | None = None  # original_max_position_embeddings
    rope_beta_fast: float | None = None  # None: 32
    rope_beta_slow: float | None = None  # None: 1
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None  # None: from factor, mscale and mscale_all_dim
    rope_truncate: bool | None = None  # None: true
    norm_eps: float = 1e-5
    init_std: float = 0.02
    attention: str = "sdpa"  # sdpa | flash_attn (GPU extra)
    # Mixture of experts (n_experts > 0 replaces every block's MLP with a MoE layer).
    n_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int = 0  # hidden size of one expert; 0 = ffn_dim
    shared_expert: bool = False  # one always-on expert beside the routed ones
    aux_loss_coef: float = 0.01  # load-balancing loss weight (docs/moe.md)
    # its f_e and P_e over the global batch (batch: Switch, Qwen3-MoE) or per sequence, averaged over the
    # sequences (sequence: DeepSeek-V3's complementary sequence-wise loss)
    aux_loss_scope: str = "batch"
    router_bias_update_rate: float = 0.0  # > 0: aux-loss-free balancing (DeepSeek-V3), the bias step
    # the top-k router probabilities renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob=true);
    # false: the softmax's own probabilities weight the experts (Qwen3-MoE's norm_topk_prob=false)
    router_norm_topk: bool = True
    # DeepSeek-V3 (docs/models.md): the shared expert n_shared_experts x moe_ffn_dim wide; the router's scores
    # softmax | sigmoid, the experts in router_groups groups of which a token picks among the best
    # router_topk_groups, the routed weights x router_scale (routed_scaling_factor); the first n_dense_layers
    # blocks of a MoE model dense (first_k_dense_replace, ffn_dim wide)
    n_shared_experts: int = 1
    router_score: str = "softmax"
    router_groups: int = 1
    router_topk_groups: int = 1
    router_scale: float = 1.0
    n_dense_layers: int = 0
    # Multi-head latent attention (DeepSeek-V3, usp/models/mla.py) when kv_lora_rank > 0: the KV latent's
    # width, q's low-rank width (0: one q projection), the per-head q/k widths without and with RoPE (the
    # RoPE key shared by the heads), the value head's width; RoPE on interleaved channel pairs (DeepSeek)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek-V3's multi-token prediction (docs/models.md): 1 = one more block predicting the token after next,
    # its cross-entropy x mtp_loss_coef added to the training loss's gradient (DeepSeek: 0.3, later 0.1);
    # not under tensor, context or pipeline parallelism
    mtp_depth: int = 0
    mtp_loss_coef: float = 0.3
    # For the planner only: a measured max / mean tokens per expert (metrics.jsonl expert_load ...
    # imbalance); the EP all-to-all and expert compute of the busiest rank scale by it. 1 = balanced.
    expert_load_imbalance: float = 1.0
    capacity_factor: float = 0.0  # 0 = dropless; > 0 = tokens per expert capped at cf * tokens * top_k / E
    # A Hugging Face checkpoint directory (Llama, Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3: config.json +
    # safetensors) whose weights
    # replace the initialisation. Its config.json gives the model's shape (the keys of
    # usp/config/init_from.py) unless a recipe or the command line sets them; a value set there must
    # agree with it (usp/plan/hf_config.py).
    init_from: str | None = None


@dataclass
class ParallelismConfig:
    # Degrees; -1 = derive so that their product equals the world size.
    dp: int | None = None  # shorthand for dp_replicate (plain DDP)
    dp_replicate: int = -1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel: ranks of dp_shard x cp (which ep divides); experts sharded over the rest
    # Data parallel flavour. dp_shard > 1 = FSDP2 (ZeRO-3, or ZeRO-2 with reshard_after_forward
    # false); dp_replicate x dp_shard = HSDP; dp_shard = 1: DDP, or ZeRO-1 with zero1 true (with TP/PP:
    # FSDP2 sharded over dp_replicate without resharding after forward, docs/parallelism.md).
    zero1: bool = False
    reshard_after_forward: bool = True
    ddp_bucket_mb: int = 25
    ddp_comm_hook: CommHook = CommHook.none  # none | bf16 | fp16 | powersgd (DDP gradient compression)
    powersgd_rank: int = 2
    # Pipeline parallel
    pp_schedule: str = "1f1b"  # afab | 1f1b | interleaved_1f1b | interleaved_zb | zbv
    pp_virtual_stages: int = 1  # stages per pp rank (interleaved / zbv schedules need 2)
    pp_layers: list[int] | None = None  # layers per stage, e.g. [3, 5]; None = balanced by the plan


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw | adam | sgd (usp/plan/optimizer.py)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine / linear / wsd decay to lr * min_lr_ratio
    weight_decay: float = 0.1  # on matrices only, never on norms or biases
    beta1: float = 0.9  # adam, adamw
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | linear | constant | wsd (warmup, stable, decay)
    decay_fraction: float = 0.2  # wsd: the last fraction of train.steps over which lr decays
    grad_clip: float = 1.0  # 0 = no clipping


@dataclass
class CalibratedConfig:
    # What cluster.timing was fitted on (written by `usp calibrate`; usp/perf/time_constants.py).
    source: str = ""  # "" = never calibrated
    runs: int = 0
    nodes: list[int] = field(default_factory=list)
    features: list[str] = field(default_factory=list)
    fitted: list[str] = field(default_factory=list)  # the constants the fit moved
    stacks: list[str] = field(default_factory=list)  # the profiles the runs were trained with
    mfu_abs_err_p50: float = 0.0  # fit residuals, MFU points
    mfu_abs_err_p90: float = 0.0
    rel_err_p50: float = 0.0  # median |predicted / measured - 1|
    ratio_p10: float = 1.0  # predicted / measured MFU
    ratio_p90: float = 1.0


@dataclass
class ClusterTimingConfig:
    # The time model's GPU and network constants (docs/planner.md "Time per step"; the catalogue's sources:
    # docs/hardware.md). A training stack's own constants are its profile's (planner.profile).
    gemm_efficiency: float = 0.5  # share of the peak a matmul with a long reduction reaches
    gemm_half_k: float = 0.0  # reduction length at which a matmul runs at half that rate
    gemm_fixed_us: float = 0.0  # fixed cost per matmul kernel
    fp8_efficiency: float = 1.0  # an FP8 matmul's gemm_efficiency relative to bf16's, at the FP8 peak
    fp8_half_k: float = 0.0  # gemm_half_k of FP8 matmuls (0: gemm_half_k)
    attention_half_seq: float = 0.0  # sequence length at which flash attention reaches half its plateau (0: none)
    clock: float = 1.0  # sustained tensor-core clock / the clock the peak is quoted at
    interference: float = 0.0  # compute slowed by this many seconds per second of communication it hides
    nvlink_efficiency: float = 1.0  # collective bus bandwidth / intra_node_gbps
    nic_efficiency: float = 1.0  # collective bus bandwidth / inter_node_gbps
    intra_latency_us: float = 10.0  # latency per ring step inside a node
    inter_latency_us: float = 25.0  # latency per ring step between nodes
    all_reduce: str = "auto"  # the all-reduce algorithm: ring | tree | auto (the faster, as NCCL's tuner picks)
    in_network_reduction: bool = False  # all-reduce through NVLS / SHARP
    eager_overhead: float = 0.0  # usp's eager (train.compile off) micro batch's extra time over a compiled one
    eager_loss_ps_per_logit: float = 0.0  # usp's eager loss's (compile off, or TP) extra cost per logit
    calibrated: CalibratedConfig = field(default_factory=CalibratedConfig)


@dataclass
class ReliabilityConfig:
    """What fails and what a restart costs: the goodput model's inputs (usp/perf/goodput.py,
    docs/faults.md). The failure rate is a large GPU fleet's; the restart costs are placeholders that
    `usp calibrate <runs dir>` fits from the runs' logs/events.jsonl."""
    # Mean hours between job-stopping failures of one node. Llama 3 405B's pre-training: 419 unexpected
    # interruptions in 54 days on 2,048 nodes of 8 H100s = 6,335 node-hours per failure.
    node_mtbf_hours: float = 6335.0
    job_start_s: float = 300.0  # a failure noticed, the job started again (requeue, torchrun), the ranks' imports
    rendezvous_s: float = 60.0  # the ranks find each other and form their process groups
    build_s: float = 120.0  # the model built and wrapped, the first step's extra time (compile); not the load
    checkpoint_overhead_s: float = 2.0  # per save and per load, besides the bytes: planning, barriers, manifest


@dataclass
class StorageConfig:
    """Where checkpoints go (checkpoint.dir): bandwidth per node and for the whole job, GB/s."""
    write_gbps_per_node: float = 5.0
    read_gbps_per_node: float = 10.0
    write_gbps_total: float = 2000.0  # 0 = no limit past the nodes'; 2 TB/s: Llama 3's Tectonic, sustained
    read_gbps_total: float = 7000.0  # Tectonic's peak
    host_copy_gbps: float = 20.0  # checkpoint.async_mode=async: a rank's copy of its state to host memory


@dataclass
class SlurmConfig:
    """How a cluster=<slurm group> job is requested (usp/launch/templates/job.sbatch.j2).
    Nodes, processes per node and GPUs come from the plan: never typed here."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"  # time limit: [D-]HH:MM:SS or minutes
    cpus_per_task: int = 0  # the one task per node runs torchrun and all its ranks; 0 = procs x threads
    mem: str | None = None  # per node, e.g. 200G; "0" = all of it; None = the partition default
    gpu_request: GpuRequest = GpuRequest.gpus_per_node  # gpus_per_node | gres | none (how GPUs are asked for)
    constraint: str | None = None
    exclusive: bool = False
    sbatch_extra: list[str] = field(default_factory=list)  # more #SBATCH options, e.g. "--reservation=big"
    setup: list[str] = field(default_factory=list)  # shell lines run first: module load, venv, NCCL env
    srun_extra: list[str] = field(default_factory=list)  # more srun options, e.g. container flags
    container_image: str | None = None  # pyxis/enroot: srun --container-image
    container_mounts: str | None = None  # pyxis/enroot: srun --container-mounts
    python: str | None = None  # interpreter on the nodes; None = the one running usp
    # c10d rendezvous port on the head node. None = 20000 + job id % 10000, so jobs (and array
    # tasks) sharing a node don't meet in one store; set a fixed one where a firewall needs it.
    rdzv_port: int | None = None
    signal_lead_s: int = 180  # USR1 this long before the time limit: checkpoint, then requeue
    max_requeues: int = 3  # requeues after preemption / time limit / node failure
    log_dir: str | None = None  # None = <run_dir>/logs


@dataclass
class ClusterConfig:
    name: str = "local_cpu"
    launcher: Launcher = Launcher.local  # local | slurm
    device: str = "cpu"  # cpu | cuda | xpu
    backend: str = "auto"  # auto = gloo on cpu, nccl on cuda, xccl on xpu
    nodes: int = 1
    procs_per_node: int = 1
    # Several machines without Slurm (launcher local, nodes > 1; docs/multinode.md): `usp train` runs
    # on each machine with the same config and its own node_rank (0 .. nodes-1); node 0 hosts the
    # rendezvous at rdzv_endpoint, "host:port" (or "host": the port is then derived from the run).
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    threads_per_proc: int = 0  # 0 = OMP_NUM_THREADS if set (local launcher), else cpu cores / procs_per_node
    # Hardware, for the planner's memory and time model (figures and sources: docs/hardware.md).
    device_name: str = "cpu"
    device_memory_gb: float = 24.0  # per device (per process on CPU), GiB
    peak_tflops_bf16: float = 0.15  # dense peak per device; CPU values are placeholders to calibrate
    peak_tflops_fp32: float = 0.15
    peak_tflops_fp8: float = 0.0  # dense FP8 peak; 0 = no FP8 matmul units (train.fp8 is refused)
    intra_node_gbps: float = 5.0  # per-device link bandwidth inside a node, GB/s (one direction)
    inter_node_gbps: float = 1.25  # per-device bandwidth between nodes, GB/s
    hbm_gbps: float = 21.5  # device memory bandwidth, GB/s (element-wise kernels, the loss, the optimizer step)
    price_per_device_hour: float = 0.0  # 0 = unknown
    timing: ClusterTimingConfig = field(default_factory=ClusterTimingConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)  # failures, restarts (goodput)
    storage: StorageConfig = field(default_factory=StorageConfig)  # the checkpoint storage's bandwidth
    timeout_s: int = 600  # collective timeout: a hung collective fails after this long
    env: dict[str, str] = field(default_factory=dict)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)  # used when launcher=slurm


@dataclass
class BlendSource:
    """One source of a data.source=blend mix (docs/data.md#blends)."""
    paths: list[str] = field(default_factory=list)  # files, directories or globs
    weight: float = 1.0  # share of the training tokens (normalised over the sources)
    text_field: str | None = None  # record files: the text column; None = data.text_field
    name: str | None = None  # None = source<i>


@dataclass
class DataConfig:
    name: str = "shakespeare"
    source: str = "shakespeare"  # shakespeare | stdlib | files (= text_files) | blend | token_files
    paths: list[str] = field(default_factory=list)  # files: files, directories or globs (.txt, .jsonl, .parquet, ...)
    text_field: str = "text"  # jsonl / parquet / arrow: the column holding each record's text
    blend: list[BlendSource] = field(default_factory=list)  # source=blend: the sources and their weights
    workers: int = 0  # processes that tokenize files in parallel; 0 = one per available core
    train_bin: str | None = None  # token_files: token file for training
    val_bin: str | None = None  # token_files: token file for validation
    token_dtype: str = "auto"  # token_files: auto (uint16 if vocab_size <= 65536, else uint32) | uint16 | uint32
    tokenizer: str = "bpe"  # bpe (byte-level BPE trained at prepare time) | bytes | hf | tiktoken
    tokenizer_path: str | None = None  # hf: tokenizer.json or a directory holding one; tiktoken: the BPE file
    add_bos: bool = False  # start every document with the tokenizer's BOS (hf, tiktoken); EOS always ends it
    bos_token: str | None = None  # hf: override tokenizer_config.json's bos_token
    eos_token: str | None = None  # hf: override tokenizer_config.json's eos_token
    vocab_size: int = 4096  # bpe: the vocabulary to train; token_files: the ids' vocabulary
    val_fraction: float = 0.05
    cache_dir: str | None = None  # None = $USP_CACHE_DIR or ~/.cache/usp
    # files of data.paths that aren't UTF-8 text (binary, invalid UTF-8): strict (refuse, naming them)
    # | skip (leave them out, with a warning) | off (no check: invalid bytes become U+FFFD)
    text_check: str = "strict"


@dataclass
class TrainConfig:
    name: str | None = None  # run name; None = derived from model/parallelism
    runs_dir: str = "runs"
    steps: int = 150
    seq_len: int = 128
    global_batch: int = 16  # sequences per optimizer step
    global_batch_tokens: int | None = None  # alternative to global_batch
    tokens: float | None = None  # training token budget (usp estimate: devices / hours / cost)
    micro_batch: int = -1  # sequences per forward/backward on one rank; -1 = global / (dp x grad_accum)
    grad_accum: int = -1  # -1 = derive from global batch / (micro batch x dp)
    recompute: str = "none"  # none | selective | full
    seed: int = 1234
    dtype: str = "auto"  # auto = fp32 on cpu, bf16 autocast on gpu | fp32 | bf16
    eval_interval: int = 50  # 0 = only at the end
    eval_batches: int = 4
    log_interval: int = 10
    sample_tokens: int = 120  # text sampled from the model at the end; 0 = none
    sample_prompt: str = "ROMEO:"
    # auto = on for CUDA (measured faster there), off elsewhere (usp.perf.specs.uses_compile) | true | false
    compile: Any = "auto"
    # FP8 training of the blocks' linears through torchao.float8 (GPUs with FP8 units; docs/parallelism.md, FP8):
    # off | tensorwise (one scale per tensor: fastest; FP8 all-gathers under FSDP) | rowwise (a scale per row)
    fp8: str = "off"
    max_restarts: int = 0  # torchrun restarts the whole job this often after a rank dies (resuming)
    nan_policy: NanPolicy = NanPolicy.stop  # stop (checkpoint the last good step, exit) | skip (drop the step)
    # None = on for CPU (exact parity and resume), off on an accelerator (its deterministic kernels
    # are slower); true on CUDA also sets CUBLAS_WORKSPACE_CONFIG (usp/launch/local.py)
    deterministic: bool | None = None
    measure_memory: bool = True  # measure the peak tensor memory of one step (usp/engine/observe/memory_probe.py)
    # A rank without step progress for this long is hung (docs/hangs.md): every live rank dumps its stacks to
    # logs/, the run stops (with a checkpoint if the stall clears) and exits 75 to be restarted. None =
    # train.hang_factor x the planner's predicted step time (at least 120 s); 0 = off.
    hang_timeout_s: float | None = None
    hang_factor: float = 20.0  # the window in predicted step times, when train.hang_timeout_s is unset


@dataclass
class CheckpointConfig:
    enabled: bool = True
    # save every N optimizer steps; 0 = only at the end; auto = the Young–Daly interval for the cluster's
    # failure rate and the save's cost (usp/perf/goodput.py), a number in plan.yaml
    interval: Any = "auto"
    keep_last: int = 2  # complete checkpoints kept (older ones are deleted); 0 = every one
    # none | async (torch.distributed.checkpoint.async_save: training goes on)
    async_mode: AsyncMode = AsyncMode["none"]
    resume: str = "auto"  # auto (newest complete checkpoint of the run) | never | <path to a step_N dir>
    dir: str | None = None  # None = <run_dir>/checkpoints


@dataclass
class LoggingConfig:
    console: ConsoleMode = ConsoleMode.auto  # auto (rich on a TTY, plain otherwise) | rich | plain | quiet
    # metrics.jsonl is always written; these add backends (rank 0 only, see usp/engine/observe/tracking.py).
    wandb: bool = False
    # offline (<run_dir>/wandb, `wandb sync` later) | online | disabled; None = $WANDB_MODE, else
    # online if $WANDB_API_KEY is set, else offline (usp/engine/observe/tracking.py: wandb_mode)
    wandb_mode: WandbMode | None = None
    wandb_project: str = "usp"
    wandb_entity: str | None = None
    wandb_tags: list[str] = field(default_factory=list)
    wandb_init_timeout_s: float = 30.0  # online only: after this, fall back to offline with a warning
    tensorboard: bool = False  # event files in <run_dir>/tensorboard


@dataclass
class ProfileConfig:
    enabled: bool = False  # torch.profiler trace per rank in <run_dir>/profile (usp/engine/observe/profiler.py)
    steps: list[int] = field(default_factory=lambda: [10, 12])  # [first, last] optimizer step, inclusive
    memory: bool = False  # CUDA memory snapshot of those steps (GPU only)
    record_shapes: bool = False


@dataclass
class FaultToleranceConfig:
    """fault_tolerance=torchft (docs/fault_tolerance.md): the dp_replicate ranks become replica groups,
    each launched and restarted on its own; torchft's lighthouse forms a quorum of the live groups every
    step, a lost group is dropped (that step's global batch is smaller) and heals from a live one when it
    is back."""
    kind: FaultToleranceKind = FaultToleranceKind.none
    min_replicas: int = 1  # replica groups a step needs to commit (fewer: the step waits)
    timeout_s: int = 30  # a collective between replica groups that takes longer fails (the step is retried)
    heartbeat_timeout_s: float = 2.0  # a group whose heartbeat stops this long is out of the quorum
    quorum_timeout_s: int = 600  # a group that can't join a quorum for this long fails
    join_timeout_s: float = 5.0  # the lighthouse waits this long for a heartbeating group that hasn't asked
    start_timeout_s: int = 600  # a fresh start waits this long for every group (then starts with those there)
    max_group_restarts: int = 3  # local launcher: restarts of each lost group (Slurm: cluster.slurm.max_requeues)
    lighthouse_port: int = 0  # 0 = a free port


@dataclass
class PlannerConfig:
    # Whose training stack the planner predicts (usp/perf/stack_profile.py): usp (this engine) | nanotron |
    # megatron | megatron_legacy | meta_llama3 | torchtitan | llmfoundry, or a profile file (usp calibrate
    # --profile-out).
    profile: str = "usp"


@dataclass
class UspConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
