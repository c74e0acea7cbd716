"""`usp report`: plots + report.md for one or more run dirs and/or sweep dirs (no torch)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from usp.errors import UspError
from usp.report import plots as P
from usp.report.expert_plots import plot_expert_load
from usp.report.heatmap import heatmap_grid
from usp.report.overlap import overlap_markdown
from usp.report.profile_plots import plot_step_breakdown
from usp.report.profiler_ops import read_profile
from usp.report.runs import RunData, is_run_dir, load_run, unique_labels
from usp.report.sweep_plots import plot_heatmap, plot_scaling
from usp.report.sweep_tables import batch_guidance, scaling, sweep_rows
from usp.report.trace import PHASES, run_breakdowns, run_events
from usp.run.files import METRICS, PROFILE, SPAN_STEP_PREFIX, staged
from usp.run.sweep_record import SWEEP_FILE, is_sweep_dir, layout_text, read_sweep, refresh_statuses
from usp.run.writable import check_new_output

MAX_BARS = 48  # step-time bars in one plot (runs x ranks x profiled steps)


@dataclass
class ReportResult:
    out: Path
    markdown: Path
    plots: list[P.Plot] = field(default_factory=list)
    runs: list[RunData] = field(default_factory=list)
    sweeps: list[dict] = field(default_factory=list)  # {"sweep": sweep.json, "rows": ..., "scaling": ...}

    def plot(self, name: str) -> P.Plot | None:
        return next((p for p in self.plots if p.name == name), None)


def collect(paths: list[str]) -> tuple[list[RunData], list[tuple[Path, dict]]]:
    """Runs (in argument order; a sweep contributes its points' run dirs) and sweeps."""
    runs, sweeps, seen = [], [], set()
    if not paths:
        raise UspError("no run or sweep directory given", key="RUN_DIR", fix="usp report runs/<name>")
    for arg in paths:
        path = Path(arg).expanduser()
        if is_sweep_dir(path):
            sweep = refresh_statuses(read_sweep(path))  # a Slurm array's points: from their run dirs
            sweeps.append((path, sweep))
            dirs = [Path(p["run_dir"]) for p in sweep["points"] if p.get("run_dir")]
        elif path.is_dir() and not is_run_dir(path) and any(is_run_dir(d) for d in path.iterdir() if d.is_dir()):
            names = sorted(d.name for d in path.iterdir() if is_run_dir(d))[:5]
            raise UspError("a directory of runs, not one run", key="RUN_DIR", value=str(path),
                           fix=f"name the runs: usp report {path}/{names[0]} ... (here: {', '.join(names)})")
        else:
            dirs = [path]
        for d in dirs:
            key = d.resolve()
            if key in seen or (d != path and not is_run_dir(d)):  # a sweep point that never ran: no dir
                continue
            seen.add(key)
            runs.append(load_run(d))
    unique_labels(runs)
    return runs, sweeps


def write_report(paths: list[str], out: str | Path | None = None, force: bool = False) -> ReportResult:
    """The report of `paths` in the directory `out` (default <first path>/report, usp's own). It is
    drawn in a temporary directory and swapped into place; an existing `out` is replaced only with
    force."""
    if out:
        check_new_output(out, force=force, key="--out", inputs=paths, own=Path(paths[0]).expanduser() / "report")
    runs, sweeps = collect(paths)
    target = Path(out).expanduser() if out else Path(paths[0]).expanduser() / "report"
    with staged(target) as tmp:
        tmp.mkdir()
        result = _draw(paths, runs, sweeps, tmp)
    for plot in result.plots:
        plot.path = target / plot.path.name
    result.out, result.markdown = target, target / result.markdown.name
    return result


def _draw(paths: list[str], runs: list[RunData], sweeps: list[tuple[Path, dict]], out: Path) -> ReportResult:
    result = ReportResult(out, out / "report.md", runs=runs)
    # runs without metrics.jsonl have empty series: the plots leave them out
    makers = (P.plot_loss, P.plot_lr, P.plot_throughput, P.plot_memory, plot_expert_load)
    run_plots = [p for p in (make(runs, out) for make in makers) if p]
    result.plots += run_plots
    profile_md = _profile_section(runs, out, result)
    sweep_md = []
    by_dir = {str(r.dir.resolve()): r for r in runs}
    for sweep_dir, sweep in sweeps:
        sweep_md += _sweep_section(sweep_dir, sweep, by_dir, out, result)
    lines = ["# usp report", "", f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `usp report "
             f"{' '.join(paths)}`. Measured numbers come from each run's metrics.jsonl / summary.json / logs; "
             "predicted ones from its plan.yaml (the planner, before the run).", ""]
    lines += _runs_section(runs)
    for plot in run_plots:
        lines += [f"![{plot.name}]({plot.path.name})", "", f"*{plot.caption}*", ""]
    lines += profile_md + sweep_md
    result.markdown.write_text("\n".join(lines).rstrip() + "\n")
    return result


def md_table(headers: list[str], rows: list[list]) -> list[str]:
    def cell(v) -> str:
        return "-" if v is None else str(v).replace("|", "\\|").replace("\n", " ")

    return ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|",
            *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows), ""]


def _num(v, fmt: str = ",.0f") -> str | None:
    return None if v is None else format(v, fmt)


def _runs_section(runs: list[RunData]) -> list[str]:
    rows = []
    for r in runs:
        plan = r.plan
        info = {"degrees": {**plan.degrees, "ep": plan.config.parallelism.ep}, "micro_batch": plan.batch.micro_batch,
                "grad_accum": plan.batch.grad_accum} if plan is not None else {}
        mfu, how = r.mfu()
        memory, memory_how = r.memory_measured()
        predicted = max((v[0] for v in r.memory_predicted_gib().values()), default=None)
        steps = f"{r.metrics[-1]['step']}/{plan.config.train.steps if plan is not None else '?'}" \
            if r.metrics else f"0 (no {METRICS})"
        rows.append([r.label, r.world_size, layout_text(info) if plan is not None else "-", steps,
                     _num(r.final_loss(), ".4f"), _num(r.tokens_per_s()),
                     None if mfu is None else f"{100 * mfu:.1f}% ({how})",
                     None if memory is None else f"{memory:.3f} ({memory_how})", _num(predicted, ".3f")])
    return ["## Runs", ""] + md_table(
        ["run", "world", "layout", "steps logged", "final loss", "tokens/s (measured)", "MFU",
         "peak mem measured (GiB)", "peak mem predicted (GiB)"], rows) + [
        "*tokens/s: median over the logged steps except step 1 (warm-up), the memory-probe step and the profiled "
        "steps (profile.steps and the profiler's warm-up step before them). MFU: the records' `mfu` (measured) or, "
        "when absent, measured tokens/s x plan FLOPs/token / (world x the planner's peak FLOP/s) (derived). "
        "Memory: peak tensor memory (max over ranks), measured by the memory probe (probe) or, without it, the "
        "CUDA/XPU allocator's peak `memory_peak_gib` of metrics.jsonl (allocator), vs the plan's prediction "
        "without the overhead allowance.*", ""]


def _profile_section(runs: list[RunData], out: Path, result: ReportResult) -> list[str]:
    """Stacked step-time bars from the traces (profile/rank_<R>.json) and, per profiled run, the
    profiler's summary: its head lines and the top ops (profile/summary_rank_<R>.txt)."""
    profiled = [r for r in runs if r.profiles or r.traces]
    lines = ["## Step-time breakdown", ""]
    if not profiled:
        return lines + [f"No profile in these runs (`<run_dir>/{PROFILE}/` not found): run with `profile.enabled=true` "
                        "to get one.", ""]
    bars, overlaps = [], []
    for run in profiled:
        events = run_events(run)  # each trace read once, for both tables; one run's traces in memory at a time
        overlaps.append(overlap_markdown(run, events))
        for b in run_breakdowns(run, events):
            label = f"step {b.step}" if len(run.traces) == 1 else f"r{b.rank} s{b.step}"
            bars.append((run.label, f"{run.label} {label}" if len(profiled) > 1 else label, b))
    plot = plot_step_breakdown([bar[1:] for bar in bars[:MAX_BARS]], out)
    if plot:
        result.plots.append(plot)
        more = f" The first {MAX_BARS} of {len(bars)} bars are drawn." if len(bars) > MAX_BARS else ""
        lines += [f"![step time]({plot.path.name})", "", f"*{plot.caption}{more}*", ""]
        phases = [p for p in PHASES if any(p in b.phases_ms for *_, b in bars)]
        lines += md_table(["run", "rank", "step", "step (ms)", *phases, "communication"],
                          [[name, b.rank, b.step, f"{b.total_ms:.1f}",
                            *(_num(b.phases_ms.get(p), ".1f") for p in phases), _num(b.comm_ms, ".1f")]
                           for name, _, b in bars])
    else:
        lines += [f"No `{SPAN_STEP_PREFIX}<N>` span in a trace (`{PROFILE}/rank_<R>.json`): no per-step breakdown.", ""]
    for run, overlap in zip(profiled, overlaps):
        lines += overlap
        lines += _top_ops(run)
    return lines


def _top_ops(run: RunData) -> list[str]:
    """The summary of the run's lowest profiled rank: head lines and top ops, else the raw text."""
    if not run.profiles:
        return []
    rank, path = next(iter(run.profiles.items()))
    ops, text = read_profile(path)
    lines = [f"### Top ops: {run.label}, rank {rank}", ""]
    if not ops:  # a format we can't parse: show it as it is
        return lines + [f"From {path}:", "", "```", *text.splitlines()[:40], "```", ""]
    head = text.split("\n\n", 1)[0].splitlines()[:6]  # the profiler's own summary lines (step time, comm share)
    lines += ["```", *head, "```", ""] if len(head) > 1 else []
    lines += md_table(["op", "self time (ms)"], [[name, f"{ms:.3f}"] for name, ms in ops])
    return lines + [f"*Largest self times from {path} (device time when the table has it, else CPU).*", ""]


def _sweep_section(sweep_dir: Path, sweep: dict, runs: dict, out: Path, result: ReportResult) -> list[str]:
    rows = sweep_rows(sweep, runs)
    scale_rows, scale_note = scaling(rows)
    guidance = batch_guidance(sweep, rows)
    result.sweeps.append({"sweep": sweep, "rows": rows, "scaling": scale_rows, "guidance": guidance})
    swept = ", ".join(f"`{k}` in {{{', '.join(v)}}}" for k, v in sweep["swept"].items())
    lines = [f"## Sweep {sweep['name']}", "", f"{len(rows)} points from {swept} ({sweep_dir / SWEEP_FILE}).", ""]
    lines += md_table(["point", "layout", "tokens/s", "MFU", "peak mem measured / predicted (GiB)", "final loss",
                       "status"],
                      [[r["id"], r["layout"] if r["info"].get("degrees") else
                        " ".join(f"{k.split('.')[-1]}={v}" for k, v in r["swept"].items()),
                        _num(r["tokens_per_s"]),
                        None if r["mfu"] is None else f"{100 * r['mfu']:.1f}% ({r['mfu_how']})",
                        f"{_num(r['memory_measured_gib'], '.3f') or '-'}"
                        f"{' (allocator)' if r['memory_measured_how'] == 'allocator' else ''}"
                        f" / {_num(r['memory_predicted_gib'], '.3f') or '-'}",
                        _num(r["final_loss"], ".4f"), r["status"] + (f": {r['reason']}" if r["reason"] else "")]
                       for r in rows])
    heat = plot_heatmap(heatmap_grid(sweep, rows), out)
    if heat:
        result.plots.append(heat)
        lines += [f"![heatmap]({heat.path.name})", "", f"*{heat.caption}*", ""]
    lines += ["### Scaling efficiency", ""]
    if scale_rows:
        lines += md_table(["kind", "group", "world", "point", "tokens/s", "tokens/s per rank", "speedup", "efficiency"],
                          [[s["kind"], s["group"], s["world"], s["point"], _num(s["tokens_per_s"]),
                            _num(s["per_rank"]), f"{s['speedup']:.2f}x", f"{100 * s['efficiency']:.0f}%"]
                           for s in scale_rows])
        lines += ["*Efficiency = (tokens/s per rank at n ranks) / (tokens/s per rank at the group's smallest world), "
                  "from measured tokens/s. Strong scaling: same global batch; weak: same batch per rank. A group also "
                  "holds every other swept value fixed (model, seq_len, ...: named in the group column), except the "
                  "node/process counts, parallel degrees and batch split; the fastest point per world size counts.*",
                  ""]
        plot = plot_scaling(scale_rows, out)
        if plot is not None:
            result.plots.append(plot)
            lines += [f"![scaling]({plot.path.name})", "", f"*{plot.caption}*", ""]
    else:
        lines += [scale_note, ""]
    if guidance:
        lines += ["### Batch size", ""] + [g + "\n" for g in guidance]
    return lines
