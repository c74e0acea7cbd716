"""Layout search: enumerate the parallel layouts of a model on a cluster, drop those that break a
rule or do not fit in memory, rank the rest by predicted throughput (usp.perf.timing).

Searched: tp (divisors of the GPUs per node), pp (with 1f1b, interleaved_1f1b v=2 and zbv), cp
(cp <= 8),
the data-parallel rest split into dp_replicate x dp_shard (DDP or ZeRO-1 when nothing is sharded;
FSDP ZeRO-3 or ZeRO-2, HSDP when both > 1), ep for MoE models, recompute none / full, and every
micro batch that divides the per-rank batch. Fixed: the model, seq_len, the global batch and the
cluster (every device is used). Selective recompute is not searched: with SDPA the model gives it
the memory and FLOPs of `none`. Kept: the layouts no rule of kind "plan" or "engine" refuses
(usp.plan.rules, the table `usp train` asks): so tp divides the heads,
seq_len divisible by 2·cp, and for MoE models only the layouts this engine trains.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from itertools import product

from usp.contract.decide import NO_COMPILE_SCHEDULES
from usp.contract.predictions import TimingPlan
from usp.errors import PlanError
from usp.perf.memory import build_peak, peak_bytes
from usp.perf.specs import GIB, Arch, Hardware, Layout, Precision
from usp.perf.stack_profile import PROFILES, Profile
from usp.perf.timing import timing_plan
from usp.plan import rules
from usp.plan.planner_inputs import config_field_failures, planner_context
from usp.plan.rules import BATCH_ONLY, BATCH_RULE_FIELDS, LAYOUT_ONLY, Settings, Subject, divisors

MAX_CP = 8
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2))
MICRO_BATCHES_TIMED = 3  # the largest fitting micro batches whose time is predicted, per layout
KINDS = ("plan", "engine")  # the search proposes only what `usp train` runs


@dataclass
class Candidate:
    layout: Layout
    peak_gib: float
    peak_stage: int
    max_micro_batch: int  # the largest micro batch that fits with this layout's other choices
    timing: TimingPlan

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.timing.tokens_per_s_per_device

    def describe(self) -> str:
        lay = self.layout
        sched = f", {lay.pp_schedule}" + (f" v={lay.pp_virtual_stages}" if lay.pp_virtual_stages > 1 else "") \
            if lay.pp > 1 else ""
        return f"{lay.label()} ({lay.dp_label()}{sched}, micro {lay.micro_batch}, recompute {lay.recompute})"


@dataclass
class SearchResult:
    model: str
    world: int
    seq_len: int
    global_batch: int
    capacity_gib: float
    top: list[Candidate]
    evaluated: int  # layouts whose memory was predicted
    fitting: int  # layouts (with their best micro batch) that fit
    seconds: float
    pure_dp: Candidate | None = None  # the best layout with tp = pp = cp = 1, for comparison
    other_shape: Candidate | None = None  # the best layout with another tp / pp / schedule
    plain_ddp: Candidate | None = None  # the best plain DDP layout (the naive choice), if one fits
    pure_dp_peak_gib: float | None = None  # its smallest predicted peak when none fits
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        return self.top[0] if self.top else None


def _flavours(dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int):
    """(zero1, reshard_after_forward) choices that differ for this split."""
    if dp_shard * cp > 1:
        return [(False, True), (False, False)]  # ZeRO-3, ZeRO-2 (FSDP2 / HSDP)
    if dp_replicate > 1 and tp == 1 and pp == 1:
        return [(False, True), (True, True)]  # DDP, ZeRO-1
    return [(False, True)]


def _grid(arch: Arch, hw: Hardware, seq_len: int, global_batch: int, recomputes):
    """The searched space (module docstring), before the rules: (layout without micro batch, per-rank batch)."""
    world = hw.world
    for tp in divisors(min(hw.procs_per_node, world)):
        for pp in divisors(world // tp):
            schedules = [("1f1b", 1)] if pp == 1 else SCHEDULES
            for cp in (c for c in divisors(world // (tp * pp)) if c <= MAX_CP):
                rest = world // (tp * pp * cp)
                if global_batch % rest:
                    continue
                for dp_shard in divisors(rest):
                    dp_rep = rest // dp_shard
                    for (sched, v), (zero1, reshard), ep, rc in product(
                            schedules, _flavours(dp_rep, dp_shard, cp, tp, pp),
                            divisors(arch.n_experts) if arch.moe else [1], recomputes):
                        yield Layout(pp=pp, dp_replicate=dp_rep, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep,
                                     zero1=zero1, reshard_after_forward=reshard, pp_schedule=sched,
                                     pp_virtual_stages=v, recompute=rc), global_batch // rest


def enumerate_layouts(arch: Arch, hw: Hardware, seq_len: int, global_batch: int, recomputes=("none", "full"),
                      settings: Settings | None = None):
    """Every (layout without micro batch, per-rank batch) of the searched space that no rule of kind
    "plan" or "engine" refuses (usp.plan.rules; the rules on the micro batch are asked per micro batch)."""
    settings = settings or Settings(seq_len=seq_len)
    for layout, local in _grid(arch, hw, seq_len, global_batch, recomputes):
        if rules.first_failure(Subject(arch, layout, hw, settings), KINDS, LAYOUT_ONLY) is None:
            yield layout, local


def _micro_batches(arch: Arch, hw: Hardware, settings: Settings, base: Layout, local: int,
                   memo: dict | None = None) -> list[int]:
    """The micro batches (dividing the per-rank batch) the rules on micro batches allow; memo: a dict
    shared by one search, keyed by what those rules read (rules.BATCH_RULE_FIELDS)."""
    key = (local, *(getattr(base, f) for f in BATCH_RULE_FIELDS))
    if memo is not None and key in memo:
        return memo[key]
    out = []
    for b in divisors(local):
        lay = replace(base, micro_batch=b, grad_accum=local // b)
        if rules.first_failure(Subject(arch, lay, hw, settings), KINDS, BATCH_ONLY) is None:
            out.append(b)
    if memo is not None:
        memo[key] = out
    return out


def _layout_precision(prec: Precision, layout: Layout) -> Precision:
    """The precision a layout runs at: a compiled recipe runs eager under a zero-bubble pipeline
    schedule (usp.contract.decide.uses_compile; train.compile=true is refused there by a rule)."""
    if prec.compiled and layout.pp > 1 and layout.pp_schedule in NO_COMPILE_SCHEDULES:
        return replace(prec, compiled=False)
    return prec


def search(arch: Arch, hw: Hardware, base_prec: Precision, seq_len: int, global_batch: int, top_k: int = 5,
           recomputes=("none", "full"), settings: Settings | None = None,
           profile: Profile = PROFILES["usp"]) -> SearchResult:
    """The top_k layouts by predicted throughput; settings: the config values some rules read
    (default: Settings(seq_len): any launcher, auto dtype, no DDP hook); profile:
    whose recipe's memory decides what fits (usp.perf.stack_profile)."""
    start = time.perf_counter()
    cap = hw.memory_gib * GIB
    fitting: list[Candidate] = []
    evaluated = 0
    pure_dp_min = None
    settings = settings or Settings(seq_len=seq_len)
    micro_memo: dict = {}
    for base, local in enumerate_layouts(arch, hw, seq_len, global_batch, recomputes, settings):
        micro = _micro_batches(arch, hw, settings, base, local, micro_memo)
        prec = _layout_precision(base_prec, base)
        if not micro or build_peak(arch, base, hw, settings.checkpoint_bytes).total > cap:  # the build must fit too
            continue
        # memory grows with the micro batch: bisect for the largest that fits
        lo, hi, best_i = 0, len(micro) - 1, -1
        peaks = {}
        while lo <= hi:
            mid = (lo + hi) // 2
            lay = replace(base, micro_batch=micro[mid], grad_accum=local // micro[mid])
            peaks[mid] = peak_bytes(arch, lay, seq_len, hw, prec, profile)
            evaluated += 1
            if peaks[mid][0] <= cap:
                best_i, lo = mid, mid + 1
            else:
                hi = mid - 1
        is_pure_dp = base.tp == base.pp == base.cp == 1
        if best_i < 0:
            if is_pure_dp:
                smallest = min(p[0] for p in peaks.values()) / GIB
                pure_dp_min = smallest if pure_dp_min is None else min(pure_dp_min, smallest)
            continue
        best_here = None
        for i in range(best_i, max(-1, best_i - MICRO_BATCHES_TIMED), -1):
            lay = replace(base, micro_batch=micro[i], grad_accum=local // micro[i])
            peak, stage = peaks.get(i) or peak_bytes(arch, lay, seq_len, hw, prec, profile)
            cand = Candidate(lay, peak / GIB, stage, micro[best_i],
                             timing_plan(arch, lay, seq_len, global_batch, hw, prec, profile, peak))
            if best_here is None or cand.tokens_per_s_per_device > best_here.tokens_per_s_per_device:
                best_here = cand
        if best_here is not None:
            fitting.append(best_here)
    fitting.sort(key=_rank_key)
    pure = next((c for c in fitting if c.layout.tp == c.layout.pp == c.layout.cp == 1), None)
    top = _top(fitting, top_k)
    shape = lambda c: (c.layout.tp, c.layout.pp, c.layout.pp_schedule)  # noqa: E731
    other = next((c for c in fitting if shape(c) != shape(fitting[0])), None) if fitting else None
    ddp = next((c for c in fitting if c.layout.dp_kind == "ddp"), None)
    result = SearchResult(model=arch.name, world=hw.world, seq_len=seq_len, global_batch=global_batch,
                          capacity_gib=hw.memory_gib, top=top, evaluated=evaluated, fitting=len(fitting),
                          seconds=0.0, pure_dp=pure, pure_dp_peak_gib=None if pure else pure_dp_min,
                          other_shape=other, plain_ddp=ddp)
    result.seconds = time.perf_counter() - start
    return result


def _top(fitting: list[Candidate], top_k: int) -> list[Candidate]:
    """The first top_k of the ranked candidates; of equal predictions of equal shape, the simplest (first)."""
    top, seen = [], set()
    for c in fitting:
        key = (_rank_key(c)[0], round(c.peak_gib, 1), c.layout.tp, c.layout.pp, c.layout.pp_schedule,
               c.layout.zero_stage, c.layout.recompute)
        if key not in seen:
            seen.add(key)
            top.append(c)
        if len(top) == top_k:
            break
    return top


def _rank_key(c: Candidate) -> tuple:
    """Throughput first (to 3 significant digits); among equals the simpler layout (fewer CP, PP,
    TP ranks; no recompute; the lower ZeRO stage), then the smaller memory peak."""
    tps = float(f"{c.tokens_per_s_per_device:.3g}")
    lay = c.layout
    return (-tps, lay.cp, lay.pp, lay.tp, lay.recompute != "none", lay.zero_stage, lay.dp_shard, c.peak_gib)


def explain(result: SearchResult) -> list[str]:
    """Why the best layout wins, from the time model's terms."""
    best = result.best
    if best is None:
        return [f"no layout of {result.model} fits in {result.capacity_gib:g} GiB per device on {result.world} "
                f"device(s) at this global batch; add devices (usp estimate) or shorten train.seq_len"]
    lines = [f"best: {best.describe()}: {_terms(best.timing)}"]
    others = []
    if result.other_shape is not None:
        others.append(("the best other tp/pp/schedule", result.other_shape))
    if result.pure_dp is not None and result.pure_dp is not best:
        others.append(("the best pure data parallel", result.pure_dp))
    if result.plain_ddp is not None and result.plain_ddp not in (best, result.pure_dp):
        others.append(("plain DDP", result.plain_ddp))
    for what, other in others:
        ratio = best.tokens_per_s_per_device / other.tokens_per_s_per_device
        if ratio < 1.005:
            lines.append(f"vs {what} {other.describe()}: the same predicted throughput ({other.peak_gib:.1f} vs "
                         f"{best.peak_gib:.1f} GiB); ties go to the simpler layout")
            continue
        lines.append(f"vs {what} {other.describe()}: {ratio:.2f}x the throughput; {_terms(other.timing)}"
                     f"; {_biggest_gap(best.timing, other.timing)}")
    if result.pure_dp is None and result.pure_dp_peak_gib is not None:
        lines.append(f"pure data parallel does not fit: {result.pure_dp_peak_gib:.1f} GiB at best > "
                     f"{result.capacity_gib:g} GiB")
    return lines


def _terms(t: TimingPlan) -> str:
    return (f"step {t.step_s:.3g} s = compute {t.compute_s:.3g} + exposed TP/CP/EP/PP comm "
            f"{t.exposed_path_comm_s:.3g} + bubble {t.bubble_s:.3g} + exposed DP comm {t.exposed_dp_comm_s:.3g} "
            f"(kernel efficiency {t.efficiency:.2f}, MFU {t.mfu:.1%})")


def _biggest_gap(best: TimingPlan, other: TimingPlan) -> str:
    """Name the step-time term that costs the other layout the most, per token."""
    def per_token(t: TimingPlan) -> dict:
        n = t.tokens_per_step
        return {"compute (kernel efficiency, recompute, pipeline stage imbalance)": t.compute_s / n,
                "exposed TP/CP/EP/PP communication": t.exposed_path_comm_s / n,
                "pipeline bubble": t.bubble_s / n, "exposed data-parallel communication": t.exposed_dp_comm_s / n}
    a, b = per_token(best), per_token(other)
    name = max(a, key=lambda k: b[k] - a[k])
    return f"it loses most on {name}"


def search_config(cfg, top_k: int = 5) -> SearchResult:
    """Search for a composed config: its model, seq_len, global batch, cluster and dtype."""
    found = config_field_failures(cfg)
    if found:
        raise found[0]
    ctx = planner_context(cfg)
    if ctx.hw.world < 1:
        raise PlanError("must be at least 1", key="cluster.nodes", value=ctx.hw.nodes, fix="cluster.nodes=1")
    error = rules.config_failure(ctx.hw, ctx.settings)  # else every layout would fail it: "nothing fits"
    if error is not None:
        raise error
    return search(ctx.arch, ctx.hw, ctx.prec, ctx.seq_len, ctx.global_batch, top_k=top_k, settings=ctx.settings,
                  profile=ctx.profile)


def run_search(cfg, top_k: int = 5, console=None) -> SearchResult:
    """`usp plan --search`: print the top layouts, why the best wins, and how to use it."""
    from rich.console import Console

    from usp.plan.render import search_table

    console = console or Console()
    result = search_config(cfg, top_k)
    console.print(search_table(result))
    for line in explain(result):
        console.print(line, highlight=False, markup=False)
    if result.best is not None:
        console.print("use it: usp plan " + " ".join(result.best.layout.overrides()), highlight=False, markup=False)
    return result
