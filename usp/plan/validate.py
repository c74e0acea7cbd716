"""Planner checks that need the whole layout: pipeline schedule vs micro batches and layers,
expert parallelism, TP groups across nodes, and predicted OOM. Each failure is one PlanError
(key, value, why, fix). `analyse` also attaches the memory and time predictions to the plan.

Rules already enforced elsewhere: degrees vs world size (usp.plan.layout.resolve_degrees), heads
and KV heads % tp, seq_len % 2·cp, layers < pp (usp.plan.plan._check_model), global batch
divisibility (usp.plan.batch.plan_batch), torch's schedule rules (usp.plan.pipeline_split)."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from usp.errors import PlanError
from usp.plan.batch import BatchPlan, plan_batch
from usp.plan.specs import GIB, RECOMPUTE_MODES, Arch, Hardware, Layout, Precision, group_crosses_nodes

ONE_F_ONE_B_FAMILY = ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")


@dataclass(frozen=True)
class PlannerContext:
    arch: Arch
    hw: Hardware
    prec: Precision
    seq_len: int
    global_batch: int


def data_vocab(model, data) -> int:
    if int(model.vocab_size) > 0:
        return int(model.vocab_size)
    return 256 if data.tokenizer == "bytes" and data.source != "token_files" else int(data.vocab_size)


def planner_context(cfg, vocab: int | None = None) -> PlannerContext:
    train = cfg.train
    seq = int(train.seq_len)
    gb = int(train.global_batch_tokens) // seq if train.global_batch_tokens is not None else int(train.global_batch)
    arch = Arch.from_model(cfg.model, vocab or data_vocab(cfg.model, cfg.data))
    hw = Hardware.from_cluster(cfg.cluster)
    return PlannerContext(arch, hw, Precision.resolve(str(train.dtype), hw.device), seq, gb)


def derive_batch(train, degrees: dict, par=None) -> BatchPlan:
    """plan_batch, except that with pipeline stages and both micro_batch and grad_accum left to
    derive (-1), it picks enough micro batches to fill the pipeline (grad_accum >= pp,
    preferably a multiple of pp) instead of one big micro batch."""
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    batch = plan_batch(train, dp)
    pp = degrees["pp"]
    if pp == 1 or int(train.micro_batch) != -1 or int(train.grad_accum) != -1 or batch.grad_accum >= pp:
        return batch
    local = batch.global_batch // dp
    options = [a for a in range(pp, local + 1) if local % a == 0]
    if not options:
        return batch
    accum = next((a for a in options if a % pp == 0), options[0])
    fields = {k: getattr(train, k) for k in ("seq_len", "global_batch", "global_batch_tokens")}
    return plan_batch(SimpleNamespace(**fields, micro_batch=-1, grad_accum=accum), dp)


def check_rules(arch: Arch, layout: Layout, hw: Hardware, *, strict: bool = False) -> list[str]:
    """Raise the first PlanError; return warnings."""
    from usp.plan.memory import stage_layer_counts
    from usp.plan.pipeline_split import validate_schedule

    warnings: list[str] = []
    if layout.recompute not in RECOMPUTE_MODES:
        raise PlanError(f"unknown recompute mode; choose one of {', '.join(RECOMPUTE_MODES)}",
                        key="train.recompute", value=layout.recompute, fix="train.recompute=none")
    p, v, m = layout.pp, layout.pp_virtual_stages, layout.grad_accum
    if v < 1:
        raise PlanError("must be at least 1", key="parallelism.pp_virtual_stages", value=v,
                        fix="parallelism.pp_virtual_stages=1")
    validate_schedule(layout.pp_schedule, p, v, m)
    if p > 1 and arch.n_layers < p * v:
        raise PlanError(f"{arch.n_layers} layers can't fill pp x pp_virtual_stages = {p} x {v} = {p * v} stages "
                        "(every stage needs a layer)", key="parallelism.pp_virtual_stages", value=v,
                        fix=f"parallelism.pp_virtual_stages <= {max(1, arch.n_layers // p)}, or a smaller "
                            "parallelism.pp")
    if p > 1 and layout.pp_schedule in ONE_F_ONE_B_FAMILY and m < p:
        local = layout.micro_batch * m
        fix_micro = max(1, local // p)
        raise PlanError(f"the {layout.pp_schedule} schedule needs at least as many micro batches per step "
                        f"(train.grad_accum) as pipeline stages ({p}); with {m} most of the pipeline idles",
                        key="train.grad_accum", value=m,
                        fix=f"train.micro_batch={fix_micro} (grad_accum {local // fix_micro}), a larger "
                            f"train.global_batch, or parallelism.pp_schedule=afab")
    if p > 1:
        stage_layer_counts(arch, p, layout.virtual, layout.schedule, layout.pp_layers)  # validates pp_layers
    if arch.moe:
        group = layout.data_group
        if arch.n_experts % layout.ep:
            ok = [d for d in range(1, arch.n_experts + 1) if arch.n_experts % d == 0 and group % d == 0]
            raise PlanError(f"{arch.n_experts} experts (model.n_experts) can't be split over {layout.ep} "
                            "expert-parallel ranks", key="parallelism.ep", value=layout.ep,
                            fix=f"parallelism.ep in {ok}")
        if group % layout.ep:
            ok = [d for d in range(1, arch.n_experts + 1) if arch.n_experts % d == 0 and group % d == 0]
            raise PlanError(f"expert parallelism is carved out of the data-parallel ranks: ep must divide "
                            f"dp_replicate x dp_shard x cp = {layout.dp_replicate} x {layout.dp_shard} x "
                            f"{layout.cp} = {group}", key="parallelism.ep", value=layout.ep,
                            fix=f"parallelism.ep in {ok}")
    if layout.zero1 and layout.dp_kind not in ("zero1",):
        warnings.append(f"parallelism.zero1=true has no effect with this layout ({layout.dp_label()}): ZeRO-1 "
                        "applies to plain DDP (dp_shard = cp = 1, no TP/PP)")
    if layout.tp > 1 and group_crosses_nodes(layout.degrees, hw.procs_per_node, ("tp",)):
        msg = (f"a tensor-parallel group of {layout.tp} ranks spans nodes (cluster.procs_per_node="
               f"{hw.procs_per_node}): its per-layer all-gathers / reduce-scatters would run over the "
               f"{hw.inter_node_gbps:g} GB/s inter-node link instead of {hw.intra_node_gbps:g} GB/s")
        if strict:
            ok = [t for t in range(1, hw.procs_per_node + 1) if hw.procs_per_node % t == 0]
            raise PlanError(msg, key="parallelism.tp", value=layout.tp,
                            fix=f"parallelism.tp in {ok} (a divisor of cluster.procs_per_node), or drop --strict")
        if layout.tp <= hw.procs_per_node:  # tp > procs_per_node is already warned about by the plan
            warnings.append(f"parallelism.tp={layout.tp}: {msg}")
    return warnings


def analyse(plan, cfg, *, force: bool = False, strict: bool = False, training: bool = True) -> None:
    """Check the layout, attach plan.memory / plan.timing, raise the first PlanError (predicted
    OOM only when not `force`). training=False: say what `usp train` would still refuse."""
    from usp.plan.memory import memory_plan
    from usp.plan.timing import timing_plan

    ctx = planner_context(cfg, plan.model.vocab_size)
    hw = Hardware.from_cluster(cfg.cluster)
    layout = Layout.from_config(plan.degrees, cfg.parallelism, plan.batch, str(cfg.train.recompute))
    warnings = check_rules(ctx.arch, layout, hw, strict=strict)
    warnings += check_observability(cfg, training)
    plan.memory = memory_plan(ctx.arch, layout, plan.batch.seq_len, hw, ctx.prec)
    plan.timing = timing_plan(ctx.arch, layout, plan.batch.seq_len, plan.batch.global_batch, hw, ctx.prec)
    plan.warnings.extend(w for w in warnings if w not in plan.warnings)
    if not plan.memory.fits:
        if not force:
            raise oom_error(plan, ctx, layout)
        plan.warnings.append(f"--force: {oom_error(plan, ctx, layout, search=False)}")


WANDB_MODES = ("offline", "online", "disabled")
CONSOLE_MODES = ("auto", "rich", "plain", "quiet")


def check_observability(cfg, training: bool = True) -> list[str]:
    """logging.* and profile.*: raise the first PlanError; return warnings. A missing tracking
    package is an error for `usp train`, a warning for `usp plan` (it may run elsewhere)."""
    from importlib.util import find_spec  # finds the package without importing it (wandb costs ~1 s)

    log, prof, steps = getattr(cfg, "logging", None), getattr(cfg, "profile", None), int(cfg.train.steps)
    warnings = []
    for key, package in (("logging.wandb", "wandb"), ("logging.tensorboard", "tensorboard")):
        if log is not None and bool(getattr(log, key.split(".")[1], False)) and find_spec(package) is None:
            error = PlanError(f"the {package} package is not installed", key=key, value=True,
                              fix=f"pip install {package} (or the usp[track] extra), or {key}=false")
            if training:
                raise error
            warnings.append(str(error).replace("\n  fix:", "; fix:"))
    if log is not None:
        if str(log.console) not in CONSOLE_MODES:
            raise PlanError(f"choose one of {', '.join(CONSOLE_MODES)}", key="logging.console", value=log.console,
                            fix="logging.console=auto")
        if getattr(log, "wandb_mode", None) is not None and str(log.wandb_mode) not in WANDB_MODES:
            raise PlanError(f"choose one of {', '.join(WANDB_MODES)}", key="logging.wandb_mode",
                            value=log.wandb_mode, fix="logging.wandb_mode=offline")
    if prof is None or not bool(prof.enabled):
        return warnings
    window = [int(s) for s in prof.steps]
    first, last = (window[0], window[1]) if len(window) == 2 else (0, -1)
    if not 1 <= first <= last <= steps:
        lo = min(10, max(1, steps - 2))
        hi = min(lo + 2, steps)
        raise PlanError(f"must be [first, last] optimizer steps with 1 <= first <= last <= train.steps ({steps})",
                        key="profile.steps", value=window, fix=f"profile.steps=[{lo},{hi}]")
    if last - first >= 10:
        warnings.append(f"profile.steps={window}: {last - first + 1} profiled steps make a large trace; 2-3 are "
                        "usually enough")
    return warnings


def oom_error(plan, ctx: PlannerContext, layout: Layout, search: bool = True) -> PlanError:
    """The predicted-OOM error: where, how much, the top 3 consumers, and (search=True) a layout
    that fits, found by usp.plan.search."""
    mem = plan.memory
    st = mem.peak
    ranks = f"rank {st.first_rank}" if st.n_ranks == 1 else f"ranks {st.first_rank}-{st.first_rank + st.n_ranks - 1}"
    where = "every rank" if layout.pp == 1 else f"pipeline stage {st.stage} ({ranks})"
    top = ", ".join(f"{name} {val / GIB:.1f} GiB" for name, val in st.top(3))
    msg = (f"predicted out of memory: {mem.peak_gib:.1f} GiB on {where}, but a {mem.device_name} has "
           f"{mem.capacity_gib:g} GiB (cluster.device_memory_gb); top consumers: {top}")
    fix = _fitting_fix(ctx) if search else "`usp plan --search` finds layouts that fit"
    return PlanError(msg, key="parallelism", value=layout.label(), fix=fix)


def _fitting_fix(ctx: PlannerContext) -> str:
    from usp.plan.search import search

    found = search(ctx.arch, ctx.hw, ctx.prec, ctx.seq_len, ctx.global_batch, top_k=1).best
    if found is None:
        return (f"no layout fits {ctx.hw.world} device(s) of {ctx.hw.memory_gib:g} GiB at this global batch: add "
                "devices (`usp estimate` sizes it) or shorten train.seq_len; --force plans it anyway")
    return (f"a layout that fits: {' '.join(found.layout.overrides())} (predicted {found.peak_gib:.1f} GiB, "
            f"{found.tokens_per_s_per_device:,.0f} tokens/s/device; `usp plan --search` ranks more); "
            "or --force to plan it anyway")
