"""`usp estimate`: how many devices and hours a token budget (train.tokens) takes, planned at the size
it quotes.

A deadline (--hours): the layout search runs at 1, 2, 4, ... nodes (from the least the peak FLOP/s
could do it with) until a node count meets the deadline; then at the exact count the throughput
there says is needed and the counts between the two powers of two (eighths of the octave), and the
smallest that meets the deadline is quoted. A device count (--gpus): the search runs there. Either
way the quoted count's layout is one `usp plan` accepts (usp/plan/sizing.py), and the global batch
stays the config's (train.global_batch_tokens, or train.global_batch sequences), as a real run
fixes it whatever the device count.

    hours = tokens / (tokens/s of the best layout at that size) / goodput / 3600
    MFU   = FLOPs/token x tokens/s / (devices x peak)            FLOPs/token = 6·N + 12·L·h·s

goodput: the share of the wall time that trains at that size, its failures, checkpoints and restarts
counted (usp/perf/goodput.py); the estimate says how many failures the hours hold.

--mfu turns the search off: the devices (or hours) follow from the given MFU alone."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from usp.errors import PlanError
from usp.plan.sizing import Sized, sized_at

MFU_CEILING = 0.75  # no layout trains faster: the search starts at the node count this MFU would need
OCTAVE_STEPS = 8  # node counts tried between two powers of two: 9/8, 10/8, ... of the lower one


@dataclass
class Estimate:
    model: str
    params: int
    seq_len: int
    global_batch: int  # sequences per step, at every size (the config's)
    flops_per_token: float
    tokens: float | None
    total_flops: float | None
    device_name: str
    peak_tflops: float
    procs_per_node: int
    mfu: float
    mfu_source: str
    devices: int | None = None
    nodes: int | None = None
    hours: float | None = None
    tokens_per_s: float | None = None
    layout: str | None = None  # the planned layout at the quoted size
    overrides: list[str] = field(default_factory=list)  # what reproduces it: usp plan <config> <overrides>
    price_per_device_hour: float = 0.0
    cost: float | None = None
    tried: list[tuple[int, float | None]] = field(default_factory=list)  # (nodes, hours; None: nothing fits)
    goodput: float | None = None  # training time / wall time at the quoted size (usp/perf/goodput.py)
    failures: float | None = None  # expected failures over the hours
    failures_per_day: float | None = None
    notes: list[str] = field(default_factory=list)


def estimate(cfg, choices: dict | None = None, *, hours: float | None = None, gpus: int | None = None,
             mfu: float | None = None, plan=None, progress: Callable[[str], None] | None = None):
    """Returns (estimate, the run plan of the configured layout with memory and timing)."""
    from usp.plan.plan import build_plan
    from usp.plan.planner_inputs import planner_context

    _check_options(hours, gpus, mfu)
    plan = plan or build_plan(cfg, choices, force=True, training=False)
    ctx = planner_context(cfg, plan.model.vocab_size)
    tokens = float(cfg.train.tokens) if cfg.train.tokens is not None else None
    est = _base(plan, ctx, tokens, cfg)
    if tokens is None:
        if hours is not None or gpus is not None:
            raise PlanError("--hours / --gpus need a token budget", key="train.tokens", value=None,
                            fix="train.tokens=15e12 (tokens to train on)")
        est.mfu, est.mfu_source = plan.timing.mfu, "predicted for the configured layout"
        return est, plan
    if mfu is not None:
        return _given_mfu(est, ctx.hw, hours, gpus, mfu), plan
    if gpus is not None:
        nodes = _nodes_of(gpus, ctx.hw.procs_per_node)
        at = _sized(ctx, cfg, choices, nodes, est, progress)
        if at is None:
            raise _nothing_fits(est, nodes, ctx.hw.procs_per_node)
    elif hours is not None:
        at = _smallest_meeting(ctx, cfg, choices, hours, est, progress)
    else:
        at = _configured(plan, ctx, cfg, choices, est, progress)
    _quote(est, at, ctx.hw.price_per_device_hour)
    return est, plan


def _check_options(hours: float | None, gpus: int | None, mfu: float | None) -> None:
    if hours is not None and gpus is not None:
        raise PlanError("give either --hours (to get devices) or --gpus (to get hours), not both",
                        key="--hours", value=hours, fix="drop one of --hours / --gpus")
    for name, value in (("--hours", hours), ("--gpus", gpus), ("--mfu", mfu)):
        if value is not None and value <= 0:
            raise PlanError("must be positive", key=name, value=value, fix=f"{name} <a positive number>")
    if mfu is not None and mfu > 1:
        raise PlanError("MFU is a fraction of peak (0-1)", key="--mfu", value=mfu, fix="--mfu 0.4")


def _base(plan, ctx, tokens: float | None, cfg) -> Estimate:
    fpt = plan.timing.model_flops_per_token
    hw = ctx.hw
    return Estimate(model=plan.model.name, params=plan.model.params, seq_len=plan.batch.seq_len,
                    global_batch=ctx.global_batch, flops_per_token=fpt, tokens=tokens,
                    total_flops=fpt * tokens if tokens else None, device_name=hw.device_name,
                    peak_tflops=hw.peak_flops(ctx.prec) / 1e12, procs_per_node=hw.procs_per_node, mfu=0.0,
                    mfu_source="", price_per_device_hour=hw.price_per_device_hour)


def _nodes_of(gpus: int, per_node: int) -> int:
    if gpus % per_node:
        raise PlanError(f"is not a whole number of nodes of {per_node} devices", key="--gpus", value=gpus,
                        fix=f"--gpus {max(1, gpus // per_node) * per_node} or {(gpus // per_node + 1) * per_node}")
    return gpus // per_node


def _sized(ctx, cfg, choices, nodes: int, est: Estimate, progress) -> Sized | None:
    """One node count searched, and the attempt noted in est.tried."""
    if progress is not None:
        progress(f"searching layouts on {nodes:,} node(s) ({nodes * ctx.hw.procs_per_node:,} devices)")
    at = sized_at(ctx, cfg, choices, nodes)
    est.tried.append((nodes, None if at is None else _hours(est, at.tokens_per_s, at.plan)))
    return at


def _smallest_meeting(ctx, cfg, choices, hours: float, est: Estimate, progress) -> Sized:
    """The fewest nodes whose best layout trains the budget within `hours` (module docstring)."""
    per_node = ctx.hw.procs_per_node
    rate = est.peak_tflops * 1e12 * MFU_CEILING / est.flops_per_token  # tokens/s per device, at best
    least = max(1, math.ceil(float(est.tokens or 0) / (hours * 3600 * rate) / per_node))
    low, nodes, best = 0, 2 ** max(0, math.floor(math.log2(least))), None
    while True:
        at = _sized(ctx, cfg, choices, nodes, est, progress)
        if at is not None and _hours(est, at.tokens_per_s, at.plan) <= hours:
            break
        if at is None and best is not None or nodes >= MAX_NODES:  # past the size the batch splits over
            raise _too_slow(est, hours, best)
        best = at if at is not None and (best is None or at.tokens_per_s > best.tokens_per_s) else best
        low, nodes = nodes, nodes * 2
    met = at
    rate = float(est.tokens or 0) / (_hours(est, met.tokens_per_s, met.plan) * 3600) / met.devices  # failures counted
    exact = math.ceil(float(est.tokens or 0) / (hours * 3600 * rate) / per_node)
    between = sorted({n for n in [exact, *_octave(low)] if low < n < met.nodes and n >= exact})
    for n in between:
        at = _sized(ctx, cfg, choices, n, est, progress)
        if at is not None and _hours(est, at.tokens_per_s, at.plan) <= hours:
            return at
    return met


MAX_NODES = 2 ** 16  # 524,288 devices of 8: past this the deadline is out of reach


def _octave(low: int) -> list[int]:
    """Node counts between low and 2 x low: low x 9/8, 10/8, ... (whole numbers)."""
    return [low * k // OCTAVE_STEPS for k in range(OCTAVE_STEPS + 1, 2 * OCTAVE_STEPS)
            if low * k % OCTAVE_STEPS == 0] if low else []


def _configured(plan, ctx, cfg, choices, est: Estimate, progress) -> Sized | None:
    """No --hours / --gpus: the configured cluster, with its own layout if it fits there."""
    if plan.memory.fits:
        est.mfu, est.mfu_source = plan.timing.mfu, "predicted for the configured layout"
        est.nodes, est.devices = ctx.hw.nodes, ctx.hw.world
        est.tokens_per_s = plan.timing.tokens_per_s
        est.hours = _hours(est, est.tokens_per_s, plan)
        _count_failures(est, plan)
        return None
    est.notes.append("the configured layout does not fit; quoted: the best layout on the configured nodes")
    at = _sized(ctx, cfg, choices, ctx.hw.nodes, est, progress)
    if at is None:
        raise _nothing_fits(est, ctx.hw.nodes, ctx.hw.procs_per_node)
    return at


def _hours(est: Estimate, tokens_per_s: float, plan) -> float:
    """Wall hours for the token budget at this throughput, the plan's failures counted."""
    return float(est.tokens or 0) / tokens_per_s / plan.goodput.expected / 3600


def _count_failures(est: Estimate, plan) -> None:
    gp = plan.goodput
    est.goodput, est.failures_per_day = gp.expected, gp.failures_per_day
    est.failures = float(est.hours or 0.0) * 3600 / gp.job_mtbf_s


def _quote(est: Estimate, at: Sized | None, price: float) -> None:
    if at is not None:
        est.nodes, est.devices, est.tokens_per_s = at.nodes, at.devices, at.tokens_per_s
        est.hours, est.mfu = _hours(est, at.tokens_per_s, at.plan), at.mfu
        _count_failures(est, at.plan)
        est.mfu_source = f"predicted for the best layout on {at.devices:,} devices"
        est.layout, est.overrides = at.candidate.describe(), at.overrides
    if price > 0 and est.devices and est.hours is not None:
        est.cost = est.devices * est.hours * price


def _given_mfu(est: Estimate, hw, hours: float | None, gpus: int | None, mfu: float) -> Estimate:
    """The calculator: devices (or hours) from an MFU the user gives, no layout planned."""
    est.mfu, est.mfu_source = mfu, "given (--mfu)"
    rate = est.peak_tflops * 1e12 * mfu
    total = float(est.total_flops or 0.0)
    if hours is not None:
        need = total / (hours * 3600 * rate)
        est.nodes = max(1, math.ceil(need / hw.procs_per_node - 1e-9))
        est.devices = est.nodes * hw.procs_per_node
        est.notes.append(f"{need:,.0f} devices needed exactly; rounded up to {est.nodes} node(s) of "
                         f"{hw.procs_per_node}")
    else:
        est.devices = gpus or hw.world
        est.nodes = math.ceil(est.devices / hw.procs_per_node)
    est.hours = total / (est.devices * rate) / 3600
    est.notes.append("--mfu: no layout planned at that size (leave --mfu out to search one), and no failures "
                     "counted: every hour trains")
    if hw.price_per_device_hour > 0:
        est.cost = est.devices * est.hours * hw.price_per_device_hour
    return est


def _nothing_fits(est: Estimate, nodes: int, per_node: int) -> PlanError:
    return PlanError(f"no layout of {est.model} fits on {nodes * per_node:,} devices at a global batch of "
                     f"{est.global_batch:,} sequences x {est.seq_len:,} tokens (or `usp plan` refuses every one "
                     "the search found)", key="--gpus", value=nodes * per_node,
                     fix="more devices (--gpus), a global batch that splits over them (train.global_batch_tokens), "
                         "or usp plan --search at that size for the reasons")


def _too_slow(est: Estimate, hours: float, at: Sized | None) -> PlanError:
    best = (f"; the best at {at.devices:,} devices takes {_hours(est, at.tokens_per_s, at.plan):,.0f} h"
            if at is not None else "")
    return PlanError(f"no node count up to {MAX_NODES:,} trains {est.tokens:.3g} tokens within {hours:g} hours at "
                     f"a global batch of {est.global_batch:,} sequences{best}", key="--hours", value=hours,
                     fix="a later deadline, fewer tokens (train.tokens), or a larger global batch "
                         "(train.global_batch_tokens) so that more devices help")
