"""Predicted step time, tokens/s, MFU and HFU of one layout (docs/planner.md "Time per step":
formulas, sources, what is not modelled). Every intermediate term stays in the TimingPlan so a
figure can be traced. The hardware's constants come from the cluster (`cluster.timing`,
usp/perf/time_constants.py), the training stack's from the profile (usp/perf/stack_profile.py).

Model, per optimizer step, on the busiest pipeline rank:

  matmuls     every linear runs three GEMMs per micro batch: forward (M = tokens, N = out, K = in),
              input gradient (M = tokens, N = in, K = out), weight gradient (M = out, N = in, K = tokens);
              a GEMM takes 2MNK / (peak x clock x E x K/(K + c_K)) + t0 (gemm_s; FP8 linears at the FP8
              peak x fp8_efficiency with their own c_K, + their casts through HBM).
  attention   12·s·(h/t) FLOPs per token at the stack's flash-attention share of the peak x s/(s + s_half).
  element-wise  the bytes a fused implementation moves per token (norms, RoPE, activation, residuals:
              elementwise_bytes_per_token) x the stack's factor / HBM bandwidth.
  loss        the stack's bytes per logit (tokens x V/t) / HBM, on the stage holding the LM head.
  host        the stack's cost per layer and micro batch, per micro batch, per step.
  recompute   full: the forward again; selective as the stack does it (usp: the element-wise kernels,
              Megatron: the core attention, torchtitan: every second matmul).
  comm        per collective of S bytes over n ranks, g of them per node: (n-1)·alpha + (n-1)/n·S / bw
              (all-gather, reduce-scatter); all-reduce by ring (2(n-1)/n·S, 2(n-1) steps) or tree (2·S,
              2·ceil(log2 n) steps), the cluster's choice or the faster; S / bw with in-network reduction;
              bw = nvlink_efficiency x the intra-node link inside a node, min(that, g x nic_efficiency x
              the per-GPU NIC) across nodes (each of the group's g GPUs of a node drives its own rail);
              bucketed reductions pay the latency per bucket.
  overlap     each collective hides behind its window as the stack does it (the last micro batch's
              backward, the first forward, every micro batch's forward / backward, the layer's
              attention) up to the stack's share; what is hidden slows compute by `interference` x its
              time; the rest is exposed.
  step        (m x micro batch + exposed TP/CP/EP/PP) x (1 + bubble) + pipeline stall + exposed data-parallel
              comm + accumulation between micro batches + optimizer (its bytes per parameter at a share of
              HBM bandwidth) + the stack's fixed cost per step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from usp.contract.dims import MESH_DIMS
from usp.contract.predictions import CommTerm, TimingPlan
from usp.errors import PlanError
from usp.perf.memory import ZERO_BUBBLE, compiled_loss, dense_layers_held, peak_bytes, stage_layer_counts
from usp.perf.specs import GIB, Arch, Hardware, Layout, Precision, group_crosses_nodes
from usp.perf.stack_profile import PROFILES, Profile, StackTime
from usp.perf.time_constants import TimeConstants

FA_BACKWARD = 2.5  # flash attention's backward takes ~2.5x its forward (the forward is 1/3.5 of the total)


@lru_cache(maxsize=65536)
def _per_node(shape: tuple, per_node: int, idx: tuple) -> int:
    """Ranks of the group through rank 0 along mesh dims `idx` that sit on rank 0's node."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    ranks = [0]
    for i in idx:
        ranks = [r + c * strides[i] for r in ranks for c in range(shape[i])]
    return max(1, sum(1 for r in ranks if r < per_node))


def _locality(layout: Layout, hw: Hardware, dims: tuple) -> tuple[bool, int]:
    """(does the group cross nodes, its ranks per node)."""
    return _locality_of(tuple(layout.degrees[d] for d in MESH_DIMS), hw.procs_per_node, dims)


@lru_cache(maxsize=65536)
def _locality_of(shape: tuple, per_node: int, dims: tuple) -> tuple[bool, int]:
    crosses = group_crosses_nodes(dict(zip(MESH_DIMS, shape)), per_node, dims)
    return crosses, _per_node(shape, per_node, tuple(sorted(MESH_DIMS.index(d) for d in dims)))


# --- the pieces: a GEMM, a collective ------------------------------------------------------------------

def gemm_s(m: float, n: float, k: float, peak: float, efficiency: float, half_k: float, fixed_s: float) -> float:
    """Seconds of one (m x k) @ (k x n) matmul: 2mnk / (peak x efficiency x k/(k + half_k)) + fixed_s."""
    return 2.0 * m * n * (k + half_k) / (peak * efficiency) + fixed_s


def link_gbps(hw: Hardware, crosses: bool, per_node: int, kind: str = "all_gather") -> float:
    """The bus bandwidth (GB/s per rank) a group's collective runs at."""
    c = hw.timing
    nvl = hw.intra_node_gbps * c.nvlink_efficiency
    if not crosses:
        return nvl
    if kind == "p2p":
        return hw.inter_node_gbps * c.nic_efficiency
    return min(nvl, max(1, per_node) * hw.inter_node_gbps * c.nic_efficiency)


def collective_s(kind: str, n: int, per_node: int, crosses: bool, nbytes: float, hw: Hardware) -> tuple[float, float,
                                                                                                          float]:
    """(seconds, GB/s, of which latency) of one collective call moving a tensor of `nbytes` over n ranks
    (per_node of them on each node). kind: all_gather | reduce_scatter | all_reduce | p2p | all_to_all."""
    if n <= 1:
        return 0.0, 0.0, 0.0
    c = hw.timing
    gbps = link_gbps(hw, crosses, per_node, kind)
    alpha = 1e-6 * (c.inter_latency_us if crosses else c.intra_latency_us)
    if kind == "p2p":
        return alpha + nbytes / (gbps * 1e9), gbps, alpha
    if kind == "all_reduce":
        seconds, latency = _all_reduce(c, n, nbytes, gbps * 1e9, alpha)
        return seconds, gbps, latency
    return (n - 1) * alpha + (n - 1) / n * nbytes / (gbps * 1e9), gbps, (n - 1) * alpha


def _all_reduce(c: TimeConstants, n: int, nbytes: float, bw: float, alpha: float) -> tuple[float, float]:
    """(seconds, of which latency) of an all-reduce: ring (2(n-1) steps, 2(n-1)/n S per rank), tree (2
    ceil(log2 n) steps, 2 S per rank: NVIDIA/nccl#457), whichever is faster (auto: NCCL's tuner picks the
    fastest algorithm per size), or in-network (NVLS / SHARP: S up and down)."""
    ring = (2 * (n - 1) * alpha, 2 * (n - 1) / n * nbytes / bw)
    tree = (2 * math.ceil(math.log2(n)) * alpha, 2 * nbytes / bw)
    if c.in_network_reduction:
        tree = (tree[0], nbytes / bw)
    pick = {"ring": ring, "tree": tree}.get(c.all_reduce, min(ring, tree, key=sum))
    return pick[0] + pick[1], pick[0]


# --- the layout's geometry (no constant) ---------------------------------------------------------------

@dataclass(frozen=True)
class Comm:
    """One communication term's geometry: `calls` collectives of `call_bytes` each over `group` ranks.
    It hides behind `window` ("" none; "self": the stack hides `overlap` of it whatever the compute; "bwd"
    the last micro batch's backward, "fwd" the first one's forward, "fwd_m" / "bwd_m" every micro batch's
    forward / backward, "attn" the attention of its layers) up to the stack's share `overlap` (a StackTime
    field; "" = never); comms sharing a window share its time. `unhidden` calls can never hide (FSDP's
    first gather and last reduce-scatter)."""

    name: str
    dims: str
    kind: str
    group: int
    crosses: bool
    per_node: int
    calls: int
    call_bytes: float
    window: str = ""
    overlap: str = ""
    path: bool = False  # on the pipeline's critical path (TP / CP / EP / PP)
    stall_ops: int = 0  # blocking pipeline sends/recvs per step on the busiest stage (each pays the p2p stall)
    unhidden: int = 0
    host_us: str = ""  # a StackTime field: host cost per call (pipeline sends)
    per_layer: bool = False  # `calls` per layer of the pp rank (TP, CP, EP): x the busiest rank's layers
    moe_only: bool = False  # per layer, its MoE layers only (EP: a MoE model's dense first blocks exchange nothing)

    @property
    def bytes_per_step(self) -> float:
        n = self.group
        return self.calls * {"all_reduce": 2 * (n - 1) / n, "p2p": 1.0}.get(self.kind, (n - 1) / n) * self.call_bytes


def _term(name: str, dims: tuple, kind: str, n: int, layout: Layout, hw: Hardware, calls: int, call_bytes: float,
          window: str = "", overlap: str = "", path: bool = False, stall_ops: int = 0, unhidden: int = 0,
          host_us: str = "", per_layer: bool = False, moe_only: bool = False) -> Comm:
    crosses, per_node = _locality(layout, hw, dims) if dims != ("tied",) else (
        group_crosses_nodes(layout.degrees, hw.procs_per_node, ("pp",)), 1)
    return Comm(name, " x ".join(dims), kind, n, crosses, per_node, calls if n > 1 else 0, call_bytes, window,
                overlap, path, stall_ops if n > 1 else 0, min(unhidden, calls), host_us, per_layer, moe_only)


@dataclass(frozen=True)
class Gemms:
    """A set of matmuls summed: time = (flops + half_k x flops_per_k) / (peak x efficiency) + calls x fixed."""

    flops: float = 0.0  # sum of 2MNK
    flops_per_k: float = 0.0  # sum of 2MN
    calls: float = 0.0

    def plus(self, m: float, n: float, k: float, count: float = 1.0) -> Gemms:
        return Gemms(self.flops + 2 * m * n * k * count, self.flops_per_k + 2 * m * n * count, self.calls + count)

    def __add__(self, o: Gemms) -> Gemms:
        return Gemms(self.flops + o.flops, self.flops_per_k + o.flops_per_k, self.calls + o.calls)


@dataclass(frozen=True)
class LayerWork:
    """One layer's work for one micro batch on one rank, forward and backward, by kind."""

    fwd: Gemms = Gemms()  # bf16 forward GEMMs
    bwd: Gemms = Gemms()  # bf16 input- and weight-gradient GEMMs
    fwd8: Gemms = Gemms()  # FP8 forward GEMMs
    bwd8: Gemms = Gemms()
    op: Gemms = Gemms()  # the forward GEMMs selective "op" recompute re-runs (bf16)
    op8: Gemms = Gemms()
    attn_flops: float = 0.0  # attention scores, forward + backward
    elem_bytes: float = 0.0  # element-wise bytes as a fused implementation moves them, forward + backward
    cast_elems: float = 0.0  # elements FP8 linears cast (input, weight, output gradient)


@dataclass(frozen=True)
class TimeShape:
    """Everything about one layout's step that does not depend on the constants: the time model is
    `evaluate(shape, hw, stack)`, so `usp calibrate` builds each run's shape once."""

    peak: float  # FLOP/s (bf16 or fp32 datasheet peak: the MFU denominator)
    tokens_mb: float  # tokens one rank processes per micro batch
    grad_accum: int
    bubble: float
    recompute: str  # none | selective | full
    selective: str  # the profile's StackProfile.selective
    recompute_extra: float
    busiest: int  # pp rank with the most matmul FLOPs (its layers set the collectives)
    stage_layers: tuple
    head_ranks: tuple  # pp ranks holding the LM head
    layer: LayerWork
    head_fwd: Gemms
    head_bwd: Gemms
    seq_len: int
    comms: tuple  # Comm
    optimizer_params: float  # parameters the rank's optimizer steps
    accum_params: float  # parameters whose gradients the rank accumulates between micro batches
    tokens_per_step: int
    model_fpt: float
    hw_fpt: float
    world: int
    nodes: int = 1
    tp: int = 1  # tensor-parallel degree (the p2p stall's TP wait)
    memory_fraction: float = 0.0  # predicted peak of the fullest stage / device memory (the p2p stall)
    logits_mb: float = 0.0  # logits the head's stage handles per micro batch (tokens x vocabulary/tp)
    compiled: bool = False  # train.compile (or the stack's own fused kernels): no eager cost
    compiled_loss: bool = False  # the loss compiled too (not under TP): no eager_loss_ps_per_logit
    fp8_peak: float = 0.0  # FLOP/s of FP8 matmuls under train.fp8; 0 = off
    matmul_flops_mb: float = 0.0  # matmul FLOPs of one micro batch on the busiest rank (the efficiency figure)
    hbm: float = 1.0  # bytes/s
    balanced: bool = False  # the profile times its stages as a split balanced by cost would (Profile.time_split)
    stage_dense: tuple = ()  # of stage_layers, a MoE model's dense first blocks (model.n_dense_layers) per pp rank
    dense_layer: LayerWork = LayerWork()  # one of those blocks' work (attention + a dense SwiGLU of ffn_dim)

    @property
    def layers_r(self) -> int:
        return self.stage_layers[self.busiest]


def rank_params(arch: Arch, layout: Layout, split: str = "params") -> list[float]:
    """Parameters on one rank of each pp rank (after TP / EP slicing), layers split as the profile
    splits them (Profile.pp_split)."""
    t = layout.tp
    ep = max(1, layout.ep) if arch.moe else 1
    counts, ranks = stage_layer_counts(arch, layout.pp, layout.virtual, layout.schedule, layout.pp_layers, split)
    layer = arch.attn_params_over(t) + arch.dense_mlp_params / (1 if arch.moe else t) + arch.router_params \
        + arch.norm_params + arch.expert_params / ep  # a MoE layer is not TP-sliced
    dense = arch.attn_params_over(t) + arch.parts["dense_mlp"] / t + arch.norm_params  # a MoE model's dense block
    vocab_pad = -(-arch.vocab_size // t) * t
    out = []
    for held in ranks:
        n_dense = dense_layers_held(arch, counts, held)
        n = (sum(counts[i] for i in held) - n_dense) * layer + n_dense * dense
        if 0 in held:
            n += vocab_pad * arch.dim / t
        if len(counts) - 1 in held:  # final norm, + the LM head unless it is the embedding (tied, no pp)
            n += arch.dim + (0 if arch.tie_embeddings and layout.pp == 1 else vocab_pad * arch.dim / t)
        out.append(n)
    return out


def _flops_per_token(arch: Arch, layout: Layout, seq_len: int) -> tuple[float, float]:
    """(model FLOPs per token: the MFU numerator, hardware FLOPs per token). Full recomputation runs each
    block's forward (1/3 of its training FLOPs) again; the LM head is not recomputed."""
    blocks_fpt = 6 * (arch.matmul_params - arch.vocab_size * arch.dim) \
        + 12 * (arch.n_layers + arch.mtp_depth) * arch.score_dim * seq_len
    model_fpt = blocks_fpt + 6 * arch.vocab_size * arch.dim
    return model_fpt, model_fpt + _recompute_extra(layout) * blocks_fpt


def _recompute_extra(layout: Layout) -> float:
    return 1 / 3 if layout.recompute == "full" else 0.0


def linears(arch: Arch, layout: Layout, fused: bool) -> list[tuple[str, float, float]]:
    """(name, in, out) of one dense layer's linears on one TP rank, in forward order."""
    h, kv, f, t, q = arch.dim, arch.kv_dim, arch.ffn_dim, layout.tp, arch.q_dim
    out: list[tuple[str, float, float]] = [("qkv", h, (q + 2 * kv) / t)] if fused else [
        ("q", h, q / t), ("k", h, kv / t), ("v", h, kv / t)]
    if arch.mla:  # latent attention (usp/models/mla.py): the low-rank projections whole on every TP rank
        r, c, v = arch.q_lora_rank, arch.kv_lora_rank, arch.n_heads * arch.v_head_dim
        out = [("q_a", h, r), ("q_b", r, q / t)] if r else [("q", h, q / t)]
        out += [("kv_a", h, c + arch.qk_rope_head_dim),
                ("kv_b", c, arch.n_heads * (arch.qk_nope_head_dim + arch.v_head_dim) / t), ("o", v / t, h)]
    else:
        out.append(("o", q / t, h))
    if arch.gated:
        out += [("w13", h, 2 * f / t)] if fused else [("w1", h, f / t), ("w3", h, f / t)]
    else:
        out.append(("up", h, f / t))
    out.append(("down", f / t, h))
    return out


def elementwise_bytes_per_token(arch: Arch) -> float:
    """Bytes the non-matmul kernels of one layer move per token, forward + backward, as fused kernels
    move them (bf16): forward reads and writes norm 1 (2h), RoPE on q, k (2(q + kv)), the residual add
    (3h), norm 2 (2h), SwiGLU (3f: reads gate and up, writes their product) or GeLU (2f), the residual
    add (3h), QK-norm on q, k (2(q + kv), model.qk_norm); the backward about twice the forward."""
    h, kv, f, q = arch.dim, arch.kv_dim, arch.ffn_dim, arch.q_dim
    fwd = (10 * h + 2 * q + 2 * kv + 3 * f) if arch.gated else (10 * h + 2 * f)
    fwd += 2 * (q + kv) if arch.qk_norm else 0
    return 3 * 2 * fwd


def _imbalance(arch: Arch, layout: Layout) -> float:
    """Tokens on the busiest EP rank over the mean: model.expert_load_imbalance (measured max / mean
    per expert: an upper bound for a rank holding several experts). Without EP every rank runs
    every token's experts, whatever their balance."""
    return arch.expert_load_imbalance if arch.moe and layout.ep > 1 else 1.0


def ep_assumption(arch: Arch, layout: Layout) -> list[str]:
    if not (arch.moe and layout.ep > 1):
        return []
    imbalance = _imbalance(arch, layout)
    if imbalance == 1.0:
        return ["EP all-to-all and expert compute: experts assumed balanced (model.expert_load_imbalance=1; "
                "give the measured max/mean tokens per expert, metrics.jsonl expert_load)"]
    return [f"EP all-to-all and expert compute x {imbalance:g} on the busiest rank: the measured "
            f"model.expert_load_imbalance (max/mean tokens per expert)"]


def _layer_work(arch: Arch, layout: Layout, seq_len: int, prec: Precision, profile: Profile) -> LayerWork:
    """One layer's GEMMs (three per linear), attention FLOPs, element-wise bytes and FP8 casts, one micro
    batch on one rank (T tokens)."""
    t_tok, fp8 = layout.micro_batch * seq_len / layout.cp, prec.fp8 != "off"
    w = {"fwd": Gemms(), "bwd": Gemms(), "fwd8": Gemms(), "bwd8": Gemms(), "op": Gemms(), "op8": Gemms()}
    casts = 0.0

    def add(m: float, k_in: float, n_out: float, count: float = 1.0, convert: bool = False, again: bool = False):
        nonlocal casts
        s = "8" if convert else ""
        w["fwd" + s] = w["fwd" + s].plus(m, n_out, k_in, count)
        w["bwd" + s] = w["bwd" + s].plus(m, k_in, n_out, count).plus(n_out, k_in, m, count)
        if again:
            w["op" + s] = w["op" + s].plus(m, n_out, k_in, count)
        if convert:
            casts += count * (m * k_in + n_out * k_in + m * n_out)

    dense = [x for x in linears(arch, layout, profile.fused_projections) if not (arch.moe and x[0] in (
        "w13", "w1", "w3", "up", "down"))]
    for i, (_, k_in, n_out) in enumerate(dense, start=1):  # torchtitan's op SAC: every second mm again
        add(t_tok, k_in, n_out, convert=fp8, again=i % 2 == 0)
    if arch.moe:
        _moe_gemms(arch, layout, t_tok, add)
    attn = 12.0 * seq_len * (arch.score_dim / layout.tp) * t_tok
    elem = elementwise_bytes_per_token(arch) * t_tok / layout.tp
    return LayerWork(w["fwd"], w["bwd"], w["fwd8"], w["bwd8"], w["op"], w["op8"], attn, elem, casts)


def _moe_gemms(arch: Arch, layout: Layout, t_tok: float, add) -> None:
    """A MoE layer (not TP-sliced): the router, each local expert's SwiGLU over the tokens routed to it
    (the busiest EP rank's: x model.expert_load_imbalance), the shared expert over every token (it needs
    no all-to-all: every rank runs it on its own tokens)."""
    h, fe = arch.dim, arch.moe_ffn_dim or arch.ffn_dim
    local = arch.n_experts / (layout.ep if layout.ep > 1 else 1)
    routed = t_tok * arch.top_k * _imbalance(arch, layout) / local
    add(t_tok, h, arch.n_experts)
    fs = fe * arch.n_shared_experts  # the shared expert: n_shared_experts experts wide (DeepSeek-V3)
    for (k_in, n_out), shared in zip(((h, fe), (h, fe), (fe, h)), ((h, fs), (h, fs), (fs, h)), strict=True):
        add(routed, k_in, n_out, count=local)
        if arch.shared_expert:
            add(t_tok, *shared)


def _stages(arch: Arch, layout: Layout, seq_len: int, split: str) -> tuple[tuple, tuple, tuple, int]:
    """(layers per pp rank, of them a MoE model's dense first blocks, the pp ranks holding the LM head, the
    rank with the most FLOPs)."""
    counts, ranks = stage_layer_counts(arch, layout.pp, layout.virtual, layout.schedule, layout.pp_layers, split)
    layers = tuple(sum(counts[i] for i in held) for held in ranks)
    dense = tuple(dense_layers_held(arch, counts, held) for held in ranks)
    heads = tuple(r for r, held in enumerate(ranks) if len(counts) - 1 in held)
    scores = 2 * arch.score_dim * seq_len
    per_layer = arch.active_layer_matmul_params + scores
    per_dense = arch.parts["attention"] + arch.parts["dense_mlp"] + scores
    busiest = max(range(layout.pp), key=lambda r: (layers[r] - dense[r]) * per_layer + dense[r] * per_dense + (
        arch.vocab_size * arch.dim if r in heads else 0))
    return layers, dense, heads, busiest


# --- communication -------------------------------------------------------------------------------------

# The sequence-parallel collectives a block's recompute runs again, per layer (all-gathers, reduce-scatters),
# measured by counting the functional collectives of usp's own TP block on gloo. torch's checkpoint replays
# the block's forward, takes the saved ops' outputs from its cache (selective) and stops once every tensor the
# backward needs exists: the block's last reduce-scatter (its output) never runs again. usp's selective policy
# saves matmuls and attention, so it re-runs as much as full recompute; torchtitan's per-op policy also saves
# reduce_scatter_tensor; Megatron's and nanotron's core-attention recompute re-runs no collective, and
# Megatron's full recompute replays the whole layer (Profile.recompute_replays_layer).
def _tp_reruns(recompute: str, profile: Profile) -> tuple[int, int]:
    if recompute == "full":
        return (2, 2) if profile.recompute_replays_layer else (2, 1)
    if recompute == "selective":
        return {"elementwise": (2, 1), "op": (2, 0)}.get(profile.selective, (0, 0))
    return 0, 0


def _tp_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision,
             profile: Profile) -> list[Comm]:
    """Tensor parallel (+ sequence parallel): 2 all-gathers + 2 reduce-scatters per layer, forward and
    backward, each of the micro batch's full activation (b·s·h), and those the recompute runs again
    (_tp_reruns); calls per layer of the pp rank."""
    size = (seq_len / layout.cp) * layout.micro_batch * arch.dim * prec.act
    overlap = "async_tp_overlap" if layout.async_tp else "tp_overlap"
    reruns = _tp_reruns(layout.recompute, profile)
    return [_term(f"TP {kind.replace('_', '-')} (activations)", ("tp",), kind, layout.tp, layout, hw,
                  (4 + again) * layout.grad_accum, size, "self", overlap, path=True, per_layer=True)
            for kind, again in zip(("all_gather", "reduce_scatter"), reruns)]


def _cp_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision,
             profile: Profile) -> list[Comm]:
    """Context parallel, per layer of this pp rank and micro batch. usp's engine: the ring passes a K/V
    block c-1 times forward (again when recomputed), c-1 times backward, and the dK/dV accumulator c
    times, fp32 blocks expanded to every query head (usp/engine/parallel/context_parallel.py). A flash
    ring (kv): 3(c-1) exchanges of the K/V of the KV heads in bf16. Llama 3's all-gather (allgather):
    3 all-gathers of K and V per layer, exposed. torch's context_parallel as torchtitan called it at the
    end of 2024 (torch): its model repeats K/V to every query head before SDPA, so torch's ring moves
    them all; one bf16 all-gather per forward pass (again when recomputed) and one in the backward, and
    the fp32 dK/dV accumulator rotated c times by all-to-all. The rings hide behind their layer's
    attention."""
    if profile.cp_ring == "torch":
        return _torch_cp_comms(arch, layout, seq_len, hw, prec)
    c, t, m = layout.cp, layout.tp, layout.grad_accum
    tokens = (seq_len / c) * layout.micro_batch
    if profile.cp_ring == "usp":
        kv = 2 * tokens * arch.q_dim / t * 4
        hops = (2 if layout.recompute == "full" else 1) * (c - 1) + (c - 1) + c
        return [_term("CP ring K/V exchange", ("cp",), "p2p", c, layout, hw, hops * m, kv, "attn",
                      "cp_overlap", path=True, per_layer=True)]
    kv = 2 * tokens * arch.kv_dim / t * prec.act
    if profile.cp_ring == "allgather":
        return [_term("CP K/V all-gather", ("cp",), "all_gather", c, layout, hw, 3 * m, kv * c, path=True,
                      per_layer=True)]
    return [_term("CP ring K/V exchange", ("cp",), "p2p", c, layout, hw, 3 * (c - 1) * m, kv, "attn",
                  "cp_overlap", path=True, per_layer=True)]


def _torch_cp_comms(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision) -> list[Comm]:
    """torch.distributed.tensor.experimental.context_parallel with its all-gather rotation (torchtitan's
    default since 2024-12): the gathered K/V arrive while the first sub-SDPA (the local block) runs, and
    each step's dK/dV all-to-all while the next step's backward does; both counted behind the attention."""
    c, t, m = layout.cp, layout.tp, layout.grad_accum
    tokens = (seq_len / c) * layout.micro_batch
    gathers = (2 if layout.recompute == "full" else 1) + 1
    kv = 2 * tokens * arch.q_dim / t * prec.act  # K and V repeated to every query head
    dkv = 2 * tokens * arch.q_dim / t * 4  # the fp32 accumulator (convert_to_f32)
    return [_term("CP K/V all-gather (every head)", ("cp",), "all_gather", c, layout, hw, gathers * m, kv * c, "attn",
                  "cp_overlap", path=True, per_layer=True),
            _term("CP dK/dV rotation (fp32)", ("cp",), "p2p", c, layout, hw, c * m, dkv, "attn", "cp_overlap",
                  path=True, per_layer=True)]


def _ep_comm(arch: Arch, layout: Layout, hw: Hardware, prec: Precision, tokens_mb: float) -> Comm:
    """Expert parallel: dispatch + combine all-to-alls, forward and backward, per layer: the routed copies
    (top_k per token); a shared expert runs on each rank's own tokens and sends none. A MoE model's dense
    first layers (model.n_dense_layers) exchange nothing: calls per MoE layer of the pp rank (moe_only)."""
    passes = 3 if layout.recompute == "full" else 2
    calls = 2 * passes * layout.grad_accum
    size = tokens_mb * arch.top_k * arch.dim * prec.act * _imbalance(arch, layout)  # the busiest rank's
    return Comm("EP all-to-all (tokens)", "ep", "all_to_all", layout.ep, _ep_crosses_nodes(layout, hw),
                min(layout.ep, hw.procs_per_node), calls, size, path=True, per_layer=True, moe_only=True)


def _ep_crosses_nodes(layout: Layout, hw: Hardware) -> bool:
    """An EP group is `ep` consecutive ranks of the flattened dp_shard x cp (the inner part,
    DistContext.expert_mesh), tp apart: aligned blocks of ep·tp ranks. Does one straddle two nodes?"""
    block, ppn = layout.ep * layout.tp, hw.procs_per_node
    if hw.nodes == 1 or block > ppn:
        return hw.nodes > 1
    return ppn % block != 0 and any(b // ppn != (b + block - 1) // ppn for b in range(0, layout.world, block))


def _pp_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision) -> Comm:
    """Pipeline: per micro batch and virtual stage a middle stage receives and sends the activations
    (sequence-sharded under TP + SP: b·s/c·h/t) and receives and sends their gradients: 4 transfers (an
    end stage 2: every stage at pp = 2), each paying the stack's host cost, each blocking: each pays the
    p2p stall (pipeline_stall_s)."""
    calls = 2 * min(layout.pp - 1, 2) * layout.grad_accum * layout.virtual
    size = (seq_len / layout.cp) * layout.micro_batch * arch.dim * prec.act / layout.tp
    stall_ops = 2 * min(layout.pp - 1, 2) * layout.grad_accum * layout.virtual
    return _term("PP send/recv (activations, grads)", ("pp",), "p2p", layout.pp, layout, hw, calls, size, "self",
                 "pp_overlap", path=True, stall_ops=stall_ops, host_us="pp_p2p_us")


def _path_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision, tokens_mb: float,
               profile: Profile) -> list[Comm]:
    """The communication on the pipeline's critical path: TP, CP, EP (per layer), PP."""
    comm = []
    if layout.tp > 1:
        comm += _tp_comm(arch, layout, seq_len, hw, prec, profile)
    if layout.cp > 1:
        comm.extend(_cp_comm(arch, layout, seq_len, hw, prec, profile))
    if arch.moe and layout.ep > 1:
        comm.append(_ep_comm(arch, layout, hw, prec, tokens_mb))
    if layout.pp > 1:
        comm.append(_pp_comm(arch, layout, seq_len, hw, prec))
    return comm


def _grad_bytes(prec: Precision, profile: Profile) -> int:
    return profile.reduce_bytes or prec.grad


def _buckets(nbytes: float, layout: Layout, profile: Profile) -> int:
    bucket = profile.dp_bucket_mb * 1e6 if profile.dp_bucket_mb else layout.ddp_bucket_mb * 2 ** 20
    return max(1, int(nbytes // bucket) + 1)


def _replicated_dp_comm(layout: Layout, hw: Hardware, prec: Precision, psi: float, layers_r: int,
                        profile: Profile) -> list[Comm]:
    """DDP / ZeRO-1 / FSDP2 replication: the gradient reduction (+ ZeRO-1's parameter gather), as the
    profile's recipe runs it (Profile.zero1), also with TP/PP where it reduces once per step."""
    kind, dims = dp_kind(layout, profile), ("dp_replicate", "cp")
    n = layout.dp_replicate * layout.cp
    gbytes = _grad_bytes(prec, profile) * psi
    pbytes = (profile.param_gather_bytes or prec.param) * psi
    if kind == "replicate":
        units = layers_r + 1
        return [_term("DP gradient all-reduce", dims, "all_reduce", n, layout, hw, units, gbytes / units, "bwd",
                      "dp_overlap")]
    calls = _buckets(gbytes, layout, profile)
    if kind not in ("zero1", "zero1_fsdp"):
        return [_term("DP gradient all-reduce", dims, "all_reduce", n, layout, hw, calls, gbytes / calls, "bwd",
                      "dp_overlap")]
    if profile.zero1 == "distributed":
        gathers = _buckets(pbytes, layout, profile)
        return [_term("ZeRO-1 gradient reduce-scatter", dims, "reduce_scatter", n, layout, hw, calls, gbytes / calls,
                      "bwd", "dp_overlap"),
                _term("ZeRO-1 parameter all-gather (next forward)", dims, "all_gather", n, layout, hw, gathers,
                      pbytes / gathers, "fwd", "param_gather_overlap")]
    if profile.zero1 == "blocking":
        gathers = _buckets(pbytes, layout, profile)
        return [_term("ZeRO-1 gradient all-reduce (blocking)", dims, "all_reduce", n, layout, hw, calls,
                      gbytes / calls),
                _term("ZeRO-1 parameter all-gather (after the step)", dims, "all_gather", n, layout, hw, gathers,
                      pbytes / gathers)]
    return [_term("DP gradient all-reduce", dims, "all_reduce", n, layout, hw, calls, gbytes / calls, "bwd",
                  "dp_overlap"),
            _term("ZeRO-1 parameter all-gather (after the step)", dims, "all_gather", n, layout, hw, 1, pbytes)]


def _sharded_dp_comm(layout: Layout, hw: Hardware, prec: Precision, psi: float, layers_r: int,
                     profile: Profile) -> list[Comm]:
    """FSDP / HSDP / ZeRO-1 with TP/PP (FSDP2 over dp_replicate): one unit per layer + the root. Parameter
    all-gathers in the dtype the matmuls read (forward, and backward under ZeRO-3) every micro batch (or
    once a step: Profile.fsdp_gather_per_micro_batch), each prefetched behind the previous unit's compute
    (the first never hides); the gradient reduce-scatter once a step (usp: sync off on inner micro batches;
    every micro batch: Profile.fsdp_reduce_per_micro_batch), the last unit's never hidden; HSDP's
    all-reduce of the shard over the replicas."""
    m = layout.grad_accum
    gbytes = _grad_bytes(prec, profile) * psi
    pbytes = (1 if prec.fp8_all_gather and prec.fp8 != "off" else prec.gathered) * psi
    dims = ("dp_replicate",) if layout.dp_kind == "zero1_fsdp" else ("dp_shard", "cp")
    n, units = layout.shard_degree, layers_r + 1
    n_ag = m if profile.fsdp_gather_per_micro_batch else 1
    n_rs = m if profile.fsdp_reduce_per_micro_batch else 1
    out = [_term("FSDP all-gather (forward)", dims, "all_gather", n, layout, hw, units * n_ag, pbytes / units,
                 "fwd_m" if n_ag > 1 else "fwd", "dp_overlap", unhidden=n_ag)]
    if layout.zero_stage == 3:
        out.append(_term("FSDP all-gather (backward)", dims, "all_gather", n, layout, hw, units * n_ag,
                         pbytes / units, "bwd_m" if n_ag > 1 else "bwd", "dp_overlap"))
    out.append(_term("FSDP gradient reduce-scatter", dims, "reduce_scatter", n, layout, hw, units * n_rs,
                     gbytes / units, "bwd_m" if n_rs > 1 else "bwd", "dp_overlap", unhidden=n_rs))
    if layout.dp_kind == "hsdp":
        r = layout.dp_replicate
        out.append(_term("HSDP gradient all-reduce (replicas)", ("dp_replicate",), "all_reduce", r, layout, hw, units,
                         gbytes / n / units, "bwd", "dp_overlap"))
    return out


def dp_kind(layout: Layout, profile: Profile) -> str:
    """The data-parallel flavour as the profile's stack builds the layout: usp's (Layout.dp_kind: cp ranks
    shard the model under FSDP2), or a Megatron-like stack's (data_parallel="nanotron"): without dp_shard,
    DDP or ZeRO-1 over dp_replicate x cp whatever tp, pp and cp."""
    if profile.data_parallel == "nanotron" and layout.dp_shard == 1:
        if layout.dp_replicate * layout.cp == 1:
            return "none"
        return "zero1" if layout.zero1 else "ddp"
    return layout.dp_kind


def shard_degree(layout: Layout, profile: Profile) -> int:
    """Ranks the optimizer states are sharded over, as the profile's stack builds the layout."""
    if dp_kind(layout, profile) == "zero1" and profile.data_parallel == "nanotron":
        return layout.dp_replicate * layout.cp
    return layout.shard_degree


def _dp_comm(arch: Arch, layout: Layout, hw: Hardware, prec: Precision, layers_r: int, psi: float,
             profile: Profile, dense_r: int = 0) -> list[Comm]:
    """The data-parallel communication of the busiest rank's parameters psi (+ the tied embedding's sum);
    dense_r of its layers_r layers are a MoE model's dense first blocks (no experts)."""
    tied = [_tied_comm(arch, layout, hw, prec, profile)] if arch.tie_embeddings and layout.pp > 1 \
        and layout.pp_schedule != "zbv" else []  # zbv: first and last stage on one rank, summed locally
    kind = dp_kind(layout, profile)
    if kind in ("ddp", "zero1", "replicate") or (kind == "zero1_fsdp" and profile.zero1_once_per_step):
        return _replicated_dp_comm(layout, hw, prec, psi, layers_r, profile) + tied
    if kind in ("fsdp", "hsdp", "zero1_fsdp"):
        return _sharded_dp_comm(layout, hw, prec, _fsdp_equivalent(arch, layout, psi, layers_r - dense_r),
                                layers_r, profile) + tied
    return tied


def _tied_comm(arch: Arch, layout: Layout, hw: Hardware, prec: Precision, profile: Profile) -> Comm:
    """Tied embeddings under pp: the embedding's and its LM-head copy's gradients (V·h/t, sharded
    like the gradients under ZeRO-2/3) all-reduced between the first and the last stage's pp ranks,
    once per step after the data-parallel reduction, before the optimizer: exposed."""
    vocab_pad = -(-arch.vocab_size // layout.tp) * layout.tp
    shard = layout.shard_degree if layout.zero_stage >= 2 and not profile.zero1_once_per_step else 1
    size = _grad_bytes(prec, profile) * vocab_pad * arch.dim / layout.tp / shard
    return _term("tied embedding gradient all-reduce (first + last stage)", ("tied",), "all_reduce", 2, layout, hw,
                 1, size)


def _fsdp_equivalent(arch: Arch, layout: Layout, psi: float, moe_layers_r: int) -> float:
    """Parameters whose traffic over dp_shard x cp (n ranks) equals this rank's: under EP the experts'
    FSDP unit (of each of its MoE layers) spans only the n/ep ranks of dp_shard_mod_ep, so they move
    (n/ep-1)/(n/ep) of their bytes, not (n-1)/n (none when ep = n)."""
    n, ep = layout.dp_shard * layout.cp, layout.ep if arch.moe else 1
    if ep <= 1 or n <= 1:
        return psi
    experts, n_e = moe_layers_r * arch.expert_params / ep, n // ep
    return psi - experts + experts * ((n_e - 1) / n_e) / ((n - 1) / n)


def _bubble(layout: Layout) -> float:
    """Idle fraction of the pipeline: (p-1)/m, (p-1)/(v·m) interleaved, 0 for zero-bubble schedules."""
    p, m = layout.pp, layout.grad_accum
    if p == 1 or layout.pp_schedule in ZERO_BUBBLE:
        return 0.0
    if layout.pp_schedule == "interleaved_1f1b":
        return (p - 1) / (layout.virtual * m)
    return (p - 1) / m


def time_shape(arch: Arch, layout: Layout, seq_len: int, global_batch: int, hw: Hardware, prec: Precision,
               profile: Profile, peak: float | None = None) -> TimeShape:
    """The layout's step geometry: GEMM shapes, attention, element-wise bytes, collectives, optimizer state
    (no fitted constant). peak: the predicted peak bytes of the fullest stage (usp.perf.memory.peak_bytes;
    computed if None)."""
    model_fpt, hw_fpt = _flops_per_token(arch, layout, seq_len)
    layers, dense, heads, busiest = _stages(arch, layout, seq_len, profile.pp_split)
    tokens_mb = layout.micro_batch * seq_len / layout.cp
    psi = max(rank_params(arch, layout, profile.pp_split))
    comms = _path_comm(arch, layout, seq_len, hw, prec, tokens_mb, profile) \
        + _dp_comm(arch, layout, hw, prec, layers[busiest], psi, profile, dense[busiest])
    vocab_t = -(-arch.vocab_size // layout.tp)
    work = _layer_work(arch, layout, seq_len, prec, profile)
    # a MoE model's dense first blocks: attention and a TP-sliced SwiGLU of ffn_dim, as a dense model's
    dense_work = _layer_work(replace(arch, n_experts=0), layout, seq_len, prec, profile) if any(dense) \
        else LayerWork()
    head_fwd = Gemms().plus(tokens_mb, vocab_t, arch.dim)
    head_bwd = Gemms().plus(tokens_mb, arch.dim, vocab_t).plus(vocab_t, arch.dim, tokens_mb)
    matmul = (layers[busiest] - dense[busiest]) * _matmul_flops(work) + dense[busiest] * _matmul_flops(dense_work) \
        + (head_fwd.flops + head_bwd.flops if busiest in heads else 0.0)
    return TimeShape(peak=hw.peak_flops(prec), tokens_mb=tokens_mb, grad_accum=layout.grad_accum,
                     bubble=_bubble(layout), recompute=layout.recompute, selective=profile.selective,
                     recompute_extra=_recompute_extra(layout), busiest=busiest, stage_layers=layers, head_ranks=heads,
                     layer=work, head_fwd=head_fwd, head_bwd=head_bwd, seq_len=seq_len, comms=tuple(comms),
                     optimizer_params=psi / shard_degree(layout, profile), accum_params=psi,
                     tokens_per_step=global_batch * seq_len, model_fpt=model_fpt, hw_fpt=hw_fpt, world=layout.world,
                     nodes=hw.nodes, memory_fraction=_memory_fraction(arch, layout, seq_len, hw, prec, profile, peak),
                     tp=layout.tp, logits_mb=tokens_mb * vocab_t,
                     compiled=prec.compiled or not profile.follows_compile,
                     compiled_loss=compiled_loss(layout, prec) or not profile.follows_compile,
                     fp8_peak=1e12 * hw.peak_tflops_fp8 if prec.fp8 != "off" else 0.0, matmul_flops_mb=matmul,
                     hbm=1e9 * hw.hbm_gbps, balanced=profile.time_split == "balanced", stage_dense=dense,
                     dense_layer=dense_work)


def _matmul_flops(w: LayerWork) -> float:
    return w.fwd.flops + w.bwd.flops + w.fwd8.flops + w.bwd8.flops


def _memory_fraction(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision, profile: Profile,
                     peak: float | None) -> float:
    """Predicted peak of the fullest stage / device memory (0 when the memory model cannot place the
    layout)."""
    if layout.pp == 1:
        return 0.0  # only the pipeline stall reads it
    if peak is None:
        try:
            peak = peak_bytes(arch, layout, seq_len, hw, prec, profile)[0]
        except PlanError:
            return 0.0
    return peak / (hw.memory_gib * GIB)


# --- the constants applied -----------------------------------------------------------------------------

@dataclass
class MicroBatch:
    """One micro batch on the busiest pp rank, forward + backward (+ recompute), by term (seconds)."""

    gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    casts: float = 0.0
    loss: float = 0.0
    host: float = 0.0
    recompute: float = 0.0
    eager: float = 0.0  # usp's measured eager blocks / loss over compiled ones
    fwd: float = 0.0  # the forward's share (overlap windows)
    bwd: float = 0.0  # the backward's (+ recompute, the head's and the loss's)
    attention_layers: float = 0.0  # the attention of the rank's layers (CP's window)
    rank: int = 0
    layers: float = 0.0  # the rank's layers (its per-layer TP / CP / EP collectives)
    dense_layers: float = 0.0  # of them, a MoE model's dense first blocks (no EP all-to-all)
    on_head: bool = False  # it holds the LM head and the loss

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.elementwise + self.casts + self.loss + self.host + self.recompute \
            + self.eager


@dataclass
class _Times:
    mb: MicroBatch
    comm: list  # (seconds, window seconds, exposed seconds, GB/s, hidden, latency) per shape.comms
    path_s: float  # exposed TP / CP / EP / PP comm (+ their interference), stretched by the bubble
    stall_s: float  # the pipeline's p2p stalls: every stage waits in them together, not stretched
    dp_s: float  # exposed data-parallel comm + its interference
    interference_s: float
    accum_s: float
    optimizer_s: float
    overhead_s: float
    step_s: float
    extra: dict = field(default_factory=dict)

    @property
    def mb_s(self) -> float:
        return self.mb.total

    @property
    def fixed_s(self) -> float:
        return self.accum_s + self.optimizer_s + self.overhead_s


def _gemm_time(g: Gemms, peak: float, eff: float, half_k: float, fixed: float) -> float:
    return (g.flops + half_k * g.flops_per_k) / (peak * eff) + g.calls * fixed if g.calls else 0.0


@dataclass(frozen=True)
class _LayerTimes:
    """One layer's seconds for one micro batch under the constants, by term."""

    gemm: float  # forward + backward
    gemm_fwd: float
    attention: float
    elementwise: float
    casts: float
    again: float  # what recomputation runs again
    host: float

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.elementwise + self.casts + self.host + self.again

    @property
    def fwd(self) -> float:
        return self.gemm_fwd + self.attention / (1 + FA_BACKWARD) + (self.elementwise + self.casts) / 3 + self.host / 2


def _layer_times(shape: TimeShape, w: LayerWork, c: TimeConstants, k: StackTime) -> _LayerTimes:
    peak, t0, eff = shape.peak * c.clock, 1e-6 * c.gemm_fixed_us, c.gemm_efficiency
    bf = lambda g: _gemm_time(g, peak, eff, c.gemm_half_k, t0)  # noqa: E731
    if shape.fp8_peak:
        p8, e8, k8 = shape.fp8_peak * c.clock, eff * c.fp8_efficiency, c.fp8_half_k or c.gemm_half_k
        f8 = lambda g: _gemm_time(g, p8, e8, k8, t0)  # noqa: E731
    else:
        f8 = bf
    g_fwd, g_all = bf(w.fwd) + f8(w.fwd8), bf(w.fwd) + bf(w.bwd) + f8(w.fwd8) + f8(w.bwd8)
    ramp = shape.seq_len / (shape.seq_len + c.attention_half_seq) if c.attention_half_seq else 1.0
    att = w.attn_flops / (peak * k.attention_efficiency * ramp)
    factor = k.eager_elementwise_factor if not shape.compiled and k.eager_elementwise_factor else k.elementwise_factor
    elem = factor * w.elem_bytes / shape.hbm
    casts = k.fp8_cast_bytes * w.cast_elems / shape.hbm if shape.fp8_peak else 0.0
    again = _recomputed(shape, g_fwd, att, elem, casts, bf(w.op) + f8(w.op8))
    return _LayerTimes(g_all, g_fwd, att, elem, casts, again, 1e-6 * k.layer_us)


def micro_batches(shape: TimeShape, c: TimeConstants, k: StackTime) -> list[MicroBatch]:
    """One micro batch on each pp rank that may be the busiest (the one with the most layers, those with
    the LM head; or, with a cost-balanced split, the stage ideal balancing would give) under the constants.
    A MoE model's dense first blocks take their own (dense) layer's time."""
    moe = _layer_times(shape, shape.layer, c, k)
    dense = _layer_times(shape, shape.dense_layer, c, k) if any(shape.stage_dense) else moe
    peak = shape.peak * c.clock
    head = _gemm_time(shape.head_fwd, peak, c.gemm_efficiency, c.gemm_half_k, 1e-6 * c.gemm_fixed_us) \
        + _gemm_time(shape.head_bwd, peak, c.gemm_efficiency, c.gemm_half_k, 1e-6 * c.gemm_fixed_us)
    loss = k.loss_bytes_per_logit * shape.logits_mb / shape.hbm
    out = []
    for r, n, d, on_head in _candidates(shape, moe.total, head + loss):

        def both(term: str, n_moe: float = n - d, n_dense: float = d) -> float:
            return n_moe * getattr(moe, term) + n_dense * getattr(dense, term)

        mb = MicroBatch(gemm=both("gemm") + (head if on_head else 0.0), attention=both("attention"),
                        elementwise=both("elementwise"), casts=both("casts"), loss=loss if on_head else 0.0,
                        host=both("host") + 1e-3 * k.micro_batch_ms, recompute=both("again"), fwd=both("fwd"),
                        attention_layers=both("attention"), rank=r, layers=n, dense_layers=d, on_head=on_head)
        mb.bwd = mb.total - mb.fwd - 1e-3 * k.micro_batch_ms
        if not shape.compiled and not k.eager_elementwise_factor:
            mb.eager = c.eager_overhead * mb.total
        if not shape.compiled_loss and on_head:
            mb.eager += 1e-12 * c.eager_loss_ps_per_logit * shape.logits_mb
        out.append(mb)
    return out


def _candidates(shape: TimeShape, layer: float, head: float) -> list[tuple[int, float, int, bool]]:
    """(pp rank, layers, of them dense first blocks, holds the head) of the stages that may be the busiest.
    A cost-balanced split's stage is counted in MoE layers (its whole layers cost at least the mean)."""
    layers, heads = shape.stage_layers, shape.head_ranks
    dense = shape.stage_dense or (0,) * len(layers)
    if shape.balanced and len(layers) > 1:  # the stage a split balanced by cost gives, in whole layers
        per = (sum(layers) * layer + head) / len(layers)
        if per <= layer:
            return [(len(layers) - 1, 1, 0, True)]
        return [(0, math.ceil(per / layer - 1e-9), 0, False)]
    most = max(range(len(layers)), key=lambda i: layers[i])
    return [(r, layers[r], dense[r], r in heads) for r in sorted({most, *heads})]


def _recomputed(shape: TimeShape, g_fwd: float, att: float, elem: float, casts: float, g_op: float) -> float:
    """Per layer: what recomputation runs again (full: the forward; selective: as the stack does it)."""
    if shape.recompute == "full":
        return g_fwd + att / (1 + FA_BACKWARD) + (elem + casts) / 3
    if shape.recompute != "selective":
        return 0.0
    return {"attention": att / (1 + FA_BACKWARD), "op": g_op + elem / 3}.get(shape.selective, elem / 3)


def _window(kind: str, shape: TimeShape, mb: MicroBatch) -> float:
    """Seconds of compute a collective can hide behind (Comm.window)."""
    m = shape.grad_accum
    return {"bwd": mb.bwd, "fwd": mb.fwd, "fwd_m": m * mb.fwd, "bwd_m": m * mb.bwd,
            "attn": m * mb.attention_layers}.get(kind, 0.0)


def evaluate(shape: TimeShape, hw: Hardware, stack: StackTime | None = None) -> _Times:
    """The step time of a shape under the cluster's constants (hw.timing, the link bandwidths) and the
    stack's (the profile's StackTime): on the pp rank whose micro batches and critical-path collectives
    take longest."""
    c, k = hw.timing, stack or PROFILES["usp"].time
    m = shape.grad_accum
    costs = [_collective(ct, hw, k) for ct in shape.comms]
    best = None
    for mb in micro_batches(shape, c, k):
        path = sum(_exposed(ct, cost, mb, shape, c, k, {})[1] for ct, cost in zip(shape.comms, costs) if ct.path)
        total = m * mb.total + path
        if best is None or total > best[0]:
            best = (total, mb)
    mb = best[1]  # type: ignore[index]
    comm, path_s, dp_s, stall_s, interference = [], 0.0, 0.0, 0.0, 0.0
    stall_one = pipeline_stall_s(k, shape.nodes, shape.memory_fraction, shape.tp)
    left: dict = {}
    for ct, (one, gbps, latency) in zip(shape.comms, costs):
        seconds, exposed, window, hidden = _exposed(ct, (one, gbps, latency), mb, shape, c, k, left)
        slowed = c.interference * hidden
        calls = _calls(ct, mb)
        stall = ct.stall_ops * stall_one
        comm.append((seconds + stall, window, exposed - slowed + stall, gbps, hidden, calls * latency, calls))
        stall_s += stall
        interference += slowed * ((1 + shape.bubble) if ct.path else 1.0)
        if ct.path:
            path_s += exposed
        else:
            dp_s += exposed
    accum = max(0, m - 1) * shape.accum_params * k.accum_bytes_per_param / shape.hbm
    opt = shape.optimizer_params * k.optimizer_bytes_per_param / (shape.hbm * k.optimizer_hbm_share) \
        if k.optimizer_hbm_share > 0 else 0.0
    overhead = 1e-3 * k.step_ms
    step = (m * mb.total + path_s) * (1 + shape.bubble) + stall_s + dp_s + accum + opt + overhead
    return _Times(mb, comm, path_s, stall_s, dp_s, interference, accum, opt, overhead, step)


def _collective(ct: Comm, hw: Hardware, k: StackTime) -> tuple[float, float, float]:
    """(seconds of one call, GB/s, latency of one call), with the stack's host cost per call."""
    one, gbps, latency = collective_s(ct.kind, ct.group, ct.per_node, ct.crosses, ct.call_bytes, hw)
    if ct.host_us and ct.calls and ct.group > 1:
        one += 1e-6 * getattr(k, ct.host_us)
    return one, gbps, latency


def _calls(ct: Comm, mb: MicroBatch) -> float:
    """A term's calls per micro batch step on the rank of `mb`: per layer (or per MoE layer) of it, or per step."""
    if ct.moe_only:
        return ct.calls * (mb.layers - mb.dense_layers)
    return ct.calls * (mb.layers if ct.per_layer else 1)


def _exposed(ct: Comm, cost: tuple, mb: MicroBatch, shape: TimeShape, c: TimeConstants, k: StackTime,
             left: dict) -> tuple[float, float, float, float]:
    """(seconds, exposed seconds + the interference of the hidden ones, window, hidden) of one term on the
    rank of `mb`; `left`: what remains of each window (shared by the terms hiding behind it)."""
    one = cost[0]
    calls = _calls(ct, mb)
    seconds, share = calls * one, getattr(k, ct.overlap) if ct.overlap else 0.0
    if ct.window == "self":
        window, hidden = seconds, share * seconds
    elif ct.window:
        window = left.setdefault(ct.window, _window(ct.window, shape, mb))
        hidden = max(0.0, min(seconds - ct.unhidden * one, share * window))
        left[ct.window] = window - hidden
    else:
        window, hidden = 0.0, 0.0
    return seconds, seconds - hidden + c.interference * hidden, window, hidden


def pipeline_stall_s(stack: StackTime, nodes: int, memory_fraction: float, tp: int = 1) -> float:
    """Seconds one blocking pipeline send/recv stalls: p2p_stall_ms x the chance that either cause
    strikes, 1 - (1 - by_nodes)(1 - by_memory), each a steep step sat = 1 / (1 + (x_half / x) ** exp):
    by_nodes in the job's node count (half at p2p_stall_nodes), by_memory in the fullest stage's
    predicted use (half at p2p_stall_headroom of the device left free: allocator retries synchronise
    the device while a peer waits); + p2p_tp_ms x (tp / 8) ** p2p_tp_exp, a wait growing with the
    tensor-parallel degree. Fitted to nanotron's blocking 1F1B sends (docs/planner.md "Time on real
    runs"); 0 for a stack without them."""
    k = stack
    tp_wait = 1e-3 * k.p2p_tp_ms * (tp / 8) ** k.p2p_tp_exp if k.p2p_tp_ms > 0 else 0.0
    if k.p2p_stall_ms <= 0:
        return tp_wait
    by_nodes = 1 / (1 + (k.p2p_stall_nodes / max(1, nodes)) ** k.p2p_stall_exp)
    free = max(1e-3, 1 - memory_fraction)
    by_memory = 1 / (1 + (free / k.p2p_stall_headroom) ** k.p2p_stall_exp) if memory_fraction > 0 else 0.0
    return 1e-3 * k.p2p_stall_ms * (1 - (1 - by_nodes) * (1 - by_memory)) + tp_wait


def mfu(shape: TimeShape, step_s: float) -> float:
    return shape.model_fpt * shape.tokens_per_step / (step_s * shape.world * shape.peak)


# --- the plan's record ------------------------------------------------------------------------------------

def _assumptions(layout: Layout, hw: Hardware, prec: Precision, shape: TimeShape, tm: _Times, profile: Profile
                 ) -> list[str]:
    c, k = hw.timing, profile.time
    ramp = f" x s/(s + {c.attention_half_seq:g})" if c.attention_half_seq else ""
    out = [
        f"matmuls: 3 GEMMs per linear at {hw.peak_tflops_bf16 * c.clock:g} TFLOP/s x {c.gemm_efficiency:.3g} "
        f"x K/(K + {c.gemm_half_k:g}) + {c.gemm_fixed_us:g} µs each; attention at {k.attention_efficiency:.2g} of "
        f"the peak{ramp}; element-wise {k.elementwise_factor:g} x the fused bytes at {hw.hbm_gbps:g} GB/s",
        f"profile {profile.name}: host {k.layer_us:.3g} µs per layer, {k.micro_batch_ms:.3g} ms per micro batch, "
        f"{k.step_ms:.3g} ms per step; loss {k.loss_bytes_per_logit:.3g} B per logit; gradients reduced in "
        f"{_grad_bytes(prec, profile) * 8} bit; optimizer {k.optimizer_bytes_per_param:g} B/param at "
        f"{k.optimizer_hbm_share:.0%} of HBM",
        f"collectives: NVLink x {c.nvlink_efficiency:g}, NIC x {c.nic_efficiency:g}; {c.intra_latency_us:.3g} µs per "
        f"ring step inside a node, {c.inter_latency_us:.3g} µs across; hidden communication slows compute by "
        f"{c.interference:.2g} x its time",
    ]
    if profile.missing_overlaps:
        out.append(f"profile {profile.name} does not overlap: {'; '.join(profile.missing_overlaps)}")
    if not shape.compiled and c.eager_overhead and not k.eager_elementwise_factor:
        out.append(f"eager blocks (train.compile off): + {c.eager_overhead:.0%} per micro batch over compiled ones")
    if not shape.compiled and k.eager_elementwise_factor:
        out.append(f"eager blocks (train.compile off): element-wise at {k.eager_elementwise_factor:g} x the fused "
                   "bytes")
    if c.eager_loss_ps_per_logit and not shape.compiled_loss and shape.logits_mb:
        out.append(f"eager loss ({'TP: vocab-parallel' if shape.compiled else 'train.compile off'}): "
                   f"+ {c.eager_loss_ps_per_logit:.3g} ps per logit over the compiled loss")
    if shape.fp8_peak:
        out.append(f"train.fp8={prec.fp8}: the blocks' linears at {shape.fp8_peak / 1e12:.0f} TFLOP/s FP8 peak x "
                   f"{c.gemm_efficiency:.3g} x fp8_efficiency {c.fp8_efficiency:.3g}, + {k.fp8_cast_bytes:g} B per "
                   "cast element; attention scores and the LM head in bf16; MFU against the bf16 peak")
    if layout.pp > 1 and (k.p2p_stall_ms > 0 or k.p2p_tp_ms > 0):
        stall = pipeline_stall_s(k, shape.nodes, shape.memory_fraction, shape.tp)
        out.append(f"pipeline p2p stall {1e3 * stall:.3g} ms per blocking send/recv (up to {k.p2p_stall_ms:.3g} ms: "
                   f"{shape.nodes} node(s), fullest stage at {shape.memory_fraction:.0%} of device memory; "
                   f"+ {k.p2p_tp_ms:.3g} ms x (tp/8)^{k.p2p_tp_exp:.3g} at tp {shape.tp})")
    if layout.pp > 1:
        out.append(f"bubble {layout.pp_schedule}: " + (
            "≈ 0 (zero-bubble schedule, idealised)" if layout.pp_schedule in ZERO_BUBBLE else
            f"(p-1)/({'v·' if layout.pp_schedule == 'interleaved_1f1b' else ''}m) = {shape.bubble:.3f}"))
    if layout.recompute == "selective":
        out.append(f"selective recompute re-runs {_SELECTIVE_WORDS[profile.selective]}")
    return out


_SELECTIVE_WORDS = {"elementwise": "the element-wise kernels (the engine keeps matmul and attention outputs)",
                    "attention": "the core attention's forward (Megatron's selective recompute)",
                    "op": "every second matmul's forward (torchtitan's op-level SAC)"}


def layout_features(layout: Layout, procs_per_node: int) -> set[str]:
    """The layout features a run exercises: what a calibration records as measured, and what
    `usp plan` checks before trusting it."""
    out = {f"dp:{layout.dp_kind}"}
    out.update(d for d in ("tp", "pp", "cp", "ep") if getattr(layout, d) > 1)
    if layout.tp > procs_per_node:
        out.add("tp across nodes")
    if layout.pp > 1:
        out.add(f"pp schedule:{layout.pp_schedule}")
    if layout.recompute != "none":
        out.add(f"recompute:{layout.recompute}")
    return out


def _calibration(layout: Layout, hw: Hardware, mfu_value: float, profile: Profile) -> tuple[tuple | None, list[str]]:
    """(MFU band, notes): the band spans the calibration's 10th-90th percentile of predicted /
    measured; the notes say what lies outside what was measured."""
    cal = hw.timing.calibrated
    notes = [f"profile {profile.name}'s time constants: {profile.fitted_on}"] if profile.fitted_on else []
    if not cal.source:
        return None, notes + [f"cluster {hw.device_name}: never calibrated on runs of its own (`usp calibrate`): no "
                              "MFU band; where its GPU and network constants come from: docs/hardware.md"]
    band = (mfu_value / cal.ratio_p90, mfu_value / cal.ratio_p10)
    notes.append(f"calibrated on {cal.runs} runs ({cal.source}): MFU |error| median {cal.mfu_abs_err_p50:.1f} points, "
                 f"p90 {cal.mfu_abs_err_p90:.1f}; band = 10th-90th percentile of predicted/measured")
    if cal.stacks and profile.name not in cal.stacks and not profile.name.endswith((".yaml", ".yml")):
        notes.append(f"profile {profile.name} is not among the calibration's ({', '.join(cal.stacks)})")
    if hw.nodes not in cal.nodes:
        where = "between" if cal.nodes and min(cal.nodes) < hw.nodes < max(cal.nodes) else "outside"
        notes.append(f"{hw.nodes} node(s) never measured ({where} the calibrated {', '.join(map(str, cal.nodes))})")
    new = sorted(layout_features(layout, hw.procs_per_node) - set(cal.features))
    if new:
        notes.append(f"never measured in the calibration: {', '.join(new)}")
    return band, notes


def timing_plan(arch: Arch, layout: Layout, seq_len: int, global_batch: int, hw: Hardware,
                prec: Precision, profile: Profile = PROFILES["usp"], peak: float | None = None) -> TimingPlan:
    """step = (compute + exposed TP/CP/EP/PP comm) x (1 + bubble) + stall + exposed data-parallel comm
    + accumulation + optimizer + fixed cost."""
    shape = time_shape(arch, layout, seq_len, global_batch, hw, prec, profile, peak)
    tm = evaluate(shape, hw, profile.time)
    comm = [CommTerm(ct.name, ct.dims, ct.group, ct.crosses, gbps, int(calls),
                     ct.bytes_per_step * calls / max(1, ct.calls) if ct.group > 1 else 0.0, seconds, window, exposed,
                     hidden=hidden, latency_s=latency,
                     overlap=getattr(profile.time, ct.overlap) if ct.overlap else 0.0)
            for ct, (seconds, window, exposed, gbps, hidden, latency, calls) in zip(shape.comms, tm.comm)]
    mb = tm.mb
    eff = _mb_flops(shape, mb) / (shape.peak * mb.gemm) if mb.gemm > 0 else 0.0
    compute_s = shape.grad_accum * mb.total
    bubble_s = shape.bubble * (compute_s + tm.path_s)  # the stall is not stretched by the bubble
    tokens_step, world, step = shape.tokens_per_step, shape.world, tm.step_s
    model_step, hw_step, peak_flops = shape.model_fpt * tokens_step, shape.hw_fpt * tokens_step, shape.peak
    c = hw.timing
    eff_terms = {"gemm_efficiency": c.gemm_efficiency, "gemm_half_k": c.gemm_half_k, "clock": c.clock,
                 "busiest_pp_rank": mb.rank}
    mfu_value = model_step / (step * world * peak_flops)
    band, notes = _calibration(layout, hw, mfu_value, profile)
    return TimingPlan(
        dtype=prec.name, peak_tflops=peak_flops / 1e12, tokens_per_step=tokens_step,
        model_flops_per_token=shape.model_fpt, hw_flops_per_token=shape.hw_fpt, model_flops_per_step=model_step,
        hw_flops_per_step=hw_step, efficiency=eff, efficiency_terms=eff_terms, micro_batch_s=mb.total,
        compute_s=compute_s, bubble_fraction=shape.bubble, bubble_s=bubble_s, comm=comm,
        exposed_path_comm_s=tm.path_s + tm.stall_s, exposed_dp_comm_s=tm.dp_s, fixed_s=tm.fixed_s,
        step_s=step, tokens_per_s=tokens_step / step, tokens_per_s_per_device=tokens_step / step / world,
        mfu=mfu_value, hfu=hw_step / (step * world * peak_flops), world=world, profile=profile.name,
        mfu_band=band, calibration=notes,
        assumptions=_assumptions(layout, hw, prec, shape, tm, profile) + ep_assumption(arch, layout),
        gemm_s=mb.gemm, attention_s=mb.attention, elementwise_s=mb.elementwise + mb.casts, loss_s=mb.loss,
        host_s=mb.host, recompute_s=mb.recompute, eager_s=mb.eager, stall_s=tm.stall_s,
        interference_s=tm.interference_s, accumulation_s=tm.accum_s, optimizer_s=tm.optimizer_s,
        step_overhead_s=tm.overhead_s)


def _mb_flops(shape: TimeShape, mb: MicroBatch) -> float:
    """Matmul FLOPs of the micro batch (the kernels' efficiency figure)."""
    blocks = (mb.layers - mb.dense_layers) * _matmul_flops(shape.layer) + mb.dense_layers * _matmul_flops(
        shape.dense_layer)
    return blocks + (shape.head_fwd.flops + shape.head_bwd.flops if mb.on_head else 0.0)
