"""Whose training recipe the planner predicts: usp's own engine, or a named foreign recipe whose
published runs the planner is calibrated against. A profile holds the recipe's choices that change
memory or time (gradient buffers, sequence-parallel activations, allocator behaviour, overlap) so
the same layout can be predicted as usp runs it or as, say, nanotron ran it. Pure Python.

Selected with `planner.profile=<name>`. docs/planner.md ("Profiles") gives each field's source."""
from __future__ import annotations

from dataclasses import dataclass

from usp.errors import PlanError


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    # memory (usp.perf.memory reads these; the defaults are usp's engine)
    # bf16 training keeps fp32 parameters and gradients and gives the matmuls bf16 copies (autocast, FSDP2's
    # MixedPrecisionPolicy): 4 + 4 + 8 bytes + the copies; False: bf16 parameters and gradients, fp32 master
    # weights in the optimizer (2 + 2 + 12; Megatron, nanotron)
    fp32_params: bool = True
    fp32_grad_accum: bool = False  # an fp32 gradient-accumulation buffer of every parameter (4 bytes), never sharded
    grads_at_peak: bool = False  # the low-precision gradients count at the peak (else the peak-phase model decides)
    # the recipe frees the low-precision gradients after each micro batch's backward (nanotron: FP32GradientAccumulator
    # adds them into its fp32 buffer, then sets param.grad = None), so the peak is the start or the end of one micro
    # batch's backward; applied up to this tp, where the sweep's rank-0 peaks follow it (0: never; docs/planner.md)
    grads_freed_max_tp: int = 0
    # data parallel as built: usp (usp.perf.specs.Layout.dp_kind) | nanotron (without ZeRO-1: DDP with its buckets,
    # also under TP/PP; ZeRO-1: no DDP, only the optimizer states sharded over dp, also under TP/PP)
    data_parallel: str = "usp"
    fused_norm: bool = False  # RMSNorm keeps only its input (a fused kernel), not x·rstd as well
    sp_norm_outputs_sharded: bool = False  # under TP + SP the projections keep their input sequence-sharded
    kv_packed_copy: bool = False  # attention keeps a packed copy of K and V (2·kv) besides q/k/v
    activation_scale: float = 1.0  # fitted: kept activations / the counted tensors (a layer's backward transients)
    sp_full_buffers: int = 0  # fitted: full-sequence s·b·h buffers alive at the peak under TP + SP
    # measured: bytes per token of the micro batch per hidden unit that a rank holding the whole model (pp = 1)
    # keeps on top when it accumulates gradients (grad_accum > 1); not divided by tp (docs/planner.md, Profiles)
    accum_bytes_per_token_h: float = 0.0
    loss_forward_bytes: float = 0.0  # bytes per logit at the loss forward (0: usp's kept log-probs + backward buffers)
    pp_split: str = "params"  # params: usp.perf.pipeline_split; matmul: nanotron's cumulative matmul-cost thresholds
    fixed_overhead_gib: float | None = None  # None: the device's allowance (usp.perf.memory)
    fragmentation: float = 0.05  # allocator fragmentation on top of the tensors (0: the peak is allocated memory)
    # time (usp/perf/timing.py): how the recipe runs its communication and optimizer
    dp_overlap: float = 0.8  # share of the data-parallel window (the last backward) its gradient reduction hides behind
    cp_overlap: float = 0.8  # share of a layer's attention the CP ring exchange hides behind
    reduce_bytes: int = 0  # bytes per gradient value reduced over dp; 0 = the precision's gradient bytes
    zero1_once_per_step: bool = False  # ZeRO-1 with TP/PP: one gradient reduction + all-gather per step (not FSDP2)
    optimizer_bytes_per_param: int = 34  # AdamW (+ clipping) streams fp32 master, m, v, the gradient, writes bf16
    # train.compile applies to the recipe (usp's blocks through torch.compile): eager blocks pay the cluster's
    # eager_overhead, compiled ones keep usp.perf.memory.compiled_block_bytes; False: the recipe's own fused
    # kernels (nanotron: flash attention, fused norms), neither
    follows_compile: bool = True


PROFILES = {
    "usp": Profile("usp", "usp's own engine (this repository), as it trains"),
    "nanotron": Profile(
        "nanotron", "nanotron as the Ultra-Scale Playbook's benchmark sweep ran it: bf16 with fp32 "
        "gradient-accumulation buffers, sequence parallel (reduce-scatter), 1F1B, flash attention, fused AdamW",
        # memory
        fp32_params=False, fp32_grad_accum=True, grads_at_peak=True, grads_freed_max_tp=1, data_parallel="nanotron",
        fused_norm=True, sp_norm_outputs_sharded=True, kv_packed_copy=True, activation_scale=1.1, sp_full_buffers=3,
        accum_bytes_per_token_h=100.0,
        loss_forward_bytes=10.0, pp_split="matmul", fixed_overhead_gib=0.0, fragmentation=0.0,
        # time
        dp_overlap=0.8, reduce_bytes=4, zero1_once_per_step=True, follows_compile=False),
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise PlanError(f"unknown planner profile {name!r}", key="planner.profile", value=name,
                        fix=f"one of: {', '.join(PROFILES)}") from None
