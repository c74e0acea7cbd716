"""The pipeline schedule as a timeline: when each pp rank runs each micro batch's forward and backward,
and where it waits, for `usp plan --html` and `usp ui` (usp/view/). Simulated from what the plan records
(the schedule, the stages each pp rank holds, the micro batches per step, one micro batch's time on the
busiest pp rank), every stage taking that rank's time: a forward is a third of a micro batch's compute and
its backward the rest (recomputation included). The schedules as ordering rules: afab runs every forward
before any backward; the 1F1B family runs a backward as soon as one is ready, and lets a rank start a
forward only while fewer than its warm-up count are in flight (Megatron's counts: pp - rank - 1 plain,
2 (pp - rank - 1) + (v - 1) pp interleaved). The zero-bubble schedules are drawn as interleaved 1F1B over
their stages: their split backward (weight gradients moved into the bubble) is not drawn; zbv's V-shaped
order (a rank holds the first stage and the last) is torch's own and not drawn."""
from __future__ import annotations

from dataclasses import dataclass

INTERLEAVED = ("interleaved_1f1b", "interleaved_zb")
MAX_SLOTS = 8_000  # a timeline past this is not drawn (the page says so)


@dataclass(frozen=True)
class Slot:
    rank: int  # pp rank
    stage: int
    micro: int  # micro batch
    kind: str  # forward | backward
    start: float  # seconds from the step's start
    end: float


def stage_times(micro_batch_s: float, recompute_s: float, stages_per_rank: int) -> tuple[float, float]:
    """(forward, backward) seconds of one stage and micro batch: the busiest rank's micro batch split over
    its stages, the backward twice the forward plus the recomputed forward."""
    per_stage = micro_batch_s / stages_per_rank
    recompute = recompute_s / stages_per_rank
    forward = (per_stage - recompute) / 3
    return forward, per_stage - forward


def timeline(schedule: str, rank_stages: list[list[int]], n_micro: int, forward_s: float,
             backward_s: float) -> list[Slot]:
    """Every forward and backward of one step, in the order the schedule runs them (see the module's
    docstring); ranks wait for the stage before (forward) or after (backward) on the same micro batch.
    Micro batches that are no multiple of pp take the warm-up nearest Megatron's that runs. ValueError:
    zbv, a step too long to draw (MAX_SLOTS), or an order that never finishes."""
    if schedule == "zbv":
        raise ValueError("zbv's V-shaped order is torch's own (torch.distributed.pipelining)")
    n_slots = 2 * n_micro * sum(len(stages) for stages in rank_stages)
    if n_slots > MAX_SLOTS:
        raise ValueError(f"{n_slots} forwards and backwards per step: too many to draw (at most {MAX_SLOTS})")
    pp = len(rank_stages)
    reach = pp * max(len(s) for s in rank_stages)
    for extra in sorted(range(-reach, reach + 1), key=abs):
        orders = [rank_order(schedule, pp, r, stages, n_micro, extra) for r, stages in enumerate(rank_stages)]
        slots = _simulate(orders, backward_s, forward_s)
        if slots is not None:
            return slots
    raise ValueError(f"the {schedule} schedule's order never finishes with {n_micro} micro batches")


def _simulate(orders: list[list[tuple[str, int, int]]], backward_s: float, forward_s: float) -> list[Slot] | None:
    """Each rank runs its order, an action once its inputs are there; None when the ranks wait on each other."""
    pp, n_stages = len(orders), 1 + max(stage for order in orders for _, stage, _ in order)
    done: dict[tuple[str, int, int], float] = {}
    free, left = [0.0] * pp, [len(order) for order in orders]
    slots: list[Slot] = []
    while any(left):
        now = min(free[r] for r in range(pp) if left[r])
        waiting = [r for r in range(pp) if left[r] and free[r] == now]
        acted = False
        for rank in waiting:
            kind, stage, micro = orders[rank][len(orders[rank]) - left[rank]]
            if _ready(kind, stage, micro, n_stages, done, now):
                end = now + (forward_s if kind == "forward" else backward_s)
                done[(kind, stage, micro)] = end
                slots.append(Slot(rank, stage, micro, kind, now, end))
                free[rank], left[rank], acted = end, left[rank] - 1, True
        if not acted:  # nobody can run at `now`: they wait for the next finish or rank
            events = [t for t in [*done.values(), *(free[r] for r in range(pp) if left[r])] if t > now]
            if not events:
                return None
            for rank in waiting:
                free[rank] = min(events)
    return slots


def rank_order(schedule: str, pp: int, rank: int, stages: list[int], n_micro: int,
               extra: int = 0) -> list[tuple[str, int, int]]:
    """One pp rank's forwards and backwards in the order it runs them: afab, every forward then every
    backward; the 1F1B family, its warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards (micro batches in groups of pp, each group through the rank's stages in turn)."""
    chunk = {s: i for i, s in enumerate(stages)}
    forwards = sorted(((s, m) for s in stages for m in range(n_micro)),
                      key=lambda sm: (sm[1] // pp, chunk[sm[0]], sm[1]))
    backwards = sorted(((s, m) for s in stages for m in range(n_micro)),
                       key=lambda sm: (sm[1] // pp, -chunk[sm[0]], sm[1]))
    fw = [("forward", s, m) for s, m in forwards]
    bw = [("backward", s, m) for s, m in backwards]
    if schedule == "afab":
        return fw + bw
    interleaved = schedule in INTERLEAVED and len(stages) > 1
    warmup = max(0, extra + (2 * (pp - rank - 1) + (len(stages) - 1) * pp if interleaved else pp - rank - 1))
    warmup = min(warmup, len(fw))
    steady = [a for pair in zip(fw[warmup:], bw) for a in pair]
    return fw[:warmup] + steady + bw[len(fw) - warmup:]


def _ready(kind: str, stage: int, micro: int, n_stages: int, done: dict, now: float) -> bool:
    """A forward needs the stage before's on the same micro batch; a backward, its own forward and the stage
    after's backward; each finished by `now`."""
    def ran(kind: str, s: int) -> bool:
        return done.get((kind, s, micro), now + 1) <= now

    if kind == "forward":
        return stage == 0 or ran("forward", stage - 1)
    return ran("forward", stage) and (stage == n_stages - 1 or ran("backward", stage + 1))
