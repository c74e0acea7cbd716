"""Inputs of the planner's memory and time model, as small frozen dataclasses: the model's
shape (`Arch`), the hardware (`Hardware`), the numeric precision (`Precision`) and one
parallel layout (`Layout`). Built once from a composed config (or by the layout search), then
handed to usp.perf.memory and usp.perf.timing. Pure Python: never imports torch."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

from usp.contract.decide import uses_bf16
from usp.contract.dims import MESH_DIMS, ParallelDims, data_parallel_kind
from usp.perf.time_constants import TimeConstants

GIB = 1024 ** 3
RECOMPUTE_MODES = ("none", "selective", "full")
DTYPES = ("auto", "fp32", "bf16")
FP8_RECIPES = ("off", "tensorwise", "rowwise")  # train.fp8: torchao.float8's recipe names (usp/engine/parallel/fp8.py)


@dataclass(frozen=True)
class Arch:
    """Model shape with its closed-form parameter and FLOP counts (the Llama / MoE model of
    usp.models, per layer and unsharded where it says so). Pure Python: the planner sizes runs
    before torch is loaded."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool
    n_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int = 0
    shared_expert: bool = False
    attention: str = "sdpa"
    expert_load_imbalance: float = 1.0  # measured max / mean tokens per expert (1 = balanced)
    gated: bool = True  # SwiGLU MLP (w1, w3, w2: 3·h·ffn); False: a GeLU MLP (2·h·ffn: GPT, MPT, Megatron's GPT)
    attn_head_dim: int = 0  # model.head_dim; 0 = dim / n_heads (Qwen3: 128 whatever dim / n_heads is)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3): 2 x head_dim weights per layer
    # DeepSeek-V3 (docs/models.md): the shared expert's width in experts, the dense first layers of a MoE
    # model, multi-head latent attention (kv_lora_rank > 0: usp/models/mla.py)
    n_shared_experts: int = 1
    n_dense_layers: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_depth: int = 0  # DeepSeek-V3's multi-token prediction: one more block (+ eh_proj, 3 norms), the head again

    @classmethod
    def from_model(cls, m, vocab_size: int | None = None) -> Arch:
        """From a model group (a ModelConfig or a composed config's node)."""
        def g(key: str, default=None):
            return getattr(m, key, default)

        return cls(name=str(g("name", "model")), dim=int(g("dim")), n_layers=int(g("n_layers")),
                   n_heads=int(g("n_heads")),
                   n_kv_heads=int(g("n_heads") if g("n_kv_heads") is None else g("n_kv_heads")),
                   ffn_dim=int(g("ffn_dim")), vocab_size=int(vocab_size or g("vocab_size")),
                   tie_embeddings=bool(g("tie_embeddings", True)), n_experts=int(g("n_experts", 0) or 0),
                   top_k=int(g("top_k", 2) or 2), moe_ffn_dim=int(g("moe_ffn_dim", 0) or 0),
                   shared_expert=bool(g("shared_expert", False)), attention=str(g("attention", "sdpa")),
                   expert_load_imbalance=float(g("expert_load_imbalance", 1.0) or 1.0),
                   attn_head_dim=int(g("head_dim") or 0), qk_norm=bool(g("qk_norm", False)),
                   n_shared_experts=int(g("n_shared_experts", 1) or 1), n_dense_layers=int(g("n_dense_layers", 0) or 0),
                   kv_lora_rank=int(g("kv_lora_rank", 0) or 0), q_lora_rank=int(g("q_lora_rank", 0) or 0),
                   qk_nope_head_dim=int(g("qk_nope_head_dim", 0) or 0),
                   qk_rope_head_dim=int(g("qk_rope_head_dim", 0) or 0), v_head_dim=int(g("v_head_dim", 0) or 0),
                   mtp_depth=int(g("mtp_depth", 0) or 0))

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def dense_layers(self) -> int:
        """Blocks with a dense MLP in a MoE model (the first ones); 0 for a dense model (every block is)."""
        return min(self.n_dense_layers, self.n_layers) if self.moe else 0

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention's output (wq's rows, wo's columns): n_heads x
        head_dim, which is dim unless model.head_dim says otherwise; latent attention's queries are
        n_heads x (qk_nope_head_dim + qk_rope_head_dim)."""
        if self.mla:
            return self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """One of K and V's width (latent attention: their mean, K of q's width and V n_heads x v_head_dim)."""
        if self.mla:
            return (self.q_dim + self.n_heads * self.v_head_dim) // 2
        return self.n_kv_heads * self.head_dim

    @property
    def score_dim(self) -> int:
        """The attention matmuls' width per token: QK^T over q's width, AV over V's; their mean (q_dim
        unless latent attention's value heads are narrower than its query heads)."""
        return (self.q_dim + self.n_heads * self.v_head_dim) // 2 if self.mla else self.q_dim

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def parts(self) -> dict:
        return _parts(self)

    @property
    def attn_params(self) -> int:  # per layer, matmul weights
        return self.parts["attention"]

    def attn_params_over(self, tp: int) -> float:
        """One layer's attention weights on a tensor-parallel rank: all over tp, except latent attention's
        low-rank projections (wq_a, wkv_a), held whole on every rank (usp/engine/parallel/tensor.py)."""
        if not self.mla:
            return self.attn_params / tp
        whole = self.dim * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim)
        return whole + (self.attn_params - whole) / tp

    @property
    def expert_params(self) -> int:  # per layer, all routed experts (0 for a dense model)
        return self.parts.get("experts", 0)

    @property
    def dense_mlp_params(self) -> int:  # per layer, MLP weights that are not routed experts
        p = self.parts
        return p["mlp"] - p.get("experts", 0) - p.get("router", 0)

    @property
    def router_params(self) -> int:
        return self.parts.get("router", 0)

    @property
    def norm_params(self) -> int:  # per layer: the two RMSNorms (+ q_norm and k_norm)
        return self.parts["norms"]

    @property
    def layer_params(self) -> int:
        """One MoE block's parameters (a dense model's block)."""
        p = self.parts
        return p["attention"] + p["mlp"] + p["norms"]

    @property
    def dense_layer_params(self) -> int:
        """One of a MoE model's dense first blocks (model.n_dense_layers): attention, SwiGLU of ffn_dim, norms."""
        p = self.parts
        return p["attention"] + p["dense_mlp"] + p["norms"]

    @property
    def mtp_params(self) -> int:
        """The multi-token-prediction module: a block of the MoE kind, eh_proj (2h x h), enorm, hnorm, head_norm."""
        return self.mtp_depth * (self.layer_params + 2 * self.dim * self.dim + 3 * self.dim)

    @property
    def layer_costs(self) -> list[int]:
        """Parameters of each block in order (the pipeline split's costs)."""
        return [self.dense_layer_params] * self.dense_layers + [self.layer_params] * (self.n_layers - self.dense_layers)

    @property
    def active_layer_matmul_params(self) -> int:
        """Matmul weights one token goes through in one layer (top_k experts for MoE)."""
        p = self.parts
        return p["attention"] + p.get("active_mlp", p["mlp"])

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def head_params(self) -> int:
        """Final norm + LM head (0 for the head when it shares the embedding matrix)."""
        return self.dim + (0 if self.tie_embeddings else self.embed_params)

    @property
    def total_params(self) -> int:
        """Exact number of (unique) parameters, what `sum(p.numel() for p in model.parameters())` gives
        (for a MoE model: all experts, on one process before expert parallelism slices them)."""
        return self.embed_params + sum(self.layer_costs) + self.head_params + self.mtp_params

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in matmuls: all block projections plus the LM head (counted
        even when tied, since the v x h matmul still runs). The embedding lookup and the norm weights
        do no matmul. For MoE, a token's matmuls: router + top_k experts + shared expert."""
        dense = self.dense_layers * (self.parts["attention"] + self.parts["dense_mlp"])
        moe = (self.n_layers - self.dense_layers) * self.active_layer_matmul_params
        mtp = self.mtp_depth * (self.active_layer_matmul_params + 2 * self.dim * self.dim + self.vocab_size * self.dim)
        return moe + dense + mtp + self.vocab_size * self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), Ultra-Scale Playbook convention:

            FLOPs/token = 6 * N + 12 * L * q * s

        N = matmul_params (projections + LM head, no embedding lookup, no norms); 6 = 2 FLOPs per
        multiply-add x (1 forward + 2 backward). The second term is the attention score/value
        matmuls (QK^T and AV): 2 matmuls x 2 FLOPs x 3 passes x q x s per layer, counted without the
        causal-mask halving, as in the playbook/PaLM MFU formula; q = n_heads x head_dim (q_dim), h
        unless model.head_dim says otherwise (latent attention: score_dim, the mean of the QK^T and AV
        widths). For MoE, N counts the active experts only (top_k + shared) plus the router, and the
        dense first layers their MLP; multi-token prediction adds its block, eh_proj and the head again."""
        return 6 * self.matmul_params + 12 * (self.n_layers + self.mtp_depth) * self.score_dim * seq_len


@lru_cache(maxsize=256)
def _parts(a: Arch) -> dict:
    """Parameter counts by part. `attention`, `mlp` and `norms` are PER LAYER.

    attention: wq (h x q) + wk, wv (h x h_kv*head_dim) + wo (q x h), no biases; q = n_heads*head_dim
    mlp:       SwiGLU w1, w3 (h x ffn) + w2 (ffn x h) (dense_mlp: the same, a MoE model's dense first layers)
    norms:     attention_norm + ffn_norm (h each), + q_norm and k_norm (head_dim each) with qk_norm
    lm_head:   v x h when untied, 0 when it shares the embedding matrix

    MoE (n_experts > 0, usp.models.moe): `mlp` is the whole MoE layer = router + experts +
    shared_expert, and these extra PER LAYER keys are added: expert (one SwiGLU expert, hidden =
    moe_ffn_dim or ffn_dim), experts (all E of them), router (h x E), shared_expert (a SwiGLU of
    n_shared_experts experts' width, or 0), active_mlp (what one token uses: router + top_k experts +
    shared_expert)."""
    dim, h_kv = a.dim, a.n_kv_heads
    if (not a.attn_head_dim and dim % a.n_heads) or a.n_heads % h_kv:
        raise ValueError(f"dim={dim}, n_heads={a.n_heads}, n_kv_heads={h_kv} do not divide evenly")
    mlp = (3 if a.gated else 2) * dim * a.ffn_dim
    out = {"embedding": a.vocab_size * dim, "attention": 2 * dim * a.q_dim + 2 * dim * a.kv_dim, "mlp": mlp,
           "dense_mlp": mlp, "norms": 2 * dim + (2 * a.head_dim if a.qk_norm else 0), "final_norm": dim,
           "lm_head": 0 if a.tie_embeddings else a.vocab_size * dim}
    if a.mla:
        out.update(_mla_parts(a))
    if a.n_experts > 0:
        if not 0 < a.top_k <= a.n_experts:
            raise ValueError(f"top_k={a.top_k} must be in [1, n_experts={a.n_experts}]")
        expert = 3 * dim * (a.moe_ffn_dim or a.ffn_dim)
        shared = expert * a.n_shared_experts if a.shared_expert else 0
        out.update(expert=expert, experts=a.n_experts * expert, router=dim * a.n_experts, shared_expert=shared,
                   mlp=a.n_experts * expert + dim * a.n_experts + shared,
                   active_mlp=a.top_k * expert + dim * a.n_experts + shared)
    return out


def _mla_parts(a: Arch) -> dict:
    """Latent attention's matmul weights (usp/models/mla.py): q (wq_a + wq_b, or wq), wkv_a, wkv_b, wo; and
    its norms: the two RMSNorms of the block and the latents' (q_a_norm, kv_a_norm)."""
    heads, qk = a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
    q = a.dim * a.q_lora_rank + a.q_lora_rank * heads * qk if a.q_lora_rank else a.dim * heads * qk
    kv = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
    return {"attention": q + kv + heads * a.v_head_dim * a.dim, "norms": 2 * a.dim + a.q_lora_rank + a.kv_lora_rank}


@dataclass(frozen=True)
class Hardware:
    """One cluster's devices and links (ClusterConfig's hardware fields)."""

    device: str
    device_name: str
    memory_gib: float
    peak_tflops_bf16: float
    peak_tflops_fp32: float
    intra_node_gbps: float
    inter_node_gbps: float
    price_per_device_hour: float
    nodes: int
    procs_per_node: int
    timing: TimeConstants = TimeConstants()  # fitted by `usp calibrate` (usp/perf/time_constants.py)
    peak_tflops_fp8: float = 0.0  # 0: no FP8 matmul units
    hbm_gbps: float = 21.5  # device memory bandwidth, GB/s (element-wise kernels, the loss, the optimizer step)

    @classmethod
    def from_cluster(cls, c) -> Hardware:
        """From a cluster group (a ClusterConfig or a composed config's node)."""
        def g(key: str, default=None):
            return getattr(c, key, default)

        return cls(device=str(g("device", "cpu")), device_name=str(g("device_name", "cpu")),
                   memory_gib=float(g("device_memory_gb", 24.0)), peak_tflops_bf16=float(g("peak_tflops_bf16", 0.15)),
                   peak_tflops_fp32=float(g("peak_tflops_fp32", 0.15)),
                   intra_node_gbps=float(g("intra_node_gbps", 5.0)), inter_node_gbps=float(g("inter_node_gbps", 1.25)),
                   price_per_device_hour=float(g("price_per_device_hour", 0.0)),
                   nodes=int(g("nodes", 1)), procs_per_node=int(g("procs_per_node", 1)),
                   timing=TimeConstants.from_config(g("timing")), peak_tflops_fp8=float(g("peak_tflops_fp8", 0.0)),
                   hbm_gbps=float(g("hbm_gbps", 21.5)))

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node

    def peak_flops(self, precision: Precision) -> float:
        return 1e12 * (self.peak_tflops_bf16 if precision.name == "bf16" else self.peak_tflops_fp32)

    def with_nodes(self, nodes: int) -> Hardware:
        return replace(self, nodes=nodes)


@dataclass(frozen=True)
class Precision:
    """Bytes per value. fp32 = plain fp32 training (4 + 4 + 8 with AdamW). bf16 as a recipe stores
    it: bf16 parameters and gradients with fp32 master weights + Adam m, v in the optimizer (the
    playbook's 2 + 2 + 12: Megatron, nanotron), or fp32 parameters and gradients (4 + 4 + 8) that the
    matmuls read as bf16 copies (usp's engine: autocast, or FSDP2's bf16 all-gathers). `optim` is the
    named optimizer's: 4 bytes per fp32 state it keeps per parameter (optimizer_states), + the 4-byte
    fp32 master copy where the parameters are stored in bf16."""

    name: str  # bf16 | fp32
    param: int  # a stored parameter
    grad: int
    optim: int
    act: int
    compute: int = 0  # the copy of a parameter the matmuls read (0: the stored one, `param` bytes)
    compiled: bool = False  # train.compile (resolved): the blocks cast their weights inside the compiled graph
    fp8: str = "off"  # train.fp8: the blocks' linears compute in FP8 (torchao.float8), their casts are FP8 copies
    optimizer: str = "adamw"  # optimizer.name, whose states `optim` counts
    fp8_all_gather: bool = False  # FSDP gathers the FP8 linears' weights in FP8 (torchtitan's float8 all-gather)

    @property
    def copy_bytes(self) -> int:
        """Bytes of a parameter's low-precision working copy; 0 when the matmuls read the stored one."""
        return self.compute if self.compute and self.compute < self.param else 0

    @property
    def gathered(self) -> int:
        """Bytes of an all-gathered (unsharded) parameter or its gradient under FSDP."""
        return self.compute or self.param

    @classmethod
    def resolve(cls, dtype: str, device: str, fp32_params: bool = False, compiled: bool = False,
                fp8: str = "off", optimizer: str = "adamw", momentum: float = 0.9) -> Precision:
        """train.dtype on this device, as the recipe stores it, with the states of the named optimizer
        (optimizer.name and, for SGD, optimizer.momentum)."""
        if dtype not in DTYPES:
            from usp.errors import PlanError

            raise PlanError(f"unknown dtype; choose one of {', '.join(DTYPES)}", key="train.dtype", value=dtype,
                            fix="train.dtype=auto")
        fp8 = fp8 if fp8 in FP8_RECIPES else "off"  # an unknown recipe is the rules' to refuse
        states = 4 * optimizer_states(optimizer, momentum)  # fp32, like the parameters they follow
        if not uses_bf16(dtype, device):
            return cls("fp32", 4, 4, states, 4, compiled=compiled, fp8=fp8, optimizer=optimizer)
        if fp32_params:
            return cls("bf16", 4, 4, states, 2, compute=2, compiled=compiled, fp8=fp8, optimizer=optimizer)
        return cls("bf16", 2, 2, 4 + states, 2, compiled=compiled, fp8=fp8, optimizer=optimizer)  # + fp32 master


# fp32 tensors an optimizer keeps per parameter (torch.optim): AdamW and Adam exp_avg and exp_avg_sq,
# SGD its momentum_buffer (none without momentum)
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1}


def optimizer_states(name: str, momentum: float = 0.9) -> int:
    """States per parameter of optimizer.name (an unknown name counts as AdamW: the rules refuse it)."""
    if name == "sgd" and not momentum > 0:
        return 0
    return OPTIMIZER_STATES.get(name, 2)


def optimizer_state_label(prec: Precision) -> str:
    """What prec.optim counts, in words (the plan's assumptions)."""
    master = prec.param < 4  # bf16-stored parameters: the optimizer keeps fp32 master weights
    states = prec.optim - (4 if master else 0)
    what = {"adamw": "AdamW's m + v", "adam": "Adam's m + v", "sgd": "SGD's momentum"}.get(prec.optimizer, "m + v")
    parts = (["fp32 master"] if master else []) + [what if states else "SGD without momentum: no state"]
    return f"{prec.optim} B/param of optimizer state ({' + '.join(parts)})"


@dataclass(frozen=True)
class Layout:
    """One parallel layout: degrees, data-parallel flavour, pipeline schedule, batch split, recompute."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    zero1: bool = False
    reshard_after_forward: bool = True
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    pp_layers: tuple | None = None
    micro_batch: int = 1
    grad_accum: int = 1
    recompute: str = "none"
    ddp_bucket_mb: int = 25
    async_tp: bool = False  # TP collectives pipelined with their matmuls (torchtitan's async TP; not usp's engine)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_config(cls, degrees: dict, par, batch, recompute: str) -> Layout:
        """From parallelism.* (a ParallelismConfig or a composed config's node) and the batch split."""
        def g(key: str, default=None):
            return getattr(par, key, default)

        pp_layers = g("pp_layers", None)
        return cls(pp=int(degrees["pp"]), dp_replicate=int(degrees["dp_replicate"]), dp_shard=int(degrees["dp_shard"]),
                   cp=int(degrees["cp"]), tp=int(degrees["tp"]), ep=int(g("ep", 1)), zero1=bool(g("zero1", False)),
                   reshard_after_forward=bool(g("reshard_after_forward", True)),
                   pp_schedule=str(g("pp_schedule", "1f1b")), pp_virtual_stages=int(g("pp_virtual_stages", 1)),
                   pp_layers=tuple(int(x) for x in pp_layers) if pp_layers is not None else None,
                   micro_batch=int(batch.micro_batch), grad_accum=int(batch.grad_accum), recompute=str(recompute),
                   ddp_bucket_mb=int(g("ddp_bucket_mb", 25)))

    @cached_property
    def degrees(self) -> dict:
        return {d: getattr(self, d) for d in MESH_DIMS}

    @cached_property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def virtual(self) -> int:
        return self.pp_virtual_stages if self.pp > 1 else 1

    @property
    def schedule(self) -> str:
        return self.pp_schedule if self.pp > 1 else "none"

    @cached_property
    def dp_kind(self) -> str:
        return data_parallel_kind(self.degrees, self.zero1)

    @cached_property
    def zero_stage(self) -> int:
        """0 = DDP/replicated, 1 = ZeRO-1, 2 = ZeRO-2, 3 = ZeRO-3 (FSDP2 reshard_after_forward).
        zero1 with TP/PP is built as FSDP2 without resharding after forward: it holds ZeRO-2's memory."""
        kind = self.dp_kind
        if kind in ("fsdp", "hsdp"):
            return 3 if self.reshard_after_forward else 2
        return {"zero1": 1, "zero1_fsdp": 2}.get(kind, 0)

    @cached_property
    def shard_degree(self) -> int:
        """Ranks that split the parameters / grads / optimizer states of one model replica."""
        kind = self.dp_kind
        if kind in ("fsdp", "hsdp"):
            return self.dp_shard * self.cp
        if kind == "zero1":
            return self.dp_replicate * self.cp
        if kind == "zero1_fsdp":
            return self.dp_replicate  # cp = dp_shard = 1 here (else the kind is fsdp / hsdp)
        return 1

    def label(self) -> str:
        return ParallelDims.of(self.degrees, self.ep).label()

    def dp_label(self) -> str:
        kind = self.dp_kind
        if kind in ("fsdp", "hsdp"):
            return f"{kind.upper()} ZeRO-{self.zero_stage}"
        return {"ddp": "DDP", "zero1": "DDP + ZeRO-1", "replicate": "replicated (FSDP2, 1-rank shards)",
                "zero1_fsdp": "ZeRO-1 with TP/PP (FSDP2 over dp_replicate, gradients sharded too: ZeRO-2)",
                "none": "no data parallel"}[kind]

    def overrides(self) -> list[str]:
        """Config overrides that reproduce this layout."""
        out = [f"parallelism.{d}={getattr(self, d)}" for d in ("dp_replicate", "dp_shard", "tp", "pp", "cp")]
        if self.ep > 1:
            out.append(f"parallelism.ep={self.ep}")
        if self.dp_kind in ("fsdp", "hsdp"):
            out.append(f"parallelism.reshard_after_forward={str(self.reshard_after_forward).lower()}")
        if self.dp_kind in ("ddp", "zero1", "replicate", "zero1_fsdp"):
            out.append(f"parallelism.zero1={str(self.zero1).lower()}")
        if self.pp > 1:
            out += [f"parallelism.pp_schedule={self.pp_schedule}",
                    f"parallelism.pp_virtual_stages={self.pp_virtual_stages}"]
        out += [f"train.micro_batch={self.micro_batch}", f"train.recompute={self.recompute}"]
        return out


def group_crosses_nodes(degrees: dict, procs_per_node: int, dims: tuple) -> bool:
    """Does any process group along `dims` hold ranks of different nodes? Exactly the rank
    table's placement (usp.perf.layout.rank_table: row-major over MESH_DIMS, node = rank //
    procs_per_node), computed per group (first and last rank) instead of per rank."""
    idx = tuple(sorted(MESH_DIMS.index(d) for d in dims))
    return _crosses(tuple(degrees[d] for d in MESH_DIMS), procs_per_node, idx)


@lru_cache(maxsize=65536)
def _crosses(shape: tuple, per_node: int, idx: tuple) -> bool:
    if not idx or all(shape[i] == 1 for i in idx):
        return False
    world = math.prod(shape)
    if world <= per_node:
        return False
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    span = sum((shape[i] - 1) * strides[i] for i in idx)
    if span >= per_node:
        return True
    # every group base: coordinates 0 along idx, anything along the other dims
    others = [i for i in range(len(shape)) if i not in idx]
    bases = [0]
    for i in others:
        bases = [b + c * strides[i] for b in bases for c in range(shape[i])]
    return any(b // per_node != (b + span) // per_node for b in bases)
