"""The planner's pipeline-schedule rule (usp/perf/pipeline_split.py validate_schedule) against torch:
torch.distributed.pipelining's schedule classes work out every rank's whole action order when they
are built, and refuse what they can't run, so building one per rank for stages placed as usp places
them (stage_ranks) tells exactly what torch accepts. No process group is needed for that."""
from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import schedules

from usp.errors import PlanError
from usp.perf.pipeline_split import SCHEDULES, stage_ranks, validate_schedule

TORCH_CLASSES = {"afab": schedules.ScheduleGPipe, "1f1b": schedules.Schedule1F1B,
                 "interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
                 "interleaved_zb": schedules.ScheduleInterleavedZeroBubble, "zbv": schedules.ScheduleZBVZeroBubble}


def torch_builds(schedule: str, pp: int, virtual: int, n_microbatches: int) -> bool:
    """Whether torch builds `schedule` on every pp rank, each holding the stages usp gives it."""
    n_stages = pp * virtual
    try:
        placement = stage_ranks(pp, virtual, schedule)
    except PlanError:  # zbv's V needs exactly 2 stages per rank, as torch's ScheduleZBVZeroBubble does
        return False
    for rank, held in enumerate(placement):
        stages = [SimpleNamespace(stage_index=i, num_stages=n_stages, group_size=pp, group_rank=rank, is_first=i == 0,
                                  is_last=i == n_stages - 1, submod=torch.nn.Identity()) for i in held]
        try:
            if issubclass(TORCH_CLASSES[schedule], schedules.PipelineScheduleSingle):
                if len(stages) != 1:
                    return False
                TORCH_CLASSES[schedule](stages[0], n_microbatches)
            else:
                TORCH_CLASSES[schedule](stages, n_microbatches)
        except (ValueError, RuntimeError, AssertionError):
            return False
    return True


def usp_accepts(schedule: str, pp: int, virtual: int, n_microbatches: int) -> bool:
    try:
        validate_schedule(schedule, pp, virtual, n_microbatches)
    except PlanError:
        return False
    return True


def test_the_rule_accepts_exactly_what_torch_builds():
    """Every schedule x pp 2..4 x 1..3 stages per rank x 1..12 micro batches. One deliberate difference:
    torch runs an interleaved schedule with one stage per rank (a plain 1F1B); usp refuses it and names
    the schedule that says so (parallelism.pp_schedule=1f1b) or the stages it needs."""
    assert set(TORCH_CLASSES) == set(SCHEDULES)
    logging.disable(logging.WARNING)  # torch logs each schedule it builds
    try:
        differ, accepted = [], 0
        for schedule, pp, virtual, n in itertools.product(SCHEDULES, (2, 3, 4), (1, 2, 3), range(1, 13)):
            ours, theirs = usp_accepts(schedule, pp, virtual, n), torch_builds(schedule, pp, virtual, n)
            accepted += ours
            if ours != theirs and not (schedule.startswith("interleaved") and virtual == 1 and theirs):
                differ.append((schedule, pp, virtual, n, ours, theirs))
    finally:
        logging.disable(logging.NOTSET)
    assert differ == []
    assert accepted > 100  # the grid holds many valid combinations, not only refusals


@pytest.mark.parametrize("schedule,pp,virtual,n_mb", [
    ("afab", 4, 1, 1), ("1f1b", 4, 1, 4), ("1f1b", 2, 1, 7),
    ("interleaved_1f1b", 2, 2, 1), ("interleaved_1f1b", 4, 2, 3), ("interleaved_1f1b", 4, 2, 6),
    ("interleaved_1f1b", 4, 2, 8), ("interleaved_zb", 2, 3, 4), ("zbv", 2, 2, 1), ("zbv", 2, 2, 5),
])
def test_valid_schedules_build_in_torch(schedule, pp, virtual, n_mb):
    assert usp_accepts(schedule, pp, virtual, n_mb) and torch_builds(schedule, pp, virtual, n_mb)
