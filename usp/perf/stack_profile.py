"""Whose training recipe the planner predicts: usp's own engine, or a named foreign stack whose
published runs the planner is calibrated against. A profile holds the stack's choices that change
memory or time (gradient buffers, sequence-parallel activations, allocator behaviour; which
collectives overlap with what, in which dtype; its kernels and host costs), so the same layout can be
predicted as usp runs it or as, say, Megatron-LM ran it. The stack's time constants (`StackTime`) live
here, apart from the hardware's (cluster.timing): a fit of one stack's runs moves only that stack's
constants and the cluster it ran on. Pure Python.

Selected with `planner.profile=<name>` (or a profile file `usp calibrate --profile-out` wrote).
docs/planner.md ("Profiles") gives each field's source and what each constant was fitted on."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from usp.errors import PlanError

SELECTIVE = ("elementwise", "attention", "op")  # what train.recompute=selective re-runs
CP_RINGS = ("usp", "kv", "allgather", "torch")
ZERO1 = ("zero_redundancy", "blocking", "distributed")


@dataclass(frozen=True)
class StackTime:
    """A stack's time constants (usp/perf/timing.py reads them; `usp calibrate` fits the ones it is asked to).
    Each catalogue value's source: docs/planner.md, "Profiles"."""

    # kernels: element-wise work (norms, RoPE, activation, residual adds) = factor x the bytes a fused
    # implementation moves (usp.perf.timing.elementwise_bytes_per_token) / HBM bandwidth
    elementwise_factor: float = 1.0
    # the factor for eager blocks (train.compile off); 0: the cluster's eager_overhead
    eager_elementwise_factor: float = 0.0
    attention_efficiency: float = 0.95  # flash attention's plateau, a share of the peak (12·s·h/t FLOPs per token)
    loss_bytes_per_logit: float = 67.0  # softmax cross-entropy, forward + backward, through HBM
    fp8_cast_bytes: float = 3.0  # bytes through HBM per element an FP8 linear casts (input, weight, output gradient)
    # host and launch costs
    layer_us: float = 0.0  # per layer and micro batch
    micro_batch_ms: float = 0.0  # per micro batch
    step_ms: float = 0.0  # per optimizer step (host sync, data loader, logging)
    # memory-bound steps
    accum_bytes_per_param: float = 0.0  # gradient accumulation per extra micro batch (fp32 += of each gradient)
    optimizer_bytes_per_param: float = 34.0  # AdamW (+ clipping): fp32 master, m, v, the gradient read and written
    optimizer_hbm_share: float = 0.72  # share of HBM bandwidth the optimizer step streams at
    # overlap: share of each collective the stack hides behind compute
    tp_overlap: float = 0.0  # tensor-parallel all-gathers / reduce-scatters (communication overlap built in)
    async_tp_overlap: float = 0.0  # the same with async TP (Layout.async_tp)
    pp_overlap: float = 0.0  # pipeline sends / receives
    pp_p2p_us: float = 0.0  # host cost per pipeline send or receive
    cp_overlap: float = 0.9  # context-parallel exchange, behind its layer's attention
    dp_overlap: float = 1.0  # gradient reduction and FSDP gathers, behind their window
    param_gather_overlap: float = 0.0  # ZeRO-1's parameter all-gather, behind the first micro batch's forward
    # a blocking pipeline send/recv's stall (usp.perf.timing.pipeline_stall_s): up to p2p_stall_ms per op,
    # growing steeply with the job's node count and as the fullest stage's memory nears the device's; 0 = none
    p2p_stall_ms: float = 0.0
    p2p_stall_nodes: float = 32.0
    p2p_stall_headroom: float = 0.1
    p2p_stall_exp: float = 8.0
    # and a wait per blocking pipeline send/recv that grows with the tensor-parallel degree:
    # p2p_tp_ms x (tp / 8) ** p2p_tp_exp (pipeline_stall_s; nanotron's residuals, docs/planner.md); 0 = none
    p2p_tp_ms: float = 0.0
    p2p_tp_exp: float = 2.0


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
    # params: usp.perf.pipeline_split (the engine's); matmul: nanotron's cumulative matmul-cost thresholds;
    # even: the same number of layers on every stage (Megatron, torchtitan), the head on the last
    pp_split: str = "params"
    fixed_overhead_gib: float | None = None  # None: the device's allowance (usp.perf.memory)
    fragmentation: float = 0.05  # allocator fragmentation on top of the tensors (0: the peak is allocated memory)
    # time (usp/perf/timing.py): how the stack runs a layout
    time_split: str = ""  # how the time model finds the busiest stage: "" the pp_split's stages; balanced: the stage
    #   a split balanced by cost gives (whole layers; the LM head and loss counted)
    fused_projections: bool = False  # q, k, v one matmul and the MLP's gate and up one (Megatron, nanotron)
    selective: str = "elementwise"  # what train.recompute=selective re-runs (SELECTIVE)
    # full recompute replays the whole layer (Megatron's own CheckpointFunction, reentrant); False: torch's
    # non-reentrant checkpoint, which stops once the backward's tensors exist (usp.perf.timing._tp_reruns)
    recompute_replays_layer: bool = False
    # usp: fp32 K/V of every head; kv: bf16 K/V of the KV heads; allgather: K/V gathered, exposed; torch: torch's
    # context_parallel (all-gather rotation) with K/V repeated to every head (usp.perf.timing._torch_cp_comms)
    cp_ring: str = "usp"
    zero1: str = "zero_redundancy"  # ZeRO-1 (ZERO1): usp's DDP + ZeroRedundancyOptimizer (fp32 broadcast after the
    #   step); blocking (nanotron: all-reduce, then all-gather, neither overlapped); distributed (Megatron's distributed
    #   optimizer: reduce-scatter behind the last backward, bf16 all-gather behind the first forward)
    zero1_once_per_step: bool = False  # ZeRO-1 with TP/PP: one gradient reduction + all-gather per step (not FSDP2)
    fsdp_gather_per_micro_batch: bool = True  # FSDP gathers the parameters every micro batch (False: once a step)
    fsdp_reduce_per_micro_batch: bool = False  # FSDP reduce-scatters every micro batch (else once a step)
    reduce_bytes: int = 0  # bytes per gradient value reduced over dp; 0 = the precision's gradient bytes
    param_gather_bytes: int = 0  # bytes per value of ZeRO-1's parameter gather; 0 = the stored parameter's
    dp_bucket_mb: float = 0.0  # data-parallel bucket (MB); 0 = parallelism.ddp_bucket_mb (MiB)
    # train.compile applies to the recipe (usp's blocks through torch.compile): eager blocks pay the cluster's
    # eager_overhead, compiled ones keep usp.perf.memory.compiled_block_bytes; False: the recipe's own fused
    # kernels (nanotron: flash attention, fused norms), neither
    follows_compile: bool = True
    time: StackTime = field(default_factory=StackTime)
    missing_overlaps: tuple = ()  # overlaps other stacks have and this one lacks (the plan says so)
    fitted_on: str = ""  # what its time constants were fitted on (docs/planner.md)

    def with_time(self, **values: float) -> Profile:
        return replace(self, time=replace(self.time, **values))


# nanotron's constants, fitted on the Ultra-Scale Playbook's sweep (its even rows, with llm-foundry's bf16 rows
# fitting the GPU's; scripts/fit_time_model.py stage A, docs/planner.md). Its host costs stand in for every eager
# PyTorch launch path whose own runs cannot separate them (borrowed: _BORROWED_HOST).
_NANOTRON_TIME = StackTime(
    elementwise_factor=0.5, attention_efficiency=1.0, loss_bytes_per_logit=166.6, layer_us=23.31,
    micro_batch_ms=5.603, step_ms=5.296, accum_bytes_per_param=10.0, tp_overlap=0.05199, pp_p2p_us=684.2,
    dp_overlap=1.0, p2p_stall_ms=313.7, p2p_stall_nodes=32.78, p2p_stall_headroom=0.1438, p2p_stall_exp=8.0,
    p2p_tp_ms=14.96, p2p_tp_exp=2.207)
_BORROWED_HOST = dict(layer_us=_NANOTRON_TIME.layer_us, micro_batch_ms=_NANOTRON_TIME.micro_batch_ms,
                      step_ms=_NANOTRON_TIME.step_ms, pp_p2p_us=_NANOTRON_TIME.pp_p2p_us)
# Megatron-Core's element-wise factor, fitted on five of its published H100 runs (calibration/published_runs.csv,
# use=fit: stage M); Llama 3's stack borrows it
_MEGATRON_ELEMENTWISE = 3.513

_BF16_STORING: dict[str, Any] = dict(
    fp32_params=False, fp32_grad_accum=True, data_parallel="nanotron", follows_compile=False, reduce_bytes=4,
    param_gather_bytes=2, zero1_once_per_step=True, dp_bucket_mb=160.0)

PROFILES = {
    "usp": Profile(
        "usp", "usp's own engine (this repository), as it trains",
        time=StackTime(attention_efficiency=0.95, loss_bytes_per_logit=67.0, accum_bytes_per_param=12.0,
                       optimizer_hbm_share=0.372, fp8_cast_bytes=11.73, **_BORROWED_HOST),
        fitted_on="not fitted: usp's engine has no multi-GPU run measured yet (attention, the loss and the optimizer "
                  "measured on one H200; host costs nanotron's, borrowed; docs/planner.md)",
        missing_overlaps=("TP collectives (no async TP, no communication-overlapped linears)",
                          "pipeline sends/receives (torch.distributed.pipelining waits before use)",
                          "ZeRO-1's fp32 parameter broadcast after the step (ZeroRedundancyOptimizer)",
                          "CP ring attention with plain matmuls (no flash kernel)")),
    "nanotron": Profile(
        "nanotron", "nanotron as the Ultra-Scale Playbook's benchmark sweep ran it: bf16 with fp32 "
        "gradient-accumulation buffers, sequence parallel (reduce-scatter), 1F1B, flash attention, fused AdamW",
        # memory
        fp32_params=False, fp32_grad_accum=True, grads_at_peak=True, grads_freed_max_tp=1, data_parallel="nanotron",
        fused_norm=True, sp_norm_outputs_sharded=True, kv_packed_copy=True, activation_scale=1.1, sp_full_buffers=3,
        accum_bytes_per_token_h=100.0,
        loss_forward_bytes=10.0, pp_split="matmul", fixed_overhead_gib=0.0, fragmentation=0.0,
        # time
        time_split="balanced", fused_projections=True, selective="attention", cp_ring="kv", zero1="blocking",
        reduce_bytes=4,
        param_gather_bytes=2, zero1_once_per_step=True, dp_bucket_mb=160.0, follows_compile=False,
        time=_NANOTRON_TIME, fitted_on="the Ultra-Scale Playbook sweep's even rows (509 runs; docs/planner.md)",
        missing_overlaps=("ZeRO-1's gradient all-reduce and parameter all-gather (blocking)",
                          "pipeline sends/receives (blocking 1F1B)")),
    "megatron": Profile(
        "megatron", "Megatron-LM / Megatron-Core (r0.8 and later): distributed optimizer with overlapped gradient "
        "reduce-scatter and bf16 parameter all-gather, TE communication-overlapped TP, overlapped pipeline P2P",
        **_BF16_STORING, pp_split="even", fused_projections=True, selective="attention", cp_ring="kv",
        zero1="distributed", recompute_replays_layer=True,
        time=StackTime(elementwise_factor=_MEGATRON_ELEMENTWISE, attention_efficiency=0.95,
                       loss_bytes_per_logit=_NANOTRON_TIME.loss_bytes_per_logit, tp_overlap=0.9, async_tp_overlap=0.9,
                       pp_overlap=0.8, dp_overlap=1.0, param_gather_overlap=1.0, **_BORROWED_HOST),
        fitted_on="elementwise_factor on 5 published Megatron-Core H100 runs (calibration/published_runs.csv, "
                  "use=fit); host costs and the loss nanotron's; overlaps as Megatron documents them"),
    "megatron_legacy": Profile(
        "megatron_legacy", "Megatron-LM before its communication overlaps (the 2021 paper's code, MegaScale's 2023 "
        "baseline): TP, PP and data-parallel communication all exposed",
        **_BF16_STORING, pp_split="even", fused_projections=True, selective="attention", cp_ring="kv",
        zero1="distributed", recompute_replays_layer=True,
        time=StackTime(elementwise_factor=8.0, attention_efficiency=0.95,
                       loss_bytes_per_logit=_NANOTRON_TIME.loss_bytes_per_logit, dp_overlap=0.0,
                       **{**_BORROWED_HOST, "step_ms": 1695.0}),
        fitted_on="elementwise_factor and step_ms on 4 of MegaScale's 8 baseline runs (calibration/published_runs.csv, "
                  "use=fit); the rest nanotron's",
        missing_overlaps=("TP collectives", "pipeline sends/receives", "data-parallel reduction and gather")),
    "meta_llama3": Profile(
        "meta_llama3", "Meta's Llama 3 training stack (arXiv 2407.21783, Sec. 3.3.2): FSDP without resharding, "
        "interleaved 1F1B balanced by cost, all-gather context parallelism",
        **{**_BF16_STORING, "data_parallel": "usp"}, pp_split="even", fused_projections=True,
        selective="attention", cp_ring="allgather", fsdp_gather_per_micro_batch=False,
        time=StackTime(elementwise_factor=_MEGATRON_ELEMENTWISE, attention_efficiency=0.95,
                       loss_bytes_per_logit=_NANOTRON_TIME.loss_bytes_per_logit, pp_overlap=0.8, dp_overlap=1.0,
                       **_BORROWED_HOST),
        fitted_on="not fitted on its runs: Megatron-Core's element-wise factor, nanotron's host costs (borrowed)",
        missing_overlaps=("TP collectives", "CP all-gather")),
    "torchtitan": Profile(
        "torchtitan", "torchtitan (PyTorch's reference stack): FSDP2 (bf16 gathers, fp32 reduce-scatters), "
        "optional async TP, op-level selective recompute, torch.compile, torch.distributed.pipelining",
        pp_split="even", selective="op", cp_ring="torch", fsdp_reduce_per_micro_batch=True, reduce_bytes=4,
        time=StackTime(elementwise_factor=1.0, eager_elementwise_factor=3.407, attention_efficiency=0.5513,
                       loss_bytes_per_logit=67.0, accum_bytes_per_param=12.0, async_tp_overlap=0.7956,
                       **_BORROWED_HOST),
        fitted_on="eager_elementwise_factor, attention_efficiency, async_tp_overlap on torchtitan's 2024-12 tables "
                  "(10 runs) + one published run; host costs nanotron's (borrowed)",
        missing_overlaps=("TP collectives without async TP", "pipeline sends/receives")),
    "llmfoundry": Profile(
        "llmfoundry", "MosaicML llm-foundry (Composer, FSDP FULL_SHARD, flash attention)",
        **{**_BF16_STORING, "data_parallel": "usp", "fp32_params": True}, fused_projections=True,
        selective="attention",
        time=StackTime(elementwise_factor=3.458, attention_efficiency=0.5394, loss_bytes_per_logit=67.0, layer_us=300.0,
                       micro_batch_ms=0.01061, step_ms=0.1031),
        fitted_on="llm-foundry's bf16 tables (H100, A100 40/80 GB: 209 runs), with the playbook's even rows"),
}


def get_profile(name: str) -> Profile:
    """A catalogue profile by name, or a profile file (YAML: `base: <profile>` and the StackTime values
    `usp calibrate --profile-out` fitted, under `time:`)."""
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith((".yaml", ".yml")):
        return _profile_file(Path(name))
    raise PlanError(f"unknown planner profile {name!r}", key="planner.profile", value=name,
                    fix=f"one of: {', '.join(PROFILES)}, or a profile file (usp calibrate --profile-out)")


TIME_FIELDS = tuple(f.name for f in fields(StackTime))


def _profile_file(path: Path) -> Profile:
    import yaml

    def refuse(why: str) -> PlanError:
        return PlanError(f"profile file {path}: {why}", key="planner.profile", value=str(path),
                         fix="a file `usp calibrate --profile-out` wrote (base: <profile>, time: {...}), or a name: "
                             + ", ".join(PROFILES))

    if not path.is_file():
        raise refuse("not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise refuse(f"not YAML ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("base") not in PROFILES:
        raise refuse(f"`base:` must name one of {', '.join(PROFILES)}")
    values = data.get("time") or {}
    unknown = sorted(set(values) - set(TIME_FIELDS)) if isinstance(values, dict) else ["(not a mapping)"]
    if unknown:
        raise refuse(f"unknown time constant(s) {', '.join(unknown)}")
    try:
        typed = {k: float(v) for k, v in values.items()}
    except (TypeError, ValueError):
        raise refuse("every time constant must be a number") from None
    base = PROFILES[data["base"]]
    return replace(base.with_time(**typed), name=str(path), fitted_on=str(data.get("fitted_on", "") or ""))
