"""`usp calibrate`: fit the time model's constants to measured runs, score the fit, and write what was
fitted: the cluster group (its GPU and network constants, `cluster.timing`, with a record of what was
fitted on what and the residuals) and, for the stack's own constants, a profile file (base profile +
its StackTime values). Hardware and stack constants stay apart: a GPU or network constant moves only
the runs of the cluster group being fitted, a stack constant only the runs of that profile, so a fit of
one cluster's runs cannot change another hardware's prediction. Pure Python: each run's step geometry
(usp.perf.timing.time_shape) is built once, then a Levenberg-Marquardt search over the constants (each
kept within a physical range) minimises the soft-L1 loss of the runs' log(predicted / measured MFU), plus
a ranking term (each cell's measured-best layout kept in the predicted top 3)."""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from usp.contract.decide import uses_bf16
from usp.errors import UspError
from usp.perf.calibration.measured_runs import (
    MeasuredRun,
    cluster_group,
    cluster_hardware,
    read_run_dirs,
    read_sweep_csv,
    with_defaults,
)
from usp.perf.specs import Hardware, Precision
from usp.perf.stack_profile import Profile, StackTime, get_profile
from usp.perf.time_constants import Calibrated, TimeConstants
from usp.perf.timing import TimeShape, evaluate, layout_features, mfu, time_shape

# (field, lower, upper) of what `usp calibrate --fit` may move, by group
NETWORK = (("intra_latency_us", 0.5, 2000.0), ("inter_latency_us", 0.5, 5000.0))
GPU = (("gemm_efficiency", 0.1, 1.0), ("gemm_fixed_us", 0.1, 200.0), ("interference", 0.001, 1.0))
STACK = (("elementwise_factor", 0.1, 20.0), ("layer_us", 0.1, 1e4), ("micro_batch_ms", 0.01, 1e3),
         ("step_ms", 0.01, 1e4), ("loss_bytes_per_logit", 1.0, 1e3), ("attention_efficiency", 0.1, 1.0))
PIPELINE = (("pp_p2p_us", 1.0, 1e5), ("p2p_stall_ms", 0.01, 1e4), ("p2p_stall_nodes", 1.0, 1e4),
            ("p2p_stall_headroom", 0.001, 1.0))
PIPELINE_TP = (("p2p_tp_ms", 0.01, 1e4), ("p2p_tp_exp", 0.5, 4.0))  # where pipelined runs also use TP
GROUPS = ("network", "gpu", "stack")
SOFT_L1_SCALE = 0.1  # residuals (log ratios) beyond ~10 % count linearly, not quadratically
RANK_WEIGHT = 5.0  # a cell's log shortfall of its measured best from the predicted top 3, as a residual


def soft_l1(r: float, f: float = SOFT_L1_SCALE) -> float:
    """2f²(sqrt(1 + (r/f)²) - 1): r²  for small r, 2f·|r| for large."""
    return 2 * f * f * (math.sqrt(1 + (r / f) ** 2) - 1)



class TooFewRuns(UspError):
    """Fewer distinct measured layouts than constants to fit: no time-model fit (a directory of runs
    still has its restart costs fitted: usp/perf/calibration/restarts.py)."""

@dataclass(frozen=True)
class Param:
    """One fitted constant: a cluster.timing field of the runs on `clusters`, or a StackTime field of the
    runs of `profile` (name `<profile>.<field>`)."""

    name: str
    field: str
    lo: float
    hi: float
    clusters: tuple = ()  # a timing constant: the cluster groups whose runs it moves
    profile: str = ""  # a stack constant: the profile whose runs it moves

    @classmethod
    def timing(cls, spec: tuple, clusters: tuple) -> Param:
        return cls(spec[0], spec[0], spec[1], spec[2], clusters=tuple(clusters))

    @classmethod
    def stack(cls, spec: tuple, profile: str) -> Param:
        return cls(f"{profile}.{spec[0]}", spec[0], spec[1], spec[2], profile=profile)


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
    rel_err_p50: float = 0.0  # median |predicted / measured - 1|
    within_15: float = 0.0  # share within 15 % (relative)
    rel_err_max: float = 0.0


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


def rank_cell(r: MeasuredRun) -> tuple:
    """The runs whose layouts compete: one model on one node count of one cluster, one stack, one precision."""
    return r.cluster, r.profile, r.precision, r.seq_len, r.model, r.nodes


def cell_ranks(runs: list[MeasuredRun], predicted: list[float]) -> dict[tuple, int]:
    """Per cell of >= 3 runs (rank_cell), the planner's rank (1 = predicted fastest) of the measured-best
    layout: the best-ranked of those tied at the best measured MFU (the sweep rounds it to 0.1 %)."""
    cells = defaultdict(list)
    for r, p in zip(runs, predicted):
        cells[rank_cell(r)].append((p, r.mfu or 0.0))
    out = {}
    for key, pairs in cells.items():
        if len(pairs) >= 3:
            best = max(m for _, m in pairs)
            order = sorted(pairs, key=lambda pm: -pm[0])
            out[key] = 1 + min(i for i, (_, m) in enumerate(order) if m == best)
    return out


def score(runs: list[MeasuredRun], predicted: list[float]) -> Scored:
    measured = [r.mfu or 0.0 for r in runs]
    err = [100 * abs(p - m) for p, m in zip(predicted, measured)]
    ratios = [p / max(m, 1e-4) for p, m in zip(predicted, measured)]
    rel = [abs(q - 1) for q in ratios]
    by_nodes, cells = defaultdict(list), defaultdict(list)
    for r, p, m, q in zip(runs, predicted, measured, ratios):
        by_nodes[r.nodes].append(q)
        cells[rank_cell(r)].append((p, m))
    rho = [spearman([p for p, _ in pairs], [m for _, m in pairs]) for pairs in cells.values() if len(pairs) >= 3]
    top = sum(rank <= 3 for rank in cell_ranks(runs, predicted).values())
    return Scored(predicted, measured, _pct(err, 0.5), _pct(err, 0.9),
                  {n: _pct(v, 0.5) for n, v in sorted(by_nodes.items())}, _pct(ratios, 0.1), _pct(ratios, 0.9),
                  _pct(rho, 0.5), top / len(rho) if rho else 0.0, len(rho), _pct(rel, 0.5),
                  sum(x <= 0.15 for x in rel) / len(rel) if rel else 0.0, max(rel, default=0.0))


def run_precision(run: MeasuredRun, profile: Profile, device: str = "cuda") -> Precision:
    """The bytes per value the run's stack stores, its compile and FP8 settings."""
    prec = Precision.resolve("bf16" if uses_bf16("auto", device) else "fp32", device, profile.fp32_params,
                             compiled=run.compiled, fp8=run.fp8)
    return replace(prec, fp8_all_gather=run.fp8_all_gather) if run.fp8_all_gather else prec


class Problem:
    """Measured runs with their step geometry, built once per run: each on its own cluster group (its
    node count) with its own profile (the command's defaults where its row names none)."""

    def __init__(self, runs: list[MeasuredRun], cluster: str = "", profile: str = "usp",
                 hardware: dict | None = None, profiles: dict | None = None):
        runs = [with_defaults(r, cluster, profile) for r in runs]
        self.runs = [r for r in runs if r.ok and r.mfu is not None and r.mfu > 0]
        self.hardware: dict[str, Hardware] = dict(hardware or {})  # cluster name -> Hardware (its constants)
        self.profiles: dict[str, Profile] = dict(profiles or {})
        for r in self.runs:
            if r.cluster not in self.hardware:
                self.hardware[r.cluster] = cluster_hardware(r.cluster)
            if r.profile not in self.profiles:
                self.profiles[r.profile] = get_profile(r.profile)
        self.shapes: list[TimeShape] = [
            time_shape(r.arch, r.layout, r.seq_len, r.global_batch, self.hardware[r.cluster].with_nodes(r.nodes),
                       run_precision(r, self.profiles[r.profile], self.hardware[r.cluster].device),
                       self.profiles[r.profile]) for r in self.runs]
        groups: dict = defaultdict(list)
        for i, r in enumerate(self.runs):
            groups[(r.cluster, r.profile)].append(i)
        self.groups = dict(groups)
        cells = defaultdict(list)
        for i, r in enumerate(self.runs):
            cells[rank_cell(r)].append(i)
        # per cell of >= 3 runs: (its runs, those measured best: all tied at the best measured MFU)
        measured = [r.mfu or 0.0 for r in self.runs]
        self.cells = [(idx, [i for i in idx if measured[i] == top])
                      for idx in cells.values() if len(idx) >= 3 for top in [max(measured[j] for j in idx)]]

    def constants(self, params: list[Param], values: dict) -> tuple[dict, dict]:
        """(cluster -> Hardware, profile -> StackTime) with the values applied."""
        hw = dict(self.hardware)
        for name in hw:
            moved = {p.field: values[p.name] for p in params if p.clusters and name in p.clusters}
            if moved:
                hw[name] = replace(hw[name], timing=replace(hw[name].timing, **moved))
        stacks = {}
        for name, prof in self.profiles.items():
            moved = {p.field: values[p.name] for p in params if p.profile == name}
            stacks[name] = replace(prof.time, **moved) if moved else prof.time
        return hw, stacks

    def predict(self, params: list[Param] | None = None, values: dict | None = None) -> list[float]:
        hw, stacks = self.constants(params or [], values or {})
        out = [0.0] * len(self.runs)
        for (cluster, profile), idx in self.groups.items():
            h, k = hw[cluster], stacks[profile]
            for i in idx:
                out[i] = mfu(self.shapes[i], evaluate(self.shapes[i], h, k).step_s)
        return out

    def residuals(self, params: list[Param], values: dict) -> list[float]:
        """One per run, ln(predicted / measured MFU), then one per cell of >= 3 runs, RANK_WEIGHT x ln(the
        predicted 3rd best / the prediction of the cell's measured-best layout) when positive: the layout a
        user should pick kept among the planner's top 3."""
        predicted = self.predict(params, values)
        out = [math.log(max(p, 1e-6) / (r.mfu or 1e-4)) for p, r in zip(predicted, self.runs)]
        for idx, best in self.cells:
            third = sorted((predicted[i] for i in idx), reverse=True)[2]
            out.append(RANK_WEIGHT * max(0.0, math.log(third / max(predicted[i] for i in best))))
        return out

    def loss(self, params: list[Param], values: dict) -> float:
        """The fit's cost: the residuals through the soft-L1 loss (robust: one run off by a factor 10
        counts like a few off by 20 %)."""
        return sum(soft_l1(r) for r in self.residuals(params, values))


def start_values(problem: Problem, params: list[Param]) -> dict:
    """The search's start: each constant as its cluster group or profile has it (clamped into its range)."""
    out = {}
    for p in params:
        if p.profile:
            v = getattr(problem.profiles[p.profile].time, p.field)
        else:
            v = getattr(problem.hardware[p.clusters[0]].timing, p.field)
        out[p.name] = min(p.hi, max(p.lo, float(v)))
    return out


@dataclass
class Fit:
    values: dict  # param name -> fitted value
    hardware: dict  # cluster -> Hardware with the fitted constants
    stacks: dict  # profile -> StackTime with the fitted constants
    fit: Scored  # on the runs it was fitted to
    evaluations: int


def fit(problem: Problem, params: list[Param], iterations: int = 60, values: dict | None = None) -> Fit:
    """Levenberg-Marquardt on the soft-L1 residuals (iteratively reweighted), each constant mapped into
    its range through a logistic (so the search never leaves it), the Jacobian by forward differences:
    what scipy.optimize.least_squares(loss="soft_l1") does, in pure Python."""
    values = dict(values or start_values(problem, params))
    u = [_to_free(values[p.name], p) for p in params]
    res = problem.residuals(params, _values(params, u))
    cost, evals, lam = sum(soft_l1(r) for r in res), 1, 1e-3
    for _ in range(iterations):
        w = [1 / math.sqrt(1 + (r / SOFT_L1_SCALE) ** 2) for r in res]  # IRLS weights of the soft-L1 loss
        jac = []
        for k in range(len(params)):
            trial = list(u)
            trial[k] += DIFF_STEP
            jac.append([(b - a) / DIFF_STEP for a, b in zip(res, problem.residuals(params, _values(params, trial)))])
            evals += 1
        n = len(params)
        a = [[sum(wi * x * y for wi, x, y in zip(w, jac[i], jac[j])) for j in range(n)] for i in range(n)]
        g = [sum(wi * x * r for wi, x, r in zip(w, jac[i], res)) for i in range(n)]
        for _ in range(12):  # raise the damping until a step lowers the cost
            step = _solve([[a[i][j] + (lam * max(a[i][i], 1e-12) if i == j else 0.0) for j in range(n)]
                           for i in range(n)], [-x for x in g])
            trial = [max(-FREE_MAX, min(FREE_MAX, x + d)) for x, d in zip(u, step)]
            new_res = problem.residuals(params, _values(params, trial))
            evals += 1
            new_cost = sum(soft_l1(r) for r in new_res)
            if new_cost < cost:
                break
            lam *= 4
        else:
            break
        gain, u, res, cost, lam = cost - new_cost, trial, new_res, new_cost, max(lam / 3, 1e-9)
        if gain < 1e-9 * max(cost, 1e-12):
            break
    values = _values(params, u)
    hw, stacks = problem.constants(params, values)
    return Fit(values, hw, stacks, score(problem.runs, problem.predict(params, values)), evals)


DIFF_STEP = 1e-3  # forward-difference step in the free (logistic) coordinate
FREE_MAX = 12.0  # |free coordinate| kept below this: within ~6e-6 of a bound


def _to_free(x: float, p: Param) -> float:
    y = min(1 - 1e-6, max(1e-6, (x - p.lo) / (p.hi - p.lo)))
    return math.log(y / (1 - y))


def _values(params: list[Param], u: list[float]) -> dict:
    return {p.name: p.lo + (p.hi - p.lo) / (1 + math.exp(-x)) for p, x in zip(params, u)}


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a small dense system)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[pivot] = m[pivot], m[c]
        if abs(m[c][c]) < 1e-300:
            continue
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            if f:
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][k] * out[k] for k in range(r + 1, n))) / m[r][r] if abs(m[r][r]) > 1e-300 \
            else 0.0
    return out


def params_for(groups: tuple, cluster: str, profile: str, runs: list[MeasuredRun]) -> list[Param]:
    """The constants `usp calibrate --fit <groups>` moves: the cluster group's network latencies and GPU
    constants, the profile's host, kernel and (when the runs are pipelined) pipeline constants."""
    out = []
    if "network" in groups:
        out += [Param.timing(s, (cluster,)) for s in NETWORK]
    if "gpu" in groups:
        out += [Param.timing(s, (cluster,)) for s in GPU]
    if "stack" in groups:
        out += [Param.stack(s, profile) for s in STACK]
        if any(r.layout.pp > 1 for r in runs):
            out += [Param.stack(s, profile) for s in PIPELINE]
        if any(r.layout.pp > 1 and r.layout.tp > 1 for r in runs):
            out += [Param.stack(s, profile) for s in PIPELINE_TP]
    return out


def calibrated(problem: Problem, runs: list[MeasuredRun], params: list[Param], scored: Scored, source: str,
               procs_per_node: int) -> Calibrated:
    """What was fitted on what (usp plan's band and notes)."""
    feats = sorted(set().union(set(), *(layout_features(r.layout, procs_per_node) for r in runs)))
    return Calibrated(source=source, runs=len(runs), nodes=tuple(sorted({r.nodes for r in runs})),
                      features=tuple(feats), fitted=tuple(p.name for p in params),
                      stacks=tuple(sorted({r.profile for r in runs})), mfu_abs_err_p50=round(scored.abs_err_p50, 2),
                      mfu_abs_err_p90=round(scored.abs_err_p90, 2), rel_err_p50=round(scored.rel_err_p50, 3),
                      ratio_p10=round(scored.ratio_p10, 3), ratio_p90=round(scored.ratio_p90, 3))


# --- the command: read runs, fit, score, write the cluster group (and the profile) -------------------------

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


def _value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else v if isinstance(v, str) else _fmt(v)


def cluster_yaml(text: str, timing: TimeConstants) -> str:
    """The cluster group's YAML with a new `timing:` block (the rest, comments included, kept as it was)."""
    text = re.sub(r"^timing:.*?(?=^\S|\Z)", "", text, flags=re.M | re.S).rstrip("\n") + "\n"
    lines = ["timing:   # the time model's GPU and network constants; `usp calibrate` fitted those in "
             "calibrated.fitted (docs/planner.md)"]
    lines += [f"  {k}: {_value(v)}" for k, v in timing.fitted().items()]
    lines.append("  calibrated:")
    for f in fields(timing.calibrated):
        v = getattr(timing.calibrated, f.name)
        lines.append(f"    {f.name}: " + (f"[{', '.join(map(str, v))}]" if isinstance(v, tuple)
                                          else repr(v) if isinstance(v, str) else _fmt(v)))
    return text + "\n".join(lines) + "\n"


def profile_yaml(base: Profile, stack: StackTime, fitted: list[Param], cal: Calibrated) -> str:
    """A profile file: the base profile and the stack constants fitted (`planner.profile=<this file>`)."""
    names = [p.field for p in fitted if p.profile]
    lines = [f"# stack constants fitted by usp calibrate on {cal.runs} runs ({cal.source}): MFU |error| median "
             f"{cal.mfu_abs_err_p50} points, p90 {cal.mfu_abs_err_p90}; median |predicted/measured - 1| "
             f"{cal.rel_err_p50}", f"base: {base.name}",
             f"fitted_on: '{cal.source}: {cal.runs} runs, {', '.join(names)} fitted'", "time:"]
    lines += [f"  {name}: {_fmt(getattr(stack, name))}" for name in names]
    return "\n".join(lines) + "\n"


def read_runs(measured: Path, archs: Path | None = None, cluster: str = "", profile: str = "") -> list[MeasuredRun]:
    if measured.is_dir():
        runs = read_run_dirs(measured)
        if not runs:
            raise UspError(f"no usp runs with plan.yaml and a measured metrics.jsonl under {measured}", key="RUNS",
                           value=str(measured), fix="point at a runs directory, or pass a CSV of measured layouts")
        return runs
    return read_sweep_csv(measured, archs, cluster=cluster, profile=profile)


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
    params: list[Param] = field(default_factory=list)
    values: dict = field(default_factory=dict)
    profile_yaml: str = ""  # the stack constants fitted ("" when none were)
    warnings: list[str] = field(default_factory=list)


def parse_groups(fit_groups: str) -> tuple:
    groups = tuple(g.strip() for g in fit_groups.split(",") if g.strip())
    bad = [g for g in groups if g not in GROUPS]
    if bad or not groups:
        raise UspError(f"--fit {fit_groups!r}: not a list of {', '.join(GROUPS)}", key="--fit", value=fit_groups,
                       fix="--fit network,stack (the default), or any of network, gpu, stack")
    return groups


def calibrate(measured: Path, cluster: str, profile: str, archs: Path | None = None, holdout: int = 0,
              fit_groups: str = "network,stack") -> Calibration:
    """Fit `cluster`'s constants (and `profile`'s) to the measured runs: the rows' own cluster and profile
    where they name one, these where they do not. Only the runs on `cluster` move its constants; only
    the runs of `profile` move the stack's."""
    groups = parse_groups(fit_groups)
    path, text, group = load_cluster(cluster)
    hw0 = Hardware.from_cluster(cluster_group(group, path))
    get_profile(profile)  # an unknown profile is refused before the runs are read
    runs = [with_defaults(r, cluster, profile) for r in read_runs(measured, archs, cluster, profile)]
    fit_runs, held = split(runs, holdout)
    problem = Problem(fit_runs, cluster, profile, hardware={cluster: hw0})
    if not problem.runs:
        raise UspError(f"no successful run with a measured MFU in {measured}", key="RUNS", value=str(measured),
                       fix="check the status/mfu_pct (or tok_s_gpu) columns")
    params = params_for(groups, cluster, profile, problem.runs)
    warnings = enough_runs(problem.runs, str(measured), params)
    result = fit(problem, params)
    source = f"{measured.name}, profile {profile}" if len(problem.profiles) == 1 else measured.name
    cal = calibrated(problem, problem.runs, params, result.fit, source, hw0.procs_per_node)
    hw = replace(result.hardware[cluster], timing=replace(result.hardware[cluster].timing, calibrated=cal))
    held_score = None
    if held:
        other = Problem(held, cluster, profile, hardware={cluster: hw0})
        held_score = score(other.runs, other.predict(params, result.values)) if other.runs else None
    stack_yaml = profile_yaml(problem.profiles[profile], result.stacks[profile], params, cal) \
        if any(p.profile for p in params) else ""
    return Calibration(hw, result.fit, held_score, cluster_yaml(text, hw.timing), len(problem.runs),
                       result.evaluations, params, result.values, stack_yaml, warnings)


MIN_RUNS_PER_CONSTANT = 3  # below 3 distinct layouts per fitted constant: a warning (the fit may not generalise)


def enough_runs(runs: list[MeasuredRun], source: str, params: list[Param]) -> list[str]:
    """Refuse fewer distinct measured layouts than the constants fitted (any fit then matches them, error 0,
    and predicts nothing); a warning below MIN_RUNS_PER_CONSTANT per constant."""
    distinct = len({(r.model, r.nodes, r.layout) for r in runs})
    k, enough = len(params), MIN_RUNS_PER_CONSTANT * len(params)
    what = f"{len(runs)} measured run(s), {distinct} distinct (model, nodes, layout)"
    if distinct < k:
        names = ", ".join(p.name for p in params)
        raise TooFewRuns(f"{what}: too few to fit the time model's {k} constants ({names}); "
                         "a fit would match them exactly and predict nothing", key="RUNS", value=source,
                         fix=f"measure at least {k} different layouts ({enough} or more to trust the fit): vary "
                             "dp/tp/pp, micro batches and node counts, e.g. with `usp sweep`, then `usp calibrate "
                             "runs/`; or fit fewer constants (--fit network)")
    if distinct < enough:
        return [f"only {what} for {k} fitted constants: the fit may not predict other layouts; measure "
                f"{enough} or more, and check it with --holdout 3"]
    return []


def report(cal: Calibration) -> list[str]:
    """The fitted constants and the fit's residuals (and the held-out runs'), one line each."""
    def lines(name: str, s: Scored) -> list[str]:
        nodes = ", ".join(f"{n}: {v:.2f}" for n, v in s.ratio_by_nodes.items())
        out = [f"{name}: MFU |error| median {s.abs_err_p50:.2f} points, p90 {s.abs_err_p90:.2f}; median "
               f"|predicted/measured - 1| {s.rel_err_p50:.1%}, {s.within_15:.0%} within 15 %; predicted/measured "
               f"p10-p90 {s.ratio_p10:.2f}-{s.ratio_p90:.2f}",
               f"  median predicted/measured by node count: {nodes}"]
        if s.cells:
            out.append(f"  ranking within (model, nodes) cells: median Spearman {s.spearman_p50:.2f}, measured-best "
                       f"layout in the predicted top 3 in {s.top3_share:.0%} of {s.cells} cells")
        return out

    consts = ", ".join(f"{k} {_fmt(v)}" for k, v in cal.values.items())
    out = [f"fitted on {cal.runs} runs ({cal.evaluations} evaluations): {consts}", *lines("fit", cal.fit)]
    if cal.held_out is not None:
        out += lines(f"held out ({len(cal.held_out.measured)} runs)", cal.held_out)
    return out
