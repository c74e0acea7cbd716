"""Predicted step time, tokens/s, MFU and HFU of one layout (docs/planner.md: formulas, sources,
what is not modelled). Every intermediate term stays in the TimingPlan so a figure can be traced.

Model, per optimizer step:

  compute     FLOPs of the busiest pp rank / (peak x kernel efficiency). FLOPs per token per
              layer: 6·(matmul weights)/t + 12·h·s/t (attention scores, playbook convention);
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
              compute + exposed TP / CP / EP / PP comm.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from usp.plan.memory import stage_layer_counts
from usp.plan.specs import Arch, Hardware, Layout, Precision, group_crosses_nodes

EFF_MAX = 0.50  # fraction of vendor peak a large transformer layer reaches (calibrated to the playbook's 40-47 % MFU)
SAT_HALF = 128  # matmul dimension at which efficiency is half of EFF_MAX
OVERLAP = 0.8  # share of an overlap window that communication can hide behind
LATENCY_S = {False: 10e-6, True: 25e-6}  # per collective call: intra-node, inter-node
ZERO_BUBBLE = ("interleaved_zb", "zbv")


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
    layer = (arch.attn_params + arch.dense_mlp_params) / t + arch.router_params + arch.norm_params \
        + arch.expert_params / (ep * t)
    vocab_pad = -(-arch.vocab_size // t) * t
    out = []
    for held in ranks:
        n = sum(counts[i] for i in held) * layer
        if 0 in held:
            n += vocab_pad * arch.dim / t
        if len(counts) - 1 in held:  # final norm, + the LM head unless it is the embedding on this rank
            n += arch.dim + (0 if arch.tie_embeddings and 0 in held else vocab_pad * arch.dim / t)
        out.append(n)
    return out


def timing_plan(arch: Arch, layout: Layout, seq_len: int, global_batch: int, hw: Hardware,
                prec: Precision) -> TimingPlan:
    t, c, p, m, b = layout.tp, layout.cp, layout.pp, layout.grad_accum, layout.micro_batch
    h, s = arch.dim, seq_len
    s_loc = s / c
    world = layout.world
    tokens_step = global_batch * s
    layer_mm = arch.active_layer_matmul_params
    layer_fpt = 6 * layer_mm + 12 * h * s  # training FLOPs per token of one block, and of the LM head
    head_fpt = 6 * arch.vocab_size * h
    blocks_fpt = arch.n_layers * layer_fpt
    model_fpt = blocks_fpt + head_fpt
    # full recomputation runs each block's forward (1/3 of its training FLOPs) again; the LM head
    # is not recomputed (usp/engine/recompute.py wraps blocks only)
    recompute_extra = 1 / 3 if layout.recompute == "full" else 0.0
    hw_fpt = model_fpt + recompute_extra * blocks_fpt

    peak = hw.peak_flops(prec)
    sat_h, sat_tok = _sat(h / t), _sat(b * s_loc)
    eff = EFF_MAX * sat_h * sat_tok

    # compute per micro batch on each pp rank
    counts, ranks = stage_layer_counts(arch, p, layout.virtual, layout.schedule, layout.pp_layers)
    tokens_mb = b * s_loc  # tokens one rank processes per micro batch
    per_layer = layer_fpt / t * (1 + recompute_extra)
    head = head_fpt / t
    stage_flops, stage_layers = [], []
    for held in ranks:
        n_layers = sum(counts[i] for i in held)
        stage_layers.append(n_layers)
        stage_flops.append(tokens_mb * (n_layers * per_layer + (head if len(counts) - 1 in held else 0)))
    busiest = max(range(p), key=lambda r: stage_flops[r])
    mb_s = stage_flops[busiest] / (peak * eff)
    compute_s = m * mb_s
    fwd_s, bwd_s = mb_s / (3 + 3 * recompute_extra), mb_s * (2 + 3 * recompute_extra) / (3 + 3 * recompute_extra)
    layers_r = max(stage_layers)

    if p == 1:
        bubble = 0.0
    elif layout.pp_schedule in ZERO_BUBBLE:
        bubble = 0.0
    elif layout.pp_schedule == "interleaved_1f1b":
        bubble = (p - 1) / (layout.virtual * m)
    else:
        bubble = (p - 1) / m

    deg, ppn = layout.degrees, hw.procs_per_node
    comm: list[CommTerm] = []
    act = prec.act
    # --- tensor parallel (+ sequence parallel): 2 all-gathers + 2 reduce-scatters per layer and pass
    if t > 1:
        x = group_crosses_nodes(deg, ppn, ("tp",))
        passes = 3 if layout.recompute == "full" else 2
        calls = 4 * passes * layers_r * m
        nbytes = calls * (t - 1) / t * s_loc * b * h * act
        comm.append(_term("TP all-gather / reduce-scatter (activations)", "tp", t, x, hw, calls, nbytes, 0.0))
    # --- context parallel: ring of K, V blocks per layer (forward), K, V + dK, dV (backward)
    if c > 1:
        x = group_crosses_nodes(deg, ppn, ("cp",))
        kv = 2 * s_loc * b * arch.kv_dim / t * act
        passes = 4 if layout.recompute == "full" else 3
        calls = passes * (c - 1) * layers_r * m
        nbytes = passes * (c - 1) * kv * layers_r * m
        attn_s = tokens_mb * 12 * h * s / t * layers_r * m / (peak * eff)
        comm.append(_term("CP ring K/V exchange", "cp", c, x, hw, calls, nbytes, attn_s))
    # --- expert parallel: dispatch + combine all-to-alls, forward and backward
    if arch.moe and layout.ep > 1:
        x = layout.ep * t > ppn or hw.nodes > 1 and group_crosses_nodes(deg, ppn, ("dp_shard", "cp"))
        passes = 3 if layout.recompute == "full" else 2
        calls = 2 * passes * layers_r * m
        nbytes = calls * (layout.ep - 1) / layout.ep * tokens_mb * arch.top_k * h * act
        comm.append(_term("EP all-to-all (tokens)", "ep", layout.ep, x, hw, calls, nbytes, 0.0))
    # --- pipeline: activations forward, gradients backward, per micro batch and virtual stage
    if p > 1:
        x = group_crosses_nodes(deg, ppn, ("pp",))
        calls = 2 * m * layout.virtual
        nbytes = calls * s_loc * b * h * act
        comm.append(_term("PP send/recv (activations, grads)", "pp", p, x, hw, calls, nbytes, 0.0))
    path_comm = sum(ct.exposed_s for ct in comm)

    # --- data parallel
    psi = max(rank_params(arch, layout))
    gbytes, pbytes = prec.grad * psi, prec.param * psi
    kind, dp_terms = layout.dp_kind, []
    bucket = layout.ddp_bucket_mb * 2 ** 20
    if kind in ("ddp", "zero1", "replicate"):
        dims = ("dp_replicate", "cp")
        n = layout.dp_replicate * c
        x = group_crosses_nodes(deg, ppn, dims)
        calls = max(1, int(gbytes // bucket) + 1) if kind != "replicate" else stage_layers[busiest] + 1
        dp_terms.append(_term("DP gradient all-reduce", "dp_replicate x cp", n, x, hw, calls,
                              2 * (n - 1) / n * gbytes, bwd_s))
        if kind == "zero1":
            dp_terms.append(_term("ZeRO-1 parameter all-gather (after the step)", "dp_replicate x cp", n, x, hw, 1,
                                  (n - 1) / n * pbytes, 0.0))
    elif kind in ("fsdp", "hsdp"):
        n = layout.dp_shard * c
        x = group_crosses_nodes(deg, ppn, ("dp_shard", "cp"))
        units = layers_r + 1
        gathers_fwd = m
        dp_terms.append(_term("FSDP all-gather (forward)", "dp_shard x cp", n, x, hw, units * gathers_fwd,
                              gathers_fwd * (n - 1) / n * pbytes, m * fwd_s))
        if layout.zero_stage == 3:
            dp_terms.append(_term("FSDP all-gather (backward)", "dp_shard x cp", n, x, hw, units * m,
                                  m * (n - 1) / n * pbytes, m * bwd_s))
        rs = 1 if (m > 1) else m  # gradient sync off on inner micro batches: one reduce-scatter per step
        dp_terms.append(_term("FSDP gradient reduce-scatter", "dp_shard x cp", n, x, hw, units * rs,
                              rs * (n - 1) / n * gbytes, bwd_s))
        if kind == "hsdp":
            r = layout.dp_replicate
            xr = group_crosses_nodes(deg, ppn, ("dp_replicate",))
            dp_terms.append(_term("HSDP gradient all-reduce (replicas)", "dp_replicate", r, xr, hw, units,
                                  2 * (r - 1) / r * gbytes / n, bwd_s))
    comm += dp_terms
    dp_exposed = sum(ct.exposed_s for ct in dp_terms)

    path = compute_s + path_comm
    bubble_s = bubble * path
    step = path + bubble_s + dp_exposed
    model_step = model_fpt * tokens_step
    hw_step = hw_fpt * tokens_step
    assumptions = [
        f"kernel efficiency {eff:.2f} = {EFF_MAX} x sat(h/t={h / t:.0f}) {sat_h:.2f} x sat(b·s/c={tokens_mb:.0f}) "
        f"{sat_tok:.2f}, sat(x) = x/(x+{SAT_HALF})",
        f"overlap: data-parallel and CP comm hide behind up to {OVERLAP:.0%} of their compute window; "
        "TP, EP and PP comm exposed",
    ]
    if p > 1:
        assumptions.append(f"bubble {layout.pp_schedule}: " + (
            "≈ 0 (zero-bubble schedule, idealised)" if layout.pp_schedule in ZERO_BUBBLE else
            f"(p-1)/({'v·' if layout.pp_schedule == 'interleaved_1f1b' else ''}m) = {bubble:.3f}"))
    if layout.recompute == "selective":
        assumptions.append("selective recompute re-runs no matmul: HFU = MFU")
    return TimingPlan(
        dtype=prec.name, peak_tflops=peak / 1e12, tokens_per_step=tokens_step, model_flops_per_token=model_fpt,
        hw_flops_per_token=hw_fpt, model_flops_per_step=model_step, hw_flops_per_step=hw_step, efficiency=eff,
        efficiency_terms={"eff_max": EFF_MAX, "sat_h": sat_h, "sat_tokens": sat_tok, "busiest_pp_rank": busiest},
        micro_batch_s=mb_s, compute_s=compute_s, bubble_fraction=bubble, bubble_s=bubble_s, comm=comm,
        exposed_path_comm_s=path_comm, exposed_dp_comm_s=dp_exposed, step_s=step,
        tokens_per_s=tokens_step / step, tokens_per_s_per_device=tokens_step / step / world,
        mfu=model_step / (step * world * peak), hfu=hw_step / (step * world * peak), world=world,
        assumptions=assumptions)
