"""The measured runs the catalogue's time constants are fitted on and scored against (calibration/,
sources in calibration/README.md), and their scores: the Ultra-Scale Playbook's nanotron sweep (even
rows fit, odd rows held out; its 3.57B and 80B never fitted), llm-foundry's and torchtitan's tables, the
published runs (Megatron-LM, MegaScale's Megatron baseline, Llama 3, torchtitan, NeMo). Each run is
predicted on its own catalogue cluster group with its stack's profile. Used by
tests/unit/test_calibration_time.py, scripts/fit_time_model.py and docs/planner.md's tables. Pure Python."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cache

from usp.perf.calibration.calibrate import Problem, Scored, score
from usp.perf.calibration.measured_runs import REPO, MeasuredRun, read_sweep_csv

CALIBRATION = REPO / "calibration"
PLAYBOOK = CALIBRATION / "playbook_h100" / "playbook_sweep_calibration.csv"
PLAYBOOK_OTHER_SIZES = CALIBRATION / "playbook_h100" / "playbook_sweep_heldout_models.csv"
LLMFOUNDRY = CALIBRATION / "at_scale" / "llmfoundry_runs.csv"
TORCHTITAN = CALIBRATION / "at_scale" / "torchtitan_runs.csv"
PUBLISHED = CALIBRATION / "published_runs.csv"
PLAYBOOK_CLUSTER, PLAYBOOK_PROFILE = "h100_playbook", "nanotron"
SCALES = ((64, "<=64"), (512, "65-512"), (2048, "513-2048"), (10 ** 9, ">2048"))


@cache
def playbook(half: str = "all") -> tuple[MeasuredRun, ...]:
    """The playbook sweep's rows (every row, ok or not), on h100_playbook with nanotron's profile: all, the
    even rows (0-based: the fit half) or the odd ones (held out)."""
    runs = read_sweep_csv(PLAYBOOK, cluster=PLAYBOOK_CLUSTER, profile=PLAYBOOK_PROFILE)
    keep = {"all": lambda i: True, "even": lambda i: i % 2 == 0, "odd": lambda i: i % 2 == 1}[half]
    return tuple(r for i, r in enumerate(runs) if keep(i))


@cache
def playbook_other_sizes() -> tuple[MeasuredRun, ...]:
    """The same sweep's 3.57B and 80B (never fitted)."""
    return tuple(read_sweep_csv(PLAYBOOK_OTHER_SIZES, cluster=PLAYBOOK_CLUSTER, profile=PLAYBOOK_PROFILE))


@cache
def llmfoundry() -> tuple[MeasuredRun, ...]:
    return tuple(read_sweep_csv(LLMFOUNDRY))


@cache
def torchtitan() -> tuple[MeasuredRun, ...]:
    return tuple(read_sweep_csv(TORCHTITAN))


@cache
def published() -> tuple[MeasuredRun, ...]:
    """calibration/published_runs.csv, its `use` column: fit (fitted on, then not scored), eval (the
    held-out bf16 runs), eval_fp8, eval_lowconf (a layout piece inferred), excluded."""
    return tuple(r for r in read_sweep_csv(PUBLISHED) if r.use != "excluded")


def scale(gpus: int) -> str:
    return next(name for top, name in SCALES if gpus <= top)


@dataclass
class Scores:
    """A set of runs predicted with the catalogue's constants."""

    runs: list[MeasuredRun]
    predicted: list[float]
    scored: Scored

    def by(self, key) -> dict[str, Scores]:
        groups: dict = defaultdict(list)
        for r, p in zip(self.runs, self.predicted):
            groups[key(r)].append((r, p))
        return {k: Scores([r for r, _ in v], [p for _, p in v], score([r for r, _ in v], [p for _, p in v]))
                for k, v in sorted(groups.items())}


def predict(runs, problem: Problem | None = None) -> Scores:
    problem = problem or Problem(list(runs))
    predicted = problem.predict()
    return Scores(problem.runs, predicted, score(problem.runs, predicted))


def gpus(r: MeasuredRun) -> int:
    return r.layout.world
