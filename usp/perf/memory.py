"""Predicted memory per rank, per pipeline stage (docs/planner.md has the formulas and sources).

Every rank of one pipeline stage holds the same amount (TP, CP and data-parallel ranks split
work evenly), so the breakdown is per pp rank ("stage" below; with interleaved / V schedules a
pp rank holds several virtual stages). Terms, in bytes (Ψ = parameters this rank holds after
TP / EP slicing, N = ranks that shard them, P/G/K = bytes per param / grad / optimizer state:
4/4/8 in fp32 and in usp's bf16 (fp32 parameters, bf16 copies C = 2), 2/2/12 for a recipe that
stores bf16 parameters (usp.perf.specs.Precision)):

  parameters   PΨ, or PΨ/N under ZeRO-3 (FSDP2 reshard_after_forward=true), PΨ/N + CΨ under ZeRO-2
  gradients    GΨ, or GΨ/N under ZeRO-2/3 (but unsharded when grad_accum > 1: the engine turns
               gradient sync off on inner micro batches and FSDP2 then keeps full gradients)
  optimizer    KΨ, or KΨ/N under ZeRO-1/2/3
  activations  values kept per token per layer between forward and backward, counted from what this
               repo's Llama block keeps (measured on CPU with torch's MemTracker, docs/planner.md),
               t = tp, kv = n_kv_heads·head_dim, q = n_heads·head_dim (h unless model.head_dim), f = ffn_dim:
                 each RMSNorm: its input and x·rstd, 2h/t (sequence-sharded under TP + SP);
                 each norm's output, the input of the projections: h (DTensor's ColwiseParallel
                 keeps the input all-gathered over the sequence, so not divided by t);
                 attention: q, k, v after RoPE (q + 2kv)/t and the SDPA output q/t; with QK-norm
                 (model.qk_norm) its input and x·rstd on q and k, 2(q + kv)/t; latent attention
                 (model.kv_lora_rank, _mla_values): the low-rank outputs and their norms' outputs
                 3r_q + 3r_kv + d_rope (whole on every TP rank), q, k, the zero-padded v and SDPA
                 output 4H·d_qk/t, wo's input H·d_v/t;
                 SwiGLU: w1 and w3 outputs, silu output, their product: 4f/t;
                 MoE MLP: router probabilities (E) + per routed copy (top_k) the token, the
                 expert output and the weighted output (3h) + 4f_expert; a shared expert 4f_expert
                 (not divided by t: the MoE layer runs replicated over the TP ranks).
               Dense: (6h + 2kv + 4f)/t + 2h values (Megatron's GPT count is 17h); bytes = values x
               the activation dtype's size (prec.act); + 5·a·s²·b/t only when attention materialises
               the scores (never with SDPA / flash); CP's ring attention keeps K, V expanded to all
               heads (kv = h) and its output in fp32. Full recompute keeps the block input (h/t);
               selective (the engine's policy: keep matmul and attention outputs) keeps the input,
               q/k/v, the SDPA output, the MLP's matmul outputs and the two row-parallel outputs (h
               each: partial sums over the whole sequence under TP). CP divides s by c. Times the
               layers of the stage, times the micro batches in flight; the stage with the LM head
               also keeps the final norm's (2h/t + h). train.compile without recompute (dense, no
               CP): what the compiled block keeps instead (compiled_block_bytes, read from its saved
               tensors): its input in fp32 under autocast (h/t, 4 bytes), the norm outputs 2h, q/k/v
               and the SDPA output (2h + 2kv)/t, wo's output h, w1/w3 outputs and w2's input 3f/t in
               the activation dtype; under train.fp8 not the norm outputs nor w2's input (recomputed).
  in flight    pp = 1: 1; afab: m; 1f1b: min(m, p - r) on pp rank r; interleaved (v virtual
               stages): min(m·v, 2(p-1-r) + (v-1)p + 1) chunks of L/(pv) layers (Megatron);
               zbv: min(m, p) (ZB-V's peak equals 1F1B's).
  logits       the loss on the rank that holds the last stage (compiled, no TP: the logits kept in
               the activation dtype + one such buffer, their gradient), else in fp32, vocab-parallel under TP:
               the log-probabilities kept for backward, 4·s·b·V/t bytes (afab: all m micro
               batches'), and, while the loss is differentiated, 2 more such buffers (the gradients
               of the log-probabilities and of the logits), 3 with TP (loss_parallel's backward also
               materialises exp(log-probs)). With pp > 1, torch.distributed.pipelining also keeps
               each micro batch's stage output until its backward: the logits (s·b·V/t values)
               on the last stage, the hidden states (s·b·h/t) on the others (under activations).
  gathered     ZeRO-3, during backward: the root unit (embedding + final norm + head, whose
               backward spans the whole backward) unsharded (P + G bytes) + two transformer blocks'
               parameters (the one computing and the prefetched next, P bytes each; under pp all the
               rank's blocks: torch's pipelining keeps them gathered after their backward until the
               step's last, and the zero-bubble schedules unshard a whole stage for their split
               backward) + one block's unsharded gradient before the reduce-scatter (G
               bytes). ZeRO-2 keeps the sharded parameters (P·Ψ/N, updated by the optimizer) and
               the all-gathered ones (P·Ψ) from the forward until backward.
  copies       bf16 under autocast (usp's engine without FSDP2's bf16 policy: P/G/K = 4/4/8, fp32
               parameters): the bf16 copy of each weight a matmul reads, 2 bytes, where alive
               (_autocast_copies: every layer's without recompute, else the LM head's; compiled
               blocks save their own casts, one set per micro batch in flight; FP8 blocks none).
               Adds the "loss forward" peak: the copies + bf16 logits and their fp32 copy (6 bytes
               per logit) beside the kept log-probs (not with the compiled loss). train.fp8: the blocks'
               linears cast their fp32 (or gathered bf16) weights to FP8 themselves, 1 byte + fp32
               scales (one per tensor, or per row and per column: rowwise), one layer's during a
               layer's backward (_fp8_copies); FSDP gathers them as without FP8.
  comm buffers DDP / ZeRO-1: a flat copy of the gradients in buckets (PyTorch's default
               gradient_as_bucket_view=False).
  peak         the terms above are not all alive at once. Parameters, optimizer states, buckets and
               the kept activations / log-probs are; on top of them the peak holds the larger of
                 loss backward: the loss's 2 (3) extra buffers (+ the gradients when grad_accum > 1:
                   earlier micro batches' gradients; with m = 1 none exist yet, the engine zeroes
                   them with set_to_none), on the stage with the LM head;
                 layer backward: the gradients + the ZeRO-3 gathered units + the layer being
                   recomputed (full / selective recompute: its full set minus what was kept); with
                   m = 1, pp = 1 and no recompute only the head's and one layer's gradients when
                   that moment, the first layer's backward, is the larger (_layer_backward).
               `peak_phase` names the winner; the terms of the other phase are 0 in the breakdown.
  overhead     a fixed allowance per device kind (FIXED_OVERHEAD_GIB: CUDA/XPU context, NCCL and cuBLAS
               workspaces: 1.3 GiB, measured on an H200; CPU: a bare rank, Python + torch + gloo + usp's
               engine imports, 0.19 GiB private, + the libraries' pages a training rank maps, 0.20 GiB:
               0.4, tests/e2e/test_memory_promise.py keeps it current) + 5 % of everything
               else for allocator fragmentation + on CPU gloo's flat copy of one FSDP2 block's all-gather or
               reduce-scatter (gloo_copy). Not tensor memory: the engine's memory probe
               (usp/engine/observe/memory_probe.py) compares the total WITHOUT it with the measured tensor peak.

All of the above is usp's engine (planner.profile=usp). Another recipe's profile (usp.perf.stack_profile:
nanotron) changes what it keeps: an fp32 gradient-accumulation buffer, its ZeRO-1 and DDP, a fused
norm, sequence-sharded norm outputs, its loss, its layer split, no overhead, a measured extra per
token when a whole-model rank accumulates gradients, and its peak moment: at tp = 1 the bf16
gradients live one micro batch's backward only, so the peak is the start of one (every micro batch
in flight, no bf16 gradient) or its end (one less, all of them) (docs/planner.md, Profiles).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import accumulate

from usp.contract.decide import (
    autocast_weight_cache,
    bf16_by_fsdp_policy,
    compiles_loss,
    cpu_memory_first,
    padded_vocab,
)
from usp.contract.predictions import TERMS, BuildMemory, LocalBytes, MemoryPlan, StageMemory
from usp.perf.specs import GIB, Arch, Hardware, Layout, Precision, optimizer_state_label
from usp.perf.stack_profile import PROFILES, Profile
from usp.run.allocator import MAX_MMAP_THRESHOLD, paired_trim

# The fixed allowance per device kind, the one place it is set. cpu: a bare rank's private memory (the worker's
# imports, plan, gloo process group and device mesh; tests/dist/bare_rank.py: 0.19 GiB anonymous, measured from
# outside) + the shared libraries' pages a training rank maps (0.20 GiB at its peak, every layout of the memory
# benchmark). Those pages are the larger the way the libraries entered the page cache: written or read whole (a
# fresh install, a copy) they sit in large folios, and a fault maps a whole one; faulted in page by page (a
# long-used environment) a rank maps half as much (0.10 GiB; the bare rank 0.34 against 0.27 GiB in all). The
# plan promises the larger. Kept between the bare rank and 1.5x of it by tests/e2e/test_memory_promise.py.
# cuda: outside the caching allocator, measured on one H200 (torch 2.11, scripts/bench/gpu_context.py): the CUDA
# context 0.60 GiB, + cuBLAS 0.73, + flash attention's kernels 0.75, + an NCCL communicator 1.29 GiB (a one-GPU
# run, without NCCL, held 0.73 at 8B). An NCCL group's per-peer buffers come on top, inside the 5 % margin (its
# reserved-beyond-allocated measured 0.12 GiB at 8B compiled). xpu: CUDA's, not measured.
FIXED_OVERHEAD_GIB = {"cpu": 0.4, "cuda": 1.3, "xpu": 1.3}
DEFAULT_FIXED_OVERHEAD_GIB = FIXED_OVERHEAD_GIB["cuda"]  # a device kind the table doesn't name
LOSS_BACKWARD_BUFFERS = 2  # fp32 logits-sized buffers alive besides the kept log-probs while the loss is differentiated
VOCAB_PARALLEL_LOSS_BACKWARD_BUFFERS = 3  # torch's loss_parallel: one-hot gradient, exp(log-probs), their sum
SCORE_MATERIALISING = ("eager",)  # attention implementations that keep the a·s² scores (none in this repo)
ZERO_BUBBLE = ("interleaved_zb", "zbv")
FSDP_ACCUM_UNSHARDED_GRADS = True  # usp.engine.parallel.data.gradient_sync: no reduce-scatter on inner micro batches

# train.compile (no TP): the compiled loss (usp/engine/loss.py) keeps the logits in the activation dtype and writes
# their gradient in that dtype, one buffer; no fp32 log-probabilities, no fp32 copy at the loss forward.
# Inductor's fused cross entropy as read from its graph. Checked on the H100 (docs/benchmarks.md): Llama-3.2 1B
# compiled, 8 x 2048, peaked 59.38 GiB with the eager loss and 43.73 with this one, 15.65 GiB = 4 bf16 logits-sized
# buffers less: the eager loss's fp32 log-probabilities + 2 fp32 buffers (6) against these 2.
COMPILED_LOSS_BACKWARD_BUFFERS = 1
LOSS_FORWARD_EXTRA_BYTES = 6  # per logit at the loss forward, besides the kept fp32 log-probs: bf16 logits + fp32 copy
# train.compile, no recompute: what inductor's partitioner keeps of a dense block (compiled_block_bytes), read tensor by
# tensor from the compiled block's saved tensors (scripts/bench/compiled_saved.py: CPU, torch 2.13, the Llama-3.2 1B
# and 3B blocks at the GPU rows' shapes, 8 x 2048 and 2 x 2048 tokens): its input in the residual stream's dtype
# (fp32 under autocast), the two norm outputs, q/k/v, the SDPA output, wo's output (x + attention(x) is recomputed
# from it), SwiGLU's w1 and w3 outputs and their product, in the activation dtype; x·rstd and silu are recomputed.
# It also keeps the bf16 cast of every weight (_autocast_copies). Under train.fp8 (torchao's Float8Linear, whose
# autograd function saves the fp32 weight itself) it recomputes the linears' inputs (the norm outputs, the product)
# and keeps no weight cast. The H100 rows it predicts (2026-11-27, docs/benchmarks.md "GPU session"; tensors,
# measured / planned): 1B 8 x 1 1.002, 8 x 4 1.002, 3B 2 x 4 1.001, 1 x 4 1.009, FP8 2 x 4 1.00.
AUTOCAST_RESIDUAL_BYTES = 4  # the residual stream under autocast: fp32 (the embedding's output, each residual add)

# --- pipeline stages ---------------------------------------------------------------------------------

@lru_cache(maxsize=1024)
def stage_layer_counts(arch: Arch, pp: int, virtual: int, schedule: str, pp_layers: tuple | None,
                       split: str = "params") -> tuple:
    """(layers per virtual stage, virtual stages per pp rank): usp.perf.pipeline_split's split, the
    one the engine builds, or a profile's: nanotron's matmul-cost split (split="matmul"), the same number of
    layers per stage (split="even": Megatron, torchtitan)."""
    from usp.perf.pipeline_split import arch_split, matmul_threshold_split, stage_ranks

    if pp * virtual == 1:
        return (arch.n_layers,), ((0,),)
    if split == "matmul" and virtual == 1 and pp_layers is None:
        return matmul_threshold_split(arch, pp), tuple((r,) for r in range(pp))
    if split == "even" and pp_layers is None:  # a profile's: the same layers on every (virtual) stage
        n = pp * virtual
        counts = tuple(arch.n_layers // n + (1 if i < arch.n_layers % n else 0) for i in range(n))
        return counts, tuple(tuple(r) for r in stage_ranks(pp, virtual, schedule if schedule == "zbv" else "1f1b"))
    counts = tuple(len(s) for s in arch_split(arch, pp * virtual, pp_layers))
    ranks = stage_ranks(pp, virtual, schedule if schedule in ("zbv",) else "1f1b")
    return counts, tuple(tuple(r) for r in ranks)


def dense_layers_held(arch: Arch, counts: tuple, held: tuple) -> int:
    """How many of a MoE model's dense first blocks (model.n_dense_layers) the virtual stages `held` hold,
    the stages having `counts` layers each, in order (0 for a dense model)."""
    if not arch.dense_layers:  # the search asks once per rank and layout: skip the prefix sums
        return 0
    starts = (0, *accumulate(counts))
    return sum(max(0, min(starts[i] + counts[i], arch.dense_layers) - starts[i]) for i in held)


def in_flight(layout: Layout, r: int) -> float:
    """Micro batches whose activations pp rank r holds at its peak, in units of its layers."""
    p, m, v = layout.pp, layout.grad_accum, layout.virtual
    if p == 1:
        return 1.0
    sched = layout.pp_schedule
    if sched == "afab":
        return float(m)
    if sched in ("interleaved_1f1b", "interleaved_zb"):
        return min(m * v, 2 * (p - 1 - r) + (v - 1) * p + 1) / v
    if sched == "zbv":
        return float(min(m, p))
    return float(min(m, p - r))


# --- the per-layer numbers ---------------------------------------------------------------------------

def activation_values(arch: Arch, layout: Layout, profile: Profile) -> tuple[float, float]:
    """(values kept per token per layer between forward and backward, values of one layer's full
    set), for the Llama block of usp/models/llama.py as the engine runs it (module docstring), or as
    the profile's recipe runs it (a fused norm, sequence-sharded norm outputs, a packed K/V copy)."""
    h, kv, t, f, q = arch.dim, arch.kv_dim, layout.tp, arch.ffn_dim, arch.q_dim
    if layout.cp > 1:  # the ring attention keeps K and V expanded to every query head (GQA)
        kv = q
    norm = (1 if profile.fused_norm else 2) * h / t  # RMSNorm input (and x·rstd), sequence-sharded under TP + SP
    norm_out = h / t if profile.sp_norm_outputs_sharded else h  # the projections' input: all-gathered by DTensor
    packed_kv = 2 * kv / t if profile.kv_packed_copy else 0
    qk_norm = 2 * (q + arch.kv_dim) / t if arch.qk_norm else 0  # QK-norm's input and x·rstd on q and k
    attention = norm + norm_out + (q + 2 * kv) / t + packed_kv + q / t + qk_norm  # + q/k/v after RoPE, SDPA out
    if arch.mla:  # latent attention: its own tensors (_mla_values); the ring's K/V as GQA's
        latent, heads, sdpa_out = _mla_values(arch, t)
        attention = norm + norm_out + latent + heads + sdpa_out + (2 * kv / t if layout.cp > 1 else 0)
    if arch.moe:
        fe = arch.moe_ffn_dim or arch.ffn_dim
        # the MoE layer runs on the whole (all-gathered) sequence on every TP rank: nothing divided by t
        fs = fe * arch.n_shared_experts
        mlp = norm + norm_out + arch.n_experts + arch.top_k * (3 * h + 4 * fe) + (4 * fs if arch.shared_expert else 0)
        mlp_matmuls: float = arch.n_experts + arch.top_k * (2 * fe + h) + ((2 * fs + h) if arch.shared_expert else 0)
    else:
        mlp = norm + norm_out + 4 * f / t  # + w1, w3 outputs, silu, product
        mlp_matmuls = 2 * f / t + h  # w1, w3 outputs; w2's (a partial sum over the whole sequence under TP)
    full = attention + mlp
    if layout.recompute == "full":
        return h / t, full  # the block input
    if layout.recompute == "selective":  # matmul / attention outputs: q, k, v, SDPA out, wo out + the MLP's
        if arch.mla:
            latent, heads, sdpa_out = _mla_values(arch, t)
            return h / t + latent + heads + sdpa_out + h + mlp_matmuls, full
        return h / t + (q + 2 * kv) / t + q / t + h + mlp_matmuls, full
    return full, full


def _mla_values(arch: Arch, t: int) -> tuple[float, float, float]:
    """Latent attention's kept values per token (usp/models/mla.py), as saved-tensor hooks count them on
    one eager forward (4,602 values per token at dim 512, 8 heads of 64 + 32, v 64, ranks 192 / 128: these
    4,576, and the log-sum-exp, RoPE tables and rstd): (the low-rank side, whole on every TP rank: wq_a's
    output, q_a_norm's and its copy as wq_b's input, wkv_a's output, kv_a_norm's and its copy; the heads'
    side over tp: q, k, the zero-padded v and SDPA output, all q/k wide; wo's input)."""
    heads, qk = arch.n_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim
    latent = 3 * arch.q_lora_rank + 3 * arch.kv_lora_rank + arch.qk_rope_head_dim
    return latent, 4 * heads * qk / t, heads * arch.v_head_dim / t


def activation_per_layer(arch: Arch, layout: Layout, seq_len: int, prec: Precision,
                         profile: Profile) -> tuple[float, float]:
    """(bytes kept per layer per micro batch between forward and backward, bytes of one layer's
    full activation set): activation_values x tokens of the micro batch x prec.act bytes (x the
    profile's fitted activation_scale)."""
    s, b, t = seq_len / layout.cp, layout.micro_batch, layout.tp
    scores = 5 * arch.n_heads * s * s * b / t * prec.act / 2 \
        if arch.attention in SCORE_MATERIALISING and layout.recompute == "none" else 0
    kept, full = activation_values(arch, layout, profile)
    casts = autocast_input_casts(arch, layout, prec) if profile.name == "usp" else 0.0
    kept, full = kept + (casts if layout.recompute == "none" else 0.0), full + casts
    ring = s * b * arch.q_dim / t * (4 - prec.act) if layout.cp > 1 else 0  # its output is kept in fp32
    kept_ring = ring if layout.recompute != "full" else 0
    scale = profile.activation_scale
    full_bytes = (s * b * full * prec.act + scores + ring) * scale
    compiled = compiled_block_bytes(arch, layout, prec)
    if compiled is not None:
        return s * b * compiled * scale, full_bytes
    return (s * b * kept * prec.act + scores + kept_ring) * scale, full_bytes


def autocast_input_casts(arch: Arch, layout: Layout, prec: Precision) -> float:
    """Values per token a layer keeps beyond one copy of each norm output when autocast runs the
    block eagerly: the norm's output stays fp32 and each projection casts its own bf16 copy of it,
    kept for its backward (wq, wk and wv: three copies where one is counted; w1 and w3: two).
    Measured on one H200 (Llama-3.2 1B eager, 8 x 2048: the allocator's peak 3.1 GiB above the count
    without them, 3·h per layer, read by scripts/bench/gpu_peak.py) and on CPU (a block's saved
    tensors). Compiled blocks cast once (compiled_block_bytes); FSDP2's bf16 policy and FP8 have no
    autocast casts; a MoE layer's inputs are counted with its dispatch."""
    if prec.compiled or not prec.copy_bytes or prec.fp8 != "off" or \
            bf16_by_fsdp_policy(layout.dp_kind, layout.pp, layout.ep):
        return 0.0
    return 2 * arch.dim + (0 if arch.moe else arch.dim)


def compiled_block_bytes(arch: Arch, layout: Layout, prec: Precision) -> float | None:
    """Bytes per token a compiled dense block keeps without recompute (AUTOCAST_RESIDUAL_BYTES: what
    inductor keeps and recomputes, measured); None where the eager count stands: eager, recompute, MoE or
    CP (not measured compiled). Under TP the terms divide as the eager ones do (not measured either)."""
    if not prec.compiled or layout.recompute != "none" or arch.moe or arch.mla or layout.cp > 1:
        return None
    h, kv, f, t, q = arch.dim, arch.kv_dim, arch.ffn_dim, layout.tp, arch.q_dim
    autocast = prec.copy_bytes and not bf16_by_fsdp_policy(layout.dp_kind, layout.pp, 1)
    block_input = h / t * (AUTOCAST_RESIDUAL_BYTES if autocast else prec.act)  # sequence-sharded under SP
    attention = (2 * q + 2 * kv) / t + (2 * (q + kv) / t if arch.qk_norm else 0)  # q, k, v, SDPA output; QK-norm
    wo_output = h  # a partial sum over the whole sequence under TP, as selective recompute counts it
    swiglu = 2 * f / t  # the w1 and w3 outputs
    linear_inputs = 0 if prec.fp8 != "off" else 2 * h + f / t  # the norm outputs (all-gathered under TP), w2's input
    return block_input + (attention + wo_output + swiglu + linear_inputs) * prec.act


def activation_formula(layout: Layout) -> str:
    t = "" if layout.tp == 1 else "/t"
    s = "(s/c)" if layout.cp > 1 else "s"
    full = f"(6h + 2kv + 4f){t} + 2h" if t else "8h + 2kv + 4f"
    if layout.recompute == "full":
        return f"full recompute: {s}·b·h{t} values per layer + one layer's {s}·b·({full}) while recomputed"
    if layout.recompute == "selective":
        return f"selective recompute: {s}·b·(matmul + attention outputs) values per layer (docs/planner.md)"
    return f"{s}·b·({full}) values per layer (Llama block as the engine runs it; SDPA keeps no a·s² scores)"


# --- the breakdown ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Held:
    """What one rank of pp rank r holds: layers and parameters (after TP / EP slicing)."""

    held: tuple
    layers: int
    holds_emb: bool
    holds_head: bool
    vocab_pad: int
    dense_layer: float  # one layer's parameters that are not routed experts
    expert_layer: float  # one layer's routed experts on this rank
    emb: float
    head: float
    dense: float
    experts: float
    # each parameter as the rank holds it after TP / EP: (dim-0 rows, values per row, how many, routed experts?)
    tensors: tuple = ()

    @property
    def params(self) -> float:
        return self.dense + self.experts


def _held(arch: Arch, layout: Layout, r: int, profile: Profile) -> _Held:
    return _held_by_shape(arch, layout.tp, layout.ep, layout.pp, layout.virtual, layout.schedule, layout.pp_layers,
                          profile.pp_split, r)


@lru_cache(maxsize=8192)  # a search asks the same stage of many data-parallel flavours and micro batches
def _held_by_shape(arch: Arch, tp: int, ep_degree: int, pp: int, virtual: int, schedule: str, pp_layers: tuple | None,
                   split: str, r: int) -> _Held:
    t, ep = tp, max(1, ep_degree) if arch.moe else 1
    counts, ranks = stage_layer_counts(arch, pp, virtual, schedule, pp_layers, split)
    held = ranks[r]
    layers = sum(counts[i] for i in held)
    n_dense = dense_layers_held(arch, counts, held)  # a MoE model's dense first blocks: the stages holding them
    holds_emb, holds_head = 0 in held, (len(counts) - 1) in held
    vocab_pad = padded_vocab(arch.vocab_size, t)
    # a MoE layer is not TP-sliced (router, experts and shared expert replicated over tp); EP slices the experts
    dense_layer = arch.attn_params_over(t) + arch.dense_mlp_params / (1 if arch.moe else t) + arch.router_params \
        + arch.norm_params
    expert_layer = arch.expert_params / ep
    dense_block = arch.attn_params_over(t) + arch.parts["dense_mlp"] / t + arch.norm_params  # a MoE model's dense one
    emb = vocab_pad * arch.dim / t if holds_emb else 0
    head: float = 0
    if holds_head:  # tied: the head is the embedding itself only without pp; a pipeline's last stage holds a copy
        tied_here = arch.tie_embeddings and pp == 1
        head = (0 if tied_here else vocab_pad * arch.dim / t) + arch.dim
    moe_layers = layers - n_dense
    mtp = arch.mtp_depth if holds_head else 0  # multi-token prediction: a block more (whole models only)
    moe_layers, layers = moe_layers + mtp, layers + mtp
    mtp_extra = mtp * (2 * arch.dim * arch.dim + 3 * arch.dim)  # its eh_proj and three norms, whole
    return _Held(held, layers, holds_emb, holds_head, vocab_pad, dense_layer, expert_layer, emb, head,
                 moe_layers * dense_layer + n_dense * dense_block + emb + head + mtp_extra, moe_layers * expert_layer,
                 _tensors(arch, t, ep, moe_layers, holds_emb, head > arch.dim, holds_head, vocab_pad)
                 + _tensors(replace(arch, n_experts=0), t, ep, n_dense, False, False, False, vocab_pad)
                 + (((arch.dim, 2 * arch.dim, mtp, False), (arch.dim, 1, 3 * mtp, False)) if mtp else ()))


def _tensors(arch: Arch, t: int, ep: int, layers: int, emb: bool, head: bool, norm: bool, vocab_pad: int) -> tuple:
    """(dim-0 rows, values per row, count, routed experts?) of every parameter a rank holds, as
    usp/engine/parallel/tensor.py shards them over tp (embedding rows, LM head and wq/wk/wv/w1/w3
    rows: Shard(0); wo, w2: Shard(1); norms replicated; a MoE layer not at all) and expert.py slices
    the experts over ep: what FSDP2 then cuts along dim 0 (sharded_params)."""
    h, kv, f, q = arch.dim, arch.kv_dim, arch.ffn_dim, arch.q_dim
    up = lambda x: -(-x // t)  # noqa: E731 - DTensor's Shard: torch.chunk pieces, the first ones the longest
    if arch.mla:
        out = _mla_tensors(arch, up, layers)
    else:
        out = [(h, 1, 2 * layers, False), (up(q), h, layers, False), (up(kv), h, 2 * layers, False),
               (h, up(q), layers, False)]  # the two norms, wq, wk + wv, wo
    if arch.qk_norm:
        out.append((arch.head_dim, 1, 2 * layers, False))  # q_norm, k_norm: replicated over tp
    if arch.moe:
        fe = arch.moe_ffn_dim or arch.ffn_dim
        out += [(arch.n_experts, h, layers, False), (arch.n_experts // ep, h * fe, 3 * layers, True)]
        if arch.shared_expert:
            fs = fe * arch.n_shared_experts
            out += [(fs, h, 2 * layers, False), (h, fs, layers, False)]
    else:
        out += [(up(f), h, 2 * layers, False), (h, up(f), layers, False)]  # w1 + w3, w2
    out += [(vocab_pad // t, h, int(emb) + int(head), False), (h, 1, int(norm), False)]  # embedding, LM head; norm
    return tuple(x for x in out if x[2] and x[0] * x[1])


def _mla_tensors(arch: Arch, up, layers: int) -> list:
    """Latent attention's parameters as tensor.py holds them: the two block norms; wq_a, q_a_norm, wkv_a,
    kv_a_norm whole; wq (or wq_b) and wkv_b rows over tp; wo columns over tp (usp/models/mla.py)."""
    h, heads, rank = arch.dim, arch.n_heads, arch.q_lora_rank
    qk, rope, kv_rank = arch.qk_nope_head_dim + arch.qk_rope_head_dim, arch.qk_rope_head_dim, arch.kv_lora_rank
    q = [(rank, h, layers, False), (rank, 1, layers, False), (up(heads * qk), rank, layers, False)] if rank \
        else [(up(heads * qk), h, layers, False)]
    return [(h, 1, 2 * layers, False), *q, (kv_rank + rope, h, layers, False), (kv_rank, 1, layers, False),
            (up(heads * (arch.qk_nope_head_dim + arch.v_head_dim)), kv_rank, layers, False),
            (h, up(heads * arch.v_head_dim), layers, False)]


def zero_sharding(layout: Layout, profile: Profile) -> tuple[int, int]:
    """(ZeRO stage, ranks sharding the model states) as the profile's recipe builds the layout:
    usp's data_parallel_kind, or nanotron's ZeRO-1 (optimizer states only, over dp, also with TP/PP)."""
    if profile.data_parallel == "nanotron" and layout.dp_kind in ("zero1", "zero1_fsdp"):
        return 1, layout.dp_replicate
    return layout.zero_stage, layout.shard_degree


def ddp_buckets(layout: Layout, profile: Profile) -> bool:
    """Is the data parallelism DDP, with its bucket copy of the gradients? usp: DDP and ZeRO-1 without
    TP/PP; nanotron: any dp_replicate > 1 without ZeRO-1 (its ZeRO-1 runs without DDP)."""
    if profile.data_parallel == "nanotron":
        return layout.dp_kind in ("ddp", "replicate")
    return layout.dp_kind in ("ddp", "zero1")


def _model_states(arch: Arch, layout: Layout, prec: Precision, h: _Held, st: StageMemory, profile: Profile) -> float:
    """Parameters and optimizer states into st (ZeRO-2 keeps its sharded parameters next to the
    all-gathered ones); returns the gradients' bytes (where they are alive: the peak decides), with
    the profile's fp32 gradient-accumulation buffer (every parameter, 4 bytes, never sharded)."""
    zero, n = zero_sharding(layout, profile)
    # params after data-parallel sharding: FSDP2's padded dim-0 shards; ZeRO-1's optimizer splits whole tensors
    sharded = sharded_params(arch, layout, h, n) if zero >= 2 else h.params / n
    st.parameters = prec.param * (sharded if zero == 3 else h.params)
    if zero == 2 and n > 1:  # the all-gathered parameters too, in the dtype the matmuls read
        st.parameters = prec.param * sharded + prec.gathered * h.params
    grads_sharded = zero >= 2 and not (FSDP_ACCUM_UNSHARDED_GRADS and layout.grad_accum > 1)
    st.optimizer = prec.optim * (sharded if zero >= 1 else h.params)
    return prec.grad * (sharded if grads_sharded else h.params) + (4 * h.params if profile.fp32_grad_accum else 0)


def _activations(arch: Arch, layout: Layout, seq_len: int, prec: Precision, h: _Held, st: StageMemory,
                 profile: Profile) -> tuple[float, float]:
    """Kept activations into st (+ the profile's full-sequence buffers under TP + SP: the all-gather
    buffer, a layer backward's unsharded input gradient; + its measured extra per token when a rank
    holding the whole model accumulates gradients); returns (the bytes of the layer being
    recomputed: its full set minus what was kept, the bytes one micro batch keeps on this rank).
    Where the profile's peak follows the micro batches (grads_freed_per_micro_batch), the backward
    transients (activation_scale) belong to the one micro batch being differentiated, not to every
    micro batch in flight."""
    kept, full_set = activation_per_layer(arch, layout, seq_len, prec, profile)
    st.activation_per_layer = kept
    tokens = (seq_len / layout.cp) * layout.micro_batch
    final_norm = tokens * (2 * arch.dim / layout.tp + arch.dim) * prec.act if h.holds_head else 0
    stage_output = tokens * arch.dim / layout.tp * prec.act if layout.pp > 1 and not h.holds_head else 0
    one = kept * h.layers + final_norm + stage_output  # torch.distributed.pipelining keeps each stage output
    st.activations = one * st.in_flight
    if grads_freed_per_micro_batch(layout, profile):  # the backward transients: one micro batch's only
        st.activations -= kept * h.layers * (1 - 1 / profile.activation_scale) * (st.in_flight - 1)
    if layout.tp > 1:
        st.activations += profile.sp_full_buffers * tokens * arch.dim * prec.act
    if layout.pp == 1 and layout.grad_accum > 1:  # measured on nanotron (docs/planner.md): 0 for usp's engine
        st.activations += profile.accum_bytes_per_token_h * tokens * arch.dim
    return (full_set - kept if layout.recompute != "none" and h.layers else 0), one


def _logits(arch: Arch, layout: Layout, seq_len: int, prec: Precision, h: _Held, st: StageMemory,
            profile: Profile) -> float:
    """Kept log-probabilities (+ the stage output under pp) into st; returns the loss backward's
    extra buffers. A profile with loss_forward_bytes: that many bytes per logit at the loss forward
    (nanotron: the bf16 logits, their fp32 copy and its max-shifted copy), nothing extra after."""
    if not h.holds_head:
        return 0.0
    t = layout.tp
    tokens = (seq_len / layout.cp) * layout.micro_batch
    if profile.loss_forward_bytes:
        st.logits = profile.loss_forward_bytes * tokens * h.vocab_pad / t
        return 0.0
    n_logits = layout.grad_accum if layout.pp > 1 and layout.pp_schedule == "afab" else 1
    if compiled_loss(layout, prec):  # the logits (under pp: the stage output) kept, their gradient one more
        one = prec.act * tokens * h.vocab_pad
        st.logits = one * n_logits
        # or the head's backward, which frees them: its weight's new gradient (fp32) before it is added into
        # .grad, larger where a micro batch has fewer tokens than the model is wide (3B at micro batch 1: 0.49 GiB)
        return max(one * COMPILED_LOSS_BACKWARD_BUFFERS, prec.grad * h.vocab_pad * arch.dim - st.logits)
    one = 4 * tokens * h.vocab_pad / t  # fp32, vocab-parallel under TP
    st.logits = one * n_logits  # log-probabilities kept for backward
    if layout.pp > 1:  # and the stage output, the logits in the activation dtype, until its backward
        st.logits += tokens * h.vocab_pad / t * prec.act * n_logits
    return one * (VOCAB_PARALLEL_LOSS_BACKWARD_BUFFERS if t > 1 else LOSS_BACKWARD_BUFFERS)


def compiled_loss(layout: Layout, prec: Precision) -> bool:
    """Does the engine compile the loss? With the blocks (train.compile), unless TP shards the vocabulary
    (usp/engine/loss.py)."""
    return compiles_loss(prec.compiled, layout.tp)


def _gathered(layout: Layout, prec: Precision, h: _Held) -> float:
    """ZeRO-3 during backward: the root unit unsharded + two blocks' parameters + one block's gradient.
    Under pp, every block of the rank's stage instead of two: torch.distributed.pipelining runs each
    micro batch's backward with set_reshard_after_backward(False) and reshards only once the step's
    last backward is done, so a block stays gathered from its first backward to the step's end
    (measured, CPU: pp2 x cp2 x dp_shard2, dim 1024: the stage's 4 blocks + its embedding gathered
    beside its shards, 0.25 GiB, docs/benchmarks.md); the zero-bubble schedules also unshard the whole
    stage for their split backward (usp/engine/parallel/pipeline.py)."""
    if layout.zero_stage != 3:
        return 0.0
    unit, root, b = h.dense_layer + h.expert_layer, h.emb + h.head, prec.gathered
    if not h.layers:
        return 2 * b * root
    blocks = h.layers if layout.pp > 1 else 2
    return 2 * b * root + (blocks * b + b) * unit


def fp8_layer_params(arch: Arch, layout: Layout) -> float:
    """Weights of one layer on one rank that train.fp8 converts: every linear of a dense block
    (attention and SwiGLU; usp/engine/parallel/fp8.py), none of a MoE layer's (refused)."""
    return 0.0 if arch.moe else (arch.attn_params + arch.dense_mlp_params) / layout.tp


def _fp8_copies(arch: Arch, layout: Layout, prec: Precision) -> float:
    """train.fp8: one layer's FP8 weight copies (1 byte each) and their fp32 scales, alive while the
    layer computes: one scale per tensor (tensorwise), or one per row and one per column (rowwise:
    the forward and the backward scale along different dims)."""
    if prec.fp8 == "off" or arch.moe:
        return 0.0
    h, kv, f, t, q = arch.dim, arch.kv_dim, arch.ffn_dim, layout.tp, arch.q_dim
    rows_and_cols = ((h + q) + 2 * (h + kv) + (q + h)) / t + 3 * (h + f) / t  # wq, wk, wv, wo; w1, w3, w2
    scales = 4 * rows_and_cols if prec.fp8 == "rowwise" else 4 * 7
    return fp8_layer_params(arch, layout) + scales


def _autocast_copies(arch: Arch, layout: Layout, prec: Precision, h: _Held,
                     in_flight: float) -> tuple[float, float, float]:
    """The bf16 copies autocast makes of the fp32 weights it feeds to matmuls, in bytes, alive at
    (the loss forward, the loss backward, a layer's backward). Each linear saves its copy for
    backward; without recompute autocast also caches it (usp.perf.specs.autocast_weight_cache), so
    a pipeline's in-flight micro batches share one copy, held for the whole step. A recomputed
    layer's copy lives within its own forward or backward: one layer's during a layer's backward.
    Compiled blocks (train.compile) cast inside their graph and, without recompute, save every cast for
    backward (compiled_block_bytes: measured), one per in-flight micro batch (each call of the
    graph casts anew). FP8 blocks (train.fp8) cast to FP8 themselves and save the fp32 weight
    (_fp8_copies): only the eager LM head's copy counts. 0 where nothing is copied: fp32, bf16-stored
    parameters, or FSDP2's bf16 policy (gathered)."""
    b = prec.copy_bytes
    if not b or bf16_by_fsdp_policy(layout.dp_kind, layout.pp, layout.ep if arch.moe else 1):
        return 0.0, 0.0, 0.0
    tied_head = arch.tie_embeddings and layout.pp == 1 and h.holds_head  # the head casts the embedding
    head = b * (h.emb if tied_head else max(0.0, h.head - arch.dim))  # its weight, not the final norm's
    if prec.fp8 != "off":
        return head, head, 0.0
    layer = b * (h.dense_layer + h.expert_layer)
    if not autocast_weight_cache(layout.recompute):  # eager or compiled: the recomputed layer casts again
        return head, head, layer
    every = head + h.layers * layer * (in_flight if prec.compiled else 1)
    return every, every, (every if layout.pp > 1 else 0.0)


def recipe_precision(prec: Precision, profile: Profile) -> Precision:
    """The precision as the profile's recipe holds its tensors: train.compile's memory terms (the compiled
    block's saved tensors, the compiled loss, autocast's casts per in-flight micro batch) are usp's blocks
    under torch.compile; a recipe that does not follow train.compile (Profile.follows_compile: nanotron's
    own fused kernels) keeps an eager block's tensors whatever the flag says."""
    return prec if profile.follows_compile or not prec.compiled else replace(prec, compiled=False)


def stage_memory(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision, r: int,
                 profile: Profile) -> StageMemory:
    """One rank of pp rank r: the terms of the module docstring, at the peak, as the profile's recipe
    holds them."""
    prec, h = recipe_precision(prec, profile), _held(arch, layout, r, profile)
    st = StageMemory(stage=r, first_rank=r * (layout.world // layout.pp), n_ranks=layout.world // layout.pp,
                     virtual_stages=list(h.held), layers=h.layers, holds_embedding=h.holds_emb,
                     holds_head=h.holds_head, params=int(h.params), in_flight=in_flight(layout, r),
                     activation_per_layer=0.0)
    grads = _model_states(arch, layout, prec, h, st, profile)
    recompute, one_micro_batch = _activations(arch, layout, seq_len, prec, h, st, profile)
    loss_extra = _logits(arch, layout, seq_len, prec, h, st, profile)
    gathered = _gathered(layout, prec, h)
    copies_fwd, copies_loss, copies_layer = _autocast_copies(arch, layout, prec, h, st.in_flight)
    copies_layer += _fp8_copies(arch, layout, prec) if h.layers else 0.0
    # The peak: the loss backward (no gradient exists yet unless earlier micro batches left some), a
    # layer's backward (gradients, ZeRO-3's gathered units, the recomputed layer) or, under autocast,
    # the loss forward (every cached copy, the bf16 logits + their fp32 copy), whichever is largest.
    layer_grads, layer_copies = _layer_backward(arch, layout, h, grads, (copies_loss, copies_layer), st)
    layer_phase = layer_grads + layer_copies + gathered + recompute
    earlier_grads = grads if layout.grad_accum > 1 else 0
    loss_phase = loss_extra + copies_loss + earlier_grads
    logits_here = (seq_len / layout.cp) * layout.micro_batch * h.vocab_pad / layout.tp
    fwd_extra = 0.0 if compiled_loss(layout, prec) else LOSS_FORWARD_EXTRA_BYTES * logits_here
    fwd_phase = copies_fwd + fwd_extra + earlier_grads if copies_fwd and h.holds_head else 0.0
    if grads_freed_per_micro_batch(layout, profile):
        # the low-precision gradients live only within one micro batch's backward: its start holds
        # every micro batch in flight and no such gradient, its end one micro batch less and all of them
        half = prec.grad * h.params
        st.gradients, st.gathered = grads - half, gathered
        if half > one_micro_batch + st.logits + loss_extra:
            st.peak_phase = "end of a micro batch's backward"
            st.gradients += half
            st.activations -= one_micro_batch
            st.logits = 0.0
        else:
            st.peak_phase = "start of a micro batch's backward"
            st.logits += loss_extra
    elif profile.grads_at_peak:  # the recipe's peak sits in a backward: everything at once
        st.peak_phase = "backward"
        st.logits += loss_extra
        st.gradients, st.gathered = grads, gathered
        st.activations += recompute
    elif fwd_phase > max(loss_phase, layer_phase):
        st.peak_phase = "loss forward"
        st.logits += fwd_extra
        st.gradients, st.copies = earlier_grads, copies_fwd
    elif h.holds_head and loss_phase > layer_phase:
        st.peak_phase = "loss backward"
        st.logits += loss_extra
        st.gradients, st.copies = earlier_grads, copies_loss
    else:
        st.peak_phase = "layer backward"
        st.gradients, st.gathered, st.copies = layer_grads, gathered, layer_copies
        st.activations += recompute
    st.comm_buffers = prec.grad * h.params if ddp_buckets(layout, profile) else 0.0
    subtotal = sum(getattr(st, k) for k in TERMS if k != "overhead")
    st.overhead = _overhead(layout, prec, h, hw, profile, subtotal)
    st.total = subtotal + st.overhead
    return st


# --- the build (and model.init_from's load) ----------------------------------------------------------

# usp's engine builds fp32 parameters (usp/models/llama.py initial_value), whatever the profile
BUILD_PARAM_BYTES = 4
# A sharded (DTensor) parameter's whole fp32 value, made on the host, plus what torch's
# distribute_tensor(src_data_rank=None) copies while cutting this rank's part out of it: measured on
# CPU (VmHWM growth over the value alone, MALLOC_MMAP_THRESHOLD_=131072): Shard(0) over 8 ranks 1.25x
# the value, Shard x Shard over 2 x 2 1.75x, Replicate 2.0x. A plain parameter takes the value in place: 1x.
DTENSOR_TRANSIENT = 2.0


def largest_parameter(arch: Arch, h: _Held) -> tuple[str, int]:
    """(name, elements of its whole tensor) of the largest parameter a rank of this stage holds. The
    init draws a parameter's whole tensor (TP's padded vocabulary included) before the rank keeps its
    part; stacked experts are drawn whole under expert parallelism too."""
    sizes: dict[str, int] = {}
    if h.holds_emb:
        sizes["tok_embeddings.weight"] = h.vocab_pad * arch.dim
    if h.head > arch.dim:  # an LM head matrix: untied, or a pipeline's last stage's copy of the tied embedding
        sizes["output.weight"] = h.vocab_pad * arch.dim
    if h.layers:
        sizes["layers.<i>.attention.wq.weight"] = arch.q_dim * arch.dim
        if arch.moe:
            fe = arch.moe_ffn_dim or arch.ffn_dim
            sizes["layers.<i>.feed_forward.experts.w1"] = arch.n_experts * fe * arch.dim
            sizes["layers.<i>.feed_forward.router.weight"] = arch.n_experts * arch.dim
        else:
            sizes["layers.<i>.feed_forward.w1.weight"] = arch.ffn_dim * arch.dim
    if not sizes:
        return "", 0
    name = max(sizes, key=lambda k: sizes[k])
    return name, sizes[name]


def sharded_params(arch: Arch, layout: Layout, h: _Held, n: int) -> float:
    """Elements of one rank's shards when FSDP2 splits the stage's parameters over n data-parallel
    ranks (experts over n / ep: the other ep ranks hold other experts). FSDP2 cuts each parameter along
    dim 0 as torch.chunk does and stores every rank's shard padded to the first one's rows: ceil(rows /
    n) rows each (one expert over 2 ranks: the whole expert on both, the second's as padding)."""
    n_exp = _expert_shards(arch, layout, n)[1]
    return float(sum(-(-rows // (n_exp if expert else n)) * cols * count for rows, cols, count, expert in h.tensors))


def _expert_shards(arch: Arch, layout: Layout, n: int) -> tuple[int, int]:
    """(ep, the ranks FSDP2 splits each routed expert over) of n data-parallel shards: n / ep, or 1
    (whole experts) when ep doesn't divide n."""
    ep = max(1, layout.ep) if arch.moe else 1
    return ep, (max(1, n // ep) if n % ep == 0 else 1)


def _chunk_rows(rows: int, n: int, i: int) -> int:
    """Rows of torch.chunk(rows, n)'s i-th piece along dim 0 (the last ones may be short or empty)."""
    c = -(-rows // n)
    return max(0, min(c, rows - i * c))


def local_bytes(arch: Arch, layout: Layout, prec: Precision, r: int, index: int = 0,
                profile: Profile = PROFILES["usp"]) -> LocalBytes:
    """One rank's model states as allocated: the rank of pp rank r whose FSDP2 shard is the index-th
    of its shard group (index 0 holds the most: memory_plan's figure). Parameters and their reduced
    gradients occupy FSDP2's padded shards (sharded_params) on every rank; the optimizer creates its
    states for the real rows only, so a short last shard holds fewer. ZeRO-1 (DDP + ZeRO's optimizer)
    counts an even split of the states. `index` of the experts' shard group: index // ep."""
    h = _held(arch, layout, r, profile)
    zero, n = zero_sharding(layout, profile)
    if zero < 2:
        optimizer = prec.optim * (h.params / n if zero == 1 else h.params)
        return LocalBytes(h.params, prec.param * h.params, prec.grad * h.params, optimizer)
    ep, n_exp = _expert_shards(arch, layout, n)
    real = sum(_chunk_rows(rows, n_exp if expert else n, index // ep if expert else index) * cols * count
               for rows, cols, count, expert in h.tensors)
    padded = sharded_params(arch, layout, h, n)
    return LocalBytes(padded, prec.param * padded, prec.grad * padded, prec.optim * real)


def uses_dtensors(layout: Layout) -> bool:
    """Does the engine hold DTensor parameters (TP, or any FSDP2 flavour), whose parts it cuts with
    distribute_tensor? DDP and ZeRO-1 hold plain ones."""
    return layout.tp > 1 or layout.dp_kind in ("fsdp", "hsdp", "replicate", "zero1_fsdp")


def _largest_part(arch: Arch, layout: Layout, h: _Held) -> tuple[int, bool]:
    """(elements, routed experts?) of the largest part of one parameter the rank holds: what
    model.init_from reads of it (an FSDP2 shard: ceil(rows / n) rows)."""
    zero, n = layout.zero_stage, layout.shard_degree
    n_exp = _expert_shards(arch, layout, n)[1]
    parts = [(-(-rows // ((n_exp if expert else n) if zero >= 2 else 1)) * cols, expert)
             for rows, cols, _, expert in h.tensors]
    return max(parts, default=(0, False))


def build_memory(arch: Arch, layout: Layout, hw: Hardware, r: int, load_bytes: int = 0) -> BuildMemory:
    """What one rank of pp rank r holds while it builds (module docstring of BuildMemory): its
    parameters as allocated (sharded where FSDP2 shards them: ZeRO-2/3, HSDP, ZeRO-1 over TP/PP;
    whole under DDP, DDP + ZeRO-1 and a single process) + the fixed overhead and fragmentation of the
    training peak's, and on top the transient of its initialisation: the largest parameter's whole
    fp32 value while its part is cut (x DTENSOR_TRANSIENT for a DTensor). model.init_from
    (load_bytes per value, 0: none) replaces that init: each rank reads only its part of each
    parameter (usp/engine/hf_checkpoint.py, safetensors slices), so the transient is the largest part
    as read (Mixtral's experts read one by one, then stacked: twice), or, where tensor parallelism
    pads the vocabulary, the embedding's whole fp32 init whose padded rows the rank keeps, whichever
    is larger. The engine's build, whatever the planner's profile."""
    h = _held(arch, layout, r, PROFILES["usp"])
    params = sharded_params(arch, layout, h, layout.shard_degree) if layout.zero_stage >= 2 else h.params
    name, largest = largest_parameter(arch, h)
    read: float = 0.0
    if load_bytes:
        part, experts = _largest_part(arch, layout, h)
        read = load_bytes * part * (2 if experts else 1)
        padded = h.vocab_pad > arch.vocab_size and (h.holds_emb or h.head > arch.dim)
        transient = max(read, float(BUILD_PARAM_BYTES * h.vocab_pad * arch.dim) if padded else 0.0)
    else:
        transient = BUILD_PARAM_BYTES * largest * (DTENSOR_TRANSIENT if uses_dtensors(layout) else 1.0)
    parameters = BUILD_PARAM_BYTES * params
    usp = PROFILES["usp"]  # the training peak's allowance
    overhead = fixed_overhead_gib(hw, usp) * GIB + usp.fragmentation * (parameters + transient)
    return BuildMemory(params, parameters, name, largest, read, transient, overhead, parameters + transient + overhead)


@lru_cache(maxsize=4096)  # the search asks it once per layout shape
def build_peak(arch: Arch, layout: Layout, hw: Hardware, load_bytes: int = 0) -> BuildMemory:
    """The fullest pp rank's build (the rules and the search ask only this)."""
    ranks = candidate_stages(arch, layout, PROFILES["usp"])
    return max((build_memory(arch, layout, hw, r, load_bytes) for r in ranks), key=lambda b: b.total)


def _layer_backward(arch: Arch, layout: Layout, h: _Held, grads: float, copies: tuple[float, float],
                    st: StageMemory) -> tuple[float, float]:
    """(gradients, weight copies) at the worst layer's backward; copies: (alive at the loss backward, at a
    layer's backward). With gradient accumulation (grad_accum > 1, so every pipeline) earlier micro
    batches left every gradient alive. Without it (pp = 1) the gradients appear as the backward walks
    down the layers while each layer frees what it kept: the first layer's backward holds only the LM
    head's gradient (tied: the embedding's) and its own beside every kept activation and weight copy;
    where that moment is the larger (a layer keeps more than its gradient), it is the peak. Otherwise
    the last layers' backward is, counted as every gradient beside every kept activation: the
    activations freed by then stand for the transients the count leaves out. So is every recomputed
    layout's (its layer backward also holds the recomputed set and the gradients flowing through it:
    on CPU, recompute layouts at a byte vocabulary peak up to 3.5 % above the count, docs/benchmarks.md).
    Measured on the H100 (docs/benchmarks.md): Llama-3.2 3B compiled at 2 x 1 peaks 11.97 GiB, its fp32
    gradients, below 2 x 4; every gradient beside every kept activation put it 5.6 GiB above."""
    if layout.grad_accum > 1 or layout.pp > 1 or layout.recompute != "none" or not h.layers:
        return grads, copies[1]
    tied_here = arch.tie_embeddings and h.holds_emb  # the head's backward writes the embedding's gradient
    first = grads * (h.head + (h.emb if tied_here else 0.0) + h.dense_layer + h.expert_layer) / h.params
    last_freed = st.activation_per_layer * (h.layers - 1)
    if first + copies[0] >= grads - last_freed + copies[1]:
        return first, copies[0]
    return grads, copies[1]


def grads_freed_per_micro_batch(layout: Layout, profile: Profile) -> bool:
    """Does the profile's recipe free the low-precision gradients after each micro batch's backward
    at this layout (nanotron: once added into its fp32 accumulation buffer), so that they never meet
    all the micro batches in flight? Measured to hold up to the profile's grads_freed_max_tp."""
    return layout.tp <= profile.grads_freed_max_tp


def _overhead(layout: Layout, prec: Precision, h: _Held, hw: Hardware, profile: Profile, subtotal: float) -> float:
    """Not tensor memory the probe sees: the fixed allowance, fragmentation, and (usp's engine on CPU) gloo's
    copy and the heap top glibc keeps."""
    usp_cpu = profile.name == "usp" and hw.device == "cpu"
    gloo = gloo_copy(layout, prec, h, hw) if usp_cpu else 0.0
    kept = heap_top_kept(layout) if usp_cpu else 0.0
    return fixed_overhead_gib(hw, profile) * GIB + profile.fragmentation * subtotal + gloo + kept


def heap_top_kept(layout: Layout) -> float:
    """A CPU rank that neither gathers parameters nor pipelines (usp.contract.decide.cpu_memory_first) trains
    under glibc's ceiling mmap threshold (32 MiB) and twice it as the trim threshold (usp/run/allocator.py: a
    step's activations reused from the heap, not faulted in again): the heap may keep that much free at its
    top, resident, beyond the tensors. Measured on the gross bench's 130 M layouts (docs/benchmarks.md, "The
    plan's figure, gross"): one process peaked 0.06-0.14 GiB above the figure printed without it."""
    if cpu_memory_first(layout.dp_kind, layout.ep, layout.pp):
        return 0.0
    return float(paired_trim(MAX_MMAP_THRESHOLD))


def gloo_copy(layout: Layout, prec: Precision, h: _Held, hw: Hardware) -> float:
    """CPU ranks (gloo): ProcessGroupGloo runs all_gather_into_tensor and reduce_scatter_tensor on a flat
    copy of the gathered output / the scattered input, made inside its work, where the memory probe (a
    Python dispatch mode) never sees it: measured, 2 ranks, a 64 MiB output: VmHWM grew 130 MiB for an
    all-gather (output + copy), 96 for a reduce-scatter (its 32 MiB output + a 64 MiB copy), 2 for an
    in-place all-reduce. Under FSDP2 (ZeRO-2/3) a layer's backward holds one block's: the next block's
    all-gather (ZeRO-3, in the gathered dtype) or its gradients' reduce-scatter. Not tensor memory the
    probe compares: part of the overhead. NCCL gathers in place: 0 on a GPU."""
    if hw.device != "cpu" or layout.zero_stage < 2 or layout.shard_degree < 2 or not h.layers:
        return 0.0
    block = h.dense_layer + h.expert_layer
    return block * max(prec.grad, prec.gathered if layout.zero_stage == 3 else 0)


def fixed_overhead_gib(hw: Hardware, profile: Profile) -> float:
    """The fixed allowance (not tensor memory): the profile's, else the device's."""
    if profile.fixed_overhead_gib is not None:
        return profile.fixed_overhead_gib
    return FIXED_OVERHEAD_GIB.get(hw.device, DEFAULT_FIXED_OVERHEAD_GIB)


def candidate_stages(arch: Arch, layout: Layout, profile: Profile) -> list[int]:
    """The pp ranks that can hold the peak: the last one (LM head, logits) and, for each
    distinct layer count, the first rank with it (in-flight micro batches never grow with the
    pp rank, and rank 0 also holds the embedding)."""
    if layout.pp == 1:
        return [0]
    return list(_candidates(arch, layout.pp, layout.virtual, layout.schedule, layout.pp_layers, profile.pp_split))


@lru_cache(maxsize=1024)
def _candidates(arch: Arch, pp: int, virtual: int, schedule: str, pp_layers: tuple | None, split: str) -> tuple:
    counts, ranks = stage_layer_counts(arch, pp, virtual, schedule, pp_layers, split)
    firsts: dict[int, int] = {}
    for r, held in enumerate(ranks):
        firsts.setdefault(sum(counts[i] for i in held), r)
    return tuple(sorted(set(firsts.values()) | {pp - 1}))


def peak_bytes(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision,
               profile: Profile) -> tuple[float, int]:
    """(largest stage total, its pp rank), for the search: only the candidate stages."""
    best = (-1.0, 0)
    for r in candidate_stages(arch, layout, profile):
        total = stage_memory(arch, layout, seq_len, hw, prec, r, profile).total
        if total > best[0]:
            best = (total, r)
    return best


def memory_plan(arch: Arch, layout: Layout, seq_len: int, hw: Hardware, prec: Precision,
                profile: Profile, load_bytes: int = 0) -> MemoryPlan:
    """Every pp rank's training peak and build (load_bytes: model.init_from's bytes per value, 0 = none)."""
    prec = recipe_precision(prec, profile)
    stages = [stage_memory(arch, layout, seq_len, hw, prec, r, profile) for r in range(layout.pp)]
    for st in stages:  # the build and the build check's figures: the plan's, not each search candidate's
        st.build = build_memory(arch, layout, hw, st.stage, load_bytes)
        st.local = local_bytes(arch, layout, prec, st.stage, 0, profile)
    build = max(range(len(stages)), key=lambda i: stages[i].build.total)  # type: ignore[union-attr]
    build_gib = stages[build].build.total / GIB  # type: ignore[union-attr]
    zero, shards = zero_sharding(layout, profile)
    peak = max(range(len(stages)), key=lambda i: stages[i].total)
    peak_gib = stages[peak].total / GIB
    assumptions = [
        f"profile {profile.name}: {profile.description}",
        f"{prec.name}: {prec.param} B/param, {prec.grad} B/grad, {optimizer_state_label(prec)}"
        + (", + a 4 B/param fp32 gradient-accumulation buffer (unsharded)" if profile.fp32_grad_accum else ""),
        f"data parallel: {layout.dp_label() if profile.data_parallel == 'usp' else profile.data_parallel}, "
        f"ZeRO-{zero} sharded over {shards} rank(s)",
        f"activations: {activation_formula(layout)}" + (
            "" if profile.name != "usp" or not autocast_input_casts(arch, layout, prec)
            else " + each projection's own bf16 cast of its norm's output (autocast, eager)") + (
            "" if profile.name == "usp" else f" (as {profile.name} keeps them: docs/planner.md, Profiles)")
        if compiled_block_bytes(arch, layout, prec) is None else "activations: what a compiled block keeps, "
        "s·b·(4h + act·(5h + 2kv + 3f)) bytes per layer (its fp32 input; train.fp8: not the norm outputs nor "
        "w2's input, 2h + f) + every weight's bf16 cast (docs/planner.md)",
        f"logits: {profile.loss_forward_bytes:g} bytes per logit at the loss forward" if profile.loss_forward_bytes
        else f"logits: compiled loss, the logits kept in {prec.act:g}-byte values, + {COMPILED_LOSS_BACKWARD_BUFFERS} "
        "such buffer (their gradient) while the loss is differentiated" if compiled_loss(layout, prec)
        else f"logits: fp32 log-probabilities kept, + {LOSS_BACKWARD_BUFFERS} such buffers "
        f"({VOCAB_PARALLEL_LOSS_BACKWARD_BUFFERS} vocab-parallel) while the loss is differentiated",
        f"peak at the {stages[peak].peak_phase}: the low-precision gradients are freed after each micro batch's "
        "backward, so they meet one micro batch less than are in flight" if grads_freed_per_micro_batch(layout, profile)
        else "peak in a backward: gradients, kept activations and the loss's buffers at once" if profile.grads_at_peak
        else f"peak at the {stages[peak].peak_phase}: the larger of the loss backward's buffers and a layer "
        "backward's gradients + gathered units + recomputed layer",
        f"overhead: {fixed_overhead_gib(hw, profile)} GiB fixed + {profile.fragmentation:.0%} fragmentation "
        + ("+ gloo's flat copy of one FSDP block's all-gather / reduce-scatter " if profile.name == "usp"
           and gloo_copy(layout, prec, _held(arch, layout, stages[peak].stage, profile), hw) else "")
        + "(not tensor memory)",
        "build: the rank's parameters as allocated (fp32; its shards under FSDP2) + "
        + (f"the largest part of one parameter as model.init_from reads it ({load_bytes} B/value)" if load_bytes else
           f"the largest one's whole fp32 value while its part is cut ({DTENSOR_TRANSIENT:g}x for a sharded DTensor)"),
    ]
    if profile.accum_bytes_per_token_h and layout.pp == 1 and layout.grad_accum > 1:
        assumptions.append(f"gradient accumulation on the whole model: + {profile.accum_bytes_per_token_h:g} bytes "
                           "per token per hidden unit (measured on the profile's runs, not divided by tp)")
    if layout.zero_stage >= 2 and FSDP_ACCUM_UNSHARDED_GRADS and layout.grad_accum > 1:
        assumptions.append("FSDP with grad_accum > 1: gradients unsharded between micro batches (no reduce-scatter "
                           "on inner micro batches)")
    return MemoryPlan(dtype=prec.name, dp_kind=layout.dp_kind, zero_stage=zero,
                      shard_degree=shards, recompute=layout.recompute, capacity_gib=hw.memory_gib,
                      device_name=hw.device_name, stages=stages, peak_stage=peak, peak_gib=peak_gib,
                      fits=peak_gib <= hw.memory_gib, activation_formula=activation_formula(layout),
                      assumptions=assumptions, build_peak_stage=build, build_peak_gib=build_gib,
                      build_fits=build_gib <= hw.memory_gib)
