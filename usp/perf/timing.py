"""Predicted step time, tokens/s, MFU and HFU of one layout (docs/planner.md: formulas, sources,
what is not modelled). Every intermediate term stays in the TimingPlan so a figure can be traced.
The physical constants come from the cluster (`cluster.timing`, usp/perf/time_constants.py, fitted
by `usp calibrate`), the recipe's choices from the profile (usp/perf/stack_profile.py).

Model, per optimizer step:

  compute     per micro batch on the busiest pp rank: sum over its matmuls of FLOPs / (peak x
              kernel efficiency) + a fixed cost per layer (launches, host); x (1 + eager_overhead)
              unless train.compile (unfused elementwise kernels), + eager_loss_ps_per_logit per
              logit where the loss runs eagerly (compile off, or TP); under train.fp8 the blocks'
              linears run at the FP8 peak x kernel efficiency x fp8_efficiency (attention scores
              and the LM head stay bf16; MFU and HFU stay against the bf16 peak, as torchtitan's). FLOPs per token per
              layer: 6·(matmul weights)/t + 12·h·s/t (attention scores, playbook convention; a
              MoE layer's 6·(router + top_k experts + shared expert) is not divided by t); LM head
              6·V·h/t on the last stage. Full recompute adds the forward again (HFU > MFU);
              selective recompute re-runs no matmul here. Kernel efficiency of a matmul =
              E x sat(b·s/c, K_tok) x sat(n, K_dim), sat(x, k) = x / (x + k), n its output width
              (h/t for q/o, kv/t for k/v, ffn/t for the MLP, V/t for the head, s/c for attention).
  pipeline    compute_path x (1 + bubble); bubble = (p-1)/m (afab, 1f1b), (p-1)/(v·m)
              (interleaved_1f1b), 0 for the zero-bubble schedules (interleaved_zb, zbv): an
              idealisation, real ones keep a small bubble.
  comm        per collective call of S bytes over n ranks, g of them per node: ring all-gather /
              reduce-scatter (n-1)/n·S / bw + (n-1) hops; all-reduce twice the bytes and
              2·min(n-1, ceil(log2 n)) hops (ring or tree, whichever NCCL would pick for latency);
              bw = the intra-node link, or across nodes min(intra, g x the per-GPU inter-node
              link: the group's g GPUs of a node share its traffic over their own NICs); a hop
              costs the intra- or inter-node latency. Gradients are reduced in the profile's
              reduction dtype.
  overlap     data-parallel collectives hide behind the profile's share of their window (DDP /
              ZeRO-1 / replicated: the last micro batch's backward; FSDP all-gathers: each micro
              batch's forward / backward; reduce-scatter: the backward); CP's K/V ring behind the
              attention of its layer; TP, EP all-to-alls and PP sends are exposed.
  stall       a blocking pipeline send/recv (4 per micro batch on a middle stage, 2 on an end
              stage) stalls up to p2p_stall_ms, as the job's node count grows and as the fullest
              stage's predicted memory nears the device's (pipeline_stall_s); every stage waits in
              it together, so the bubble does not stretch it. 0 unless calibrated.
  step        compute_path x (1 + bubble) + stall + exposed data-parallel comm + optimizer (its
              states streamed at the cluster's optimizer bandwidth) + a fixed cost per step, where
              compute_path = compute + exposed TP / CP / EP / PP comm. Tied embeddings under pp
              add the embedding group's gradient all-reduce (exposed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from usp.contract.dims import MESH_DIMS
from usp.contract.predictions import CommTerm, TimingPlan
from usp.errors import PlanError
from usp.perf.memory import ZERO_BUBBLE, compiled_loss, peak_bytes, stage_layer_counts
from usp.perf.specs import GIB, Arch, Hardware, Layout, Precision, group_crosses_nodes
from usp.perf.stack_profile import PROFILES, Profile


def _sat(x: float, half: float) -> float:
    return x / (x + half)


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


def collective_s(kind: str, n: int, per_node: int, crosses: bool, nbytes: float, hw: Hardware) -> tuple[float, float]:
    """(seconds, GB/s) of one collective call moving a tensor of `nbytes` over n ranks (per_node of
    them on each node). kind: all_gather | reduce_scatter | all_reduce | p2p | all_to_all."""
    if n <= 1:
        return 0.0, 0.0
    c = hw.timing
    gbps = min(hw.intra_node_gbps, per_node * hw.inter_node_gbps) if crosses else hw.intra_node_gbps
    hop, call = 1e-6 * (c.inter_hop_us if crosses else c.intra_hop_us), 1e-6 * c.call_overhead_us
    if kind == "p2p":
        return call + hop + 1e-6 * c.p2p_us + nbytes / (gbps * 1e9), gbps
    if kind == "all_reduce":
        hops = 2 * min(n - 1, math.ceil(math.log2(n)))
        return call + hops * hop + 2 * (n - 1) / n * nbytes / (gbps * 1e9), gbps
    return call + (n - 1) * hop + (n - 1) / n * nbytes / (gbps * 1e9), gbps


@dataclass(frozen=True)
class Comm:
    """One communication term's geometry: `calls` collectives of `call_bytes` each over `group`
    ranks; it hides behind `overlap` of its window (window: "" none, "bwd" the last micro batch's
    backward, "fwd_m" / "bwd_m" every micro batch's forward / backward, "attn" the attention)."""

    name: str
    dims: str
    kind: str
    group: int
    crosses: bool
    per_node: int
    calls: int
    call_bytes: float
    window: str = ""
    overlap: float = 0.0
    path: bool = False  # on the pipeline's critical path (TP / CP / EP / PP)
    stall_ops: int = 0  # blocking pipeline sends/recvs per step on the busiest stage (each pays the p2p stall)

    @property
    def bytes_per_step(self) -> float:
        n = self.group
        return self.calls * {"all_reduce": 2 * (n - 1) / n, "p2p": 1.0}.get(self.kind, (n - 1) / n) * self.call_bytes


def _term(name: str, dims: tuple, kind: str, n: int, layout: Layout, hw: Hardware, calls: int, call_bytes: float,
          window: str = "", overlap: float = 0.0, path: bool = False, stall_ops: int = 0) -> Comm:
    crosses, per_node = _locality(layout, hw, dims) if dims != ("tied",) else (
        group_crosses_nodes(layout.degrees, hw.procs_per_node, ("pp",)), 1)
    return Comm(name, " x ".join(dims), kind, n, crosses, per_node, calls if n > 1 else 0, call_bytes, window,
                overlap, path, stall_ops if n > 1 else 0)


def rank_params(arch: Arch, layout: Layout, split: str = "params") -> list[float]:
    """Parameters on one rank of each pp rank (after TP / EP slicing), layers split as the profile
    splits them (Profile.pp_split)."""
    t = layout.tp
    ep = max(1, layout.ep) if arch.moe else 1
    counts, ranks = stage_layer_counts(arch, layout.pp, layout.virtual, layout.schedule, layout.pp_layers, split)
    layer = arch.attn_params / t + arch.dense_mlp_params / (1 if arch.moe else t) + arch.router_params \
        + arch.norm_params + arch.expert_params / ep  # a MoE layer is not TP-sliced
    vocab_pad = -(-arch.vocab_size // t) * t
    out = []
    for held in ranks:
        n = sum(counts[i] for i in held) * layer
        if 0 in held:
            n += vocab_pad * arch.dim / t
        if len(counts) - 1 in held:  # final norm, + the LM head unless it is the embedding (tied, no pp)
            n += arch.dim + (0 if arch.tie_embeddings and layout.pp == 1 else vocab_pad * arch.dim / t)
        out.append(n)
    return out


@dataclass(frozen=True)
class TimeShape:
    """Everything about one layout's step that does not depend on the cluster's fitted constants:
    the time model is `evaluate(shape, hw)`, so `usp calibrate` builds each run's shape once."""

    peak: float  # FLOP/s
    tokens_mb: float  # tokens one rank processes per micro batch
    grad_accum: int
    bubble: float
    recompute_extra: float
    busiest: int  # pp rank
    stage_layers: tuple
    matmuls: tuple  # (name, training FLOPs per token on the busiest rank, output width, recomputed)
    attn_fpt: float  # attention-score FLOPs per token of one layer
    comms: tuple  # Comm
    optimizer_params: float  # parameters the rank's optimizer steps
    optimizer_bytes: int  # per parameter
    tokens_per_step: int
    model_fpt: float
    hw_fpt: float
    world: int
    nodes: int = 1
    memory_fraction: float = 0.0  # predicted peak of the fullest stage / device memory (the p2p stall)
    logits_mb: float = 0.0  # logits the busiest pp rank's loss handles per micro batch (tokens x vocabulary/tp)
    compiled: bool = False  # train.compile: no eager_overhead
    compiled_loss: bool = False  # the loss compiled too (not under TP): no eager_loss_ps_per_logit
    fp8_peak: float = 0.0  # FLOP/s of the FP8 matmuls (FP8_MATMULS) under train.fp8; 0 = off

    @property
    def layers_r(self) -> int:
        return self.stage_layers[self.busiest]


def _flops_per_token(arch: Arch, layout: Layout, seq_len: int) -> tuple[float, float, float, float]:
    """(FLOPs per token of one block, of the LM head, model total (the MFU numerator), hardware total).
    Full recomputation runs each block's forward (1/3 of its training FLOPs) again; the LM head is
    not recomputed (usp/engine/parallel/recompute.py wraps blocks only)."""
    h, s = arch.dim, seq_len
    layer_fpt = 6 * arch.active_layer_matmul_params + 12 * h * s
    head_fpt = 6 * arch.vocab_size * h
    blocks_fpt = arch.n_layers * layer_fpt
    model_fpt = blocks_fpt + head_fpt
    return layer_fpt, head_fpt, model_fpt, model_fpt + _recompute_extra(layout) * blocks_fpt


def _recompute_extra(layout: Layout) -> float:
    return 1 / 3 if layout.recompute == "full" else 0.0


def _layer_matmuls(arch: Arch, layout: Layout, seq_len: int) -> list[tuple[str, float, float]]:
    """(name, training FLOPs per token, output width on one rank) of one block's matmuls."""
    t, h, kv = layout.tp, arch.dim, arch.kv_dim
    out = [("q/o", 6 * 2 * h * h / t, h / t), ("k/v", 6 * 2 * h * kv / t, kv / t),
           ("attention", 12 * h * seq_len / t, seq_len / layout.cp)]
    if arch.moe:  # a MoE layer's work is repeated on every TP rank; the busiest EP rank's experts get
        extra = (_imbalance(arch, layout) - 1) * arch.top_k * arch.parts["expert"]  # imbalance x the mean
        out.append(("moe", 6 * (arch.parts["active_mlp"] + extra), arch.moe_ffn_dim or arch.ffn_dim))
    else:
        out.append(("mlp", 6 * arch.dense_mlp_params / t, arch.ffn_dim / t))
    return out


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


def _stage_matmuls(arch: Arch, layout: Layout, seq_len: int, split: str) -> tuple[int, tuple, tuple]:
    """(busiest pp rank by FLOPs, layers per pp rank, its matmuls: (name, FLOPs per token, width, recomputed)),
    the layers split as the profile's recipe splits them (nanotron: by matmul cost, the LM head's included)."""
    mats = _layer_matmuls(arch, layout, seq_len)
    layer_fpt = sum(f for _, f, _ in mats)
    head_fpt = 6 * arch.vocab_size * arch.dim / layout.tp
    counts, ranks = stage_layer_counts(arch, layout.pp, layout.virtual, layout.schedule, layout.pp_layers, split)
    layers = tuple(sum(counts[i] for i in held) for held in ranks)
    last = [len(counts) - 1 in held for held in ranks]
    busiest = max(range(layout.pp), key=lambda r: layers[r] * layer_fpt + (head_fpt if last[r] else 0))
    out = tuple((name, f * layers[busiest], width, True) for name, f, width in mats)
    if last[busiest]:
        out += (("head", head_fpt, -(-arch.vocab_size // layout.tp), False),)
    return busiest, layers, out


FP8_MATMULS = ("q/o", "k/v", "mlp")  # _layer_matmuls' names of the linears train.fp8 converts (not attention, moe)


def _compute(shape: TimeShape, hw: Hardware) -> tuple[float, float, float, dict]:
    """(micro batch seconds on the busiest pp rank incl. its fixed cost, matmul seconds, sat(tokens),
    sat(width) per matmul): FLOPs / (peak x kernel efficiency) + a fixed cost per layer + the loss's
    cost per logit (memory-bound: it scales with tokens x vocabulary/tp, not with FLOPs), x (1 +
    eager_overhead) for eager blocks. FP8 matmuls run at their own peak x fp8_efficiency."""
    c, extra = hw.timing, shape.recompute_extra
    sat_tok = _sat(shape.tokens_mb, c.kernel_half_tokens)
    rate = shape.peak * c.kernel_efficiency * sat_tok
    fp8_speedup = shape.fp8_peak * c.fp8_efficiency / shape.peak if shape.fp8_peak else 1.0
    sat_dims = {name: _sat(width, c.kernel_half_dim) for name, _, width, _ in shape.matmuls}
    matmul_s = shape.tokens_mb * sum(f * (1 + extra if again else 1) / sat_dims[name]
                                     / (fp8_speedup if name in FP8_MATMULS else 1.0)
                                     for name, f, _, again in shape.matmuls) / rate
    loss_s = 1e-12 * c.loss_ps_per_logit * shape.logits_mb
    eager_loss_s = 0.0 if shape.compiled_loss else 1e-12 * c.eager_loss_ps_per_logit * shape.logits_mb
    mb_s = matmul_s + 1e-6 * c.layer_overhead_us * shape.layers_r + loss_s
    return mb_s * (1 if shape.compiled else 1 + c.eager_overhead) + eager_loss_s, matmul_s, sat_tok, sat_dims


def _bubble(layout: Layout) -> float:
    """Idle fraction of the pipeline: (p-1)/m, (p-1)/(v·m) interleaved, 0 for zero-bubble schedules."""
    p, m = layout.pp, layout.grad_accum
    if p == 1 or layout.pp_schedule in ZERO_BUBBLE:
        return 0.0
    if layout.pp_schedule == "interleaved_1f1b":
        return (p - 1) / (layout.virtual * m)
    return (p - 1) / m


def _tp_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision, layers_r: int) -> list[Comm]:
    """Tensor parallel (+ sequence parallel): 2 all-gathers + 2 reduce-scatters per layer and pass,
    each of the micro batch's full activation (b·s·h)."""
    passes = 3 if layout.recompute == "full" else 2
    calls = 2 * passes * layers_r * layout.grad_accum  # per kind
    size = (seq_len / layout.cp) * layout.micro_batch * arch.dim * prec.act
    return [_term(f"TP {kind.replace('_', '-')} (activations)", ("tp",), kind, layout.tp, layout, hw, calls, size,
                  path=True) for kind in ("all_gather", "reduce_scatter")]


def _cp_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, layers_r: int, profile: Profile) -> Comm:
    """Context parallel, per layer of this pp rank and micro batch: the ring passes a K/V block
    c-1 times forward (again when recomputed), c-1 times backward, and the dK/dV accumulator c
    times (it returns to its owner). The engine's ring sends fp32 blocks expanded to every
    query head (usp/engine/parallel/context_parallel.py). Hides behind the attention of its layer."""
    c, t, m = layout.cp, layout.tp, layout.grad_accum
    kv = 2 * (seq_len / c) * layout.micro_batch * arch.dim / t * 4
    forwards = 2 if layout.recompute == "full" else 1
    hops = forwards * (c - 1) + (c - 1) + c
    return _term("CP ring K/V exchange", ("cp",), "p2p", c, layout, hw, hops * layers_r * m, kv, "attn",
                 profile.cp_overlap, path=True)


def _ep_comm(arch: Arch, layout: Layout, hw: Hardware, prec: Precision, layers_r: int, tokens_mb: float) -> Comm:
    """Expert parallel: dispatch + combine all-to-alls, forward and backward."""
    passes = 3 if layout.recompute == "full" else 2
    calls = 2 * passes * layers_r * layout.grad_accum
    size = tokens_mb * arch.top_k * arch.dim * prec.act * _imbalance(arch, layout)  # the busiest rank's
    return Comm("EP all-to-all (tokens)", "ep", "all_to_all", layout.ep, _ep_crosses_nodes(layout, hw),
                min(layout.ep, hw.procs_per_node), calls, size, path=True)


def _ep_crosses_nodes(layout: Layout, hw: Hardware) -> bool:
    """An EP group is `ep` consecutive ranks of the flattened dp_shard x cp (the inner part,
    DistContext.expert_mesh), tp apart: aligned blocks of ep·tp ranks. Does one straddle two nodes?"""
    block, ppn = layout.ep * layout.tp, hw.procs_per_node
    if hw.nodes == 1 or block > ppn:
        return hw.nodes > 1
    return ppn % block != 0 and any(b // ppn != (b + block - 1) // ppn for b in range(0, layout.world, block))


def _pp_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision) -> Comm:
    """Pipeline: activations forward, gradients backward, per micro batch and virtual stage. A middle
    stage blocks on 4 sends/recvs per micro batch (activation in and out, gradient in and out), an
    end stage (all of them when pp = 2) on 2: each pays the p2p stall (pipeline_stall_s)."""
    calls = 2 * layout.grad_accum * layout.virtual
    size = (seq_len / layout.cp) * layout.micro_batch * arch.dim * prec.act
    stall_ops = 2 * min(layout.pp - 1, 2) * layout.grad_accum * layout.virtual
    return _term("PP send/recv (activations, grads)", ("pp",), "p2p", layout.pp, layout, hw, calls, size, path=True,
                 stall_ops=stall_ops)


def _path_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision, layers_r: int,
               tokens_mb: float, profile: Profile) -> list[Comm]:
    """The communication on the pipeline's critical path: TP, CP, EP, PP."""
    comm = []
    if layout.tp > 1:
        comm += _tp_comm(arch, layout, seq_len, hw, prec, layers_r)
    if layout.cp > 1:
        comm.append(_cp_comm(arch, layout, seq_len, hw, layers_r, profile))
    if arch.moe and layout.ep > 1:
        comm.append(_ep_comm(arch, layout, hw, prec, layers_r, tokens_mb))
    if layout.pp > 1:
        comm.append(_pp_comm(arch, layout, seq_len, hw, prec))
    return comm


def _grad_bytes(prec: Precision, profile: Profile) -> int:
    return profile.reduce_bytes or prec.grad


def _replicated_dp_comm(layout: Layout, hw: Hardware, prec: Precision, psi: float, layers_r: int,
                        profile: Profile) -> list[Comm]:
    """DDP / ZeRO-1 / FSDP2 replication: the gradient all-reduce (+ ZeRO-1's parameter all-gather).
    A profile with classic ZeRO-1 runs it this way also with TP/PP (dp_replicate only)."""
    kind, dims = layout.dp_kind, ("dp_replicate", "cp")
    n = layout.dp_replicate * layout.cp
    gbytes, pbytes = _grad_bytes(prec, profile) * psi, prec.param * psi
    bucket = layout.ddp_bucket_mb * 2 ** 20
    calls = max(1, int(gbytes // bucket) + 1) if kind != "replicate" else layers_r + 1
    out = [_term("DP gradient all-reduce", dims, "all_reduce", n, layout, hw, calls, gbytes / calls, "bwd",
                 profile.dp_overlap)]
    if kind in ("zero1", "zero1_fsdp"):
        out.append(_term("ZeRO-1 parameter all-gather (after the step)", dims, "all_gather", n, layout, hw, 1, pbytes))
    return out


def _sharded_dp_comm(layout: Layout, hw: Hardware, prec: Precision, psi: float, layers_r: int,
                     profile: Profile) -> list[Comm]:
    """FSDP / HSDP / ZeRO-1 with TP/PP (FSDP2 over dp_replicate): parameter all-gathers (forward, and
    backward under ZeRO-3), the gradient reduce-scatter (once per step: gradient sync is off on
    inner micro batches), HSDP's all-reduce."""
    m, ov = layout.grad_accum, profile.dp_overlap
    gbytes, pbytes = _grad_bytes(prec, profile) * psi, prec.gathered * psi  # gathered in the dtype the matmuls read
    dims = ("dp_replicate",) if layout.dp_kind == "zero1_fsdp" else ("dp_shard", "cp")
    n, units = layout.shard_degree, layers_r + 1
    out = [_term("FSDP all-gather (forward)", dims, "all_gather", n, layout, hw, units * m, pbytes / units, "fwd_m",
                 ov)]
    if layout.zero_stage == 3:
        out.append(_term("FSDP all-gather (backward)", dims, "all_gather", n, layout, hw, units * m, pbytes / units,
                         "bwd_m", ov))
    out.append(_term("FSDP gradient reduce-scatter", dims, "reduce_scatter", n, layout, hw, units, gbytes / units,
                     "bwd", ov))
    if layout.dp_kind == "hsdp":
        r = layout.dp_replicate
        out.append(_term("HSDP gradient all-reduce (replicas)", ("dp_replicate",), "all_reduce", r, layout, hw, units,
                         gbytes / n / units, "bwd", ov))
    return out


def _dp_comm(arch: Arch, layout: Layout, hw: Hardware, prec: Precision, layers_r: int, psi: float,
             profile: Profile) -> list[Comm]:
    """The data-parallel communication of the busiest rank's parameters psi (+ the tied embedding's sum)."""
    tied = [_tied_comm(arch, layout, hw, prec, profile)] if arch.tie_embeddings and layout.pp > 1 \
        and layout.pp_schedule != "zbv" else []  # zbv: first and last stage on one rank, summed locally
    kind = layout.dp_kind
    if kind in ("ddp", "zero1", "replicate") or (kind == "zero1_fsdp" and profile.zero1_once_per_step):
        return _replicated_dp_comm(layout, hw, prec, psi, layers_r, profile) + tied
    if kind in ("fsdp", "hsdp", "zero1_fsdp"):
        return _sharded_dp_comm(layout, hw, prec, _fsdp_equivalent(arch, layout, psi, layers_r), layers_r,
                                profile) + tied
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


def _fsdp_equivalent(arch: Arch, layout: Layout, psi: float, layers_r: int) -> float:
    """Parameters whose traffic over dp_shard x cp (n ranks) equals this rank's: under EP the experts'
    FSDP unit spans only the n/ep ranks of dp_shard_mod_ep, so they move (n/ep-1)/(n/ep) of their
    bytes, not (n-1)/n (none when ep = n)."""
    n, ep = layout.dp_shard * layout.cp, layout.ep if arch.moe else 1
    if ep <= 1 or n <= 1:
        return psi
    experts, n_e = layers_r * arch.expert_params / ep, n // ep
    return psi - experts + experts * ((n_e - 1) / n_e) / ((n - 1) / n)


def time_shape(arch: Arch, layout: Layout, seq_len: int, global_batch: int, hw: Hardware, prec: Precision,
               profile: Profile, peak: float | None = None) -> TimeShape:
    """The layout's step geometry: FLOPs per matmul, collectives, optimizer state (no fitted constant).
    peak: the predicted peak bytes of the fullest stage (usp.perf.memory.peak_bytes; computed if None)."""
    _, _, model_fpt, hw_fpt = _flops_per_token(arch, layout, seq_len)
    busiest, layers, mats = _stage_matmuls(arch, layout, seq_len, profile.pp_split)
    tokens_mb = layout.micro_batch * seq_len / layout.cp
    psi = max(rank_params(arch, layout, profile.pp_split))
    comms = _path_comm(arch, layout, seq_len, hw, prec, layers[busiest], tokens_mb, profile) \
        + _dp_comm(arch, layout, hw, prec, layers[busiest], psi, profile)
    return TimeShape(peak=hw.peak_flops(prec), tokens_mb=tokens_mb, grad_accum=layout.grad_accum,
                     bubble=_bubble(layout), recompute_extra=_recompute_extra(layout), busiest=busiest,
                     stage_layers=layers, matmuls=mats, attn_fpt=12 * arch.dim * seq_len / layout.tp,
                     comms=tuple(comms), optimizer_params=psi / layout.shard_degree,
                     optimizer_bytes=profile.optimizer_bytes_per_param, tokens_per_step=global_batch * seq_len,
                     model_fpt=model_fpt, hw_fpt=hw_fpt, world=layout.world, nodes=hw.nodes,
                     memory_fraction=_memory_fraction(arch, layout, seq_len, hw, prec, profile, peak),
                     logits_mb=tokens_mb * mats[-1][2] if mats[-1][0] == "head" else 0.0,
                     compiled=prec.compiled or not profile.follows_compile,
                     compiled_loss=compiled_loss(layout, prec) or not profile.follows_compile,
                     fp8_peak=1e12 * hw.peak_tflops_fp8 if prec.fp8 != "off" else 0.0)


def _memory_fraction(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision, profile: Profile,
                     peak: float | None) -> float:
    """Predicted peak of the fullest stage / device memory (0 when the memory model cannot place the
    layout: the stall's memory term then stays off)."""
    if layout.pp == 1:
        return 0.0  # only the pipeline stall reads it
    if peak is None:
        try:
            peak = peak_bytes(arch, layout, seq_len, hw, prec, profile)[0]
        except PlanError:
            return 0.0
    return peak / (hw.memory_gib * GIB)


@dataclass
class _Times:
    mb_s: float
    matmul_s: float
    sat_tok: float
    sat_dims: dict
    comm: list  # (seconds, window seconds, exposed seconds, GB/s) per shape.comms
    path_s: float  # exposed TP / CP / EP / PP comm, stretched by the bubble
    stall_s: float  # the pipeline's p2p stalls: every stage waits in them together, not stretched
    dp_s: float
    fixed_s: float
    step_s: float


def evaluate(shape: TimeShape, hw: Hardware) -> _Times:
    """The step time of a shape under the cluster's constants (hw.timing, link bandwidths)."""
    c, m, extra = hw.timing, shape.grad_accum, shape.recompute_extra
    mb_s, matmul_s, sat_tok, sat_dims = _compute(shape, hw)
    fwd = mb_s / (3 + 3 * extra)
    comm, path_s, dp_s, stall_s = [], 0.0, 0.0, 0.0
    stall_one = pipeline_stall_s(hw, shape.nodes, shape.memory_fraction)
    for ct in shape.comms:
        one, gbps = collective_s(ct.kind, ct.group, ct.per_node, ct.crosses, ct.call_bytes, hw)
        seconds = ct.calls * one
        window = _window(ct.window, shape, hw, mb_s, fwd, sat_tok, sat_dims)
        exposed = max(0.0, seconds - ct.overlap * window)
        stall = ct.stall_ops * stall_one
        comm.append((seconds + stall, window, exposed + stall, gbps))
        stall_s += stall
        if ct.path:
            path_s += exposed
        else:
            dp_s += exposed
    opt = shape.optimizer_params * shape.optimizer_bytes / (c.optimizer_gbps * 1e9) if c.optimizer_gbps > 0 else 0.0
    fixed = opt + 1e-3 * c.step_overhead_ms
    step = (m * mb_s + path_s) * (1 + shape.bubble) + stall_s + dp_s + fixed
    return _Times(mb_s, matmul_s, sat_tok, sat_dims, comm, path_s, stall_s, dp_s, fixed, step)


def pipeline_stall_s(hw: Hardware, nodes: int, memory_fraction: float) -> float:
    """Seconds one blocking pipeline send/recv stalls: p2p_stall_ms x the chance that either cause
    strikes, 1 - (1 - by_nodes)(1 - by_memory), each a steep step sat = 1 / (1 + (x_half / x) ** exp):
    by_nodes in the job's node count (half at p2p_stall_nodes), by_memory in the fullest stage's
    predicted use (half at p2p_stall_headroom of the device left free: allocator retries synchronise
    the device while a peer waits). Fitted to nanotron's blocking 1F1B sends (docs/planner.md "Time on
    real runs"); 0 unless calibrated."""
    c = hw.timing
    if c.p2p_stall_ms <= 0:
        return 0.0
    by_nodes = 1 / (1 + (c.p2p_stall_nodes / max(1, nodes)) ** c.p2p_stall_exp)
    free = max(1e-3, 1 - memory_fraction)
    by_memory = 1 / (1 + (free / c.p2p_stall_headroom) ** c.p2p_stall_exp)
    return 1e-3 * c.p2p_stall_ms * (1 - (1 - by_nodes) * (1 - by_memory))


def _window(kind: str, shape: TimeShape, hw: Hardware, mb_s: float, fwd: float, sat_tok: float,
            sat_dims: dict) -> float:
    """Seconds of compute a collective can hide behind (Comm.window)."""
    if not kind:
        return 0.0
    m = shape.grad_accum
    if kind == "bwd":
        return mb_s - fwd
    if kind == "fwd_m":
        return m * fwd
    if kind == "bwd_m":
        return m * (mb_s - fwd)
    return shape.tokens_mb * shape.attn_fpt * shape.layers_r * m / (
        shape.peak * hw.timing.kernel_efficiency * sat_tok * sat_dims.get("attention", 1.0))


def mfu(shape: TimeShape, step_s: float) -> float:
    return shape.model_fpt * shape.tokens_per_step / (step_s * shape.world * shape.peak)


def _assumptions(layout: Layout, hw: Hardware, prec: Precision, shape: TimeShape, tm: _Times, eff: float,
                 profile: Profile) -> list[str]:
    c = hw.timing
    dims = ", ".join(f"{k} {v:.2f}" for k, v in tm.sat_dims.items())
    out = [
        f"kernel efficiency {eff:.2f} = {c.kernel_efficiency:.2f} x sat(b·s/c={shape.tokens_mb:.0f}) {tm.sat_tok:.2f} "
        f"x sat(matmul width) ({dims}), sat(x) = x/(x+k), k = {c.kernel_half_tokens:.0f} tokens, "
        f"{c.kernel_half_dim:.0f} wide",
        f"profile {profile.name}: data-parallel comm hides behind {profile.dp_overlap:.0%} of its window, CP behind "
        f"{profile.cp_overlap:.0%}; TP, EP and PP comm exposed; gradients reduced in "
        f"{_grad_bytes(prec, profile) * 8} bit",
        f"ring latency {c.intra_hop_us:.3g} µs per hop inside a node, {c.inter_hop_us:.3g} µs across; fixed "
        f"{c.layer_overhead_us:.3g} µs per layer and micro batch, {c.step_overhead_ms:.3g} ms per step",
    ]
    if c.eager_overhead and not shape.compiled:
        out.append(f"eager blocks (train.compile off): + {c.eager_overhead:.0%} per micro batch over compiled ones")
    if c.eager_loss_ps_per_logit and not shape.compiled_loss and shape.logits_mb:
        out.append(f"eager loss ({'TP: vocab-parallel' if shape.compiled else 'train.compile off'}): "
                   f"+ {c.eager_loss_ps_per_logit:.3g} ps per logit over the compiled loss")
    if shape.fp8_peak:
        out.append(f"train.fp8={prec.fp8}: the blocks' linears at {shape.fp8_peak / 1e12:.0f} TFLOP/s FP8 peak x "
                   f"fp8_efficiency {c.fp8_efficiency:.2f}"
                   + (" (uncalibrated)" if c.fp8_efficiency == 1.0 else "")
                   + "; attention scores and the LM head in bf16; MFU against the bf16 peak")
    if layout.pp > 1 and c.p2p_stall_ms > 0:
        stall = pipeline_stall_s(hw, shape.nodes, shape.memory_fraction)
        out.append(f"pipeline p2p stall {1e3 * stall:.3g} ms per blocking send/recv (up to {c.p2p_stall_ms:.3g} ms: "
                   f"{shape.nodes} node(s), fullest stage at {shape.memory_fraction:.0%} of device memory)")
    if layout.pp > 1:
        out.append(f"bubble {layout.pp_schedule}: " + (
            "≈ 0 (zero-bubble schedule, idealised)" if layout.pp_schedule in ZERO_BUBBLE else
            f"(p-1)/({'v·' if layout.pp_schedule == 'interleaved_1f1b' else ''}m) = {shape.bubble:.3f}"))
    if layout.recompute == "selective":
        out.append("selective recompute re-runs no matmul: HFU = MFU")
    return out


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
    if not cal.source:
        return None, [f"cluster {hw.device_name}: time constants never calibrated (`usp calibrate`): the time "
                      "figures are uncalibrated estimates"]
    band = (mfu_value / cal.ratio_p90, mfu_value / cal.ratio_p10)
    notes = [f"calibrated on {cal.runs} runs ({cal.source}): MFU |error| median {cal.mfu_abs_err_p50:.1f} points, "
             f"p90 {cal.mfu_abs_err_p90:.1f}; band = 10th-90th percentile of predicted/measured"]
    if hw.nodes not in cal.nodes:
        where = "between" if cal.nodes and min(cal.nodes) < hw.nodes < max(cal.nodes) else "outside"
        notes.append(f"{hw.nodes} node(s) never measured ({where} the calibrated {', '.join(map(str, cal.nodes))})")
    new = sorted(layout_features(layout, hw.procs_per_node) - set(cal.features))
    if new:
        notes.append(f"never measured in the calibration: {', '.join(new)}")
    return band, notes


def timing_plan(arch: Arch, layout: Layout, seq_len: int, global_batch: int, hw: Hardware,
                prec: Precision, profile: Profile = PROFILES["usp"], peak: float | None = None) -> TimingPlan:
    """step = (compute + exposed TP/CP/EP/PP comm) x (1 + bubble) + exposed data-parallel comm
    + optimizer + fixed cost."""
    shape = time_shape(arch, layout, seq_len, global_batch, hw, prec, profile, peak)
    tm = evaluate(shape, hw)
    comm = [CommTerm(ct.name, ct.dims, ct.group, ct.crosses, gbps, ct.calls,
                     ct.bytes_per_step if ct.group > 1 else 0.0, seconds, window, exposed)
            for ct, (seconds, window, exposed, gbps) in zip(shape.comms, tm.comm)]
    extra = shape.recompute_extra
    flops_mb = shape.tokens_mb * sum(f * (1 + extra if again else 1) for _, f, _, again in shape.matmuls)
    eff = flops_mb / (shape.peak * tm.matmul_s) if tm.matmul_s > 0 else 0.0
    compute_s = shape.grad_accum * tm.mb_s
    bubble_s = shape.bubble * (compute_s + tm.path_s)  # the stall is not stretched by the bubble
    tokens_step, world, step = shape.tokens_per_step, shape.world, tm.step_s
    model_step, hw_step, peak = shape.model_fpt * tokens_step, shape.hw_fpt * tokens_step, shape.peak
    eff_terms = {"kernel_efficiency": hw.timing.kernel_efficiency, "sat_tokens": tm.sat_tok, **tm.sat_dims,
                 "busiest_pp_rank": shape.busiest}
    mfu_value = model_step / (step * world * peak)
    band, notes = _calibration(layout, hw, mfu_value, profile)
    return TimingPlan(
        dtype=prec.name, peak_tflops=peak / 1e12, tokens_per_step=tokens_step, model_flops_per_token=shape.model_fpt,
        hw_flops_per_token=shape.hw_fpt, model_flops_per_step=model_step, hw_flops_per_step=hw_step, efficiency=eff,
        efficiency_terms=eff_terms, micro_batch_s=tm.mb_s, compute_s=compute_s, bubble_fraction=shape.bubble,
        bubble_s=bubble_s, comm=comm, exposed_path_comm_s=tm.path_s + tm.stall_s, exposed_dp_comm_s=tm.dp_s,
        fixed_s=tm.fixed_s,
        step_s=step, tokens_per_s=tokens_step / step, tokens_per_s_per_device=tokens_step / step / world,
        mfu=mfu_value, hfu=hw_step / (step * world * peak), world=world, profile=profile.name,
        mfu_band=band, calibration=notes,
        assumptions=_assumptions(layout, hw, prec, shape, tm, eff, profile) + ep_assumption(arch, layout))
