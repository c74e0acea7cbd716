"""The planner's rules: each config value on its own (FIELD_RULES, on the composed config read by
dotted key: ranges, choices, paths that must exist, values that need another), then what a model
shape (Arch), a parallel layout (Layout) and the hardware (Hardware), plus config values (Settings:
the optimizer and schedule, the tokenizer, the device, ...), must satisfy (RULES).

Each `Rule` is one record: the condition it refuses (`broken`), the config key it names, why, the
fix, and its kind:
  plan    the run can't work: `build_plan` raises the first one;
  engine  the plan can describe it (memory and time estimates), but this engine can't train it
          yet: `checked_plan` (what `usp train` runs) raises the first one after the plan kinds;
  warn    worth saying, not refusing: a plan warning (an error under `usp plan --strict`).
The field rules come first (`field_failures`: every value that fails; usp.plan.plan raises the first,
`usp plan` lists them all, the engine checks plan.yaml with them again). Three callers read RULES:
`usp.plan.plan.build_plan` / `checked_plan` (first failure), `usp plan` (every failure,
usp.plan.plan.plan_with_failures) and the layout search (usp.plan.search: it keeps only layouts with
no plan or engine failure, so it never proposes what `usp train` refuses).

Rules checked elsewhere, because the Subject can't be built without them: degrees vs world size
(usp.contract.dims.ParallelDims.resolve), the global batch split (usp.plan.batch.plan_batch), the tokenizer's
vocabulary, a Hugging Face model.init_from's config.json (usp.plan.plan._subject, usp.plan.hf_config),
train.dtype (usp.perf.specs.Precision.resolve); logging / profile settings
(usp.plan.validate.check_observability); the run's name (one directory name, usp.run.names) and
train.steps >= 1 (usp.plan.validate.check_run); predicted OOM, in training and while the model is built
(usp.plan.validate.analyse: they need the memory model, and --force plans them anyway; the layout search
keeps only layouts where both fit). CHECKED_ELSEWHERE (at the end) maps each such field to its check;
FREE_FIELDS lists the fields any value of whose type is fine; `field_checks()` says how every schema
field is checked.

To add a rule: append a Rule to FIELD_RULES (a value) or RULES (kind, key, broken, why, fix;
`batch=True` when it reads micro_batch / grad_accum, which the search varies last) and a test; the
callers pick it up."""
from __future__ import annotations

import math
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from typing import Any, cast

from usp.config.schema import default_of, enum_keys, schema_keys
from usp.contract.decide import ATTENTION_CHOICES, NO_COMPILE_SCHEDULES, compile_choice, torchft_wait_s, uses_compile
from usp.contract.hf_shape import HF_ROPE, ROPE_VALUES
from usp.contract.schedule import OptimSettings
from usp.contract.typed import plain
from usp.data.corpus import TEXT_SOURCES
from usp.data.text_check import TEXT_CHECKS
from usp.data.tokenizer import BYTE_VOCAB, MAX_VOCAB
from usp.data.tokenizer import KINDS as TOKENIZERS
from usp.data.tokens import ITEMSIZE as TOKEN_DTYPES
from usp.errors import PlanError
from usp.perf.pipeline_split import check_explicit, validate_schedule
from usp.perf.specs import FP8_RECIPES, RECOMPUTE_MODES, Arch, Hardware, Layout, group_crosses_nodes
from usp.plan.optimizer import OPTIMIZERS, REFUSED_OPTIMIZERS, SCHEDULES

KINDS = ("plan", "engine", "warn")
ONE_F_ONE_B_FAMILY = ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")  # need grad_accum >= pp


ROPE_TYPES = tuple(ROPE_VALUES)  # what usp/models/layers.py rope_inv_freq implements
ROPE_SCALING = tuple(HF_ROPE)  # model.rope_<k>


@dataclass(frozen=True)
class RopeSettings:
    """model.rope_type and its scaling values (model.rope_factor, ...): they change no shape, only the
    rotation's frequencies (and, under YaRN, the attention's temperature)."""

    type: str = "default"
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_positions: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None

    @classmethod
    def from_model(cls, model) -> RopeSettings:
        return cls(str(model.rope_type), *(getattr(model, f"rope_{k}") for k in ROPE_SCALING))


@dataclass(frozen=True)
class FtSettings:
    """fault_tolerance=torchft and the values of other groups its rules read (docs/fault_tolerance.md)."""

    kind: str = "none"
    min_replicas: int = 1
    async_checkpoint: bool = False
    max_restarts: int = 0
    trackers: bool = False  # logging.wandb or logging.tensorboard

    @classmethod
    def from_config(cls, cfg) -> FtSettings:
        ft = getattr(cfg, "fault_tolerance", None)
        if ft is None or str(ft.kind) != "torchft":
            return cls()
        return cls(kind="torchft", min_replicas=int(ft.min_replicas),
                   async_checkpoint=str(cfg.checkpoint.async_mode) == "async" and bool(cfg.checkpoint.enabled),
                   max_restarts=int(cfg.train.max_restarts),
                   trackers=bool(cfg.logging.wandb) or bool(cfg.logging.tensorboard))


@dataclass(frozen=True)
class Settings:
    """The config values a few rules need besides the shape, the layout and the hardware."""

    seq_len: int
    dtype: str = "auto"
    launcher: str | None = None  # None: not known (a bare search), the launcher rule doesn't apply
    ddp_comm_hook: str = "none"
    optim: OptimSettings = OptimSettings()
    tokenizer: str = "bpe"
    node_rank: int | None = None  # cluster.node_rank / rdzv_endpoint: several machines without Slurm
    rdzv_endpoint: str | None = None
    compile: Any = "auto"  # train.compile as configured (usp.perf.specs.uses_compile resolves it)
    fp8: str = "off"  # train.fp8
    rope: RopeSettings = RopeSettings()
    checkpoint_bytes: int = 0  # model.init_from: bytes per value of its tensors, 0 = no load (usp.plan.planner_inputs)
    tokens: float | None = None  # train.tokens: the token budget, when one is set
    ft: FtSettings = FtSettings()  # fault_tolerance.* and the settings torchft's replica groups can't take

    @classmethod
    def from_config(cls, cfg) -> Settings:
        """From a composed config (or a plan's, RunPlan.config)."""
        train, cluster = cfg.train, cfg.cluster
        return cls(seq_len=int(train.seq_len), dtype=str(train.dtype), launcher=str(cluster.launcher),
                   ddp_comm_hook=str(cfg.parallelism.ddp_comm_hook),
                   optim=OptimSettings.from_config(cfg.optimizer, int(train.steps)),
                   tokenizer=str(cfg.data.tokenizer), node_rank=cluster.node_rank,
                   rdzv_endpoint=cluster.rdzv_endpoint, compile=train.compile, fp8=str(train.fp8),
                   rope=RopeSettings.from_model(cfg.model), tokens=train.tokens, ft=FtSettings.from_config(cfg))


@dataclass(frozen=True)
class Subject:
    """What the rules look at: one layout of one model on one cluster."""

    arch: Arch
    layout: Layout
    hw: Hardware
    settings: Settings


Text = str | Callable[[Any], Any]  # of the Subject (or, for a field rule, the Values)


@dataclass(frozen=True)
class Rule:
    """One rule. `broken(s)` is True when subject s breaks it; key, value, why and fix are strings or
    functions of the subject. `check` instead of `broken`: a function that raises the PlanError itself
    (torch's schedule rules, written once in usp.perf.pipeline_split). `gate`: the rules after it assume
    it holds (they are not evaluated once it fails). `batch`: it reads micro_batch / grad_accum."""

    name: str
    kind: str
    key: Text = ""
    broken: Callable[[Any], bool] | None = None
    why: Text = ""
    fix: Text = ""
    value: Text | bool | None = None
    check: Callable[[Subject], None] | None = None
    gate: bool = False
    batch: bool = False
    also: tuple[str, ...] = ()  # other config keys it checks (the field registry's view, FIELD_CHECKS)

    def failure(self, s) -> PlanError | None:
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

    def text(self, s, what: str):
        t = getattr(self, what)
        return t(s) if callable(t) else t


def divisors(n: int) -> list[int]:
    """n's divisors, ascending, in O(sqrt(n)): a global batch of 10^9 is refused in milliseconds."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


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


def _scaling(rope_type: str, key: str, broken: Callable[[Any, RopeSettings], bool], why: str, fix: str) -> Rule:
    """A rule on one of the values model.rope_type=<rope_type> reads (`broken` sees it and the others)."""
    return Rule(f"rope_{rope_type}_{key}", "plan", f"model.rope_{key}",
                lambda s: s.settings.rope.type == rope_type and broken(getattr(s.settings.rope, key), s.settings.rope),
                f"model.rope_type={rope_type} needs {why}", f"model.rope_{key}={fix}",
                lambda s: getattr(s.settings.rope, key))


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _optional(ok: Callable[[Any], bool]) -> Callable[[Any, RopeSettings], bool]:
    """broken(x, rope) for a value that may be left unset (None: transformers' default)."""
    return lambda x, r: x is not None and not ok(x)


ROPE_RULES = [
    Rule("rope_type_known", "plan", "model.rope_type", lambda s: s.settings.rope.type not in ROPE_TYPES,
         f"usp implements the RoPE types {', '.join(ROPE_TYPES)} (transformers' rope_type names); other "
         "scalings (linear, dynamic, longrope, ...) are not implemented",
         "model.rope_type=default, or llama3 / yarn with their model.rope_* values", lambda s: s.settings.rope.type),
    _scaling("llama3", "factor", lambda x, r: not _number(x) or x < 1,
             "a factor >= 1 (the long wavelengths are divided by it)", "8.0 (Llama 3.1; 32.0 for Llama 3.2)"),
    _scaling("llama3", "low_freq_factor", lambda x, r: not _number(x) or x <= 0, "a low_freq_factor > 0",
             "1.0 (Llama 3)"),
    _scaling("llama3", "high_freq_factor",
             lambda x, r: not _number(x) or (_number(r.low_freq_factor) and x <= r.low_freq_factor),
             "a high_freq_factor > model.rope_low_freq_factor", "4.0 (Llama 3)"),
    _scaling("llama3", "original_max_positions", lambda x, r: not _count(x),
             "the context length the model was pre-trained with (original_max_position_embeddings), an integer >= 1",
             "8192 (Llama 3)"),
    _scaling("yarn", "factor", lambda x, r: not _number(x) or x < 1,
             "a factor >= 1: the context's extension over model.rope_original_max_positions",
             "40.0 (DeepSeek-V3), 4.0 (Qwen3)"),
    _scaling("yarn", "original_max_positions", lambda x, r: not _count(x),
             "the context length the model was pre-trained with (original_max_position_embeddings), an integer >= 1",
             "4096 (DeepSeek-V3), 32768 (Qwen3)"),
    _scaling("yarn", "beta_fast", _optional(lambda x: _number(x) and x > 0),
             "a beta_fast > 0 (channels turning more often over the original context keep their frequency), "
             "or null for 32", "32"),
    _scaling("yarn", "beta_slow", lambda x, r: x is not None and not (
        _number(x) and 0 < x < (r.beta_fast if _number(r.beta_fast) else 32)),
        "a beta_slow > 0 below model.rope_beta_fast (channels turning less often are interpolated), or null "
        "for 1", "1"),
    *(_scaling("yarn", k, _optional(lambda x: _number(x) and x >= 0),
               f"a {k} >= 0 (YaRN's attention temperature, 0.1 {k} ln(factor) + 1), or null", "1.0 (DeepSeek-V3)")
      for k in ("mscale", "mscale_all_dim")),
    _scaling("yarn", "attention_factor", _optional(lambda x: _number(x) and x > 0),
             "an attention_factor > 0 (cos and sin are multiplied by it), or null to derive it from the factor",
             "null"),
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
    Rule("dim_splits_into_heads", "plan", "model.n_heads",
         lambda s: not s.arch.attn_head_dim and s.arch.dim % s.arch.n_heads != 0,
         lambda s: f"model.dim={s.arch.dim} is not divisible by the number of heads (model.head_dim is null: "
                   "dim / n_heads)", "pick n_heads that divides model.dim, or set model.head_dim (Qwen3: 128)",
         lambda s: s.arch.n_heads, gate=True),
    Rule("kv_heads_divide_heads", "plan", "model.n_kv_heads", lambda s: s.arch.n_heads % s.arch.n_kv_heads != 0,
         lambda s: f"model.n_heads={s.arch.n_heads} is not a multiple of the KV heads",
         "n_kv_heads must divide n_heads", lambda s: s.arch.n_kv_heads, gate=True),
    Rule("head_dim_even", "plan", lambda s: "model.head_dim" if s.arch.attn_head_dim else "model.n_heads",
         lambda s: s.arch.head_dim % 2 != 0,
         lambda s: f"head dim {s.arch.head_dim} is odd; RoPE rotates pairs of channels",
         lambda s: "model.head_dim=<an even number>" if s.arch.attn_head_dim else "make model.dim / model.n_heads even",
         lambda s: s.arch.attn_head_dim or s.arch.n_heads, gate=True),
    Rule("load_imbalance_at_least_one", "plan", "model.expert_load_imbalance",
         lambda s: not s.arch.expert_load_imbalance >= 1.0,
         "is the busiest expert's tokens over the mean (metrics.jsonl expert_load: imbalance), at least 1",
         "model.expert_load_imbalance=1.0 (balanced) or the measured value", lambda s: s.arch.expert_load_imbalance),
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
    Rule("pp_layers_split", "plan", check=lambda s: _check_pp_layers(s), also=("parallelism.pp_layers",)),
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
        s.layout.pp_schedule, s.layout.pp, s.layout.pp_virtual_stages, s.layout.grad_accum),
         also=("parallelism.pp_schedule",)),
    Rule("compile_with_zero_bubble", "plan", "train.compile",
         lambda s: s.layout.pp > 1 and s.layout.pp_schedule in NO_COMPILE_SCHEDULES
         and compile_choice(s.settings.compile) == "true",
         lambda s: f"torch runs the {s.layout.pp_schedule} pipeline schedule only on stage modules that were not "
                   "compiled (torch.distributed.pipelining refuses them)",
         "train.compile=auto (eager under this schedule), or parallelism.pp_schedule=interleaved_1f1b",
         lambda s: s.settings.compile, also=("parallelism.pp_schedule",)),
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


def _ft(s: Subject) -> bool:
    return s.settings.ft.kind == "torchft"


def _ft_groups_placed(s: Subject) -> bool:
    """Each replica group is a job of whole nodes, or the groups share one node evenly."""
    groups, nodes, per_node = s.layout.dp_replicate, s.hw.nodes, s.hw.procs_per_node
    return nodes % groups == 0 if nodes > 1 else per_node % groups == 0


FT_FIX = "fault_tolerance=none"
FT_RULES = [  # fault_tolerance=torchft (docs/fault_tolerance.md)
    Rule("ft_needs_replicas", "plan", "parallelism.dp_replicate", lambda s: _ft(s) and s.layout.dp_replicate < 2,
         "torchft keeps training when a replica group is lost: the groups are the data-parallel replicate "
         "dimension (DDP, or HSDP's outer dim), and this layout has none", "parallelism.dp_replicate=<replica "
         f"groups, at least 2> (each group trains the rest of the layout: dp_shard x cp x tp x pp), or {FT_FIX}",
         lambda s: s.layout.dp_replicate),
    Rule("ft_min_replicas", "plan", "fault_tolerance.min_replicas",
         lambda s: _ft(s) and s.settings.ft.min_replicas > s.layout.dp_replicate,
         lambda s: f"a step needs more replica groups than the run has (parallelism.dp_replicate="
                   f"{s.layout.dp_replicate}): no step could commit",
         lambda s: f"fault_tolerance.min_replicas=1 (at most {s.layout.dp_replicate})",
         lambda s: s.settings.ft.min_replicas),
    Rule("ft_groups_on_nodes", "plan", "cluster.nodes", lambda s: _ft(s) and not _ft_groups_placed(s),
         lambda s: f"each of the {s.layout.dp_replicate} replica groups is a job of its own: it needs whole nodes "
                   f"(cluster.nodes a multiple of {s.layout.dp_replicate}), or the groups share one node evenly "
                   f"(cluster.procs_per_node a multiple of {s.layout.dp_replicate})",
         lambda s: f"cluster.nodes={s.layout.dp_replicate * max(1, s.hw.nodes // s.layout.dp_replicate)} (or "
                   f"parallelism.dp_replicate dividing cluster.nodes)", lambda s: s.hw.nodes),
    Rule("ft_zero1", "engine", "parallelism.zero1", lambda s: _ft(s) and s.layout.zero1,
         "ZeRO-1 shards the optimizer states over the replicated ranks; under torchft each replica group keeps "
         "a whole copy (a lost group heals from a live one)", "parallelism.zero1=false (shard inside each group: "
         "parallelism.dp_shard=<ranks>)", True),
    Rule("ft_comm_hook", "engine", "parallelism.ddp_comm_hook",
         lambda s: _ft(s) and s.settings.ddp_comm_hook != "none",
         "DDP's communication hooks compress DDP's all-reduce; under torchft the gradients between replica "
         "groups go through torchft's all-reduce", "parallelism.ddp_comm_hook=none",
         lambda s: s.settings.ddp_comm_hook),
    Rule("ft_dense_only", "engine", "model.n_experts", lambda s: _ft(s) and s.arch.moe,
         "MoE's load-balancing statistics are summed over the global batch inside the forward, across the replica "
         "groups, which torchft's per-step all-reduce of gradients does not carry", f"a dense model, or {FT_FIX}",
         lambda s: s.arch.n_experts),
    Rule("ft_async_checkpoint", "engine", "checkpoint.async_mode", lambda s: _ft(s) and s.settings.ft.async_checkpoint,
         "under torchft the replica group that writes a checkpoint may change from one save to the next; a save "
         "in the background would outlive it", "checkpoint.async_mode=none", "async"),
    Rule("ft_max_restarts", "engine", "train.max_restarts", lambda s: _ft(s) and s.settings.ft.max_restarts > 0,
         "torchrun's restarts restart a whole job; under torchft usp restarts each lost replica group on its own",
         "train.max_restarts=0 (fault_tolerance.max_group_restarts locally, cluster.slurm.max_requeues on Slurm)",
         lambda s: s.settings.ft.max_restarts),
    Rule("ft_trackers", "engine", "logging.wandb", lambda s: _ft(s) and s.settings.ft.trackers,
         "under torchft the replica group that logs each step changes as groups come and go; W&B and TensorBoard "
         "are not written from several jobs yet (metrics.jsonl is, with the participants of every step)",
         "logging.wandb=false logging.tensorboard=false", True, also=("logging.tensorboard",)),
    Rule("ft_local_one_node", "engine", "cluster.nodes",
         lambda s: _ft(s) and s.settings.launcher == "local" and s.hw.nodes > 1,
         "the local launcher starts the replica groups and the lighthouse on this machine only",
         "cluster=<a Slurm group> (one job per replica group), or cluster.nodes=1", lambda s: s.hw.nodes),
]


ENGINE_RULES = [
    Rule("mtp_whole_sequence", "engine", lambda s: f"parallelism.{_mtp_split(s)}", lambda s: bool(_mtp_split(s)),
         lambda s: f"multi-token prediction (model.mtp_depth=1) reads the next token's embedding beside the main "
                   f"model's last hidden state, with the embedding and the head on the same rank and each "
                   f"sequence whole there: not under {_mtp_split(s)} > 1",
         lambda s: f"parallelism.{_mtp_split(s)}=1 (data, tensor and expert parallelism instead), or "
                   f"model.mtp_depth=0",
         lambda s: getattr(s.layout, str(_mtp_split(s)))),
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
    Rule("local_multinode_rendezvous", "engine", check=lambda s: _check_node_keys(s),
         also=("cluster.node_rank", "cluster.rdzv_endpoint")),
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
    """The first scaling value (model.rope_<it>) set that model.rope_type doesn't read."""
    rope = s.settings.rope
    reads = ROPE_VALUES.get(rope.type, ROPE_SCALING)
    return next((k for k in ROPE_SCALING if getattr(rope, k) is not None and k not in reads), None)


def _rope_types_reading(key: str) -> str:
    return " or ".join(t for t, keys in ROPE_VALUES.items() if key in keys)


# A global batch this many times the fitted optimum (DeepSeek LLM, arXiv 2401.02954, section 3.1: B_opt =
# 0.2920 C^0.3271 tokens for C training FLOPs) is warned about: near the optimum the loss is flat in the
# batch size; far past it ("the critical batch size", McCandlish et al. 2018) steps stop paying for tokens.
CRITICAL_BATCH_FACTOR = 4.0


def _batch_tokens(s: Subject) -> int:
    lay = s.layout
    return lay.micro_batch * lay.grad_accum * lay.dp * s.settings.seq_len


def _optimal_batch_tokens(s: Subject) -> float:
    flops = s.arch.flops_per_token(s.settings.seq_len) * float(s.settings.tokens or 0.0)
    return 0.2920 * flops ** 0.3271


def _past_critical_batch(s: Subject) -> float | None:
    """How many times the optimal batch the global batch is, when past CRITICAL_BATCH_FACTOR (a token
    budget set), else None."""
    if not s.settings.tokens:
        return None
    ratio = _batch_tokens(s) / _optimal_batch_tokens(s)
    return ratio if ratio > CRITICAL_BATCH_FACTOR else None


WARN_RULES = [
    Rule("rope_scaling_unused", "warn", lambda s: f"model.rope_{_unused_rope_scaling(s)}",
         lambda s: _unused_rope_scaling(s) is not None,
         lambda s: f"model.rope_type={s.settings.rope.type} doesn't read it: the value is ignored",
         lambda s: f"model.rope_type={_rope_types_reading(_unused_rope_scaling(s) or 'factor')} to use it, "
                   "or drop the value",
         lambda s: getattr(s.settings.rope, _unused_rope_scaling(s) or "factor")),
    Rule("fp8_compiled", "warn", "train.compile",
         lambda s: _fp8(s) and compile_choice(s.settings.compile) is not None
         and not uses_compile(s.settings.compile, s.hw.device, s.layout.pp_schedule, s.layout.pp),
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
    Rule("batch_past_critical", "warn", "train.global_batch", lambda s: _past_critical_batch(s) is not None,
         lambda s: f"{_batch_tokens(s):,} tokens per step is {_past_critical_batch(s):.0f}x the batch DeepSeek's "
                   f"scaling law fits as optimal for this compute budget ({_optimal_batch_tokens(s):,.0f} tokens, "
                   "B_opt = 0.292 C^0.3271): past a few times it, more tokens per step buy fewer steps, not more "
                   "learning", lambda s: f"train.global_batch_tokens near {_optimal_batch_tokens(s):,.0f} (more "
                   "steps, fewer devices per step), or drop --strict",
         lambda s: _batch_tokens(s) // s.settings.seq_len),
    # the engine builds MoE x TP without expert tensor parallelism (usp/engine/parallel/tensor.py)
    Rule("moe_replicated_over_tp", "warn", "parallelism.tp", lambda s: s.arch.moe and s.layout.tp > 1,
         lambda s: f"MoE layers are not tensor-parallel (no expert TP): each of the {s.layout.tp} TP ranks runs the "
                   "router and experts on the whole sequence (tp x their FLOPs and activations, in the plan)",
         "parallelism.tp=1 with parallelism.ep to shard the experts, or drop --strict", lambda s: s.layout.tp),
]

RULES: list[Rule] = [*CONFIG_RULES, *MODEL_RULES, *LAYOUT_RULES, *BATCH_RULES, *FT_RULES, *ENGINE_RULES,
                     *WARN_RULES]
assert all(r.kind in KINDS for r in RULES) and len({r.name for r in RULES}) == len(RULES)


# --- one config value at a time: ranges, choices, paths, and values that need another one ---------------

class Values:
    """What the field rules look at: a config's plain values (field_failures converts a composed one)
    read by dotted key. A key that isn't there reads as None, and None (an optional value left unset) is
    never refused."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def __getitem__(self, dotted: str):
        node = self.cfg
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node


def _field(key: str, broken: Callable[[Any], bool], why: str, fix: str | None = None, *,
           when: Callable[[Values], bool] | None = None, name: str | None = None) -> Rule:
    """A plan rule on one value; `when` limits it to configs where the value is used. The default
    fix is the schema's default."""
    def is_broken(v: Values) -> bool:
        value = v[key]
        return value is not None and (when is None or when(v)) and bool(broken(value))

    return Rule(name or key, "plan", key, is_broken, why, fix or (lambda v: f"{key}={default_of(key)} (the default)"),
                lambda v: v[key])  # the default looked up only when the rule fails (it reads the type hints)


def _ints(lo: int, hi: float = math.inf) -> Callable[[Any], bool]:
    """broken(x): x is not an integer in [lo, hi]."""
    return lambda x: isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi


def _at_least(key: str, lo: int, meaning: str = "", fix: str | None = None, **kw) -> Rule:
    return _field(key, _ints(lo), f"must be at least {lo}{meaning}", fix, **kw)


def _real(key: str, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False,
            meaning: str = "", fix: str | None = None, **kw) -> Rule:
    """A finite number in a range; its message says the range ("> 0", "in (0, 1]")."""
    if hi == math.inf:
        where = f"{'>' if lo_open else '>='} {lo:g}"
    else:
        where = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    return _field(key, _finite(lo, hi, lo_open=lo_open, hi_open=hi_open), f"must be a finite number {where}{meaning}",
                  fix, **kw)


def _one_of(key: str, choices, what: str, fix: str | None = None, **kw) -> Rule:
    return _field(key, lambda x: str(x) not in choices, f"unknown {what}; choose one of {', '.join(choices)}", fix,
                  **kw)


def _set(v: Values, *keys: str) -> bool:
    """The cross-field rules' guard: all these values are there (a partial config may lack some)."""
    return all(v[k] is not None for k in keys)


def _slurm(v: Values) -> bool:
    return str(v["cluster.launcher"]) == "slurm"


def _moe(v: Values) -> bool:
    return int(v["model.n_experts"] or 0) > 0


def _mtp_split(s: Subject) -> str | None:
    """The parallelism that splits what multi-token prediction needs (cp: the sequence, pp: the embedding from the
    head), or None. Under tp every rank holds the whole token sequence, and the MTP block's input is sharded
    over it as the main stack's (usp.models.llama.Llama._mtp_loss)."""
    if not s.arch.mtp_depth:
        return None
    return next((dim for dim in ("cp", "pp") if getattr(s.layout, dim) > 1), None)


def _group_problem(v: Values) -> str | None:
    """Why model.router_groups / router_topk_groups can't route model.top_k of model.n_experts, or None:
    DeepSeek-V3 ranks a group by its two best experts, and a token's experts come from its best groups."""
    e, g, k, top = (int(v[f"model.{x}"]) for x in ("n_experts", "router_groups", "router_topk_groups", "top_k"))
    if g == 1:
        return None
    if e % g or e // g < 2:
        return f"model.n_experts={e} must split into {g} groups of at least 2 experts"
    if not k <= g or k * (e // g) < top:
        return f"model.router_topk_groups={k} must be at most {g} groups holding top_k={top} experts"
    return None


def _token_files(v: Values) -> bool:
    return str(v["data.source"]) == "token_files"


def _bpe(v: Values) -> bool:
    return str(v["data.tokenizer"]) == "bpe" and str(v["data.source"]) != "token_files"


def _resume_problem(value) -> str | None:
    """Why checkpoint.resume can't be resumed from, or None (auto, never, a complete checkpoint)."""
    if str(value) in ("auto", "never"):
        return None
    path = Path(str(value)).expanduser()
    if not path.is_dir():
        return "no such checkpoint directory (checkpoint.resume is auto, never, or a run's checkpoints/step_<N>)"
    if not re.fullmatch(r"step_\d+", path.name):
        return "not a checkpoint directory: a run's checkpoints/step_<N>"
    from usp.run.files import check_manifest  # only for a path (usp plan doesn't import run/files otherwise)

    problem = check_manifest(path)
    return None if problem is None else f"not a complete checkpoint: {problem}"


def _backend_problem(v: Values) -> str | None:
    """cluster.backend: a torch.distributed backend the device can use, or auto."""
    backend, device = str(v["cluster.backend"]), str(v["cluster.device"])
    if backend in ("auto", "None"):
        return None
    names = [part.rpartition(":")[2] for part in backend.split(",")]  # "gloo" or "cpu:gloo,cuda:nccl"
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        return f"unknown backend {unknown[0]!r}; choose auto or one of {', '.join(BACKENDS)}"
    needs = {"nccl": "cuda", "xccl": "xpu"}
    wrong = [n for n in names if n in needs and ":" not in backend and needs[n] != device]
    if wrong:
        return f"{wrong[0]} runs on {needs[wrong[0]]} devices, and cluster.device={device}"
    return None


def _bad_weight(v: Values) -> int | None:
    """The index of the first data.blend source whose weight isn't a finite number > 0."""
    weights = [float(source.get("weight", 1.0)) for source in v["data.blend"] or []]
    return next((i for i, w in enumerate(weights) if not (math.isfinite(w) and w > 0)), None)


def _bad_env_key(v: Values) -> str | None:
    return next((str(k) for k in (v["cluster.env"] or {}) if not ENV_KEY.match(str(k))), None)


def _slurm_time_s(text: str) -> int | None:
    """Seconds of a Slurm time limit (minutes | [D-]H[:M[:S]] | M:S), or None when it isn't one."""
    if not SLURM_TIME.match(text):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, s = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + s
    if len(parts) == 1:
        return parts[0] * 60  # minutes
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]  # M:S
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def _lead_too_long(v: Values) -> bool:
    if not _set(v, "cluster.slurm.time", "cluster.slurm.signal_lead_s"):
        return False
    limit = _slurm_time_s(str(v["cluster.slurm.time"]))
    return limit is not None and int(v["cluster.slurm.signal_lead_s"]) >= limit


def _lines(key: str, option: bool, why: str, fix: str) -> Rule:
    """A Slurm list whose entries are one line each (and, for sbatch options, start with '-')."""
    def bad(v: Values) -> int | None:
        entries = v[key] or []
        return next((i for i, x in enumerate(entries) if "\n" in str(x) or (option and not str(x).startswith("-"))),
                    None)

    return Rule(key, "plan", lambda v: f"{key}[{bad(v)}]", lambda v: _slurm(v) and bad(v) is not None, why, fix,
                lambda v: v[key][bad(v)], also=(key,))


BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
ROUTER_SCORES = ("softmax", "sigmoid")  # model.router_score (usp/models/moe.py)
AUX_LOSS_SCOPES = ("batch", "sequence")  # model.aux_loss_scope (usp/models/moe.py)
MODEL_FAMILIES = ("llama",)  # the decoder usp builds (usp/models/llama.py; n_experts > 0: MoE blocks, as Mixtral)
DATA_SOURCES = (*TEXT_SOURCES, "blend", "token_files")
SLURM_TIME = re.compile(r"^\d+(-\d+)?(:\d+){0,2}$")  # minutes | [D-]H[:M[:S]] | M:S (sbatch --time forms)
SLURM_WORD = re.compile(r"^[^\s'\"`$;\\]+$")  # one #SBATCH word: no spaces, quotes or shell characters
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SEED_MAX = 2 ** 63 - 1  # torch.manual_seed's range, from 0 (the sampler's seeds are >= 0)
TIMING = "cluster.timing."
MODEL_FIELD_RULES = [
    _one_of("model.family", MODEL_FAMILIES, "model family (usp builds the Llama decoder; MoE with model.n_experts)"),
    _field("model.vocab_size", lambda x: x == 0 or x < -1, "must be -1 (take it from the tokenizer) or a positive "
           "vocabulary size"),
    *(_real(f"model.{k}", 0, lo_open=True) for k in ("rope_theta", "norm_eps", "init_std")),
    _field("model.head_dim", lambda x: isinstance(x, bool) or not isinstance(x, int) or x < 2 or x % 2 != 0,
           "must be null (model.dim / model.n_heads) or a positive even number: RoPE rotates pairs of channels",
           "model.head_dim=null (model.dim / model.n_heads), or the checkpoint's head_dim (Qwen3: 128)"),
    _at_least("model.n_experts", 0, " (0 = a dense model)"),
    _field("model.top_k", lambda x: not 1 <= x, "a token goes to at least one expert", when=_moe),
    Rule("model.top_k<=n_experts", "plan", "model.top_k",
         lambda v: _moe(v) and _set(v, "model.top_k") and int(v["model.top_k"]) > int(v["model.n_experts"]),
         lambda v: f"a token can't go to more experts than model.n_experts={v['model.n_experts']}",
         lambda v: f"model.top_k<={v['model.n_experts']} (Mixtral: 2)", lambda v: v["model.top_k"]),
    _at_least("model.moe_ffn_dim", 0, " (0 = model.ffn_dim)"),
    _real("model.aux_loss_coef", 0),
    _one_of("model.aux_loss_scope", AUX_LOSS_SCOPES, "balance loss scope (batch: over the global batch, Qwen3-MoE; "
            "sequence: per sequence, DeepSeek-V3)"),
    _real("model.capacity_factor", 0, meaning=" (0 = dropless)"),
    _real("model.router_bias_update_rate", 0, meaning=" (0 = off; > 0: aux-loss-free balancing, the bias step)"),
    # DeepSeek-V3's options (docs/models.md)
    _at_least("model.n_shared_experts", 1, " (the shared expert's width in experts)"),
    _one_of("model.router_score", ROUTER_SCORES, "router score (softmax: Mixtral, Qwen3-MoE; sigmoid: DeepSeek-V3)"),
    _at_least("model.router_groups", 1, " (1 = no group-limited routing)"),
    _at_least("model.router_topk_groups", 1),
    Rule("model.router_groups_split_experts", "plan", "model.router_groups",
         lambda v: _moe(v) and _set(v, "model.router_groups", "model.router_topk_groups", "model.top_k")
         and _group_problem(v) is not None, lambda v: str(_group_problem(v)),
         "model.router_groups=1 (DeepSeek-V3: 8 groups of 32 experts, router_topk_groups=4)",
         lambda v: v["model.router_groups"]),
    _real("model.router_scale", 0, lo_open=True, meaning=" (routed_scaling_factor; 1 = none)"),
    _at_least("model.n_dense_layers", 0, " (the first blocks of a MoE model with a dense MLP)"),
    *(_at_least(f"model.{k}", 0) for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim")),
    _field("model.qk_rope_head_dim", lambda x: isinstance(x, bool) or not isinstance(x, int) or x < 2 or x % 2 != 0,
           "latent attention's RoPE part must be a positive even width: RoPE rotates pairs of channels",
           "model.qk_rope_head_dim=64 (DeepSeek-V3)", when=lambda v: int(v["model.kv_lora_rank"] or 0) > 0),
    _field("model.v_head_dim", _ints(1), "latent attention's value heads must be at least 1 wide",
           "model.v_head_dim=128 (DeepSeek-V3)", when=lambda v: int(v["model.kv_lora_rank"] or 0) > 0),
    _field("model.mtp_depth", lambda x: x not in (0, 1), "usp implements multi-token prediction of depth 1 (or 0)",
           "model.mtp_depth=1 (DeepSeek-V3)"),
    _real("model.mtp_loss_coef", 0, lo_open=True, meaning=" (the MTP loss's weight; DeepSeek-V3: 0.3, then 0.1)",
          when=lambda v: int(v["model.mtp_depth"] or 0) > 0),
    _field("model.qk_norm", lambda x: bool(x), "latent attention (model.kv_lora_rank > 0) has no QK-norm",
           "model.qk_norm=false", when=lambda v: int(v["model.kv_lora_rank"] or 0) > 0),
]
PARALLEL_FIELD_RULES = [
    _at_least("parallelism.ddp_bucket_mb", 1),
    _at_least("parallelism.powersgd_rank", 1, when=lambda v: str(v["parallelism.ddp_comm_hook"]) == "powersgd"),
]
CLUSTER_FIELD_RULES = [
    _at_least("cluster.nodes", 1, fix="cluster.nodes=1"),
    _at_least("cluster.procs_per_node", 1, fix="cluster.procs_per_node=1"),
    Rule("cluster.backend", "plan", "cluster.backend", lambda v: _backend_problem(v) is not None,
         lambda v: _backend_problem(v), "cluster.backend=auto (gloo on cpu, nccl on cuda, xccl on xpu)",
         lambda v: v["cluster.backend"]),
    _at_least("cluster.threads_per_proc", 0, " (0 = OMP_NUM_THREADS, else the cores split over the processes)"),
    _real("cluster.device_memory_gb", 0, lo_open=True, fix="cluster.device_memory_gb=<GiB per device, e.g. 80>"),
    *(_real(f"cluster.{k}", 0, lo_open=True, fix=f"cluster.{k}=<the device's dense peak, e.g. 989 for an H100>")
      for k in ("peak_tflops_bf16", "peak_tflops_fp32")),
    _real("cluster.peak_tflops_fp8", 0, meaning=" (0 = no FP8 units)"),
    *(_real(f"cluster.{k}", 0, lo_open=True, fix=f"cluster.{k}=<GB/s per device, one direction>")
      for k in ("intra_node_gbps", "inter_node_gbps")),
    _real("cluster.price_per_device_hour", 0, meaning=" (0 = unknown)"),
    *(_real(f"{TIMING}{k}", 0, 1, lo_open=True, meaning=" (a share of the peak or of the link)") for k in (
        "gemm_efficiency", "nvlink_efficiency", "nic_efficiency")),
    _real(f"{TIMING}clock", 0, 2, lo_open=True, meaning=" (sustained clock / the datasheet's)"),
    _real("cluster.reliability.node_mtbf_hours", 0, lo_open=True, meaning=" (mean hours between one node's failures)",
          fix="cluster.reliability.node_mtbf_hours=6335 (Llama 3's fleet; docs/faults.md)"),
    *(_real(f"cluster.reliability.{k}", 0, meaning=" (seconds)") for k in (
        "job_start_s", "rendezvous_s", "build_s", "checkpoint_overhead_s")),
    *(_real(f"cluster.storage.{k}", 0, lo_open=True, meaning=" (GB/s)") for k in (
        "write_gbps_per_node", "read_gbps_per_node", "host_copy_gbps")),
    *(_real(f"cluster.storage.{k}", 0, meaning=" (GB/s; 0 = no limit past the nodes')") for k in (
        "write_gbps_total", "read_gbps_total")),
    *(_real(f"{TIMING}{k}", 0) for k in (
        "gemm_half_k", "gemm_fixed_us", "fp8_half_k", "attention_half_seq", "interference", "intra_latency_us",
        "inter_latency_us", "eager_overhead", "eager_loss_ps_per_logit")),
    _real(f"{TIMING}fp8_efficiency", 0, lo_open=True),
    _one_of(f"{TIMING}all_reduce", ("auto", "ring", "tree"), "all-reduce algorithm"),
    _real("cluster.hbm_gbps", 0, lo_open=True, fix="cluster.hbm_gbps=<the device's memory bandwidth, GB/s>"),
    _real(f"{TIMING}calibrated.ratio_p10", 0, lo_open=True, meaning=" (predicted / measured MFU)"),
    _field(f"{TIMING}calibrated.ratio_p90", lambda x: not x < math.inf, "must be a finite number",
           "run `usp calibrate` again, or delete cluster.timing.calibrated"),
    Rule("calibrated.ratio_p10<=p90", "plan", f"{TIMING}calibrated.ratio_p90",
         lambda v: _set(v, f"{TIMING}calibrated.ratio_p10", f"{TIMING}calibrated.ratio_p90")
         and v[f"{TIMING}calibrated.ratio_p10"] > v[f"{TIMING}calibrated.ratio_p90"],
         "the 90th percentile of predicted / measured MFU is below the 10th (ratio_p10)",
         "run `usp calibrate` again, or delete cluster.timing.calibrated",
         lambda v: v[f"{TIMING}calibrated.ratio_p90"]),
    _at_least("cluster.timeout_s", 1, " (seconds a collective may hang before it fails)"),
    Rule("cluster.env", "plan", lambda v: f"cluster.env.{_bad_env_key(v)}", lambda v: _bad_env_key(v) is not None,
         "not a valid environment variable name", "letters, digits and _ (not starting with a digit)",
         lambda v: _bad_env_key(v), also=("cluster.env",)),
]
SLURM_FIELD_RULES = [
    _field("cluster.slurm.time", lambda x: not SLURM_TIME.match(str(x)), "not a Slurm time limit",
           "cluster.slurm.time=HH:MM:SS (or D-HH:MM:SS, or minutes)", when=_slurm),
    *(_field(f"cluster.slurm.{k}", lambda x: not SLURM_WORD.match(str(x)),
             "must be one word without spaces, quotes or shell characters",
             f"cluster.slurm.{k}=<value> (for anything else use cluster.slurm.sbatch_extra)", when=_slurm)
      for k in ("partition", "account", "qos", "mem", "constraint", "container_image", "container_mounts")),
    _lines("cluster.slurm.sbatch_extra", True, "each entry is one sbatch option on one line",
           "cluster.slurm.sbatch_extra=['--reservation=big']"),
    _lines("cluster.slurm.setup", False, "each entry is one shell line", "split it into several list entries"),
    _at_least("cluster.slurm.cpus_per_task", 0, " (0 = procs_per_node x threads_per_proc)", when=_slurm),
    _at_least("cluster.slurm.signal_lead_s", 1, ": the ranks need a warning before the time limit to checkpoint",
              "cluster.slurm.signal_lead_s=180", when=_slurm),
    Rule("cluster.slurm.signal_lead_s<time", "plan", "cluster.slurm.signal_lead_s",
         lambda v: _slurm(v) and _lead_too_long(v),
         lambda v: f"is not shorter than the time limit ({v['cluster.slurm.time']})",
         "a lead of a few minutes, well inside cluster.slurm.time", lambda v: v["cluster.slurm.signal_lead_s"]),
    _at_least("cluster.slurm.max_requeues", 0, fix="cluster.slurm.max_requeues=3", when=_slurm),
    _field("cluster.slurm.rdzv_port", _ints(1, 65535), "not a TCP port (1..65535)",
           "cluster.slurm.rdzv_port=29500, or null for one per job", when=_slurm),
]
DATA_FIELD_RULES = [
    _one_of("data.source", DATA_SOURCES, "data source", "data=shakespeare, or data.source=files data.paths=[...]"),
    Rule("data.blend", "plan", "data.blend", lambda v: str(v["data.source"]) == "blend" and not v["data.blend"],
         "data.source=blend mixes the sources listed in data.blend, and it is empty",
         "data=blend (an example), or data.blend=[{paths: [a.jsonl], weight: 0.7}, ...]", lambda v: []),
    Rule("data.blend[].weight", "plan", lambda v: f"data.blend[{_bad_weight(v)}].weight",
         lambda v: _bad_weight(v) is not None,
         "a source's weight must be a finite number > 0 (the weights are normalised over the sources)",
         "data.blend=[{paths: [...], weight: 0.7}, {paths: [...], weight: 0.3}]",
         lambda v: v["data.blend"][_bad_weight(v)].get("weight"), also=("data.blend[].weight",)),
    _at_least("data.workers", 0, " (0 = one per available core)"),
    _one_of("data.text_check", TEXT_CHECKS, "text check", "data.text_check=strict (or skip, off)"),
    _one_of("data.token_dtype", ("auto", *TOKEN_DTYPES), "token dtype", when=_token_files),
    _field("data.vocab_size", lambda x: not BYTE_VOCAB < x <= MAX_VOCAB,
           f"byte-level BPE needs more than the {BYTE_VOCAB} byte tokens and at most {MAX_VOCAB} (uint32 ids)",
           "data.vocab_size=4096, or data.tokenizer=bytes", when=_bpe, name="data.vocab_size(bpe)"),
    _at_least("data.vocab_size", 1, when=_token_files, name="data.vocab_size(ids)"),
    _real("data.val_fraction", 0, 1, lo_open=True, hi_open=True, meaning=" (the share held out for validation)"),
]
TRAIN_FIELD_RULES = [
    _field("train.tokens", lambda x: not (math.isfinite(x) and x > 0), "a token budget is a finite number > 0",
           "train.tokens=1e12, or leave it unset (null)"),
    _field("train.seed", _ints(0, SEED_MAX), "must be at least 0 (and below 2^63, torch's seed range)",
           "train.seed=1234"),
    _at_least("train.eval_interval", 0, " (0 = only at the end)"),
    _at_least("train.eval_batches", 1),
    _at_least("train.log_interval", 1),
    _at_least("train.sample_tokens", 0, " (0 = no sample)"),
    Rule("train.sample_prompt", "plan", "train.sample_prompt",
         lambda v: int(v["train.sample_tokens"] or 0) > 0 and not str(v["train.sample_prompt"] or ""),
         "the sample continues a prompt: it needs at least one character", "train.sample_prompt='ROMEO:', or "
         "train.sample_tokens=0", lambda v: v["train.sample_prompt"]),
    _at_least("train.max_restarts", 0),
    _real("train.hang_timeout_s", 0, meaning=" (seconds without step progress; 0 = off, unset = train.hang_factor x "
          "the predicted step time)", fix="train.hang_timeout_s=300, or leave it unset (null)"),
    _real("train.hang_factor", 1, lo_open=True, meaning=" (the hang window in predicted step times: a smaller one "
          "would call a normal step a hang)"),
    Rule("train.hang_timeout_s<=cluster.timeout_s/2", "plan", "train.hang_timeout_s",
         lambda v: _set(v, "train.hang_timeout_s", "cluster.timeout_s")
         and float(v["train.hang_timeout_s"]) > int(v["cluster.timeout_s"]) / 2,
         lambda v: f"is more than half of the collective timeout cluster.timeout_s={v['cluster.timeout_s']}: the "
                   "collective would time out during the watchdog's window and grace, failing the run without "
                   "naming the hung rank or dumping a stack (docs/hangs.md)",
         lambda v: f"train.hang_timeout_s={int(v['cluster.timeout_s']) // 2} (or less), or raise cluster.timeout_s "
                   f"to {2 * float(v['train.hang_timeout_s']):g} or more", lambda v: v["train.hang_timeout_s"]),
]
CHECKPOINT_FIELD_RULES = [
    _field("checkpoint.interval", lambda x: x != "auto" and _ints(0)(x),
           "must be auto (the Young–Daly interval for the cluster's failure rate) or a number of steps >= 0 "
           "(0 = only at the end)", "checkpoint.interval=auto"),
    _at_least("checkpoint.keep_last", 0, " (0 = keep every one)"),
    Rule("checkpoint.resume", "plan", "checkpoint.resume",
         lambda v: bool(v["checkpoint.enabled"]) and _resume_problem(v["checkpoint.resume"]) is not None,
         lambda v: _resume_problem(v["checkpoint.resume"]),
         "checkpoint.resume=auto (this run's newest checkpoint), never, or <run_dir>/checkpoints/step_<N> "
         "(`usp status <run_dir>` lists them)", lambda v: v["checkpoint.resume"]),
]
LOGGING_FIELD_RULES = [_real("logging.wandb_init_timeout_s", 0, lo_open=True)]


def _torchft(v: Values) -> bool:
    return str(v["fault_tolerance.kind"]) == "torchft"


def _ft_wait(v: Values) -> float:
    return torchft_wait_s(*(float(v[f"fault_tolerance.{k}"] or 0) for k in ("timeout_s", "join_timeout_s",
                                                                             "heartbeat_timeout_s")))


FT_FIELD_RULES = [
    _at_least("fault_tolerance.min_replicas", 1, fix="fault_tolerance.min_replicas=1", when=_torchft),
    *(_at_least(f"fault_tolerance.{k}", 1, " (seconds)", when=_torchft)
      for k in ("timeout_s", "quorum_timeout_s", "start_timeout_s")),
    _real("fault_tolerance.heartbeat_timeout_s", 0, lo_open=True, when=_torchft),
    _real("fault_tolerance.join_timeout_s", 0, when=_torchft),
    _at_least("fault_tolerance.max_group_restarts", 0, when=_torchft),
    Rule("train.hang_timeout_s>torchft_wait", "plan", "train.hang_timeout_s",
         lambda v: _torchft(v) and _set(v, "train.hang_timeout_s")
         and 0 < float(v["train.hang_timeout_s"]) <= _ft_wait(v),
         lambda v: f"is no longer than a live replica group may wait for a stopped one before it trains on without "
                   f"it ({_ft_wait(v):g} s: fault_tolerance.timeout_s + join_timeout_s + heartbeat_timeout_s): the "
                   "watchdog would call the live groups hung too (docs/hangs.md#under-torchft)",
         lambda v: f"train.hang_timeout_s={2 * _ft_wait(v):g} (or more), or lower fault_tolerance.timeout_s",
         lambda v: v["train.hang_timeout_s"]),
    _field("fault_tolerance.lighthouse_port", _ints(0, 65535), "not a TCP port (0 = a free one)",
           "fault_tolerance.lighthouse_port=0", when=_torchft),
]


def _enum_rules() -> list[Rule]:
    """A rule per Enum-typed schema key: omegaconf already refuses other values when it composes, so
    these speak for a plain dict, e.g. the engine's plan.yaml (usp.engine.worker checks it again)."""
    return [_one_of(key, [m.value for m in kind], "value") for key, kind in enum_keys().items()]


FIELD_RULES: list[Rule] = [*MODEL_FIELD_RULES, *PARALLEL_FIELD_RULES, *CLUSTER_FIELD_RULES, *SLURM_FIELD_RULES,
                           *DATA_FIELD_RULES, *TRAIN_FIELD_RULES, *CHECKPOINT_FIELD_RULES, *LOGGING_FIELD_RULES,
                           *FT_FIELD_RULES, *_enum_rules()]


def field_failures(cfg) -> list[PlanError]:
    """Every field rule a composed config (a DictConfig, a UspConfig, or a plain dict with some of its
    keys) fails, in table order. Read as plain values: a DictConfig's attribute access costs 3x the
    conversion."""
    if is_dataclass(cfg):
        cfg = plain(cfg)
    elif not isinstance(cfg, dict) and hasattr(cfg, "_metadata"):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return failures(cast(Subject, Values(cfg)), ("plan",), FIELD_RULES)


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


# --- every schema field: its rule, the check that owns it elsewhere, or why any value is fine ---------------
# tests/unit/test_field_rules.py walks the schema (usp.config.schema.schema_keys) and fails on a field that
# is in none of: a rule's key (FIELD_RULES, RULES; an Enum's rule is made from its type), a bool (omegaconf
# refuses anything else), CHECKED_ELSEWHERE, FREE_FIELDS.

# key -> the function that refuses its bad values (raising a UspError naming the key) before launch, where the
# value needs more than itself: the world size, the data on disk, a tokenizer, the run directory.
CHECKED_ELSEWHERE = {
    "model.name": "usp.plan.validate.check_run",  # one directory name (the run's, unless train.name)
    "model.init_from": "usp.plan.hf_config.read_hf_config",  # a Hugging Face directory matching the model group
    **{f"parallelism.{d}": "usp.contract.dims.ParallelDims" for d in ("dp", "dp_replicate", "dp_shard", "pp", "cp")},
    "data.paths": "usp.data.tokenized.dataset_dir",  # the files exist (usp plan: a warning when not on this machine)
    "data.blend[].paths": "usp.data.tokenized.dataset_dir",
    "data.train_bin": "usp.data.tokenized.dataset_dir",
    "data.val_bin": "usp.data.tokenized.dataset_dir",
    "data.tokenizer_path": "usp.data.tokenizer.pretrained_vocab_size",  # read at plan time (hf, tiktoken)
    "data.bos_token": "usp.data.tokenizer.load_pretrained",  # a token of the tokenizer's vocabulary
    "data.eos_token": "usp.data.tokenizer.load_pretrained",
    "train.name": "usp.plan.validate.check_run",
    "train.steps": "usp.plan.validate.check_run",
    "train.runs_dir": "usp.launch.pre_launch.check_run_dir",  # created and writable (usp plan --save too)
    **{f"train.{k}": "usp.plan.batch.plan_batch" for k in ("global_batch", "global_batch_tokens", "micro_batch")},
    "checkpoint.dir": "usp.launch.checkpoints.check_checkpoint_dir",  # writable, with room for keep_last + 1
    "logging.wandb": "usp.plan.validate.check_observability",  # the package is installed
    "logging.tensorboard": "usp.plan.validate.check_observability",
    "profile.steps": "usp.plan.validate.check_observability",
    "planner.profile": "usp.perf.stack_profile.get_profile",
}

# key -> why any value of its type is fine
FREE_FIELDS = {
    "cluster.name": "a label shown in the plan",
    "cluster.device_name": "a label: the hardware figures are their own keys",
    **{f"cluster.timing.calibrated.{k}": "a record of what `usp calibrate` fitted on, only reported"
       for k in ("source", "runs", "nodes", "features", "fitted", "stacks", "mfu_abs_err_p50", "mfu_abs_err_p90",
                 "rel_err_p50")},
    "cluster.slurm.srun_extra": "each entry is passed to srun as one quoted word",
    "cluster.slurm.python": "a path on the compute nodes, which usp can't see from here",
    "cluster.slurm.log_dir": "created by the job (a path on the cluster's file system)",
    "data.name": "a label; the dataset's directory name is made safe from it",
    "data.text_field": "a column name, looked up in each record file as it is read",
    "data.blend[].text_field": "a column name, looked up in each record file as it is read",
    "data.blend[].name": "a label for the source in the dataset's metadata",
    "data.cache_dir": "created when the data is prepared (usp prepare-data, usp train)",
    "train.sample_prompt": "any text (an empty one with train.sample_tokens > 0: the rule train.sample_prompt)",
    "logging.wandb_project": "W&B's own name; it says so when the run starts (offline by default)",
    "logging.wandb_entity": "W&B's own name; it says so when the run starts (offline by default)",
    "logging.wandb_tags": "free text shown in W&B",
}


def field_checks() -> dict[str, str]:
    """Every schema key -> how its values are checked: "rule <name>", "type bool", "<function>" (checked
    elsewhere) or "free: <why>"; "" for a key in none of them (tests/unit/test_field_rules.py fails on it)."""
    by_rule: dict[str, str] = {}
    for rule in [*FIELD_RULES, *RULES]:
        for key in ([rule.key] if isinstance(rule.key, str) else []) + list(rule.also):
            by_rule.setdefault(key, f"rule {rule.name}")
    out = {}
    for key, hint in schema_keys().items():
        boolean = all(t is bool for t in typing.get_args(hint) if t is not type(None)) if typing.get_args(hint) \
            else hint is bool
        out[key] = (by_rule.get(key) or ("type bool" if boolean else None) or CHECKED_ELSEWHERE.get(key)
                    or (f"free: {FREE_FIELDS[key]}" if key in FREE_FIELDS else ""))
    return out
