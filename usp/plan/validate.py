"""Whole-plan checks that are not layout rules, and the predictions: `analyse` attaches the memory
and time models' figures to the plan and raises the predicted-OOM error; `check_observability`
checks logging.* / profile.*; `check_run` the run's name and step count; `derive_batch` fills the
pipeline with micro batches.

The layout rules (model shape, degrees vs heads and layers, pipeline schedules, expert
parallelism, what the engine trains, TP across nodes) are one table, usp.plan.rules; its
docstring lists the few checks that live elsewhere and why."""
from __future__ import annotations

from types import SimpleNamespace

from usp.contract.run_plan import BatchPlan
from usp.errors import PlanError
from usp.perf.specs import GIB, Layout
from usp.plan import rules
from usp.plan.batch import plan_batch
from usp.plan.planner_inputs import PlannerContext, recipe_precision
from usp.plan.rules import Subject
from usp.run.names import check_dir_name


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


def analyse(plan, cfg, subject: Subject, *, force: bool = False, strict: bool = False,
            training: bool = True) -> None:
    """For a plan whose rules of kind "plan" hold: add the warn rules' warnings (raise the first
    under strict) and the observability checks, attach plan.memory / plan.timing, raise the
    predicted OOM (a warning under `force`). training=False: say what `usp train` would still refuse."""
    from usp.perf.goodput import plan_goodput
    from usp.perf.memory import memory_plan
    from usp.perf.timing import timing_plan

    hw, layout = subject.hw, subject.layout
    profile, prec = recipe_precision(cfg, hw.device)
    ctx = PlannerContext(subject.arch, hw, prec, plan.batch.seq_len, plan.batch.global_batch, subject.settings, profile)
    warnings = rules.warnings(subject, strict=strict)
    warnings += check_observability(cfg, training)
    plan.memory = memory_plan(ctx.arch, layout, plan.batch.seq_len, hw, ctx.prec, ctx.profile,
                              load_bytes=subject.settings.checkpoint_bytes)
    plan.timing = timing_plan(ctx.arch, layout, plan.batch.seq_len, plan.batch.global_batch, hw, ctx.prec, ctx.profile,
                              plan.memory.peak.total)  # the memory model's peak, not computed again
    plan.goodput = plan_goodput(plan, ctx.prec, cfg.cluster)
    if plan.goodput.interval_auto:  # checkpoint.interval=auto: plan.yaml (and the engine) get the number
        plan.config.checkpoint.interval = plan.goodput.interval_steps
    plan.warnings.extend(w for w in warnings if w not in plan.warnings)
    if not plan.memory.fits:
        if not force:
            raise oom_error(plan, ctx, layout)
        plan.warnings.append(f"--force: {oom_error(plan, ctx, layout, search=False)}")
    if not plan.memory.build_fits:
        if not force:
            raise build_oom_error(plan.memory, layout)
        plan.warnings.append(f"--force: {build_oom_error(plan.memory, layout)}")


def check_run(cfg, name: str) -> None:
    """The run's own values: its name is one directory name under train.runs_dir (the rule shared
    with `usp sweep --name`, usp.run.names), and it trains at least one step."""
    check_dir_name(name, key="model.name" if cfg.train.name is None else "train.name", error=PlanError,
                   fix="train.name=my_run (letters, digits, '.', '_', '-'); train.runs_dir=<dir> says where it goes")
    steps = int(cfg.train.steps)
    if steps < 1:
        raise PlanError("a run trains at least one optimizer step", key="train.steps", value=steps,
                        fix="train.steps=100 (any number >= 1)")


def check_observability(cfg, training: bool = True) -> list[str]:
    """logging.* and profile.*: raise the first PlanError; return warnings. A missing tracking
    package is an error for `usp train`, a warning for `usp plan` (it may run elsewhere).
    (logging.console and wandb_mode are Enums in the schema: omegaconf refuses other values.)"""
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


def build_oom_error(mem, layout: Layout) -> PlanError:
    """The build doesn't fit (usp.perf.memory.build_memory): where, how much, of what, and a fix."""
    st = mem.stages[mem.build_peak_stage]
    b, cap = st.build, mem.capacity_gib * GIB
    where = "every rank" if layout.pp == 1 else f"pipeline stage {st.stage}'s ranks"
    what = "the largest part of one parameter as model.init_from reads it (or a padded vocabulary's init)" \
        if b.read_buffer else (f"the largest one, {b.largest} with {b.largest_params:,} values, made whole in "
                               "fp32 while its part is cut")
    msg = (f"predicted out of memory while the model is built: {b.total / GIB:.1f} GiB on {where} before training "
           f"starts (its parameters {b.parameters / GIB:.1f} GiB; {what}, {b.transient / GIB:.1f} GiB; overhead "
           f"{b.overhead / GIB:.1f} GiB), but a {mem.device_name} has {mem.capacity_gib:g} GiB "
           "(cluster.device_memory_gb)")
    if b.total - b.parameters > cap and not b.read_buffer:  # every rank makes that whole tensor: sharding can't help
        fix = (f"a device with more than {(b.total - b.parameters) / GIB:.1f} GiB (another cluster group, or "
               "cluster.device_memory_gb if yours has more); --force plans it anyway")
    else:
        fix = ("shard the parameters over more ranks: a larger parallelism.dp_shard (FSDP), tp or pp (`usp plan "
               "--search` lists layouts that fit), or devices with more memory; --force plans it anyway")
    return PlanError(msg, key="parallelism", value=layout.label(), fix=fix)


def _fitting_fix(ctx: PlannerContext) -> str:
    from usp.plan.search import search

    found = search(ctx.arch, ctx.hw, ctx.prec, ctx.seq_len, ctx.global_batch, top_k=1, settings=ctx.settings,
                   profile=ctx.profile).best
    if found is None:
        return (f"no layout fits {ctx.hw.world} device(s) of {ctx.hw.memory_gib:g} GiB at this global batch: add "
                "devices (`usp estimate` sizes it) or shorten train.seq_len; --force plans it anyway")
    return (f"a layout that fits: {' '.join(found.layout.overrides())} (predicted {found.peak_gib:.1f} GiB, "
            f"{found.tokens_per_s_per_device:,.0f} tokens/s/device; `usp plan --search` ranks more); "
            "or --force to plan it anyway")
