"""`usp calibrate`: fit a cluster's time constants (usp/perf/time_constants.py and the two link
bandwidths) to measured runs, score the fit, and write the fitted cluster group. Pure Python: each
run's step geometry (usp.perf.timing.time_shape) is built once, then a coordinate search in log
space over the few constants minimises the runs' MFU error (mean |error| in points plus the mean
|log(predicted / measured)|, so that both large and small MFUs count) plus a ranking term (each
(model, nodes) cell's measured-best layout kept in the predicted top 3). ~1,000 runs fit in minutes."""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from usp.contract.decide import uses_bf16
from usp.errors import UspError
from usp.perf.calibration.measured_runs import MeasuredRun, cluster_group, read_run_dirs, read_sweep_csv
from usp.perf.specs import Hardware, Precision
from usp.perf.stack_profile import Profile, get_profile
from usp.perf.time_constants import Calibrated
from usp.perf.timing import TimeShape, evaluate, layout_features, mfu, time_shape

# (name, lower, upper): Hardware link bandwidths (GB/s; upper bound: the cluster's nominal figure,
# an achieved bandwidth never exceeds it) and TimeConstants fields
PARAMS = (("intra_node_gbps", 1.0, 1e4), ("inter_node_gbps", 0.1, 1e4),
          ("kernel_efficiency", 0.1, 1.0), ("kernel_half_tokens", 1.0, 1e5), ("kernel_half_dim", 1.0, 1e5),
          ("intra_hop_us", 0.5, 2000.0), ("inter_hop_us", 0.5, 5000.0),
          ("call_overhead_us", 1.0, 1e4), ("p2p_us", 1.0, 1e6), ("layer_overhead_us", 1.0, 1e5),
          ("step_overhead_ms", 0.1, 1e4), ("optimizer_gbps", 50.0, 1e5),
          ("p2p_stall_ms", 0.01, 1e4), ("p2p_stall_nodes", 1.0, 1e4), ("p2p_stall_headroom", 0.001, 1.0),
          ("p2p_stall_exp", 1.0, 16.0), ("loss_ps_per_logit", 0.01, 1e4))
HW_PARAMS = ("intra_node_gbps", "inter_node_gbps")
LOG_RATIO_WEIGHT = 10.0  # points of MFU error worth a factor e of ratio error
LOG_RATIO_CAP = 2.0  # one pathological run (measured 0.1 % MFU) counts at most this much
RANK_WEIGHT = 20.0  # points per unit of log shortfall of a cell's measured best from the predicted top 3


@dataclass
class Scored:
    """Predicted vs measured MFU of a set of runs, and the Done-when figures."""

    predicted: list[float]
    measured: list[float]
    abs_err_p50: float  # MFU points
    abs_err_p90: float
    ratio_by_nodes: dict  # nodes -> median predicted / measured
    ratio_p10: float
    ratio_p90: float
    spearman_p50: float  # median over (model, nodes) cells
    top3_share: float  # cells whose measured-best layout is in the predicted top 3
    cells: int


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return 0.0
    k = (len(s) - 1) * q
    lo = math.floor(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def _ranks(v: list[float]) -> list[float]:
    order = sorted(range(len(v)), key=lambda i: v[i])
    out = [0.0] * len(v)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return num / den if den else 0.0


def score(runs: list[MeasuredRun], predicted: list[float]) -> Scored:
    measured = [r.mfu or 0.0 for r in runs]
    err = [100 * abs(p - m) for p, m in zip(predicted, measured)]
    ratios = [p / max(m, 1e-4) for p, m in zip(predicted, measured)]
    by_nodes, cells = defaultdict(list), defaultdict(list)
    for r, p, m, q in zip(runs, predicted, measured, ratios):
        by_nodes[r.nodes].append(q)
        cells[r.cell].append((p, m))
    rho, top = [], 0
    for pairs in cells.values():
        if len(pairs) < 3:
            continue
        rho.append(spearman([p for p, _ in pairs], [m for _, m in pairs]))
        # the measured-best layout: any of those tied at the best measured MFU (the sweep rounds it to 0.1 %)
        best = max(m for _, m in pairs)
        top += any(pairs[i][1] == best for i in sorted(range(len(pairs)), key=lambda i: -pairs[i][0])[:3])
    return Scored(predicted, measured, _pct(err, 0.5), _pct(err, 0.9),
                  {n: _pct(v, 0.5) for n, v in sorted(by_nodes.items())}, _pct(ratios, 0.1), _pct(ratios, 0.9),
                  _pct(rho, 0.5), top / len(rho) if rho else 0.0, len(rho))


@dataclass
class Fit:
    hw: Hardware  # the base cluster with the fitted constants
    fit: Scored  # on the runs it was fitted to
    evaluations: int


def with_params(hw: Hardware, values: dict) -> Hardware:
    const = replace(hw.timing, **{k: v for k, v in values.items() if k not in HW_PARAMS})
    return replace(hw, timing=const, **{k: v for k, v in values.items() if k in HW_PARAMS})


# Where an uncalibrated cluster's search starts (its link bandwidths start at the nominal figures):
# round values of a GPU cluster; the search moves each by factors of 4, 2, sqrt 2, ... The pipeline
# stall starts at its floor (none): runs that never stalled (no pp, few nodes) leave it there.
START = {"kernel_efficiency": 0.6, "kernel_half_tokens": 128.0, "kernel_half_dim": 128.0, "intra_hop_us": 5.0,
         "inter_hop_us": 20.0, "call_overhead_us": 50.0, "p2p_us": 1000.0, "layer_overhead_us": 50.0,
         "step_overhead_ms": 10.0, "optimizer_gbps": 1000.0, "p2p_stall_ms": 0.01, "p2p_stall_nodes": 16.0,
         "p2p_stall_headroom": 0.1, "p2p_stall_exp": 4.0, "loss_ps_per_logit": 10.0}


def _params(hw: Hardware) -> dict:
    """The search's start: the cluster's constants if it was calibrated before, else START."""
    out = {}
    for name, lo, hi in PARAMS:
        if name in HW_PARAMS:
            v = getattr(hw, name)
        else:
            v = getattr(hw.timing, name) if hw.timing.calibrated.source else START[name]
        out[name] = min(hi, max(lo, v))
    return out


class Problem:
    """Measured runs with their step geometry, built once per (run, node count)."""

    def __init__(self, runs: list[MeasuredRun], hw: Hardware, prec: Precision, profile: Profile):
        self.runs = [r for r in runs if r.ok and r.mfu is not None and r.mfu > 0]
        self.hw, self.prec, self.profile = hw, prec, profile
        self.shapes: list[TimeShape] = [
            time_shape(r.arch, r.layout, r.seq_len, r.global_batch, hw.with_nodes(r.nodes), prec, profile)
            for r in self.runs]
        cells = defaultdict(list)
        for i, r in enumerate(self.runs):
            cells[r.cell].append(i)
        # per cell of >= 3 runs: (its runs, those measured best: all tied at the best measured MFU)
        measured = [r.mfu or 0.0 for r in self.runs]
        self.cells = [(idx, [i for i in idx if measured[i] == top])
                      for idx in cells.values() if len(idx) >= 3 for top in [max(measured[j] for j in idx)]]

    def predict(self, hw: Hardware) -> list[float]:
        return [mfu(s, evaluate(s, hw).step_s) for s in self.shapes]

    def loss(self, hw: Hardware) -> float:
        """Mean per run of |MFU error| in points + LOG_RATIO_WEIGHT x |ln(predicted / measured)| (capped),
        + RANK_WEIGHT x the mean per cell of ln(the predicted 3rd best / the measured best's prediction)
        when positive: the layout a user should pick kept among the planner's top 3."""
        total, predicted = 0.0, []
        for s, r in zip(self.shapes, self.runs):
            p, m = mfu(s, evaluate(s, hw).step_s), r.mfu or 1e-4
            predicted.append(p)
            total += 100 * abs(p - m) + LOG_RATIO_WEIGHT * min(LOG_RATIO_CAP, abs(math.log(p / m)))
        shortfall = 0.0
        for idx, best in self.cells:
            third = sorted((predicted[i] for i in idx), reverse=True)[2]
            shortfall += max(0.0, math.log(third / max(predicted[i] for i in best)))
        return total / max(1, len(self.runs)) + RANK_WEIGHT * shortfall / max(1, len(self.cells))


def fit(problem: Problem, rounds: int = 60, restarts: int = 2) -> Fit:
    """Coordinate search in log space: each constant in turn is multiplied / divided by a step
    factor while the loss improves; the factor shrinks when no constant moves. Restarted from the
    best point with the large step while a pass still gains (the search stalls in shallow valleys)."""
    values, bounds = _params(problem.hw), {n: (lo, hi) for n, lo, hi in PARAMS}
    for name in HW_PARAMS:  # effective <= nominal
        bounds[name] = (bounds[name][0], getattr(problem.hw, name))
    best, evals = problem.loss(with_params(problem.hw, values)), 1
    for _ in range(restarts + 1):
        before = best
        values, best, n = _descend(problem, values, bounds, best, rounds)
        evals += n
        if best > before * (1 - 1e-3):
            break
    hw = with_params(problem.hw, values)
    return Fit(hw, score(problem.runs, problem.predict(hw)), evals)


def _descend(problem: Problem, values: dict, bounds: dict, best: float, rounds: int) -> tuple[dict, float, int]:
    """One coordinate search from `values` (its loss `best`): (values, loss, evaluations)."""
    evals, step = 0, 4.0
    for _ in range(rounds):
        moved = False
        for name in values:
            for factor in (step, 1 / step):
                lo, hi = bounds[name]
                trial = dict(values, **{name: min(hi, max(lo, values[name] * factor))})
                if trial[name] == values[name]:
                    continue
                loss = problem.loss(with_params(problem.hw, trial))
                evals += 1
                if loss < best - 1e-9:
                    best, values, moved = loss, trial, True
                    break
        if not moved:
            step = math.sqrt(step)
            if step < 1.02:
                break
    return values, best, evals


def calibrated(problem: Problem, hw: Hardware, scored: Scored, source: str) -> Hardware:
    """The fitted hardware with what it was fitted on recorded (usp plan's band and notes)."""
    feats = sorted(set().union(set(), *(layout_features(r.layout, hw.procs_per_node) for r in problem.runs)))
    cal = Calibrated(source=source, runs=len(problem.runs), nodes=tuple(sorted({r.nodes for r in problem.runs})),
                     features=tuple(feats), mfu_abs_err_p50=round(scored.abs_err_p50, 2),
                     mfu_abs_err_p90=round(scored.abs_err_p90, 2), ratio_p10=round(scored.ratio_p10, 3),
                     ratio_p90=round(scored.ratio_p90, 3))
    return replace(hw, timing=replace(hw.timing, calibrated=cal))


# --- the command: read runs, fit, score, write the cluster group ------------------------------------

def load_cluster(cluster: str) -> tuple[Path, str, dict]:
    """(path, text, values) of a cluster group: a name in conf/cluster or a YAML path (checked as
    `usp plan cluster=<path>` checks it: YAML, no key twice, a mapping)."""
    from usp.config.paths import conf_dir, group_options
    from usp.config.recipe import check_group_file, parsed_yaml

    path = Path(cluster) if cluster.endswith((".yaml", ".yml")) else conf_dir() / "cluster" / f"{cluster}.yaml"
    if not path.is_file():
        raise UspError(f"cluster group not found: {path}", key="--cluster", value=cluster,
                       fix=f"a YAML path, or a name in conf/cluster: {', '.join(group_options('cluster'))}")
    check_group_file(path, "cluster")
    return path, path.read_text(encoding="utf-8"), parsed_yaml(path, "cluster", "cluster")


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def cluster_yaml(text: str, hw: Hardware) -> str:
    """The cluster group's YAML with the fitted link bandwidths and a new `timing:` block (the
    rest, comments included, kept as it was)."""
    for key in HW_PARAMS:
        line = f"{key}: {_fmt(getattr(hw, key))}   # fitted by usp calibrate (effective, per GPU)"
        text, n = re.subn(rf"^{key}:.*$", line, text, flags=re.M)
        if not n:
            text = text.rstrip("\n") + "\n" + line + "\n"
    text = re.sub(r"^timing:.*?(?=^\S|\Z)", "", text, flags=re.M | re.S).rstrip("\n") + "\n"
    c = hw.timing
    lines = ["timing:   # the time model's constants, fitted by `usp calibrate` (docs/planner.md)"]
    lines += [f"  {k}: {_fmt(v)}" for k, v in c.fitted().items()]
    lines.append("  calibrated:")
    for f in fields(c.calibrated):
        v = getattr(c.calibrated, f.name)
        lines.append(f"    {f.name}: " + (f"[{', '.join(map(str, v))}]" if isinstance(v, tuple)
                                          else repr(v) if isinstance(v, str) else _fmt(v)))
    return text + "\n".join(lines) + "\n"


def read_runs(measured: Path, archs: Path | None = None) -> list[MeasuredRun]:
    if measured.is_dir():
        runs = read_run_dirs(measured)
        if not runs:
            raise UspError(f"no usp runs with plan.yaml and a measured metrics.jsonl under {measured}", key="RUNS",
                           value=str(measured), fix="point at a runs directory, or pass a CSV of measured layouts")
        return runs
    return read_sweep_csv(measured, archs)


def split(runs: list[MeasuredRun], holdout: int) -> tuple[list[MeasuredRun], list[MeasuredRun]]:
    """(fit, held out): every `holdout`-th run is held out (0: none)."""
    if holdout <= 1:
        return runs, []
    return [r for i, r in enumerate(runs) if i % holdout], [r for i, r in enumerate(runs) if i % holdout == 0]


@dataclass
class Calibration:
    hw: Hardware
    fit: Scored
    held_out: Scored | None
    yaml: str
    runs: int
    evaluations: int
    warnings: list[str] = field(default_factory=list)


def calibrate(measured: Path, cluster: str, profile: str, archs: Path | None = None, holdout: int = 0) -> Calibration:
    """Fit `cluster`'s time constants to the measured runs (trained with `profile`'s recipe)."""
    path, text, group = load_cluster(cluster)
    hw0 = Hardware.from_cluster(cluster_group(group, path))
    prof = get_profile(profile)
    prec = Precision.resolve("bf16" if uses_bf16("auto", hw0.device) else "fp32", hw0.device, prof.fp32_params)
    runs = read_runs(measured, archs)
    fit_runs, held = split(runs, holdout)
    problem = Problem(fit_runs, hw0, prec, prof)
    if not problem.runs:
        raise UspError(f"no successful run with a measured MFU in {measured}", key="RUNS", value=str(measured),
                       fix="check the status/mfu columns")
    warnings = enough_runs(problem.runs, str(measured))
    result = fit(problem)
    hw = calibrated(problem, result.hw, result.fit, f"{measured.name}, profile {prof.name}")
    held_score = None
    if held:
        other = Problem(held, hw0, prec, prof)
        held_score = score(other.runs, other.predict(hw)) if other.runs else None
    return Calibration(hw, result.fit, held_score, cluster_yaml(text, hw), len(problem.runs), result.evaluations,
                       warnings)


MIN_RUNS_PER_CONSTANT = 3  # below 3 distinct layouts per fitted constant: a warning (the fit may not generalise)


def enough_runs(runs: list[MeasuredRun], source: str) -> list[str]:
    """Refuse fewer distinct measured layouts than the constants fitted (any fit then matches them, error 0,
    and predicts nothing); a warning below MIN_RUNS_PER_CONSTANT per constant."""
    distinct = len({(r.model, r.nodes, r.layout) for r in runs})
    k, enough = len(PARAMS), MIN_RUNS_PER_CONSTANT * len(PARAMS)
    what = f"{len(runs)} measured run(s), {distinct} distinct (model, nodes, layout)"
    if distinct < k:
        raise UspError(f"{what}: too few to fit the time model's {k} constants ({', '.join(n for n, *_ in PARAMS)}); "
                       "a fit would match them exactly and predict nothing", key="RUNS", value=source,
                       fix=f"measure at least {k} different layouts ({enough} or more to trust the fit): vary "
                           "dp/tp/pp, micro batches and node counts, e.g. with `usp sweep`, then `usp calibrate runs/`")
    if distinct < enough:
        return [f"only {what} for {k} fitted constants: the fit may not predict other layouts; measure "
                f"{enough} or more, and check it with --holdout 3"]
    return []


def report(cal: Calibration) -> list[str]:
    """The fit's residuals (and the held-out runs'), one line each."""
    def lines(name: str, s: Scored) -> list[str]:
        nodes = ", ".join(f"{n}: {v:.2f}" for n, v in s.ratio_by_nodes.items())
        return [f"{name}: MFU |error| median {s.abs_err_p50:.2f} points, p90 {s.abs_err_p90:.2f}; "
                f"predicted/measured p10-p90 {s.ratio_p10:.2f}-{s.ratio_p90:.2f}",
                f"  median predicted/measured by node count: {nodes}",
                f"  ranking within (model, nodes) cells: median Spearman {s.spearman_p50:.2f}, measured-best "
                f"layout in the predicted top 3 in {s.top3_share:.0%} of {s.cells} cells"]

    hw = cal.hw
    consts = ", ".join(f"{k} {_fmt(v)}" for k, v in hw.timing.fitted().items())
    out = [f"fitted on {cal.runs} runs ({cal.evaluations} evaluations): intra_node_gbps {_fmt(hw.intra_node_gbps)}, "
           f"inter_node_gbps {_fmt(hw.inter_node_gbps)}, {consts}", *lines("fit", cal.fit)]
    if cal.held_out is not None:
        out += lines(f"held out ({len(cal.held_out.measured)} runs)", cal.held_out)
    return out
