"""Predicted step time, tokens/s, MFU and HFU of one layout (docs/planner.md: formulas, sources,
what is not modelled). Every intermediate term stays in the TimingPlan so a figure can be traced.

Model, per optimizer step:

  compute     FLOPs of the busiest pp rank / (peak x kernel efficiency). FLOPs per token per
              layer: 6·(matmul weights)/t + 12·h·s/t (attention scores, playbook convention; a
              MoE layer's 6·(router + top_k experts + shared expert) is not divided by t);
              LM head 6·V·h/t on the last stage. Full recompute adds the forward again (+1/3:
              HFU > MFU); selective recompute re-runs no matmul here (norms, activations, RoPE).
              Kernel efficiency = EFF_MAX x sat(h/t) x sat(b·s/c), sat(x) = x / (x + SAT_HALF):
              small matmuls reach a smaller fraction of peak.
  pipeline    compute_path x (1 + bubble); bubble = (p-1)/m (afab, 1f1b), (p-1)/(v·m)
              (interleaved_1f1b), 0 for the zero-bubble schedules (interleaved_zb, zbv): an
              idealisation, real ones keep a small bubble.
  comm        bytes on the wire per rank, ring collectives: all-reduce 2(n-1)/n·S, all-gather
              and reduce-scatter (n-1)/n·S, plus LATENCY per call; bandwidth = the link the group
              crosses (inter-node iff the group's ranks sit on different nodes in the rank table).
  overlap     DP/FSDP collectives hide behind compute up to OVERLAP of their window (DDP / ZeRO-1
              / replicated: the last micro batch's backward; FSDP all-gathers: each micro batch's
              forward / backward; reduce-scatter: the backward); CP's K/V ring hides behind the
              attention of its layer up to OVERLAP; TP, EP all-to-alls and PP sends are exposed.
  step        compute_path x (1 + bubble) + exposed data-parallel comm, where compute_path =
              compute + exposed TP / CP / EP / PP comm. Tied embeddings under pp add the
              embedding group's gradient all-reduce (exposed) to the data-parallel comm.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from usp.plan.memory import ZERO_BUBBLE, stage_layer_counts
from usp.plan.specs import Arch, Hardware, Layout, Precision, group_crosses_nodes

EFF_MAX = 0.50  # fraction of vendor peak a large transformer layer reaches (calibrated to the playbook's 40-47 % MFU)
SAT_HALF = 128  # matmul dimension at which efficiency is half of EFF_MAX
OVERLAP = 0.8  # share of an overlap window that communication can hide behind
LATENCY_S = {False: 10e-6, True: 25e-6}  # per collective call: intra-node, inter-node


@dataclass
class CommTerm:
    name: str
    dims: str  # mesh dims of the group
    group: int  # ranks in the group
    crosses_nodes: bool
    gbps: float
    calls: int  # collective calls per step
    bytes_per_step: float  # on the wire, per rank
    seconds: float
    window_s: float  # compute it can hide behind
    exposed_s: float


@dataclass
class TimingPlan:
    dtype: str
    peak_tflops: float
    tokens_per_step: int
    model_flops_per_token: float  # 6·N_active + 12·L·h·s (the MFU numerator)
    hw_flops_per_token: float  # + the recomputed forward
    model_flops_per_step: float
    hw_flops_per_step: float
    efficiency: float
    efficiency_terms: dict
    micro_batch_s: float  # busiest pp rank, one micro batch forward + backward (+ recompute)
    compute_s: float  # m micro batches on the busiest pp rank
    bubble_fraction: float
    bubble_s: float
    comm: list[CommTerm]
    exposed_path_comm_s: float  # TP / CP / EP / PP, on the pipeline's critical path
    exposed_dp_comm_s: float
    step_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float
    hfu: float
    world: int
    assumptions: list[str] = field(default_factory=list)


def _sat(x: float) -> float:
    return x / (x + SAT_HALF)


def _bw(hw: Hardware, crosses: bool) -> float:
    return (hw.inter_node_gbps if crosses else hw.intra_node_gbps) * 1e9


def _term(name, dims, group, crosses, hw, calls, nbytes, window) -> CommTerm:
    gbps = hw.inter_node_gbps if crosses else hw.intra_node_gbps
    seconds = nbytes / _bw(hw, crosses) + calls * LATENCY_S[crosses] if group > 1 else 0.0
    exposed = max(0.0, seconds - OVERLAP * window)
    return CommTerm(name, dims, group, crosses, gbps, calls if group > 1 else 0, nbytes if group > 1 else 0.0,
                    seconds, window, exposed)


def rank_params(arch: Arch, layout: Layout) -> list[float]:
    """Parameters on one rank of each pp rank (after TP / EP slicing)."""
    t = layout.tp
    ep = max(1, layout.ep) if arch.moe else 1
    counts, ranks = stage_layer_counts(arch, layout.pp, layout.virtual, layout.schedule, layout.pp_layers)
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


@dataclass
class _Compute:
    """The compute term and what the communication terms need from it."""

    peak: float  # FLOP/s
    eff: float
    sat_h: float
    sat_tok: float
    tokens_mb: float  # tokens one rank processes per micro batch
    busiest: int  # pp rank
    stage_layers: list[int]
    mb_s: float
    fwd_s: float
    bwd_s: float

    @property
    def layers_r(self) -> int:
        return max(self.stage_layers)


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


def _compute(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision) -> _Compute:
    """Per micro batch on the busiest pp rank: its FLOPs / (peak x kernel efficiency)."""
    t, b = layout.tp, layout.micro_batch
    s_loc = seq_len / layout.cp
    layer_fpt, head_fpt, _, _ = _flops_per_token(arch, layout, seq_len)
    extra = _recompute_extra(layout)
    peak = hw.peak_flops(prec)
    sat_h, sat_tok = _sat(arch.dim / t), _sat(b * s_loc)
    eff = EFF_MAX * sat_h * sat_tok
    counts, ranks = stage_layer_counts(arch, layout.pp, layout.virtual, layout.schedule, layout.pp_layers)
    tokens_mb = b * s_loc
    moe_fpt = 6 * arch.parts["active_mlp"] if arch.moe else 0  # a MoE layer's work is repeated on every TP rank
    per_layer, head = ((layer_fpt - moe_fpt) / t + moe_fpt) * (1 + extra), head_fpt / t
    stage_flops, stage_layers = [], []
    for held in ranks:
        n_layers = sum(counts[i] for i in held)
        stage_layers.append(n_layers)
        stage_flops.append(tokens_mb * (n_layers * per_layer + (head if len(counts) - 1 in held else 0)))
    busiest = max(range(layout.pp), key=lambda r: stage_flops[r])
    mb_s = stage_flops[busiest] / (peak * eff)
    fwd_s, bwd_s = mb_s / (3 + 3 * extra), mb_s * (2 + 3 * extra) / (3 + 3 * extra)
    return _Compute(peak, eff, sat_h, sat_tok, tokens_mb, busiest, stage_layers, mb_s, fwd_s, bwd_s)


def _bubble(layout: Layout) -> float:
    """Idle fraction of the pipeline: (p-1)/m, (p-1)/(v·m) interleaved, 0 for zero-bubble schedules."""
    p, m = layout.pp, layout.grad_accum
    if p == 1 or layout.pp_schedule in ZERO_BUBBLE:
        return 0.0
    if layout.pp_schedule == "interleaved_1f1b":
        return (p - 1) / (layout.virtual * m)
    return (p - 1) / m


def _tp_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision, cx: _Compute) -> CommTerm:
    """Tensor parallel (+ sequence parallel): 2 all-gathers + 2 reduce-scatters per layer and pass."""
    t, m = layout.tp, layout.grad_accum
    x = group_crosses_nodes(layout.degrees, hw.procs_per_node, ("tp",))
    passes = 3 if layout.recompute == "full" else 2
    calls = 4 * passes * cx.layers_r * m
    nbytes = calls * (t - 1) / t * (seq_len / layout.cp) * layout.micro_batch * arch.dim * prec.act
    return _term("TP all-gather / reduce-scatter (activations)", "tp", t, x, hw, calls, nbytes, 0.0)


def _cp_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, cx: _Compute) -> CommTerm:
    """Context parallel, per layer of this pp rank and micro batch: the ring passes a K/V block
    c-1 times forward (again when recomputed), c-1 times backward, and the dK/dV accumulator c
    times (it returns to its owner). The engine's ring sends fp32 blocks expanded to every
    query head (usp/engine/parallel/context.py). Hides behind the attention of its layer."""
    c, t, m, layers_r = layout.cp, layout.tp, layout.grad_accum, cx.layers_r
    x = group_crosses_nodes(layout.degrees, hw.procs_per_node, ("cp",))
    kv = 2 * (seq_len / c) * layout.micro_batch * arch.dim / t * 4
    forwards = 2 if layout.recompute == "full" else 1
    hops = forwards * (c - 1) + (c - 1) + c
    calls = hops * layers_r * m
    nbytes = hops * kv * layers_r * m
    attn_s = cx.tokens_mb * 12 * arch.dim * seq_len / t * layers_r * m / (cx.peak * cx.eff)
    return _term("CP ring K/V exchange", "cp", c, x, hw, calls, nbytes, attn_s)


def _ep_comm(arch: Arch, layout: Layout, hw: Hardware, prec: Precision, cx: _Compute) -> CommTerm:
    """Expert parallel: dispatch + combine all-to-alls, forward and backward."""
    x = _ep_crosses_nodes(layout, hw)
    passes = 3 if layout.recompute == "full" else 2
    calls = 2 * passes * cx.layers_r * layout.grad_accum
    nbytes = calls * (layout.ep - 1) / layout.ep * cx.tokens_mb * arch.top_k * arch.dim * prec.act
    return _term("EP all-to-all (tokens)", "ep", layout.ep, x, hw, calls, nbytes, 0.0)


def _ep_crosses_nodes(layout: Layout, hw: Hardware) -> bool:
    """An EP group is `ep` consecutive ranks of the flattened dp_shard x cp (the inner part,
    DistContext.expert_mesh), tp apart: aligned blocks of ep·tp ranks. Does one straddle two nodes?"""
    block, ppn = layout.ep * layout.tp, hw.procs_per_node
    if hw.nodes == 1 or block > ppn:
        return hw.nodes > 1
    return ppn % block != 0 and any(b // ppn != (b + block - 1) // ppn for b in range(0, layout.world, block))


def _pp_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision) -> CommTerm:
    """Pipeline: activations forward, gradients backward, per micro batch and virtual stage."""
    x = group_crosses_nodes(layout.degrees, hw.procs_per_node, ("pp",))
    calls = 2 * layout.grad_accum * layout.virtual
    nbytes = calls * (seq_len / layout.cp) * layout.micro_batch * arch.dim * prec.act
    return _term("PP send/recv (activations, grads)", "pp", layout.pp, x, hw, calls, nbytes, 0.0)


def _path_comm(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision,
               cx: _Compute) -> list[CommTerm]:
    """The communication on the pipeline's critical path: TP, CP, EP, PP."""
    comm = []
    if layout.tp > 1:
        comm.append(_tp_comm(arch, layout, seq_len, hw, prec, cx))
    if layout.cp > 1:
        comm.append(_cp_comm(arch, layout, seq_len, hw, cx))
    if arch.moe and layout.ep > 1:
        comm.append(_ep_comm(arch, layout, hw, prec, cx))
    if layout.pp > 1:
        comm.append(_pp_comm(arch, layout, seq_len, hw, prec))
    return comm


def _replicated_dp_comm(layout: Layout, hw: Hardware, prec: Precision, psi: float, cx: _Compute) -> list[CommTerm]:
    """DDP / ZeRO-1 / FSDP2 replication: the gradient all-reduce (+ ZeRO-1's parameter all-gather)."""
    kind, c = layout.dp_kind, layout.cp
    gbytes, pbytes = prec.grad * psi, prec.param * psi
    n = layout.dp_replicate * c
    x = group_crosses_nodes(layout.degrees, hw.procs_per_node, ("dp_replicate", "cp"))
    bucket = layout.ddp_bucket_mb * 2 ** 20
    calls = max(1, int(gbytes // bucket) + 1) if kind != "replicate" else cx.stage_layers[cx.busiest] + 1
    out = [_term("DP gradient all-reduce", "dp_replicate x cp", n, x, hw, calls, 2 * (n - 1) / n * gbytes, cx.bwd_s)]
    if kind == "zero1":
        out.append(_term("ZeRO-1 parameter all-gather (after the step)", "dp_replicate x cp", n, x, hw, 1,
                         (n - 1) / n * pbytes, 0.0))
    return out


def _sharded_dp_comm(layout: Layout, hw: Hardware, prec: Precision, psi: float, cx: _Compute) -> list[CommTerm]:
    """FSDP / HSDP / ZeRO-1 with TP/PP (FSDP2 over dp_replicate): parameter all-gathers (forward, and
    backward under ZeRO-3), the gradient reduce-scatter (once per step: gradient sync is off on
    inner micro batches), HSDP's all-reduce."""
    m, deg, ppn = layout.grad_accum, layout.degrees, hw.procs_per_node
    gbytes, pbytes = prec.grad * psi, prec.param * psi
    dims = ("dp_replicate",) if layout.dp_kind == "zero1_fsdp" else ("dp_shard", "cp")
    group, n = " x ".join(dims), layout.shard_degree
    x = group_crosses_nodes(deg, ppn, dims)
    units = cx.layers_r + 1
    out = [_term("FSDP all-gather (forward)", group, n, x, hw, units * m, m * (n - 1) / n * pbytes, m * cx.fwd_s)]
    if layout.zero_stage == 3:
        out.append(_term("FSDP all-gather (backward)", group, n, x, hw, units * m,
                         m * (n - 1) / n * pbytes, m * cx.bwd_s))
    rs = 1 if (m > 1) else m
    out.append(_term("FSDP gradient reduce-scatter", group, n, x, hw, units * rs,
                     rs * (n - 1) / n * gbytes, cx.bwd_s))
    if layout.dp_kind == "hsdp":
        r = layout.dp_replicate
        xr = group_crosses_nodes(deg, ppn, ("dp_replicate",))
        out.append(_term("HSDP gradient all-reduce (replicas)", "dp_replicate", r, xr, hw, units,
                         2 * (r - 1) / r * gbytes / n, cx.bwd_s))
    return out


def _dp_comm(arch: Arch, layout: Layout, hw: Hardware, prec: Precision, cx: _Compute) -> list[CommTerm]:
    """The data-parallel communication of the busiest rank's parameters (+ the tied embedding's sum)."""
    psi = max(rank_params(arch, layout))
    tied = [_tied_comm(arch, layout, hw, prec)] if arch.tie_embeddings and layout.pp > 1 \
        and layout.pp_schedule != "zbv" else []  # zbv: first and last stage on one rank, summed locally
    if layout.dp_kind in ("ddp", "zero1", "replicate"):
        return _replicated_dp_comm(layout, hw, prec, psi, cx) + tied
    if layout.dp_kind in ("fsdp", "hsdp", "zero1_fsdp"):
        return _sharded_dp_comm(layout, hw, prec, _fsdp_equivalent(arch, layout, psi, cx), cx) + tied
    return tied


def _tied_comm(arch: Arch, layout: Layout, hw: Hardware, prec: Precision) -> CommTerm:
    """Tied embeddings under pp: the embedding's and its LM-head copy's gradients (V·h/t, sharded
    like the gradients under ZeRO-2/3) all-reduced between the first and the last stage's pp ranks,
    once per step after the data-parallel reduction, before the optimizer: exposed."""
    x = group_crosses_nodes(layout.degrees, hw.procs_per_node, ("pp",))
    vocab_pad = -(-arch.vocab_size // layout.tp) * layout.tp
    shard = layout.shard_degree if layout.zero_stage >= 2 else 1
    nbytes = prec.grad * vocab_pad * arch.dim / layout.tp / shard  # 2(n-1)/n·S with n = 2
    return _term("tied embedding gradient all-reduce (first + last stage)", "pp", 2, x, hw, 1, nbytes, 0.0)


def _fsdp_equivalent(arch: Arch, layout: Layout, psi: float, cx: _Compute) -> float:
    """Parameters whose traffic over dp_shard x cp (n ranks) equals this rank's: under EP the experts'
    FSDP unit spans only the n/ep ranks of dp_shard_mod_ep, so they move (n/ep-1)/(n/ep) of their
    bytes, not (n-1)/n (none when ep = n)."""
    n, ep = layout.dp_shard * layout.cp, layout.ep if arch.moe else 1
    if ep <= 1 or n <= 1:
        return psi
    experts, n_e = cx.layers_r * arch.expert_params / ep, n // ep
    return psi - experts + experts * ((n_e - 1) / n_e) / ((n - 1) / n)


def _assumptions(arch: Arch, layout: Layout, cx: _Compute, bubble: float) -> list[str]:
    out = [
        f"kernel efficiency {cx.eff:.2f} = {EFF_MAX} x sat(h/t={arch.dim / layout.tp:.0f}) {cx.sat_h:.2f} x "
        f"sat(b·s/c={cx.tokens_mb:.0f}) {cx.sat_tok:.2f}, sat(x) = x/(x+{SAT_HALF})",
        f"overlap: data-parallel and CP comm hide behind up to {OVERLAP:.0%} of their compute window; "
        "TP, EP and PP comm exposed",
    ]
    if layout.pp > 1:
        out.append(f"bubble {layout.pp_schedule}: " + (
            "≈ 0 (zero-bubble schedule, idealised)" if layout.pp_schedule in ZERO_BUBBLE else
            f"(p-1)/({'v·' if layout.pp_schedule == 'interleaved_1f1b' else ''}m) = {bubble:.3f}"))
    if layout.recompute == "selective":
        out.append("selective recompute re-runs no matmul: HFU = MFU")
    return out


def timing_plan(arch: Arch, layout: Layout, seq_len: int, global_batch: int, hw: Hardware,
                prec: Precision) -> TimingPlan:
    """step = (compute + exposed TP/CP/EP/PP comm) x (1 + bubble) + exposed data-parallel comm."""
    world, tokens_step = layout.world, global_batch * seq_len
    _, _, model_fpt, hw_fpt = _flops_per_token(arch, layout, seq_len)
    cx = _compute(arch, layout, seq_len, hw, prec)
    compute_s = layout.grad_accum * cx.mb_s
    bubble = _bubble(layout)
    comm = _path_comm(arch, layout, seq_len, hw, prec, cx)
    path_comm = sum(ct.exposed_s for ct in comm)
    dp_terms = _dp_comm(arch, layout, hw, prec, cx)
    comm += dp_terms
    dp_exposed = sum(ct.exposed_s for ct in dp_terms)
    path = compute_s + path_comm
    bubble_s = bubble * path
    step = path + bubble_s + dp_exposed
    model_step, hw_step, peak = model_fpt * tokens_step, hw_fpt * tokens_step, cx.peak
    eff_terms = {"eff_max": EFF_MAX, "sat_h": cx.sat_h, "sat_tokens": cx.sat_tok, "busiest_pp_rank": cx.busiest}
    return TimingPlan(
        dtype=prec.name, peak_tflops=peak / 1e12, tokens_per_step=tokens_step, model_flops_per_token=model_fpt,
        hw_flops_per_token=hw_fpt, model_flops_per_step=model_step, hw_flops_per_step=hw_step, efficiency=cx.eff,
        efficiency_terms=eff_terms,
        micro_batch_s=cx.mb_s, compute_s=compute_s, bubble_fraction=bubble, bubble_s=bubble_s, comm=comm,
        exposed_path_comm_s=path_comm, exposed_dp_comm_s=dp_exposed, step_s=step,
        tokens_per_s=tokens_step / step, tokens_per_s_per_device=tokens_step / step / world,
        mfu=model_step / (step * world * peak), hfu=hw_step / (step * world * peak), world=world,
        assumptions=_assumptions(arch, layout, cx, bubble))
