"""The planner's rules, in one table: what a model shape (Arch), a parallel layout (Layout) and the
hardware (Hardware), plus config values (Settings: the optimizer and schedule, the tokenizer, the
device, ...), must satisfy.

Each `Rule` is one record: the condition it refuses (`broken`), the config key it names, why, the
fix, and its kind:
  plan    the run can't work: `build_plan` raises the first one;
  engine  the plan can describe it (memory and time estimates), but this engine can't train it
          yet: `checked_plan` (what `usp train` runs) raises the first one after the plan kinds;
  warn    worth saying, not refusing: a plan warning (an error under `usp plan --strict`).
Three callers read the table: `usp.plan.plan.build_plan` / `checked_plan` (first failure),
`usp plan` (every failure, usp.plan.plan.plan_with_failures) and the layout search
(usp.plan.search: it keeps only layouts with no plan or engine failure, so it never proposes what
`usp train` refuses).

Rules checked elsewhere, because the Subject can't be built without them: degrees vs world size
(usp.perf.layout.resolve_degrees), the global batch split (usp.plan.batch.plan_batch), cluster
sizes and launcher, the tokenizer's vocabulary, a Hugging Face model.init_from's config.json
(usp.plan.plan._subject, usp.plan.hf_config), train.dtype (usp.perf.specs.Precision.resolve);
logging / profile settings (usp.plan.validate.check_observability); the run's name (one directory
name, usp.run.names) and train.steps >= 1 (usp.plan.validate.check_run); predicted OOM
(usp.plan.validate.analyse: it needs the memory model).

To add a rule: append a Rule to RULES (kind, key, broken, why, fix; `batch=True` when it reads
micro_batch / grad_accum, which the search varies last) and a test; the three callers pick it up."""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from usp.data.tokenizer import KINDS as TOKENIZERS
from usp.errors import PlanError
from usp.perf.pipeline_split import check_explicit, validate_schedule
from usp.perf.specs import (
    ATTENTION_CHOICES,
    FP8_RECIPES,
    RECOMPUTE_MODES,
    Arch,
    Hardware,
    Layout,
    compile_choice,
    group_crosses_nodes,
    uses_compile,
)
from usp.plan.optimizer import OPTIMIZERS, REFUSED_OPTIMIZERS, SCHEDULES, OptimSettings

KINDS = ("plan", "engine", "warn")
ONE_F_ONE_B_FAMILY = ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")  # need grad_accum >= pp


ROPE_TYPES = ("default", "llama3")  # what usp/models/layers.py rope_inv_freq implements
ROPE_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_positions")  # model.rope_<k>


@dataclass(frozen=True)
class RopeSettings:
    """model.rope_type and its scaling values (model.rope_factor, ...): they change no shape, only the
    rotation's frequencies."""

    type: str = "default"
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_positions: int | None = None

    @classmethod
    def from_model(cls, model) -> RopeSettings:
        return cls(str(_get(model, "rope_type", "default")), *(_get(model, f"rope_{k}") for k in ROPE_SCALING))


@dataclass(frozen=True)
class Settings:
    """The config values a few rules need besides the shape, the layout and the hardware."""

    seq_len: int
    dtype: str = "auto"
    launcher: str | None = None  # None: not known (a bare search), the launcher rule doesn't apply
    checkpoint: bool = False
    ddp_comm_hook: str = "none"
    optim: OptimSettings = OptimSettings()
    tokenizer: str = "bpe"
    node_rank: int | None = None  # cluster.node_rank / rdzv_endpoint: several machines without Slurm
    rdzv_endpoint: str | None = None
    compile: Any = "auto"  # train.compile as configured (usp.perf.specs.uses_compile resolves it)
    fp8: str = "off"  # train.fp8
    rope: RopeSettings = RopeSettings()

    @classmethod
    def from_config(cls, cfg) -> Settings:
        """From a composed config, or the plain dict of RunPlan.config."""
        g = lambda section, key, d=None: _get(_get(cfg, section, {}), key, d)  # noqa: E731
        return cls(seq_len=int(g("train", "seq_len")), dtype=str(g("train", "dtype", "auto")),
                   launcher=str(g("cluster", "launcher", "local")), checkpoint=bool(g("checkpoint", "enabled", False)),
                   ddp_comm_hook=str(g("parallelism", "ddp_comm_hook", "none")),
                   optim=OptimSettings.from_config(_get(cfg, "optimizer", {}), int(g("train", "steps", 150))),
                   tokenizer=str(g("data", "tokenizer", "bpe")),
                   node_rank=g("cluster", "node_rank"), rdzv_endpoint=g("cluster", "rdzv_endpoint"),
                   compile=g("train", "compile", "auto"), fp8=str(g("train", "fp8", "off")),
                   rope=RopeSettings.from_model(_get(cfg, "model", {})))


def _get(obj, key: str, default=None):
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


@dataclass(frozen=True)
class Subject:
    """What the rules look at: one layout of one model on one cluster."""

    arch: Arch
    layout: Layout
    hw: Hardware
    settings: Settings


Text = str | Callable[[Subject], Any]


@dataclass(frozen=True)
class Rule:
    """One rule. `broken(s)` is True when subject s breaks it; key, value, why and fix are strings or
    functions of the subject. `check` instead of `broken`: a function that raises the PlanError itself
    (torch's schedule rules, written once in usp.perf.pipeline_split). `gate`: the rules after it assume
    it holds (they are not evaluated once it fails). `batch`: it reads micro_batch / grad_accum."""

    name: str
    kind: str
    key: Text = ""
    broken: Callable[[Subject], bool] | None = None
    why: Text = ""
    fix: Text = ""
    value: Text | bool | None = None
    check: Callable[[Subject], None] | None = None
    gate: bool = False
    batch: bool = False

    def failure(self, s: Subject) -> PlanError | None:
        if self.check is not None:
            try:
                self.check(s)
            except PlanError as exc:
                return exc
            return None
        if self.broken is None or not self.broken(s):
            return None
        return PlanError(self.text(s, "why"), key=self.text(s, "key"), value=self.text(s, "value"),
                         fix=self.text(s, "fix"))

    def text(self, s: Subject, what: str):
        t = getattr(self, what)
        return t(s) if callable(t) else t


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --- config values (no layout needed) --------------------------------------------------------------------

DEVICES = ("cpu", "cuda", "xpu")


def _opt(key: str, broken: Callable[[float], bool], why: str, fix: str, when: Callable[[OptimSettings], bool]
         = lambda o: True) -> Rule:
    """A rule on one optimizer.* value."""
    return Rule(f"optimizer_{key}", "plan", f"optimizer.{key}",
                lambda s: when(s.settings.optim) and broken(getattr(s.settings.optim, key)), why, fix,
                lambda s: getattr(s.settings.optim, key))


def _finite(lo: float, hi: float, *, hi_open: bool = False, lo_open: bool = False) -> Callable[[float], bool]:
    """broken(x): x is not a finite number in [lo, hi] (open ends excluded)."""
    return lambda x: not (math.isfinite(x) and (lo < x if lo_open else lo <= x) and (x < hi if hi_open else x <= hi))


def _wsd_overlap(o: OptimSettings) -> bool:
    return o.schedule == "wsd" and o.steps >= 1 and o.warmup_steps + o.decay_steps > o.steps


def _llama3(key: str, broken: Callable[[Any, RopeSettings], bool], why: str, fix: str) -> Rule:
    """A rule on one of the values model.rope_type=llama3 needs."""
    return Rule(f"rope_{key}", "plan", f"model.rope_{key}",
                lambda s: s.settings.rope.type == "llama3" and broken(getattr(s.settings.rope, key), s.settings.rope),
                f"model.rope_type=llama3 needs {why}", f"model.rope_{key}={fix}",
                lambda s: getattr(s.settings.rope, key))


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


ROPE_RULES = [
    Rule("rope_type_known", "plan", "model.rope_type", lambda s: s.settings.rope.type not in ROPE_TYPES,
         f"usp implements the RoPE types {' and '.join(ROPE_TYPES)} (transformers' rope_type names); other "
         "scalings (linear, dynamic, yarn, longrope, ...) are not implemented",
         "model.rope_type=default, or llama3 with its model.rope_* values", lambda s: s.settings.rope.type),
    _llama3("factor", lambda x, r: not _number(x) or x < 1, "a factor >= 1 (the long wavelengths are divided by it)",
            "8.0 (Llama 3.1; 32.0 for Llama 3.2)"),
    _llama3("low_freq_factor", lambda x, r: not _number(x) or x <= 0, "a low_freq_factor > 0", "1.0 (Llama 3)"),
    _llama3("high_freq_factor", lambda x, r: not _number(x) or (_number(r.low_freq_factor) and x <= r.low_freq_factor),
            "a high_freq_factor > model.rope_low_freq_factor", "4.0 (Llama 3)"),
    _llama3("original_max_positions", lambda x, r: not isinstance(x, int) or isinstance(x, bool) or x < 1,
            "the context length the model was pre-trained with (original_max_position_embeddings), an integer >= 1",
            "8192 (Llama 3)"),
]


def _fp8(s: Subject) -> bool:
    return s.settings.fp8 in FP8_RECIPES and s.settings.fp8 != "off"


FP8_GPUS = "NVIDIA compute capability 8.9 or newer (H100, H200, L40S) or an AMD MI300X"
INF = math.inf
CONFIG_RULES = [
    Rule("device_known", "plan", "cluster.device", lambda s: s.hw.device not in DEVICES,
         f"unknown device; choose one of {', '.join(DEVICES)} (usp has no backend for others, e.g. TPUs)",
         "cluster.device=cpu, or a cluster group: cluster=local_gpu", lambda s: s.hw.device),
    Rule("optimizer_refused", "plan", "optimizer.name", lambda s: s.settings.optim.name in REFUSED_OPTIMIZERS,
         lambda s: REFUSED_OPTIMIZERS[s.settings.optim.name], "optimizer=adamw", lambda s: s.settings.optim.name),
    Rule("optimizer_known", "plan", "optimizer.name",
         lambda s: s.settings.optim.name not in (*OPTIMIZERS, *REFUSED_OPTIMIZERS),
         f"unknown optimizer; choose one of {', '.join(OPTIMIZERS)}", "optimizer=adamw (or optimizer=sgd, adam)",
         lambda s: s.settings.optim.name),
    Rule("schedule_known", "plan", "optimizer.schedule", lambda s: s.settings.optim.schedule not in SCHEDULES,
         f"unknown learning-rate schedule; choose one of {', '.join(SCHEDULES)}", "optimizer.schedule=cosine",
         lambda s: s.settings.optim.schedule),
    _opt("lr", _finite(0, INF, lo_open=True, hi_open=True), "the learning rate must be a finite number > 0",
         "optimizer.lr=3e-4"),
    _opt("min_lr_ratio", _finite(0, 1), "the decayed lr is lr x min_lr_ratio: a number in [0, 1]",
         "optimizer.min_lr_ratio=0.1"),
    _opt("weight_decay", _finite(0, INF, hi_open=True), "must be a finite number >= 0", "optimizer.weight_decay=0.1"),
    _opt("beta1", _finite(0, 1, hi_open=True), "Adam's betas are in [0, 1)", "optimizer.beta1=0.9",
         lambda o: o.name != "sgd"),
    _opt("beta2", _finite(0, 1, hi_open=True), "Adam's betas are in [0, 1)", "optimizer.beta2=0.95",
         lambda o: o.name != "sgd"),
    _opt("eps", _finite(0, INF, lo_open=True, hi_open=True), "must be a finite number > 0", "optimizer.eps=1e-8",
         lambda o: o.name != "sgd"),
    _opt("momentum", _finite(0, 1, hi_open=True), "SGD's momentum is in [0, 1)", "optimizer.momentum=0.9",
         lambda o: o.name == "sgd"),
    Rule("nesterov_needs_momentum", "plan", "optimizer.nesterov",
         lambda s: s.settings.optim.name == "sgd" and s.settings.optim.nesterov and s.settings.optim.momentum <= 0,
         "Nesterov momentum needs a momentum > 0", "optimizer.momentum=0.9, or optimizer.nesterov=false", True),
    _opt("grad_clip", _finite(0, INF, hi_open=True), "the gradient-norm limit must be a finite number >= 0 "
         "(0 = no clipping)", "optimizer.grad_clip=1.0"),
    _opt("warmup_steps", lambda x: x < 0, "must be >= 0 (0 = no warmup)", "optimizer.warmup_steps=0"),
    _opt("decay_fraction", _finite(0, 1, lo_open=True), "warmup-stable-decay decays over this fraction of "
         "train.steps: a number in (0, 1]", "optimizer.decay_fraction=0.2", lambda o: o.schedule == "wsd"),
    Rule("wsd_phases_fit", "plan", "optimizer.warmup_steps", lambda s: _wsd_overlap(s.settings.optim),
         lambda s: f"warmup ({s.settings.optim.warmup_steps} steps) and decay (decay_fraction x train.steps = "
                   f"{s.settings.optim.decay_steps} steps) don't fit in train.steps={s.settings.optim.steps}",
         lambda s: f"optimizer.warmup_steps<={max(0, s.settings.optim.steps - s.settings.optim.decay_steps)}, "
                   "a smaller optimizer.decay_fraction, or more train.steps", lambda s: s.settings.optim.warmup_steps),
    Rule("tokenizer_known", "plan", "data.tokenizer", lambda s: s.settings.tokenizer not in TOKENIZERS,
         f"unknown tokenizer; choose one of {', '.join(TOKENIZERS)}", "data.tokenizer=bpe",
         lambda s: s.settings.tokenizer),
    Rule("compile_choice", "plan", "train.compile", lambda s: compile_choice(s.settings.compile) is None,
         "choose auto (on for CUDA, off elsewhere), true or false", "train.compile=auto",
         lambda s: s.settings.compile),
    Rule("fp8_recipe", "plan", "train.fp8", lambda s: s.settings.fp8 not in FP8_RECIPES,
         f"unknown FP8 recipe; choose one of {', '.join(FP8_RECIPES)}", "train.fp8=tensorwise (or off)",
         lambda s: s.settings.fp8),
    Rule("fp8_on_cuda", "plan", "train.fp8", lambda s: _fp8(s) and s.hw.device != "cuda",
         lambda s: f"FP8 training runs torchao's float8 matmuls on GPUs with FP8 units ({FP8_GPUS}); "
                   f"cluster.device={s.hw.device} has none",
         "train.fp8=off, or a cluster group whose GPUs have FP8: cluster=slurm_h100 (or h200, mi300x)",
         lambda s: s.settings.fp8),
    Rule("fp8_units", "plan", "train.fp8", lambda s: _fp8(s) and s.hw.device == "cuda" and s.hw.peak_tflops_fp8 <= 0,
         lambda s: f"the cluster's GPU ({s.hw.device_name}) has no FP8 matmul units (cluster.peak_tflops_fp8=0); "
                   f"FP8 needs {FP8_GPUS}",
         "train.fp8=off; or, if this GPU has FP8 units, cluster.peak_tflops_fp8=<its dense FP8 TFLOP/s>",
         lambda s: s.settings.fp8),
    *ROPE_RULES,
]


def _model_positive(key: str) -> Rule:
    return Rule(f"model_{key}_positive", "plan", f"model.{key}", lambda s: getattr(s.arch, key) < 1,
                "must be at least 1", f"model.{key}=<a positive integer>", lambda s: getattr(s.arch, key), gate=True)


MODEL_RULES = [
    *(_model_positive(k) for k in ("dim", "n_layers", "n_heads", "ffn_dim")),
    Rule("kv_heads_positive", "plan", "model.n_kv_heads", lambda s: s.arch.n_kv_heads < 1,
         "must be at least 1, or null for as many as model.n_heads", "model.n_kv_heads=null",
         lambda s: s.arch.n_kv_heads, gate=True),
    Rule("dim_splits_into_heads", "plan", "model.n_heads", lambda s: s.arch.dim % s.arch.n_heads != 0,
         lambda s: f"model.dim={s.arch.dim} is not divisible by the number of heads",
         "pick n_heads that divides model.dim", lambda s: s.arch.n_heads, gate=True),
    Rule("kv_heads_divide_heads", "plan", "model.n_kv_heads", lambda s: s.arch.n_heads % s.arch.n_kv_heads != 0,
         lambda s: f"model.n_heads={s.arch.n_heads} is not a multiple of the KV heads",
         "n_kv_heads must divide n_heads", lambda s: s.arch.n_kv_heads, gate=True),
    Rule("head_dim_even", "plan", "model.n_heads", lambda s: s.arch.head_dim % 2 != 0,
         lambda s: f"head dim {s.arch.head_dim} is odd; RoPE rotates pairs of channels",
         "make model.dim / model.n_heads even", lambda s: s.arch.n_heads, gate=True),
]


def _fill_key(s: Subject) -> str:
    return "parallelism.pp" if s.arch.n_layers < s.layout.pp else "parallelism.pp_virtual_stages"


def _fill_fix(s: Subject) -> str:
    n, p = s.arch.n_layers, s.layout.pp
    if n < p:
        return f"parallelism.pp <= {n}"
    return f"parallelism.pp_virtual_stages <= {max(1, n // p)}, or a smaller parallelism.pp"


def _stages(s: Subject) -> int:
    return s.layout.pp * s.layout.virtual


LAYOUT_RULES = [
    Rule("heads_split_over_tp", "plan", "model.n_heads", lambda s: s.arch.n_heads % s.layout.tp != 0,
         lambda s: f"{s.arch.n_heads} heads can't be split over parallelism.tp={s.layout.tp}",
         lambda s: f"parallelism.tp in {divisors(s.arch.n_heads)}", lambda s: s.arch.n_heads),
    Rule("kv_heads_split_over_tp", "plan", "model.n_kv_heads",
         lambda s: s.arch.n_kv_heads != s.arch.n_heads and s.arch.n_kv_heads % s.layout.tp != 0,
         lambda s: f"{s.arch.n_kv_heads} heads can't be split over parallelism.tp={s.layout.tp}",
         lambda s: f"parallelism.tp in {divisors(s.arch.n_kv_heads)}", lambda s: s.arch.n_kv_heads),
    Rule("layers_fill_stages", "plan", _fill_key, lambda s: s.arch.n_layers < _stages(s),
         lambda s: f"{s.arch.n_layers} layers can't fill pp x pp_virtual_stages = {s.layout.pp} x "
                   f"{s.layout.virtual} = {_stages(s)} stages (every stage needs a layer)",
         _fill_fix, lambda s: s.layout.pp if s.arch.n_layers < s.layout.pp else s.layout.pp_virtual_stages),
    Rule("seq_splits_over_cp", "plan", "train.seq_len",
         lambda s: s.layout.cp > 1 and s.settings.seq_len % (2 * s.layout.cp) != 0,
         lambda s: f"zigzag context parallelism splits the sequence into 2 x cp = {2 * s.layout.cp} chunks",
         lambda s: f"train.seq_len={-(-s.settings.seq_len // (2 * s.layout.cp)) * 2 * s.layout.cp}",
         lambda s: s.settings.seq_len),
    Rule("recompute_mode", "plan", "train.recompute", lambda s: s.layout.recompute not in RECOMPUTE_MODES,
         f"unknown recompute mode; choose one of {', '.join(RECOMPUTE_MODES)}", "train.recompute=none",
         lambda s: s.layout.recompute),
    Rule("virtual_stages_positive", "plan", "parallelism.pp_virtual_stages",
         lambda s: s.layout.pp_virtual_stages < 1, "must be at least 1", "parallelism.pp_virtual_stages=1",
         lambda s: s.layout.pp_virtual_stages),
    Rule("pp_layers_split", "plan", check=lambda s: _check_pp_layers(s)),
    Rule("fp8_rowwise_over_tp", "plan", "train.fp8", lambda s: s.settings.fp8 == "rowwise" and s.layout.tp > 1,
         lambda s: "torchao's float8 tensor-parallel styles (Float8ColwiseParallel, Float8RowwiseParallel) scale "
                   f"per tensor only: rowwise scales can't be sharded over parallelism.tp={s.layout.tp}",
         "train.fp8=tensorwise, or parallelism.tp=1 (shard over data-parallel ranks instead: parallelism.dp_shard)",
         "rowwise"),
]


def _check_pp_layers(s: Subject) -> None:
    if s.layout.pp > 1 and s.layout.pp_layers is not None:
        check_explicit(list(s.layout.pp_layers), s.arch.n_layers, _stages(s))


def _family_fix(s: Subject) -> str:
    local = s.layout.micro_batch * s.layout.grad_accum
    micro = max(1, local // s.layout.pp)
    return f"train.micro_batch={micro} (grad_accum {local // micro}), a larger train.global_batch, or " \
           "parallelism.pp_schedule=afab"


BATCH_RULES = [  # torch's schedule rules (usp.perf.pipeline_split), then ours
    Rule("pipeline_schedule", "plan", batch=True, check=lambda s: validate_schedule(
        s.layout.pp_schedule, s.layout.pp, s.layout.pp_virtual_stages, s.layout.grad_accum)),
    Rule("micro_batches_fill_pipeline", "plan", "train.grad_accum",  # 1f1b itself: pipeline_schedule says it
         lambda s: s.layout.pp > 1 and s.layout.pp_schedule in ONE_F_ONE_B_FAMILY[1:]
         and s.layout.grad_accum < s.layout.pp,
         lambda s: f"the {s.layout.pp_schedule} schedule needs at least as many micro batches per step "
                   f"(train.grad_accum) as pipeline stages ({s.layout.pp}); with {s.layout.grad_accum} most of "
                   "the pipeline idles", _family_fix, lambda s: s.layout.grad_accum, batch=True),
]


# --- what this engine trains ---------------------------------------------------------------------------

def _ep_problems(s: Subject) -> list[str]:
    """Expert parallelism as the engine runs it (usp.engine.parallel, as torchtitan): the ep ranks are
    sharded data-parallel ranks, ep divides dp_shard x cp; experts are sharded over the rest of
    dp_shard x cp (dp_shard_mod_ep) and replicated over dp_replicate; tp and pp compose (the MoE layer
    runs replicated over tp: no expert tensor parallelism). model.n_experts splits evenly over ep."""
    lay, experts = s.layout, s.arch.n_experts
    if lay.ep <= 1:
        return []
    if experts == 0:
        return ["expert parallelism needs a MoE model (model.n_experts > 0)"]
    out = []
    if experts % lay.ep:
        out.append(f"{experts} experts (model.n_experts) can't be split over ep={lay.ep}")
    shard = lay.dp_shard * lay.cp
    if shard % lay.ep:
        out.append(f"expert parallelism takes its ranks from the sharded data-parallel ranks, dp_shard x cp = "
                   f"{lay.dp_shard} x {lay.cp} = {shard}, which ep={lay.ep} must divide")
    return out


def _ep_fix(s: Subject) -> str:
    if s.arch.n_experts == 0:
        return "parallelism.ep=1, or a MoE model (model=moe_tiny)"
    shard = s.layout.dp_shard * s.layout.cp
    ok = [d for d in divisors(s.arch.n_experts) if shard % d == 0]
    fix = f"parallelism.ep in {ok} (divisors of model.n_experts={s.arch.n_experts} and of dp_shard x cp={shard})"
    if s.arch.n_experts % s.layout.ep == 0 and s.layout.dp_replicate % s.layout.ep == 0:
        fix += f", or move the replicas to shards: parallelism.dp_shard={s.layout.dp_shard * s.layout.ep} " \
               f"parallelism.dp_replicate={s.layout.dp_replicate // s.layout.ep}"
    return fix


def _flash(s: Subject) -> bool:
    return s.arch.attention == "flash_attn"


ENGINE_RULES = [
    Rule("expert_parallel", "engine", "parallelism.ep", lambda s: bool(_ep_problems(s)),
         lambda s: "; ".join(_ep_problems(s)), _ep_fix, lambda s: s.layout.ep),
    Rule("zero1_on_replicas", "engine", "parallelism.zero1",
         lambda s: s.layout.zero1 and s.layout.dp_kind not in ("zero1", "zero1_fsdp"),
         lambda s: f"ZeRO-1 shards over replicated data-parallel ranks (DDP, or with TP/PP FSDP2 over "
                   f"dp_replicate); this layout uses {s.layout.dp_kind}",
         "parallelism.zero1=false (FSDP already shards the optimizer states)", True),
    Rule("comm_hook_on_ddp", "engine", "parallelism.ddp_comm_hook",
         lambda s: s.settings.ddp_comm_hook != "none" and s.layout.dp_kind != "ddp",
         lambda s: f"communication hooks apply to plain DDP; this layout uses {s.layout.dp_kind}",
         "parallelism.ddp_comm_hook=none", lambda s: s.settings.ddp_comm_hook),
    Rule("bf16_hook_device", "engine", "parallelism.ddp_comm_hook",
         lambda s: s.settings.ddp_comm_hook == "bf16" and s.hw.device not in ("cuda", "xpu"),
         "PyTorch's bf16 compression hook needs NCCL (CUDA) or XCCL (XPU), not gloo",
         "parallelism.ddp_comm_hook=fp16 or powersgd on CPU", "bf16"),
    Rule("flash_attn_on_cuda", "engine", "model.attention", lambda s: _flash(s) and s.hw.device != "cuda",
         "flash-attn runs on CUDA only", "model.attention=sdpa", "flash_attn"),
    Rule("attention_kernel", "engine", "model.attention", lambda s: s.arch.attention not in ATTENTION_CHOICES,
         "unknown attention kernel", "model.attention=sdpa (or flash_attn on CUDA)", lambda s: s.arch.attention),
    Rule("flash_attn_dtype", "engine", "train.dtype", lambda s: _flash(s) and s.settings.dtype == "fp32",
         "flash-attn computes in bf16/fp16 only", "train.dtype=auto (bf16 on GPU), or model.attention=sdpa", "fp32"),
    Rule("flash_attn_without_cp", "engine", "model.attention", lambda s: _flash(s) and s.layout.cp > 1,
         "context parallelism brings its own (ring) attention", "model.attention=sdpa", "flash_attn"),
    Rule("ep_checkpoints", "engine", "checkpoint.enabled", lambda s: s.layout.ep > 1 and s.settings.checkpoint,
         "checkpoints of expert-parallel runs are not supported yet (expert weights differ per rank)",
         "checkpoint.enabled=false", True),
    Rule("local_multinode_rendezvous", "engine", check=lambda s: _check_node_keys(s)),
    Rule("fp8_over_tp", "engine", "parallelism.tp", lambda s: _fp8(s) and s.layout.tp > 1,
         "this engine doesn't install torchao's float8 tensor-parallel styles yet: FP8 trains with FSDP, DDP, "
         "CP and PP", "parallelism.tp=1 (shard with FSDP: parallelism.dp_shard=<ranks>), or train.fp8=off",
         lambda s: s.layout.tp),
    Rule("fp8_dense_only", "engine", "train.fp8", lambda s: _fp8(s) and s.arch.moe,
         "FP8 converts the linears of dense blocks; this engine doesn't convert MoE layers (routed experts) yet",
         "train.fp8=off, or a dense model", lambda s: s.settings.fp8),
]


# --- several machines without Slurm (usp/launch/rendezvous.py) -------------------------------------------

# host name, IPv4 address or [IPv6 address], then an optional :port
RDZV_ENDPOINT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9_.-]*)(?::(?P<port>\d{1,5}))?$")
RDZV_FIX = "cluster.rdzv_endpoint=<node 0's address>:29500 (or the address alone: a port per run)"


def endpoint_problem(endpoint) -> str | None:
    """Why a cluster.rdzv_endpoint value is not "host:port" or "host", or None."""
    match = RDZV_ENDPOINT.match(str(endpoint or ""))
    if match is None:
        return "not host:port (a host name or IP address, then an optional :port)"
    if match["port"] is not None and not 1 <= int(match["port"]) <= 65535:
        return "the port is not in 1..65535"
    return None


def _check_node_keys(s: Subject) -> None:
    """The local launcher with cluster.nodes > 1 is `usp train` on each machine: it needs this node's
    rank and node 0's rendezvous endpoint. Slurm assigns both itself."""
    nodes, rank, endpoint, launcher = s.hw.nodes, s.settings.node_rank, s.settings.rdzv_endpoint, s.settings.launcher
    if launcher == "slurm" and (rank is not None or endpoint is not None):
        key = "cluster.node_rank" if rank is not None else "cluster.rdzv_endpoint"
        raise PlanError("Slurm places the nodes and runs the rendezvous itself", key=key,
                        value=rank if rank is not None else endpoint, fix=f"drop {key} (set it to null)")
    if launcher != "local":
        return
    if nodes > 1 and (rank is None or endpoint is None):
        missing = [k for k, v in (("cluster.node_rank", rank), ("cluster.rdzv_endpoint", endpoint)) if v is None]
        raise PlanError(f"the local launcher runs {nodes} nodes as `usp train` on each machine, which needs "
                        f"{' and '.join(missing)}", key=" and ".join(missing), value=None,
                        fix=f"on each machine: cluster.node_rank=<0..{nodes - 1}> "
                            "cluster.rdzv_endpoint=<node 0's address>:29500; or a Slurm cluster group, "
                            "or cluster.nodes=1")
    if rank is not None and not 0 <= int(rank) < nodes:
        raise PlanError(f"a node rank is in 0..{nodes - 1} (cluster.nodes={nodes})", key="cluster.node_rank",
                        value=rank, fix=f"cluster.node_rank=<0..{nodes - 1}>, different on each machine")
    if nodes > 1 and endpoint_problem(endpoint):
        raise PlanError(str(endpoint_problem(endpoint)), key="cluster.rdzv_endpoint", value=endpoint, fix=RDZV_FIX)


# --- warnings ------------------------------------------------------------------------------------------

def _tp_across_nodes(s: Subject) -> str:
    hw, tp = s.hw, s.layout.tp
    return (f"a tensor-parallel group of {tp} ranks spans nodes (cluster.procs_per_node={hw.procs_per_node}): its "
            f"per-layer all-gathers / reduce-scatters would run over the {hw.inter_node_gbps:g} GB/s inter-node "
            f"link instead of {hw.intra_node_gbps:g} GB/s")


def _unused_rope_scaling(s: Subject) -> str | None:
    """The first scaling value (model.rope_<it>) set while model.rope_type=default ignores it."""
    rope = s.settings.rope
    return next((k for k in ROPE_SCALING if getattr(rope, k) is not None), None) if rope.type == "default" else None


WARN_RULES = [
    Rule("rope_scaling_unused", "warn", lambda s: f"model.rope_{_unused_rope_scaling(s)}",
         lambda s: _unused_rope_scaling(s) is not None,
         "model.rope_type=default scales no frequency: the value is ignored",
         "model.rope_type=llama3 to scale them, or drop the value",
         lambda s: getattr(s.settings.rope, _unused_rope_scaling(s) or "factor")),
    Rule("fp8_compiled", "warn", "train.compile",
         lambda s: _fp8(s) and compile_choice(s.settings.compile) is not None
         and not uses_compile(s.settings.compile, s.hw.device),
         "FP8 without compile: torchao's scaling and casts run as separate kernels, slower than bf16 "
         "(torchtitan compiles every float8 run)", "train.compile=auto (or true), or drop --strict",
         lambda s: s.settings.compile),
    Rule("warmup_ends", "warn", "optimizer.warmup_steps",
         lambda s: 1 <= s.settings.optim.steps <= s.settings.optim.warmup_steps,
         lambda s: f"the warmup outlasts the run (train.steps={s.settings.optim.steps}): the learning rate peaks at "
                   f"{s.settings.optim.steps / max(1, s.settings.optim.warmup_steps):.0%} of optimizer.lr",
         lambda s: f"optimizer.warmup_steps<{s.settings.optim.steps}, or drop --strict",
         lambda s: s.settings.optim.warmup_steps),
    Rule("tp_within_node", "warn", "parallelism.tp",
         lambda s: s.layout.tp > 1 and group_crosses_nodes(s.layout.degrees, s.hw.procs_per_node, ("tp",)),
         _tp_across_nodes, lambda s: f"parallelism.tp in {divisors(s.hw.procs_per_node)} (a divisor of "
                                     "cluster.procs_per_node), or drop --strict", lambda s: s.layout.tp),
    # the engine builds MoE x TP without expert tensor parallelism (usp/engine/parallel/tensor.py)
    Rule("moe_replicated_over_tp", "warn", "parallelism.tp", lambda s: s.arch.moe and s.layout.tp > 1,
         lambda s: f"MoE layers are not tensor-parallel (no expert TP): each of the {s.layout.tp} TP ranks runs the "
                   "router and experts on the whole sequence (tp x their FLOPs and activations, in the plan)",
         "parallelism.tp=1 with parallelism.ep to shard the experts, or drop --strict", lambda s: s.layout.tp),
]

RULES: list[Rule] = [*CONFIG_RULES, *MODEL_RULES, *LAYOUT_RULES, *BATCH_RULES, *ENGINE_RULES, *WARN_RULES]
assert all(r.kind in KINDS for r in RULES) and len({r.name for r in RULES}) == len(RULES)


# --- the callers' views --------------------------------------------------------------------------------

def failures(s: Subject, kinds: tuple = ("plan", "engine"), rules: list[Rule] | None = None) -> list[PlanError]:
    """Every failing rule of these kinds, in table order (stopping after a failed gate rule)."""
    out = []
    for rule in RULES if rules is None else rules:
        if rule.kind not in kinds and not rule.gate:
            continue
        error = rule.failure(s)
        if error is not None:
            if rule.kind in kinds:
                out.append(error)
            if rule.gate:
                break
    return out


def first_failure(s: Subject, kinds: tuple = ("plan",), rules: list[Rule] | None = None) -> PlanError | None:
    for rule in RULES if rules is None else rules:
        if rule.kind in kinds:
            error = rule.failure(s)
            if error is not None:
                return error
    return None


def warnings(s: Subject, *, strict: bool = False) -> list[str]:
    """The warn rules that fire, as plan warnings; under strict, raise the first as a PlanError."""
    out = []
    for rule in WARN_RULES:
        error = rule.failure(s)
        if error is None:
            continue
        if strict:
            raise error
        out.append(f"{error.key}={error.value}: {rule.text(s, 'why')}")
    return out


LAYOUT_ONLY = [r for r in RULES if not r.batch and r not in CONFIG_RULES]  # the search checks config values once


def config_failure(hw: Hardware, settings: Settings) -> PlanError | None:
    """The first config-value rule that fails: they read only the hardware and the settings."""
    return first_failure(Subject(cast(Arch, None), cast(Layout, None), hw, settings), ("plan",), CONFIG_RULES)
BATCH_ONLY = [r for r in RULES if r.batch]
# Besides micro_batch / grad_accum, the layout fields the batch rules read: the search asks them once per
# (these values, per-rank batch). tests/unit/test_search.py checks the memo against asking every layout.
BATCH_RULE_FIELDS = ("pp", "pp_schedule", "pp_virtual_stages")
